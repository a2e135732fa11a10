"""The holes the reliability campaign found in the entry rules, each closed (CPU tier).

Options are strict ``bool``; outputs may not alias an input; an explicit plan must live on the inputs' device;
on CPU tensors a bad index value is named before the device rule; a shape no kernel builds is refused by
``can_implement`` and every ``plan_*`` with the kernel's own reason, before any planning.
"""

import pytest
import torch

import cute_attn
from cute_attn import api, testing
from cute_attn.config import default_paged_config


def _decode():
    return testing.make_gqa_decode_case([3, 0, 70], num_qo_heads=10, num_kv_heads=2, head_dim=128, page_size=64)


@pytest.mark.parametrize("option, value", [("natural_lse", "no"), ("natural_lse", 1), ("natural_lse", None),
                                           ("check_indices", "yes"), ("check_indices", 0)])
def test_flags_must_be_real_bools(option, value):
    case = _decode()
    with pytest.raises(TypeError, match=f"{option} must be True or False"):
        cute_attn.gqa_paged_decode(*case.inputs(), **{option: value})


def test_an_output_aliasing_an_input_is_refused():
    case = _decode()
    _, lse = case.new_outputs()
    with pytest.raises(ValueError, match="output overlaps q in memory"):
        cute_attn.gqa_paged_decode(*case.inputs(), case.q, lse)
    out, _ = case.new_outputs()
    lse_in_out = out.view(torch.float32).view(-1)[: lse.numel()].view(lse.shape)  # lse written over output
    with pytest.raises(ValueError, match="lse overlaps output"):
        cute_attn.gqa_paged_decode(*case.inputs(), out, lse_in_out)
    # a view of one slice of the K cache as the output: the span check finds the overlap
    k_as_out = case.k_cache.view(-1)[: case.q.numel()].view(case.q.shape)
    with pytest.raises(ValueError, match="output overlaps k_cache"):
        cute_attn.gqa_paged_decode(*case.inputs(), k_as_out, lse)


def test_disjoint_outputs_are_accepted_up_to_the_device_rule():
    case = _decode()
    out, lse = case.new_outputs()
    with pytest.raises(ValueError, match="run on a CUDA device"):
        cute_attn.gqa_paged_decode(*case.inputs(), out, lse)


def test_a_bad_index_value_on_cpu_is_named_before_the_device_rule():
    case = _decode()
    case.kv_indices[0] = 10_000
    with pytest.raises(ValueError, match="kv_indices holds page id 10000"):
        cute_attn.gqa_paged_decode(*case.inputs())
    case = testing.make_gqa_prefill_case([5, 0, 9], [70, 3, 9])
    case.kv_last_page_len[0] = 0
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] = 0"):
        cute_attn.gqa_paged_prefill(*case.inputs())
    mla = testing.make_mla_prefill_case([2, 3], [4, 3])
    mla.qo_indptr[1] = 9
    with pytest.raises(ValueError, match="qo_indptr must be non-decreasing"):
        cute_attn.mla_paged_prefill(*mla.inputs())


def test_a_plan_on_another_device_is_refused(monkeypatch):
    case = _decode()
    monkeypatch.setattr(api, "_require_cuda", lambda device: None)  # CPU inputs stand in for a CUDA device
    plan = cute_attn.plan_gqa_paged_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    plan.items = plan.items.to("meta")  # as if made for another device
    with pytest.raises(ValueError, match="plan lives on meta, the inputs on cpu"):
        cute_attn.gqa_paged_decode(*case.inputs(), plan=plan, arch="sm_90a", num_sms=8)


def test_a_junk_plan_is_named_before_index_values():
    case = _decode()
    case.kv_indices[0] = -1
    with pytest.raises(TypeError, match="plan must be a DevicePlan"):
        cute_attn.gqa_paged_decode(*case.inputs(), plan="not a plan")


@pytest.mark.parametrize("kind, shape, reason", [
    ("gqa_paged_decode", dict(num_qo_heads=20, num_kv_heads=4, head_dim_qk=256, head_dim_v=256, page_size=128),
     "shared memory holds fewer than 2 K/V stages"),
    ("gqa_paged_prefill", dict(num_qo_heads=32, num_kv_heads=4, head_dim_qk=256, head_dim_v=256, page_size=128),
     "page_size=128 is not built at head_dim 256"),
    ("gqa_paged_prefill", dict(num_qo_heads=160, num_kv_heads=1, head_dim_qk=128, head_dim_v=128, page_size=64),
     "group size 160 exceeds the 128-row tile"),
])
def test_a_shape_no_kernel_builds_is_refused_with_the_kernels_reason(kind, shape, reason):
    config = default_paged_config(kind, arch="sm_90a", causal=kind != "gqa_paged_decode", **shape)
    assert reason in (config.can_implement() or "")
    assert config.shape_reason() is None  # the kind's own rules allow it: the kernel is what refuses


def test_plan_refuses_a_shape_no_kernel_builds_before_planning(monkeypatch):
    case = testing.make_gqa_decode_case([3, 70], num_qo_heads=20, num_kv_heads=4, head_dim=256, page_size=128)
    planned = []
    monkeypatch.setattr(api, "plan_work", lambda *a, **kw: planned.append(a))
    with pytest.raises(ValueError, match="shared memory holds fewer than 2 K/V stages"):
        cute_attn.plan_gqa_paged_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    assert not planned


def test_can_implement_names_a_missing_arch_kernel():
    config = default_paged_config("gqa_paged_decode", arch="sm_100a", num_qo_heads=20, num_kv_heads=4,
                                  head_dim_qk=256, head_dim_v=256, page_size=128, causal=False)
    assert "TMEM" in config.can_implement() and "768 of 512 columns" in config.can_implement()


def test_inference_mode_tensors_plan_every_call(monkeypatch):
    """Engines run under torch.inference_mode: those tensors have no version counter to key a cache on."""
    launches = []
    monkeypatch.setattr(api, "_require_cuda", lambda device: None)
    monkeypatch.setattr(api, "find_launcher", lambda config: lambda plan, *a, natural_lse=False: launches.append(plan))
    cute_attn.clear_plan_cache()
    with torch.inference_mode():
        case = _decode()
        out, lse = case.new_outputs()
        for _ in range(2):
            cute_attn.gqa_paged_decode(*case.inputs(), out, lse, arch="sm_90a", num_sms=8, check_indices=True)
        case.kv_last_page_len[0] = 5  # request 0 grows to 5 keys: an in-place write no version counter sees
        cute_attn.gqa_paged_decode(*case.inputs(), out, lse, arch="sm_90a", num_sms=8, check_indices=True)
    assert len(launches) == 3 and len({id(p) for p in launches}) == 3  # a fresh plan every call
    first, last = (p.plan.valid_items() for p in (launches[0], launches[-1]))
    assert 3 in first[first[:, 0] == 0, 5] and 5 in last[last[:, 0] == 0, 5]  # request 0's KV_END: 3, then 5
    assert not api._PLANS.entries and not api._FAST.entries


def test_mla_decode_is_mla_prefill_with_one_cached_query_per_request(monkeypatch):
    """The decode entry hands the MLA prefill kind qo_indptr = 0..batch, one tensor per batch size (plans cache)."""
    from cute_attn.ops import mla_decode

    launches = []
    monkeypatch.setattr(api, "_require_cuda", lambda device: None)
    monkeypatch.setattr(api, "find_launcher", lambda config: lambda plan, *a, natural_lse=False: launches.append(
        (plan, a)))
    cute_attn.clear_plan_cache()
    case = testing.make_mla_prefill_case([1, 1, 1], [40, 0, 7])
    args = (case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, case.kv_indptr, case.kv_indices, case.sm_scale)
    for _ in range(2):
        cute_attn.mla_paged_decode(*args, arch="sm_90a", num_sms=8, check_indices=True)  # host-planned
    (plan_a, first), (plan_b, second) = launches
    assert first[4].tolist() == [0, 1, 2, 3] and first[4] is second[4] and plan_a is plan_b  # one plan, reused
    assert plan_a.config.kind == "mla_paged_prefill"
    with pytest.raises(ValueError, match=r"q_nope.shape\[0\] must equal batch_size = len\(kv_indptr\) - 1 \(3\)"):
        cute_attn.mla_paged_decode(case.q_nope[:2], *args[1:])
    bad = case.kv_indices.clone()
    bad[0] = 10**6
    with pytest.raises(ValueError, match="kv_indices holds token row id 1000000"):
        cute_attn.mla_paged_decode(*args[:5], bad, case.sm_scale)
    assert mla_decode.plan_mla_paged_decode(*args, arch="sm_90a", num_sms=8).config.kind == "mla_paged_prefill"

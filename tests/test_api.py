"""Public entry points: validation first, config rules, explicit plans and the plan cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cute_attn
from cute_attn import api, testing
from cute_attn.config import PagedAttentionConfig


def prefill_case(**kw):
    return testing.make_gqa_prefill_case([5, 0, 9], [70, 3, 9], **kw)


def test_entries_validate_before_anything_else():
    case = prefill_case()
    bad_q = case.q.float()
    with pytest.raises(TypeError, match="q must have dtype torch.bfloat16"):
        cute_attn.gqa_paged_prefill(bad_q, *case.inputs()[1:])
    # valid inputs on the CPU: the device rule comes next, before any plan or launch
    with pytest.raises(ValueError, match="run on a CUDA device"):
        cute_attn.gqa_paged_prefill(*case.inputs())
    dec = testing.make_gqa_decode_case([3, 0])
    with pytest.raises(ValueError, match="run on a CUDA device"):
        cute_attn.gqa_paged_decode(*dec.inputs())
    mla = testing.make_mla_prefill_case([2], [3])
    with pytest.raises(ValueError, match="run on a CUDA device"):
        cute_attn.mla_paged_prefill(*mla.inputs())


def _entry_cases():
    prefill = prefill_case(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    decode = testing.make_gqa_decode_case([3, 0, 70], num_qo_heads=10, num_kv_heads=2, head_dim=64, page_size=16)
    mla = testing.make_mla_prefill_case([2, 3], [4, 3], num_heads=4, ckv_dim=32, kpe_dim=16)
    return {
        "gqa_paged_prefill": (cute_attn.gqa_paged_prefill, prefill),
        "plan_gqa_paged_prefill": (cute_attn.plan_gqa_paged_prefill, prefill),
        "gqa_paged_decode": (cute_attn.gqa_paged_decode, decode),
        "plan_gqa_paged_decode": (cute_attn.plan_gqa_paged_decode, decode),
        "mla_paged_prefill": (cute_attn.mla_paged_prefill, mla),
        "plan_mla_paged_prefill": (cute_attn.plan_mla_paged_prefill, mla),
    }


ENTRIES = _entry_cases()
NASTY = [None, 1.5, "x", -1.0, float("nan"), True, torch.zeros(3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
         torch.full((3,), -7, dtype=torch.int32), torch.zeros(2, 2, 2, dtype=torch.bfloat16),
         torch.zeros(5, 4, 32, dtype=torch.float16)]


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@settings(settings.default, max_examples=max(1000, settings.default.max_examples))
@given(data=st.data())
def test_fuzzed_entry_calls_raise_only_value_or_type_errors(entry, data):
    """Malformed arguments (1-3 replaced by junk) at every public entry: a clear ValueError/TypeError."""
    fn, case = ENTRIES[entry]
    args = list(case.inputs())
    for i in data.draw(st.lists(st.integers(0, len(args) - 1), min_size=1, max_size=3, unique=True)):
        args[i] = data.draw(st.sampled_from(NASTY))
    try:
        fn(*args, arch="sm_90a")
    except (ValueError, TypeError):
        pass


def test_explicit_plan_covers_the_batch_and_has_fixed_capacity():
    case = prefill_case()
    plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), arch="sm_90a", num_sms=8)
    assert plan.config.kind == "gqa_paged_prefill" and plan.config.group_size == 8
    assert plan.items.dtype == torch.int32 and plan.items.shape[0] == plan.plan.capacity.max_items
    assert plan.work_indptr.shape[0] == 8 + 1 and int(plan.work_indptr[-1]) == plan.plan.num_items
    assert plan.partial_out.shape[1:] == (plan.config.tile_q_rows, 128)


def test_explicit_plan_checks_index_values():
    case = prefill_case()
    case.kv_indices[0] = case.k_cache.shape[0]
    with pytest.raises(ValueError, match="kv_indices holds page id"):
        cute_attn.plan_gqa_paged_prefill(*case.inputs(), arch="sm_90a")


def test_unsupported_configs_are_rejected_with_a_reason():
    case = testing.make_gqa_prefill_case([3], [3], head_dim=96)
    with pytest.raises(ValueError, match="GQA head_dim must be one of"):
        cute_attn.plan_gqa_paged_prefill(*case.inputs(), arch="sm_90a")
    case = testing.make_gqa_prefill_case([3], [3], page_size=48)
    with pytest.raises(ValueError, match="page_size=48 must be a power of two"):
        cute_attn.plan_gqa_paged_prefill(*case.inputs(), arch="sm_90a")
    with pytest.raises(ValueError, match="unsupported arch"):
        cute_attn.plan_gqa_paged_prefill(*prefill_case().inputs(), arch="sm_80")


@pytest.mark.parametrize("change,reason", [
    (dict(kind="gqa_paged_verify"), "kind="),
    (dict(num_qo_heads=30), "positive multiple of num_kv_heads"),
    (dict(kind="mla_paged_prefill"), "MLA head dims"),
    (dict(tile_q_rows=96), "tile_q_rows=96 must be 64 or 128"),
    (dict(kv_tile=100), "kv_tile=100 must be a power of two"),
    (dict(kind="gqa_paged_decode", num_qo_heads=128, num_kv_heads=1, tile_q_rows=64), "packs the group"),
    (dict(arch="sm_80"), "arch='sm_80' is not supported"),
])
def test_can_implement_reasons(change, reason):
    cfg = PagedAttentionConfig(**{"arch": "sm_90a", **change})
    assert reason in (cfg.can_implement() or "")


def test_default_configs_of_the_three_definitions_are_implementable():
    for arch in ("sm_90a", "sm_100a"):
        for kind, heads, dims, page in [("gqa_paged_prefill", (32, 4), (128, 128), 64),
                                         ("gqa_paged_decode", (20, 4), (128, 128), 64),
                                         ("mla_paged_prefill", (16, 1), (576, 512), 1)]:
            cfg = api.default_paged_config(kind, arch=arch, num_qo_heads=heads[0], num_kv_heads=heads[1],
                                           head_dim_qk=dims[0], head_dim_v=dims[1], page_size=page,
                                           causal=kind != "gqa_paged_decode")
            assert cfg.can_implement() is None, (kind, arch, cfg.can_implement())


# ---------------------------------------------------------------------------------------------
# Plan cache: identity + shape + version counter, never a bare pointer
# ---------------------------------------------------------------------------------------------
def test_plan_cache_hits_only_for_the_same_unmodified_tensors():
    cache = api._PlanCache(size=2)
    a, b = torch.arange(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    cache.put("cfg", (a, b), "plan-ab")
    assert cache.get("cfg", (a, b)) == "plan-ab"
    assert cache.get("other-cfg", (a, b)) is None
    a_copy = a.clone()  # equal values, another tensor: a different batch as far as we can know cheaply
    assert cache.get("cfg", (a_copy, b)) is None
    a[0] = 0  # in-place write (same value even): bumps the version counter
    assert cache.get("cfg", (a, b)) is None


def test_plan_cache_is_bounded_and_evicts_least_recent():
    cache = api._PlanCache(size=2)
    ts = [torch.zeros(1, dtype=torch.int32) for _ in range(3)]
    for i, t in enumerate(ts):
        cache.put("cfg", (t,), i)
    assert cache.get("cfg", (ts[0],)) is None
    assert cache.get("cfg", (ts[1],)) == 1 and cache.get("cfg", (ts[2],)) == 2


def test_plan_cache_never_returns_a_plan_for_a_recycled_id():
    cache = api._PlanCache()
    t = torch.zeros(3, dtype=torch.int32)
    key = cache._key("cfg", (t,))
    cache.put("cfg", (t,), "old")
    ref_list, _ = cache.entries[key]
    cache.entries[key] = ([lambda: None], "old")  # as if the tensor died and its id() was reused
    assert cache.get("cfg", (t,)) is None and key not in cache.entries
    del ref_list


def test_device_plan_refresh_reuses_buffers_for_graph_replay():
    cfg = api.default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4,
                                   head_dim_qk=128, head_dim_v=128, page_size=64, causal=False)
    pcfg = cfg.plan_config(16)
    capacity = cute_attn.PlanCapacity.for_limits(pcfg, max_batch=8, max_total_q=8)
    dp = api.DevicePlan.allocate(cfg, capacity, 16, "cpu")
    pointers = [t.data_ptr() for t in (dp.items, dp.work_indptr, dp.merges, dp.merge_indptr, dp.partial_out)]
    for kv_lens in ([3000], [5, 70, 1, 4096, 9, 9, 9, 9]):
        plan = cute_attn.plan_work(pcfg, [1] * len(kv_lens), kv_lens, capacity=capacity)
        dp.refresh(plan)
        assert torch.equal(dp.items, torch.from_numpy(plan.items))
        assert torch.equal(dp.merges, torch.from_numpy(plan.merges))
        assert torch.equal(dp.work_indptr, torch.from_numpy(plan.work_indptr))
    assert pointers == [t.data_ptr() for t in (dp.items, dp.work_indptr, dp.merges, dp.merge_indptr, dp.partial_out)]
    other = cute_attn.plan_work(pcfg, [1], [10])  # its own (smaller) capacity
    with pytest.raises(ValueError, match="does not match these buffers"):
        dp.refresh(other)

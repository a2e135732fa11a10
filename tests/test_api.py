"""Public entry points: validation first, config rules, explicit plans and the plan cache."""

import gc
import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st

import cute_attn
from cute_attn import api, testing
from cute_attn.config import PagedAttentionConfig
from cute_attn.ops import get_spec
from cute_attn.ops import mla_prefill
from cpu_stand_ins import host_planned_route


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


def test_planning_into_an_existing_plan_needs_a_device_plan():
    """``api.plan_for(into=)`` (the wrappers' graph mode) re-plans a device plan in place: a host plan cannot be
    refilled that way, and the inputs' rules come before the plan's (a CPU input stops at the device rule)."""
    case = prefill_case()
    host_plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), arch="sm_90a", num_sms=8)
    spec = get_spec("gqa_paged_prefill")
    with pytest.raises(ValueError, match="into= and recycle= refill a device plan: pass on_device=True"):
        api.plan_for(spec, case.inputs(), arch="sm_90a", num_sms=8, into=host_plan)
    with pytest.raises(ValueError, match="CUDA device"):
        api.plan_for(spec, case.inputs(), arch="sm_90a", num_sms=8, on_device=True, into=host_plan)


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


# ---------------------------------------------------------------------------------------------
# Fast path: a repeated call skips the rules, the config and the plan lookup; anything else is checked
# ---------------------------------------------------------------------------------------------
class _FastEnv:
    """CPU stand-ins for the device rule and the kernels: which calls took the full path, what launched."""

    def __init__(self, monkeypatch):
        self.full = 0
        self.launches = []
        full = api._run_full

        def counting_full(*a, **kw):
            self.full += 1
            return full(*a, **kw)

        def launcher(device_plan, *args, natural_lse=False):
            *inputs, output, lse = args
            self.launches.append(dict(plan=device_plan, work=device_plan.plan, inputs=inputs, output=output,
                                      lse=lse, natural_lse=natural_lse))

        monkeypatch.setattr(api, "_require_cuda", lambda device: None)
        monkeypatch.setattr(api, "find_launcher", lambda config: launcher)
        monkeypatch.setattr(api, "_run_full", counting_full)
        monkeypatch.setattr(api, "_run_device", host_planned_route)
        cute_attn.clear_plan_cache()


@pytest.fixture
def fast(monkeypatch):
    env = _FastEnv(monkeypatch)
    yield env
    cute_attn.clear_plan_cache()


def _decode(**kw):
    # a shape both arches' decode kernels build: config choice asks the kernel
    return testing.make_gqa_decode_case([3, 0, 70], num_qo_heads=10, num_kv_heads=2, head_dim=128, page_size=64,
                                        **kw)


def _call(case, out, lse, **kw):
    return cute_attn.gqa_paged_decode(*case.inputs(), out, lse, **{"arch": "sm_90a", "num_sms": 8, **kw})


def test_fast_path_hits_a_repeated_call(fast):
    case = _decode()
    out, lse = case.new_outputs()
    for _ in range(3):
        assert _call(case, out, lse) == (out, lse)
    assert fast.full == 1 and len(fast.launches) == 3
    assert all(launch["plan"] is fast.launches[0]["plan"] for launch in fast.launches)
    assert fast.launches[-1]["inputs"][0] is case.q and fast.launches[-1]["output"] is out


@pytest.mark.parametrize("entry", ["gqa_paged_prefill", "mla_paged_prefill"])
def test_fast_path_hits_for_every_entry(fast, entry):
    fn, case = ENTRIES[entry]
    if entry == "mla_paged_prefill":  # the definition's head dims: the config rules come before the plan
        case = testing.make_mla_prefill_case([2, 3], [4, 3], num_heads=4, ckv_dim=512, kpe_dim=64)
    out, lse = case.new_outputs()
    for _ in range(2):
        fn(*case.inputs(), out, lse, arch="sm_90a", num_sms=8)
    assert fast.full == 1 and len(fast.launches) == 2


def test_fast_path_keys_on_every_option(fast):
    case = _decode()
    out, lse = case.new_outputs()
    variants = [dict(), dict(natural_lse=True), dict(num_sms=4), dict(arch="sm_100a"), dict(sm_scale=0.5)]
    for kw in variants * 2:  # each one misses once, then hits
        scale = kw.pop("sm_scale", case.sm_scale)
        cute_attn.gqa_paged_decode(*case.inputs()[:-1], scale, out, lse, **{"arch": "sm_90a", "num_sms": 8, **kw})
    assert fast.full == len(variants)
    assert [launch["natural_lse"] for launch in fast.launches[:2]] == [False, True]
    assert fast.launches[2]["plan"].work_indptr.shape[0] == 4 + 1  # num_sms=4 got its own plan


def test_fast_path_allocates_outputs_each_call(fast):
    case = _decode()
    first = cute_attn.gqa_paged_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    second = cute_attn.gqa_paged_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    assert fast.full == 1
    assert first[0].shape == second[0].shape == (3, 10, 128) and first[1].shape == (3, 10)
    assert second[0] is not first[0] and second[0].dtype == torch.bfloat16 and second[1].dtype == torch.float32


def test_fast_path_matches_new_tensors_of_the_same_metadata(fast):
    """Engines pass per-layer caches and fresh q/output tensors: no rule reads their values, so they hit."""
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    layer = _decode(seed=5)  # other values and pointers, one metadata
    for name in ("q", "k_cache", "v_cache"):
        setattr(case, name, getattr(layer, name))
    out2, lse2 = case.new_outputs()
    _call(case, out2, lse2)
    assert fast.full == 1
    assert fast.launches[1]["inputs"][0] is layer.q and fast.launches[1]["inputs"][1] is layer.k_cache
    assert fast.launches[1]["output"] is out2


def _misaligned(t):
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype)
    return flat[1:].view(t.shape)  # 2 bytes off


def _strided_pages(t):
    pages = t.shape[0]
    big = torch.zeros(pages, t[0].numel() + 4, dtype=t.dtype)  # page stride not a multiple of 8 elements
    return big[:, : t[0].numel()].view(t.shape)


# (argument, replacement from the case, error): each is a new object, so only the metadata can tell
NEW_OBJECT_CHANGES = [
    ("q", lambda c: c.q.float(), TypeError, "q must have dtype torch.bfloat16"),
    ("q", lambda c: c.q[:2], ValueError, r"q.shape\[0\] must equal batch_size"),
    ("q", lambda c: c.q.transpose(1, 2).contiguous().transpose(1, 2), ValueError, "q must be contiguous"),
    ("k_cache", lambda c: _misaligned(c.k_cache), ValueError, "k_cache must start at a 16-byte aligned address"),
    ("k_cache", lambda c: _strided_pages(c.k_cache), ValueError, "k_cache must have compact pages"),
    ("v_cache", lambda c: c.v_cache.to("meta"), ValueError, "all tensors must be on one device"),
    ("kv_indices", lambda c: torch.full_like(c.kv_indices, 10**6), ValueError, "kv_indices holds page id 1000000"),
    ("kv_indptr", lambda c: c.kv_indptr.long(), TypeError, "kv_indptr must have dtype torch.int32"),
    ("kv_last_page_len", lambda c: torch.zeros_like(c.kv_last_page_len), ValueError, "kv_last_page_len"),
    ("sm_scale", lambda c: -c.sm_scale, ValueError, "sm_scale must be finite and > 0"),
    ("sm_scale", lambda c: True, TypeError, "sm_scale must be a real number"),
]


@pytest.mark.parametrize("name,change,exc,message", NEW_OBJECT_CHANGES, ids=lambda x: x if isinstance(x, str) else "")
def test_fast_path_misses_when_an_argument_changes(fast, name, change, exc, message):
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    setattr(case, name, change(case))
    with pytest.raises(exc, match=message):
        _call(case, out, lse)
    assert fast.full == 2 and len(fast.launches) == 1


@pytest.mark.parametrize("change,exc,message", [
    (lambda out, lse: (out.to("meta"), lse), ValueError, "output and lse must be on the inputs' device"),
    (lambda out, lse: (out, lse.double()), TypeError, "lse must have dtype torch.float32"),
    (lambda out, lse: (out, None), ValueError, "must be passed together"),
    (lambda out, lse: (out[:, :4], lse), ValueError, "output must be contiguous"),
])
def test_fast_path_misses_when_an_output_changes(fast, change, exc, message):
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    with pytest.raises(exc, match=message):
        _call(case, *change(out, lse))
    assert fast.full == 2


def test_a_smaller_cache_rechecks_the_page_ids(fast):
    """The same index tensors, valid for the old cache: the plan cache must not vouch for them (found by fuzz)."""
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    case.k_cache, case.v_cache = case.k_cache[:2], case.v_cache[:2]
    with pytest.raises(ValueError, match=r"kv_indices holds page id \d+, outside \[0, 2\)"):
        _call(case, out, lse)


# in-place changes of the cached objects themselves (same id): version counters, pointers, metadata
IN_PLACE_CHANGES = [
    ("kv_indices", lambda t: t.__setitem__(0, 10**6), ValueError, "kv_indices holds page id"),
    ("kv_indices", lambda t: t.resize_(t.numel() - 1), ValueError, r"kv_indptr\[-1\] \(\d+\) must be at most len"),
    ("kv_indptr", lambda t: t.set_(torch.tensor([0, 1, 1, 700], dtype=torch.int32)), ValueError,
     r"kv_indptr\[-1\] \(700\) must be at most len\(kv_indices\)"),
    ("kv_last_page_len", lambda t: t.as_strided_((2,), (1,)), ValueError, r"kv_last_page_len.shape\[0\] must equal"),
    ("kv_last_page_len", lambda t: t.fill_(0), ValueError, r"kv_last_page_len\[0\] = 0 must be in 1..page_size"),
    ("q", lambda t: t.resize_(2, *t.shape[1:]), ValueError, r"q.shape\[0\] must equal batch_size"),
    ("q", lambda t: t.as_strided_(t.shape, (1, t.shape[0], t.shape[0] * t.shape[1])), ValueError,
     "q must be contiguous"),
    ("q", lambda t: setattr(t, "data", t.data.view(torch.float16)), TypeError, "q must have dtype torch.bfloat16"),
    ("k_cache", lambda t: t.set_(_misaligned(t)), ValueError, "k_cache must start at a 16-byte aligned address"),
    # .data = keeps the version counter: the new data pointer gives it away (swap_tensors refuses weakref'd tensors)
    ("kv_indices", lambda t: setattr(t, "data", torch.full_like(t, -1)), ValueError, "kv_indices holds page id -1"),
]


@pytest.mark.parametrize("name,mutate,exc,message", IN_PLACE_CHANGES, ids=lambda x: x if isinstance(x, str) else "")
def test_fast_path_misses_after_in_place_changes(fast, name, mutate, exc, message):
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    mutate(getattr(case, name))
    with pytest.raises(exc, match=message):
        _call(case, out, lse)
    assert fast.full == 2 and len(fast.launches) == 1


def test_valid_in_place_index_update_replans(fast):
    """Engines refill one set of index buffers per batch: a version bump means a new plan, not a stale one."""
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    case.kv_last_page_len[2] = 1  # request 2: 65 keys instead of 70
    _call(case, out, lse)
    _call(case, out, lse)
    assert fast.full == 2
    first, second = fast.launches[0]["work"], fast.launches[1]["work"]
    assert fast.launches[2]["work"] is second
    assert not np.array_equal(first.valid_items(), second.valid_items())


def test_fast_path_drops_entries_whose_index_tensors_die(fast):
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    assert len(api._FAST.entries) == 1
    fast.launches.clear()
    case.kv_indices = case.kv_indices.clone()  # the only reference to the old one goes
    gc.collect()
    assert len(api._FAST.entries) == 0


def test_fast_path_never_trusts_a_recycled_id(fast):
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    (key, (refs, plan_ref, hits)), = api._FAST.entries.items()
    api._FAST.entries[key] = ((lambda: None,) + refs[1:], plan_ref, hits)  # as if kv_indptr died, its id reused
    _call(case, out, lse)
    assert fast.full == 2


def test_clear_plan_cache_clears_the_fast_path(fast):
    case = _decode()
    out, lse = case.new_outputs()
    _call(case, out, lse)
    cute_attn.clear_plan_cache()
    assert not api._FAST.entries and not api._PLANS.entries
    _call(case, out, lse)
    assert fast.full == 2


def test_fast_path_with_explicit_plans(fast):
    case = _decode()
    out, lse = case.new_outputs()
    plan = cute_attn.plan_gqa_paged_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    for _ in range(2):
        _call(case, out, lse, plan=plan, check_indices=False)
    assert fast.full == 1 and all(launch["plan"] is plan for launch in fast.launches)
    assert not any(hit.device_plan for _, _, hits in api._FAST.entries.values() for hit in hits)  # not kept alive
    other = cute_attn.plan_gqa_paged_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    _call(case, out, lse, plan=other, check_indices=False)
    assert fast.full == 2 and fast.launches[-1]["plan"] is other
    # the plan's config is re-checked on a hit, not trusted
    config = plan.config
    plan.config = api.default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4,
                                           head_dim_qk=64, head_dim_v=64, page_size=16, causal=False)
    with pytest.raises(ValueError, match="plan was made for"):
        _call(case, out, lse, plan=plan, check_indices=False)
    plan.config = config
    # check_indices=True on a hit: the same unmodified index tensors were checked; a write is checked again
    _call(case, out, lse, plan=plan, check_indices=True)
    _call(case, out, lse, plan=plan, check_indices=True)
    assert fast.full == 4
    case.kv_indices[0] = -1
    with pytest.raises(ValueError, match="kv_indices holds page id -1"):
        _call(case, out, lse, plan=plan, check_indices=True)
    with pytest.raises(TypeError, match="plan must be a DevicePlan"):
        _call(case, out, lse, plan="not a plan")


# Fuzz: with the fast path primed, mutated arguments are rejected or launch exactly what the full path allows
FUZZ_ENTRIES = {  # public entry, a small valid case (implementable configs: the plan is compared)
    "gqa_paged_decode": (cute_attn.gqa_paged_decode, _decode),
    "gqa_paged_prefill": (cute_attn.gqa_paged_prefill,
                          lambda: prefill_case(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)),
    "mla_paged_prefill": (cute_attn.mla_paged_prefill,
                          lambda: testing.make_mla_prefill_case([2, 3], [4, 3], num_heads=4, ckv_dim=512, kpe_dim=64)),
    # the ps64 order: kv_last_page_len before sm_scale
    "mla_paged_prefill/ps16": (cute_attn.mla_paged_prefill,
                               lambda: testing.make_mla_prefill_case([2, 3], [20, 3], num_heads=4, ckv_dim=512,
                                                                     kpe_dim=64, page_size=16)),
    "gqa_paged_multi_token_decode": (cute_attn.gqa_paged_multi_token_decode,
                                     lambda: testing.make_gqa_multi_token_decode_case([3, 1], [5, 70])),
}


def _fresh_plan_items(kind, args, num_sms=8):
    """The plan the full path makes for these arguments now."""
    problem, host = kind.check(*args, check_indices=True)
    config = api._make_config(kind, problem, "sm_90a")
    plan = cute_attn.plan_work(config.plan_config(api._num_ctas(config, problem.device, num_sms)),
                               np.diff(host.qo_indptr), host.kv_lens)
    return plan.valid_items()


@st.composite
def _mutation(draw, name, value):
    if name == "sm_scale":
        return "replace", draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 0.5, 2, True, "x", None,
                                                np.float64(0.25)]))
    kind = draw(st.sampled_from(["junk", "dtype", "shape", "values", "noncontig", "clone", "resize_", "set_",
                                 "as_strided_", "fill_", "data_dtype", "empty"]))
    if kind == "junk":
        return "replace", draw(st.sampled_from(NASTY))
    if kind == "dtype":
        return "replace", value.to(draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.int32,
                                                         torch.int64])))
    if kind == "shape":
        return "replace", torch.zeros(draw(st.lists(st.integers(0, 5), max_size=4)), dtype=value.dtype)
    if kind == "values":
        return "replace", torch.full_like(value, draw(st.integers(-3, 300)))
    if kind == "noncontig":
        return "replace", value.transpose(0, -1)
    if kind == "clone":
        return "replace", value.clone()
    if kind == "empty":
        return "replace", value[:0]
    if kind == "resize_":
        size = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
        return "inplace", lambda t: t.resize_(size)
    if kind == "set_":
        size = draw(st.lists(st.integers(0, 5), max_size=4))
        return "inplace", lambda t: t.set_(torch.zeros(size, dtype=t.dtype))
    if kind == "as_strided_":
        size = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        stride = draw(st.lists(st.integers(0, 2), min_size=len(size), max_size=len(size)))
        return "inplace", lambda t: t.as_strided_(size, stride) if t.numel() >= 27 else t.resize_(0)
    if kind == "fill_":
        fill = draw(st.integers(-2, 80))
        return "inplace", lambda t: t.fill_(fill)
    return "inplace", lambda t: setattr(t, "data", t.data.view(torch.float16 if t.element_size() == 2 else
                                                                 torch.float32 if t.dtype == torch.int32 else
                                                                 torch.int16))


@pytest.mark.parametrize("entry", sorted(FUZZ_ENTRIES))
@settings(settings.default, max_examples=max(300, settings.default.max_examples // 3), deadline=None)
@given(data=st.data())
def test_fuzz_fast_path_never_launches_what_the_full_rules_reject(entry, data):
    fn, make_case = FUZZ_ENTRIES[entry]
    kind = get_spec(entry.split("/")[0])
    with pytest.MonkeyPatch.context() as mp:
        env = _FastEnv(mp)
        case = make_case()
        names = list(inspect.signature(fn).parameters)[: len(kind.arg_names)]
        if len(case.inputs()) + 2 < len(names):  # MLA's page-size-1 order has no kv_last_page_len
            names.remove("kv_last_page_len")
        values = dict(zip(names, (*case.inputs(), *case.new_outputs())))
        fn(*values.values(), arch="sm_90a", num_sms=8)  # primes the fast path
        for name in data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
            how, what = data.draw(_mutation(name, values[name]))
            if how == "replace":
                values[name] = what
            else:
                try:
                    what(values[name])
                except RuntimeError:  # torch refused the change (a storage that cannot grow): not our case
                    reject()
        args = list(values.values())
        try:
            fn(*args, arch="sm_90a", num_sms=8)
        except (ValueError, TypeError):
            assert len(env.launches) == 1
            return
        finally:
            cute_attn.clear_plan_cache()
        # it launched: the full rules accept these arguments and the plan is the one they give
        assert len(env.launches) == 2
        assert np.array_equal(env.launches[1]["work"].valid_items(), _fresh_plan_items(kind, args))
        inputs = tuple(args[:-2])
        if kind.name == "mla_paged_prefill":  # launched in the canonical order (kv_last_page_len None at ps1)
            inputs = mla_prefill.canonical_inputs(inputs)
        assert len(env.launches[1]["inputs"]) == len(inputs)
        assert all(a is b for a, b in zip(env.launches[1]["inputs"], inputs))

"""The device planner on a GPU: its lists equal its numpy twin's, the default (device-planned) calls match the
reference, hostile page tables are contained, and a captured decode step replays across changing batches."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
from cute_attn import hostile, testing  # noqa: E402
from cute_attn.plan_partition import partition, partition_plan  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _clean():
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    yield
    torch.cuda.synchronize()


def _lists(plan):
    torch.cuda.synchronize()
    work = plan.work_indptr.cpu().numpy()
    n = int(work[-1])
    merges = plan.merge_indptr.cpu().numpy()
    return work, plan.items.cpu().numpy()[:n], merges, plan.merges.cpu().numpy()


def _assert_twin(plan, qo, kvp, q_lens, kv_lens, what):
    work, items, merge_ptr, merges = _lists(plan)
    config = plan.config.plan_config(len(work) - 1)
    twin = partition_plan(config, q_lens, kv_lens, kv_page_start=np.asarray(kvp[:-1]),
                          token_start=np.asarray(qo[:-1]), capacity=plan_capacity(plan))
    assert np.array_equal(work, twin.work_indptr), f"{what}: work_indptr {work.tolist()} != {twin.work_indptr.tolist()}"
    bad = np.nonzero((items != twin.valid_items()).any(axis=1))[0]
    assert bad.size == 0, (f"{what}: item {bad[0]}: device {items[bad[0]].tolist()} twin "
                           f"{twin.valid_items()[bad[0]].tolist()}")
    m = twin.num_merges
    assert np.array_equal(merge_ptr, twin.merge_indptr), f"{what}: merge_indptr differs"
    assert np.array_equal(merges[:m], twin.merges[:m]), f"{what}: merges differ"


def _assert_default_call_matches_reference(case, what, run=None):
    """The default call (planned on the device) on ``case`` against the float32 reference, no device error.
    ``run``: the entry (default: ``hostile.entry_for(case).run``; an MLA decode case takes ``mla_paged_decode``)."""
    out, lse = case.new_outputs()
    (run or hostile.entry_for(case).run)(*case.inputs(), out, lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, f"{what} output")
    testing.assert_close_benchmark(lse, ref_lse, f"{what} lse")
    cute_attn.raise_on_device_error()


def plan_capacity(plan):
    from cute_attn.plan import PlanCapacity

    return PlanCapacity(plan.items.shape[0], plan.partial_out.shape[0], plan.merges.shape[0])


@SETTINGS
@given(kv_lens=st.lists(st.integers(0, 6000), min_size=1, max_size=30))
def test_decode_lists_equal_the_twin(kv_lens):
    case = testing.make_gqa_decode_case(kv_lens, device="cuda", seed=len(kv_lens))
    plan = cute_attn.plan_gqa_paged_decode(*case.inputs(), on_device=True)
    kvp = case.kv_indptr.tolist()
    _assert_twin(plan, list(range(len(kv_lens) + 1)), kvp, [1] * len(kv_lens), kv_lens, f"decode {kv_lens}")


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=9000))
def test_prefill_lists_equal_the_twin(batch):
    q_lens, kv_lens = batch
    case = testing.make_gqa_prefill_case(q_lens, kv_lens, device="cuda", seed=sum(q_lens))
    plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=True)
    _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"prefill {batch}")


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=12, max_q=260, max_kv=3000))
def test_mla_prefill_lists_equal_the_twin(batch):
    # many short causal requests: the shape where the sorted deal replaces the cuts
    q_lens, kv_lens = batch
    case = testing.make_mla_prefill_case(q_lens, kv_lens, device="cuda", seed=sum(q_lens))
    plan = cute_attn.plan_mla_paged_prefill(*case.inputs(), on_device=True)
    _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"MLA prefill {batch}")


DEALT = {  # batches whose device plan is a sorted deal (the twin says so: checked below)
    "gqa 1 x 700": lambda: testing.make_gqa_prefill_case([700], [700], device="cuda", seed=11),
    "mla 8 short": lambda: testing.make_mla_prefill_case(
        [179, 23, 43, 55, 43, 177, 191, 130], [186, 41, 109, 141, 167, 272, 243, 161], device="cuda", seed=12),
    # whole-tile cuts that snap unevenly (1.12 x the mean) are dealt too (plan_partition.deal_bound)
    "gqa h20 8 x 992 whole tiles": lambda: testing.make_gqa_prefill_case(
        [992] * 8, [992] * 8, num_qo_heads=20, num_kv_heads=4, device="cuda", seed=13),
}


@pytest.mark.parametrize("name", list(DEALT))
def test_dealt_plans_equal_the_twin_and_the_default_call_the_reference(name):
    case = DEALT[name]()
    mla = hasattr(case, "ckv_cache")
    q_lens, kv_lens = np.diff(case.qo_indptr.cpu().numpy()).tolist(), list(case.kv_lens)
    plan_fn = cute_attn.plan_mla_paged_prefill if mla else cute_attn.plan_gqa_paged_prefill
    plan = plan_fn(*case.inputs(), on_device=True)
    config = plan.config.plan_config(plan.work_indptr.shape[0] - 1)
    twin, dealt = partition(config, q_lens, kv_lens)
    assert dealt and twin.num_merges == 0, "the batch no longer exercises the deal"
    _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, name)
    _assert_default_call_matches_reference(case, name)


@pytest.mark.parametrize("kv_lens", [[2048] * 64, [2048] * 7 + [5, 0, 3000], [70, 9000, 1, 3232]], ids=str)
@pytest.mark.parametrize("heads, kv_heads, page_size", [(20, 4, 1), (24, 8, 1), (20, 4, 16), (32, 16, 64)])
def test_line_deal_lists_equal_the_twin_and_the_call_the_reference(kv_lens, heads, kv_heads, page_size):
    """Decode's line deal (``ops/gqa_decode.line_deals``: pages 1-2 and from 8 KV heads by default) under its policy at
    each page size: the device lists equal the twin's (dealt or not), and the device-planned call matches the
    reference."""
    from cute_attn.ops import gqa_decode

    with gqa_decode.line_deal_policy((page_size,)):
        case = testing.make_gqa_decode_case(kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, page_size=page_size,
                                            device="cuda", seed=len(kv_lens) + heads)
        plan = cute_attn.plan_gqa_paged_decode(*case.inputs(), on_device=True)
        assert plan.config.plan_config(plan.work_indptr.shape[0] - 1).line_deal
        _assert_twin(plan, list(range(len(kv_lens) + 1)), case.kv_indptr.tolist(), [1] * len(kv_lens), kv_lens,
                     f"line deal {kv_lens} page {page_size}")
        out, lse = case.new_outputs()
        hostile.entry_for(case).run(*case.inputs(), out, lse)
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, "line deal output")
        testing.assert_close_benchmark(lse, ref_lse, "line deal lse")
        cute_attn.raise_on_device_error()


EVEN_PIECES_CASES = {  # (maker, q_lens or None for decode, kv_lens, page size): uniform batches and near misses
    "gqa decode 16 x 2048": ("decode", None, [2048] * 16, 64),
    "gqa decode 16 x 2048 page 1 (line deal)": ("decode", None, [2048] * 16, 1),
    "gqa decode 1 x 3232": ("decode", None, [3232], 64),
    "gqa decode 15 x 2048 + 2047": ("decode", None, [2048] * 15 + [2047], 64),
    "gqa decode 8 x 4096 + empty": ("decode", None, [4096] * 8 + [0], 16),
    "mla decode 64 x 8192": ("mla_decode", None, [8192] * 64, 64),
    "mla decode 16 x 4096 page 1": ("mla_decode", None, [4096] * 16, 1),
    "mla decode 1 x 4096": ("mla_decode", None, [4096], 64),
    "gqa prefill 8 x 3 over 1000": ("prefill", [3] * 8, [1000] * 8, 64),
}


def _even_pieces_case(name):
    kind, q_lens, kv_lens, page_size = EVEN_PIECES_CASES[name]
    seed = len(kv_lens) + page_size
    if kind == "prefill":
        return testing.make_gqa_prefill_case(q_lens, kv_lens, page_size=page_size, device="cuda", seed=seed)
    maker = testing.make_mla_decode_case if kind == "mla_decode" else testing.make_gqa_decode_case
    return maker(kv_lens, page_size=page_size, device="cuda", seed=seed)


@pytest.mark.parametrize("name", list(EVEN_PIECES_CASES))
def test_even_pieces_lists_equal_the_twin_and_the_call_the_reference(name):
    """``config.even_pieces_policy(True)``: the device planner's even pieces (equal one-tile requests) give the twin's
    lists field by field, near misses keep the line's cuts, and the device-planned call matches the reference."""
    from cute_attn.config import even_pieces_policy

    with even_pieces_policy(True):
        case = _even_pieces_case(name)
        kind, q_lens, kv_lens, _ = EVEN_PIECES_CASES[name]
        plan_fn = {"decode": cute_attn.plan_gqa_paged_decode, "prefill": cute_attn.plan_gqa_paged_prefill,
                   "mla_decode": cute_attn.plan_mla_paged_decode}[kind]
        plan = plan_fn(*case.inputs(), on_device=True)
        assert plan.config.plan_config(plan.work_indptr.shape[0] - 1).even_pieces
        qo = case.qo_indptr.tolist() if q_lens else list(range(len(kv_lens) + 1))
        _assert_twin(plan, qo, case.kv_indptr.tolist(), q_lens or [1] * len(kv_lens), kv_lens, name)
        _assert_default_call_matches_reference(case, name, cute_attn.mla_paged_decode if kind == "mla_decode" else None)


@SETTINGS
@given(batch=st.integers(1, 70), kv=st.integers(0, 9000), mla=st.booleans())
def test_even_pieces_lists_equal_the_twin_on_drawn_uniform_batches(batch, kv, mla):
    from cute_attn.config import even_pieces_policy

    with even_pieces_policy(True):
        maker = testing.make_mla_decode_case if mla else testing.make_gqa_decode_case
        case = maker([kv] * batch, device="cuda", seed=batch)
        plan_fn = cute_attn.plan_mla_paged_decode if mla else cute_attn.plan_gqa_paged_decode
        plan = plan_fn(*case.inputs(), on_device=True)
        _assert_twin(plan, list(range(batch + 1)), case.kv_indptr.tolist(), [1] * batch, [kv] * batch,
                     f"{'MLA ' if mla else ''}decode {batch} x {kv}")


@pytest.mark.parametrize("q_lens, kv_lens, call", [([16384], [16387], False), ([12000], [12000], True),
                                                    ([6000, 10], [6000, 5000], False)], ids=["16k", "12k", "6k_and_10"])
def test_slack_cap_lists_equal_the_twin(q_lens, kv_lens, call):
    """``config.max_slack_keys_policy(1024)``: long MLA prefill batches split where the whole-tile rule's eighth of W
    took whole tiles; the device's lists equal the twin's, and (12K) the device-planned call matches the reference."""
    from cute_attn.config import max_slack_keys_policy

    with max_slack_keys_policy(1024):
        case = testing.make_mla_prefill_case(q_lens, kv_lens, device="cuda", seed=len(q_lens) + q_lens[0])
        plan = cute_attn.plan_mla_paged_prefill(*case.inputs(), on_device=True)
        assert plan.config.plan_config(plan.work_indptr.shape[0] - 1).max_slack_keys == 1024
        _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"MLA {q_lens}")
        if call:
            _assert_default_call_matches_reference(case, f"MLA {q_lens}")


@pytest.mark.parametrize("batch, longest, scan_ctas, in_shared_memory", [
    (64, 8000, 2, True),  # ~8000 page ids: two scan CTAs beside the planning one (acq_rel arrival counter)
    (1500, 700, 4, False),  # past SMEM_REQUESTS: the planning CTA's arrays live in the global scratch
    (3000, 3000, 31, False),  # both, with many scan CTAs
])
def test_decode_lists_equal_the_twin_past_one_cta_and_shared_memory(batch, longest, scan_ctas, in_shared_memory):
    from cute_attn.kernels.common import device_planner

    kv_lens = np.random.default_rng(batch).integers(longest * 3 // 4, longest + 1, size=batch).tolist()
    case = testing.make_gqa_decode_case(kv_lens, device="cuda", seed=batch, extra_pages=8)
    assert device_planner.scan_ctas(case.kv_indices.shape[0]) == scan_ctas
    assert (batch <= device_planner.SMEM_REQUESTS) == in_shared_memory
    plan = cute_attn.plan_gqa_paged_decode(*case.inputs(), on_device=True)
    _assert_twin(plan, list(range(batch + 1)), case.kv_indptr.tolist(), [1] * batch, kv_lens, f"decode {batch}")


def test_prefill_lists_equal_the_twin_past_shared_memory_q_tiles():
    # 4 x 9000 query tokens of group 8 in 128-row tiles: 2252 q tiles > SMEM_Q_TILES, the global-scratch path
    q_lens, kv_lens = [9000, 9000, 8000, 10000], [9000, 9500, 8000, 12000]
    case = testing.make_gqa_prefill_case(q_lens, kv_lens, device="cuda", seed=5)
    plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=True)
    _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, "prefill 36k tokens")


Q_TILE_PASS_CASES = {  # (q_lens or None for decode, kv_lens): one pass and several; requests that start between
    # a thread's two tiles (one tile each: decode), and empty requests among them (the pair's second search)
    "decode 64 x 2048": (None, [2048] * 64),
    "prefill 16 x 992": ([992] * 16, [992] * 16),
    "prefill ragged with empty requests": ([0, 130, 0, 0, 1, 700, 0, 17, 2500], [5, 130, 0, 64, 900, 700, 3, 17, 2600]),
    "prefill 3 x 77": ([77] * 3, [300] * 3),
}


@pytest.mark.parametrize("per_pass", [2, 0], ids=["two_a_thread", "chosen_per_launch"])
@pytest.mark.parametrize("name", list(Q_TILE_PASS_CASES))
def test_q_tile_passes_equal_the_twin(name, per_pass):
    """``DevicePlannerConfig.q_tiles_per_pass`` (``device_planner.q_tile_pass_policy``): two neighbouring q tiles a
    thread, or the choice per launch, plan exactly what the twin plans."""
    from cute_attn.kernels.common import device_planner

    q_lens, kv_lens = Q_TILE_PASS_CASES[name]
    with device_planner.q_tile_pass_policy(per_pass):
        if q_lens is None:
            case = testing.make_gqa_decode_case(kv_lens, device="cuda", seed=21)
            plan = cute_attn.plan_gqa_paged_decode(*case.inputs(), on_device=True)
            _assert_twin(plan, list(range(len(kv_lens) + 1)), case.kv_indptr.tolist(), [1] * len(kv_lens), kv_lens,
                         name)
        else:
            case = testing.make_gqa_prefill_case(q_lens, kv_lens, device="cuda", seed=22)
            plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=True)
            _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, name)
            _assert_default_call_matches_reference(case, name)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mla"])
def test_default_calls_plan_on_the_device_and_match_the_reference(kind):
    cases = {
        "decode": lambda s: testing.make_gqa_decode_case([3232, 0, 70, 9000, 1], device="cuda", seed=s),
        "prefill": lambda s: testing.make_gqa_prefill_case([5, 0, 300, 1], [300, 3, 4000, 1], device="cuda", seed=s),
        "mla": lambda s: testing.make_mla_prefill_case([3, 0, 170], [50, 4, 2000], device="cuda", seed=s),
    }
    for seed in range(3):  # new index tensors every call: the cold call; nothing is faulted
        _assert_default_call_matches_reference(cases[kind](seed), f"{kind} seed {seed}")


HOSTILE = {
    "decode": lambda: testing.make_gqa_decode_case([3232, 0, 70, 129], device="cuda", seed=21),
    "prefill": lambda: testing.make_gqa_prefill_case([5, 0, 40], [300, 3, 40], device="cuda", seed=22),
    "mla": lambda: testing.make_mla_prefill_case([3, 0, 17], [50, 4, 17], num_pages=168, device="cuda", seed=23),
}


@pytest.mark.parametrize("entry", sorted(HOSTILE))
def test_hostile_page_tables_are_contained_and_reported(entry):
    """Default path: no error at the call, no read outside the pool (compute-sanitizer memcheck runs this test),
    every output row written (finite: the pool's NaN never reached it), and raise_on_device_error names it."""
    case = HOSTILE[entry]()
    kinds = [k for k in hostile.applicable_kinds(case) if k in hostile.INPUT_ERROR_KINDS]

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(drawn=hostile.corruptions(case, kinds))
    def check(drawn):
        bad_case, corruption = drawn
        out, lse = bad_case.new_outputs()
        hostile.entry_for(bad_case).run(*bad_case.inputs(), out, lse)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{corruption.description}: rows unwritten"
        with pytest.raises(ValueError) as err:
            cute_attn.raise_on_device_error()
        named = hostile.first_named_argument(str(err.value))
        assert named == corruption.names, f"{corruption.description}: names {named!r}: {err.value}"
        cute_attn.raise_on_device_error()  # cleared

    check()
    out, lse = case.new_outputs()
    hostile.entry_for(case).run(*case.inputs(), out, lse)  # and a good batch is right afterwards
    torch.cuda.synchronize()
    ref_out, _ = case.reference()
    testing.assert_close_benchmark(out, ref_out, "after hostile calls")


PAGE_FAULTED = {  # (case, requests whose first page id goes bad, the first of them split across CTAs)
    "decode": (lambda: testing.make_gqa_decode_case([3232, 300, 130, 700], device="cuda", seed=31), (0, 1, 3)),
    "mla decode page 1": (lambda: testing.make_mla_decode_case([4096, 50, 300], page_size=1, device="cuda", seed=32),
                          (0, 2)),
    "prefill": (lambda: testing.make_gqa_prefill_case([5, 0, 300, 1], [300, 3, 4000, 1], device="cuda", seed=33),
                (2, 0)),
    "mla": (lambda: testing.make_mla_prefill_case([3, 0, 170], [50, 4, 2000], device="cuda", seed=34), (2,)),
}


@pytest.mark.parametrize("late", [False, True, "scan_last"],
                         ids=["marks_before_the_lists", "last_to_arrive_empties", "a_scan_cta_empties"])
@pytest.mark.parametrize("name", list(PAGE_FAULTED))
def test_page_faults_empty_their_requests_split_or_not(name, late):
    """A page id outside the pool, found by the scan CTAs while CTA 0 plans (``planner_scan.py``): the faulted
    requests' rows are 0 / lse -inf, a split one's pieces included, every other row is the reference's, the error
    word names kv_indices; the marks are cleared, so the next clean call is right. Both ways the marks reach the
    lists: before CTA 0 writes them, and (``late_scan_policy``) by the last CTA to arrive, in place: CTA 0 itself, or
    (``scan_last``: the scan CTAs arrive 50 us late) a scan CTA, reading the items CTA 0's bulk copies wrote."""
    from cute_attn.device_errors import DeviceIndexError
    from cute_attn.kernels.common.device_planner import late_scan_policy
    from cute_attn.plan import MergeField

    make, faulted = PAGE_FAULTED[name]
    with late_scan_policy(scan_last=late == "scan_last") if late else _no_policy():
        case = make()
        mla_decode = name.startswith("mla decode")
        run = cute_attn.mla_paged_decode if mla_decode else hostile.entry_for(case).run
        plan_fn = cute_attn.plan_mla_paged_decode if mla_decode else hostile.entry_for(case).plan
        decode = mla_decode or name == "decode"
        plan = plan_fn(*case.inputs(), on_device=True)
        merge_indptr = plan.merge_indptr.cpu().numpy()
        n_merges = int((merge_indptr < merge_indptr[-1]).sum())  # past the last merge every entry is the total
        merged = set(plan.merges.cpu().numpy()[:n_merges, MergeField.REQUEST].tolist())
        assert faulted[0] in merged, f"{name}: request {faulted[0]} is no longer split (merges of {sorted(merged)})"
        ref_out, ref_lse = case.reference()
        rows = (lambda b: slice(b, b + 1)) if decode else \
            (lambda b: slice(int(case.qo_indptr[b]), int(case.qo_indptr[b + 1])))
        kvp = case.kv_indptr.tolist()
        saved = case.kv_indices.clone()
        for k, b in enumerate(faulted):
            ref_out[rows(b)], ref_lse[rows(b)] = 0, float("-inf")
            case.kv_indices[kvp[b]] = -3 if k % 2 else (case.ckv_cache if hasattr(case, "ckv_cache")
                                                           else case.k_cache).shape[0] + 7
        out, lse = case.new_outputs()
        run(*case.inputs(), out, lse)
        torch.cuda.synchronize()
        testing.assert_close_benchmark(out, ref_out, f"{name}: output")
        testing.assert_close_benchmark(lse, ref_lse, f"{name}: lse")
        with pytest.raises(DeviceIndexError, match="kv_indices"):
            cute_attn.raise_on_device_error()
        case.kv_indices.copy_(saved)
        _assert_default_call_matches_reference(case, f"{name}, clean again", run)


@contextlib.contextmanager
def _no_policy():
    yield


@pytest.mark.parametrize("q_lens, kv_lens, call", [
    ([4300], [4300], True),  # 1075 q tiles: past the MLA sort's 1024 keys, four a thread
    ([2200, 2200], [2300, 2250], True),  # two zigzag requests' equal tiles interleave by line order
    ([3000, 1500, 40], [3100, 1600, 900], True),
    ([16384], [16387], False),  # the bench's 16K: 4096 q tiles, eight a thread (lists only: its reference is large)
], ids=["1x4300", "2x2200", "ragged3", "16k"])
def test_ranked_deal_lists_equal_the_twin(q_lens, kv_lens, call):
    """``config.rank_deal_policy()`` (built in session 24): past the sort's keys the planner ranks the q tiles from
    the requests' shapes (``rank_sort.py``); its lists equal the twin's (a deal), and the default call the reference."""
    from cute_attn.config import rank_deal_policy

    with rank_deal_policy(4096):
        case = testing.make_mla_prefill_case(q_lens, kv_lens, device="cuda", seed=len(q_lens) + q_lens[0])
        plan = cute_attn.plan_mla_paged_prefill(*case.inputs(), on_device=True)
        config = plan.config.plan_config(plan.work_indptr.shape[0] - 1)
        assert config.rank_deal_max_q_tiles == 4096 and config.zigzag
        _, dealt = partition(config, q_lens, kv_lens)
        assert dealt, "the batch no longer exercises the ranked deal"
        _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"ranked {q_lens}")
        if call:
            _assert_default_call_matches_reference(case, f"ranked {q_lens}")


DEAL_FIRST_CASES = {  # (q_lens, kv_lens, heads, kv_heads, mla, the deal kept before any cut)
    "gqa h32 8 x 992": ([992] * 8, [992] * 8, 32, 4, False, True),
    "gqa h16/kv1 1 x 992": ([992], [992], 16, 1, False, False),  # tiles past W + W / 8: the cuts first, no sort
    "gqa uniform 8 one-tile requests": ([16] * 8, [900] * 8, 32, 4, False, False),  # even pieces may cut it
    "mla seed-like": ([179, 23, 43, 55, 43, 177, 191, 130], [186, 41, 109, 141, 167, 272, 243, 161], 16, 1, True,
                      False),  # made first, past W + W / 8; the cuts then give way to it
    "mla 1 x 1028": ([1028], [1038], 16, 1, True, True),
    "gqa ragged made, then cut": ([35, 294, 224, 288, 28, 217], [269, 726, 963, 509, 608, 345], 32, 4, False, False),
}


def _deal_first_case(q_lens, kv_lens, heads, kv_heads, mla):
    if mla:
        case = testing.make_mla_prefill_case(q_lens, kv_lens, device="cuda", seed=len(q_lens) + 21)
        return case, cute_attn.plan_mla_paged_prefill(*case.inputs(), on_device=True)
    case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, device="cuda",
                                         seed=len(q_lens) + 22)
    return case, cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=True)


def _deal_first_builds(one_site):
    """deal_first on for both causal kinds; ``one_site``: the A/B build with the deal's code at one call site."""
    from cute_attn.config import deal_first_policy
    from cute_attn.kernels.common.device_planner import deal_one_site_policy

    stack = contextlib.ExitStack()
    stack.enter_context(deal_first_policy())
    stack.enter_context(deal_one_site_policy(one_site))
    return stack


@pytest.mark.parametrize("one_site", [False, True], ids=["two_sites", "one_site"])
@pytest.mark.parametrize("name", list(DEAL_FIRST_CASES))
def test_deal_first_lists_equal_the_twin_and_the_call_the_reference(name, one_site):
    """``config.deal_first_policy()`` (built in session 25): the planner deals before it cuts and keeps a deal near
    the mean with no cuts made; elsewhere the cuts decide against the same deal. Its lists equal the twin's, which
    equal the plan the cuts-first rule makes, and the default call matches the reference. ``one_site``: the build
    with the deal's code at one call site (``planner_deal_first.deal_first_one_site``)."""
    from cute_attn.plan_partition import deal_first_bound, deals_first, line_width, q_tiles, sorted_deal

    q_lens, kv_lens, heads, kv_heads, mla, kept = DEAL_FIRST_CASES[name]
    with _deal_first_builds(one_site):
        case, plan = _deal_first_case(q_lens, kv_lens, heads, kv_heads, mla)
        config = plan.config.plan_config(plan.work_indptr.shape[0] - 1)
        assert config.deal_first and deals_first(config, len(q_lens), q_tiles(config, q_lens, kv_lens).cost.size)
        tiles = q_tiles(config, q_lens, kv_lens)
        cost = tiles.cost
        tile, cta = sorted_deal(config, cost)
        busiest = np.bincount(cta, weights=cost[tile], minlength=config.num_ctas).max()
        uniform = np.array_equal(tiles.request, np.arange(len(q_lens))) and (tiles.kv_end == tiles.kv_end[0]).all()
        assert (busiest <= deal_first_bound(line_width(config, int(cost.sum()) * config.num_kv_heads))
                and not uniform) == kept, "the case no longer takes the path it names"
        _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"deal first {name}")
        cuts_first = partition_plan(dataclasses.replace(config, deal_first=False), q_lens, kv_lens,
                                    kv_page_start=case.kv_indptr.cpu().numpy()[:-1],
                                    token_start=case.qo_indptr.cpu().numpy()[:-1], capacity=plan_capacity(plan))
        work, items, _, _ = _lists(plan)
        assert np.array_equal(work, cuts_first.work_indptr) and np.array_equal(items, cuts_first.valid_items()), (
            f"{name}: the deal-first plan differs from the cuts-first one")
        _assert_default_call_matches_reference(case, f"deal first {name}")


def _assert_drawn_batch_lists_equal_the_twin(batch, mla, what):
    """A drawn GQA (h32/kv4) or MLA prefill batch (MLA: at most 260 query and 3000 keys a request) planned on the
    device under the caller's policy, its lists against the twin's."""
    q_lens, kv_lens = batch
    if mla:
        q_lens, kv_lens = [min(q, 260) for q in q_lens], [min(k, 3000) for k in kv_lens]
        q_lens = [min(q, k) for q, k in zip(q_lens, kv_lens)]
    case, plan = _deal_first_case(q_lens, kv_lens, 32, 4, mla)
    _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens,
                 f"{what} {'mla' if mla else 'gqa'} {q_lens} {kv_lens}")


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=9000), mla=st.booleans(), one_site=st.booleans())
def test_deal_first_lists_equal_the_twin_on_drawn_batches(batch, mla, one_site):
    with _deal_first_builds(one_site):
        _assert_drawn_batch_lists_equal_the_twin(batch, mla, "deal first")


LAP_LISTS_CASES = {  # (q_lens, kv_lens, heads, kv_heads, mla)
    "gqa h32 8 x 992 (1984 items: one pass)": ([992] * 8, [992] * 8, 32, 4, False),
    "gqa h20 8 x 992": ([992] * 8, [992] * 8, 20, 4, False),
    "gqa 16 x 992 (3968 items: the chunks)": ([992] * 16, [992] * 16, 32, 4, False),
    "mla seed-like": ([179, 23, 43, 55, 43, 177, 191, 130], [186, 41, 109, 141, 167, 272, 243, 161], 16, 1, True),
}


@pytest.mark.parametrize("name", list(LAP_LISTS_CASES))
def test_lap_lists_equal_the_twin_and_the_call_the_reference(name):
    """``device_planner.lap_lists_policy()`` (session 25; GQA prefill's default since session 26, where it follows
    ``deal_first``): a dealt plan's rows built in one pass by (CTA, lap) slots, no CTA search; past both stage buffers
    the chunks as before. Its lists equal the twin's, and the default call matches the reference."""
    from cute_attn.kernels.common.device_planner import lap_lists_policy

    q_lens, kv_lens, heads, kv_heads, mla = LAP_LISTS_CASES[name]
    with lap_lists_policy():
        case, plan = _deal_first_case(q_lens, kv_lens, heads, kv_heads, mla)
        config = plan.config.plan_config(plan.work_indptr.shape[0] - 1)
        _, dealt = partition(config, q_lens, kv_lens)
        assert dealt, "the batch no longer exercises a dealt plan"
        _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"lap lists {name}")
        _assert_default_call_matches_reference(case, f"lap lists {name}")


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=9000), mla=st.booleans())
def test_lap_lists_equal_the_twin_on_drawn_batches(batch, mla):
    from cute_attn.kernels.common.device_planner import lap_lists_policy

    with lap_lists_policy():
        _assert_drawn_batch_lists_equal_the_twin(batch, mla, "lap lists")


def test_captured_decode_step_replays_across_changing_batches():
    """Capture plan + attention once at capacity; replay with new lengths, page tables and live batch sizes
    (requests past the live batch are empty: output 0, lse -inf), equal to eager calls and to the reference."""
    max_batch, page_size, pool_pages = 24, 64, 3000
    shape = testing.make_gqa_decode_case([64] * max_batch, device="cuda", seed=0, extra_pages=pool_pages)
    q, k_cache, v_cache = shape.q.clone(), shape.k_cache, shape.v_cache
    k_cache.normal_()  # every page may be drawn below: no NaN poison here
    v_cache.normal_()
    kv_indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(k_cache.shape[0], dtype=torch.int32, device="cuda")
    last = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    rng = np.random.default_rng(5)

    def load(live):
        lens = [int(x) for x in rng.integers(1, 9000, live)] + [0] * (max_batch - live)
        testing.refill_page_table(lens, page_size, kv_indptr, kv_indices, last, rng)
        q.normal_()
        return lens

    def step():
        cute_attn.gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, last, shape.sm_scale, out, lse)

    load(max_batch)
    step()  # compile and allocate outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for live in (max_batch, 1, 7, 17, 3):
        lens = load(live)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone(), lse.clone()
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed[0], out) and torch.equal(replayed[1], lse), f"live {live}: replay != eager"
        case = testing.GqaDecodeCase(q=q, k_cache=k_cache, v_cache=v_cache, kv_indptr=kv_indptr,
                                     kv_indices=kv_indices[: int(kv_indptr[-1])], kv_last_page_len=last,
                                     sm_scale=shape.sm_scale, kv_lens=lens, page_size=page_size)
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(replayed[0], ref_out, f"live {live} output")
        testing.assert_close_benchmark(replayed[1], ref_lse, f"live {live} lse")
        assert (replayed[0][live:] == 0).all() and torch.isneginf(replayed[1][live:]).all()
    cute_attn.raise_on_device_error()


@pytest.mark.parametrize("q_lens, kv_lens, heads, kv_heads", [
    ([992] * 32, [992] * 32, 32, 4), ([992] * 40, [992] * 40, 20, 4), ([600] * 30, [3000] * 30, 32, 4),
    ([0, 130, 1, 700, 64, 900] * 16, [5, 130, 64, 900, 64, 1000] * 16, 32, 4),  # 1840 q tiles: dealt
    ([0, 130, 1, 700, 64, 2500] * 10, [5, 130, 64, 900, 64, 2600] * 10, 32, 4),  # 2150: past the sort, cut
], ids=["32x992-h32kv4", "40x992-h20kv4", "30x600-3000", "ragged-1840", "ragged-2150"])
def test_the_2048_key_deal_lists_equal_the_twin(q_lens, kv_lens, heads, kv_heads):
    """``deal_max_q_tiles`` 2048 (``ops/gqa_prefill.DEAL_MAX_Q_TILES``): batches of 1025..2048 q tiles are sorted four
    keys a thread and dealt; the device's lists equal the twin's and the default call matches the reference."""
    from cute_attn.ops.gqa_prefill import deal_max_q_tiles_policy

    with deal_max_q_tiles_policy(2048):
        case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, device="cuda",
                                             seed=len(q_lens) + heads)
        plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=True)
        assert plan.config.plan_config(plan.work_indptr.shape[0] - 1).deal_max_q_tiles == 2048
        _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"{q_lens[:3]}...")
        _assert_default_call_matches_reference(case, f"2048-key deal {heads}/{kv_heads}")


@pytest.mark.parametrize("q_lens, kv_lens, heads, kv_heads", [
    ([992] * 8, [992] * 8, 32, 4), ([992] * 8, [992] * 8, 32, 8), ([128] * 8, [2048] * 8, 32, 4),
    ([0, 130, 1, 700, 64, 2500], [5, 130, 64, 900, 64, 2600], 20, 4),
], ids=["8x992-h32kv4", "8x992-h32kv8", "8x128-2048", "ragged-h20kv4"])
def test_whole_cuts_dealt_lists_equal_the_twin(q_lens, kv_lens, heads, kv_heads):
    """``deal_whole_cuts`` (``ops/gqa_prefill.DEVICE_WHOLE_DEAL``): whole-tile cuts give way to the serpentine deal
    within 1/16 of their busiest CTA; the device's lists equal the twin's and the default call matches the reference."""
    from cute_attn.ops.gqa_prefill import device_whole_deal_policy

    with device_whole_deal_policy(True):
        case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, device="cuda",
                                             seed=len(q_lens) + heads)
        plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=True)
        assert plan.config.plan_config(plan.work_indptr.shape[0] - 1).deal_whole_cuts
        _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"{q_lens[:3]}...")
        _assert_default_call_matches_reference(case, f"whole cuts dealt {heads}/{kv_heads}")


LAP_TURN_CASES = {  # (q_lens, kv_lens, heads, kv_heads, num_sms)
    "gqa h32 8 x 992": ([992] * 8, [992] * 8, 32, 4, None),
    "gqa h16/kv1 8 x 992": ([992] * 8, [992] * 8, 16, 1, None),
    "gqa 16 x 992 (the chunks)": ([992] * 16, [992] * 16, 32, 4, None),
    "gqa h16/kv1 16 x 992 (2048 keys, 16 laps)": ([992] * 16, [992] * 16, 16, 1, None),
    "gqa 32 x 992 (61 laps: the serpentine)": ([992] * 32, [992] * 32, 32, 4, None),
    # 120 CTAs: on the H200's 132 this batch's cuts win and nothing is dealt
    "gqa ragged (runs in a lap, 120 CTAs)": ([35, 294, 224, 288, 28, 217], [269, 726, 963, 509, 608, 345], 32, 4, 120),
    "gqa h5/kv1 8 x 992 (the serpentine wins the vote)": ([992] * 8, [992] * 8, 5, 1, None),
    "gqa 8 x 992 on 3 CTAs (661 laps: the serpentine)": ([992] * 8, [992] * 8, 32, 4, 3),
}


@pytest.mark.parametrize("name", list(LAP_TURN_CASES))
def test_lap_turn_lists_equal_the_twin_and_the_call_the_reference(name):
    """``config.lap_turn_policy()`` (session 27, ``sorted_deal.turned_deal_loads``): each lap's CTA order rotated past the CTAs
    that drew its longest cost, where that deal's busiest CTA beats the serpentine's; the lists equal the twin's
    (``plan_partition.turned_deal``), and the default call matches the reference. The cases: turned deals kept first,
    the chunked lists, the 2048-key sort, laps of several runs, a batch the serpentine wins, and more laps than
    ``LAP_TURN_MAX_LAPS`` (the serpentine)."""
    from cute_attn.config import lap_turn_policy
    from cute_attn.plan_partition import turns_laps

    q_lens, kv_lens, heads, kv_heads, num_sms = LAP_TURN_CASES[name]
    with lap_turn_policy():
        case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads,
                                             device="cuda", seed=len(q_lens) + 27)
        plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=True, num_sms=num_sms)
        config = plan.config.plan_config(plan.work_indptr.shape[0] - 1)
        assert config.lap_turn and turns_laps(config)
        _, dealt = partition(config, q_lens, kv_lens)
        assert dealt, "the batch no longer exercises a dealt plan"
        _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"lap turn {name}")
        out, lse = case.new_outputs()
        cute_attn.gqa_paged_prefill(*case.inputs(), out, lse, num_sms=num_sms)
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, f"lap turn {name} output")
        testing.assert_close_benchmark(lse, ref_lse, f"lap turn {name} lse")
        cute_attn.raise_on_device_error()


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=9000))
def test_lap_turn_lists_equal_the_twin_on_drawn_batches(batch):
    from cute_attn.config import lap_turn_policy

    with lap_turn_policy():
        _assert_drawn_batch_lists_equal_the_twin(batch, False, "lap turn")


ROW_WRITER_CASES = {  # (q_lens or None for decode, kv_lens, heads, kv_heads, mla, rows a writer)
    "gqa h32 8 x 992, 8 writers": ([992] * 8, [992] * 8, 32, 4, False, 256),
    "gqa h32 4 x 992, 3 writers (odd shares)": ([992] * 4, [992] * 4, 32, 4, False, 400),
    "gqa h32 32 x 992, 3 writers (chunked shares)": ([992] * 32, [992] * 32, 32, 4, False, 3000),
    "gqa ragged cut plan, 5 writers": ([35, 294, 224, 288, 28, 217], [269, 726, 963, 509, 608, 345], 32, 4, False,
                                       60),
    "gqa more writers than rows": ([3, 1], [40, 9], 32, 4, False, 1),
    "mla seed-like": ([179, 23, 43, 55, 43, 177, 191, 130], [186, 41, 109, 141, 167, 272, 243, 161], 16, 1, True, 16),
    "decode 64 x 2048 page 1 (line deal)": (None, [2048] * 64, 20, 4, False, 48),
}


def _row_writer_builds(rows):
    """Every planner built with MAX_ROW_WRITERS writers, a launch taking one writer a ``rows`` rows of its tile
    bound."""
    from cute_attn.kernels.common.device_planner import MAX_ROW_WRITERS, row_writers_policy

    return row_writers_policy(MAX_ROW_WRITERS, rows)


@pytest.mark.parametrize("name", list(ROW_WRITER_CASES))
def test_row_writers_lists_equal_the_twin_and_the_call_the_reference(name):
    """Several planning CTAs (``DevicePlannerConfig.row_writers``, built in session 30, off by default) make
    the same plan and each writes its share of the rows: dealt plans in one pass, chunked shares, cut plans, shares
    with no rows, MLA and decode builds under the policy. The lists equal the twin's, and the default call matches
    the reference."""
    q_lens, kv_lens, heads, kv_heads, mla, rows = ROW_WRITER_CASES[name]
    with _row_writer_builds(rows):
        if q_lens is None:
            case = testing.make_gqa_decode_case(kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, page_size=1,
                                                device="cuda", seed=41)
            plan = cute_attn.plan_gqa_paged_decode(*case.inputs(), on_device=True)
            qo, q_lens = list(range(len(kv_lens) + 1)), [1] * len(kv_lens)
        else:
            case, plan = _deal_first_case(q_lens, kv_lens, heads, kv_heads, mla)
            qo = case.qo_indptr.tolist()
        assert plan.planner.writers > 1, f"{name}: the launch has one writer"
        _assert_twin(plan, qo, case.kv_indptr.tolist(), q_lens, kv_lens, f"row writers {name}")
        _assert_default_call_matches_reference(case, f"row writers {name}")


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=9000), mla=st.booleans(),
       rows=st.sampled_from([1, 8, 64, 256]))
def test_row_writers_lists_equal_the_twin_on_drawn_batches(batch, mla, rows):
    with _row_writer_builds(rows):
        _assert_drawn_batch_lists_equal_the_twin(batch, mla, f"row writers a {rows} rows")


@pytest.mark.parametrize("late", [False, True, "scan_last"],
                         ids=["marks_before_the_lists", "last_to_arrive_empties", "a_scan_cta_empties"])
@pytest.mark.parametrize("name", list(PAGE_FAULTED))
def test_page_faults_with_row_writers(name, late):
    """The page-fault test with several row writers a launch (one a 8 rows of the tile bound): each writer takes the
    marks without clearing them, or writes its rows unaware and the last CTA to arrive empties the faulted items of
    those late writers' shares; it clears the marks (``planner_scan.py``)."""
    with _row_writer_builds(8):
        test_page_faults_empty_their_requests_split_or_not(name, late)


COUNT_SORT_CASES = {  # (q_lens, kv_lens, heads, kv_heads, mla): sorted deals ranked by counting, or past its bins
    "gqa h32 8 x 992 (1984 keys, 8 values)": ([992] * 8, [992] * 8, 32, 4, False),
    "gqa h32 1 x 700": ([700], [700], 32, 4, False),
    "gqa ragged": ([35, 294, 224, 288, 28, 217], [269, 726, 963, 509, 608, 345], 32, 4, False),
    "gqa past the bins (71 kv tiles: the bitonic sort)": ([992, 40], [9000, 300], 32, 4, False),
    "mla seed-like": ([179, 23, 43, 55, 43, 177, 191, 130], [186, 41, 109, 141, 167, 272, 243, 161], 16, 1, True),
}


@pytest.mark.parametrize("name", list(COUNT_SORT_CASES))
def test_count_sort_lists_equal_the_twin_and_the_call_the_reference(name):
    """``device_planner.count_sort_policy()`` (built in session 30, off): the sorted deal's order by counting
    (``count_sort.py``) where every tile holds fewer than COUNT_BINS kv tiles, the bitonic sort past them. The lists
    equal the twin's, and the default call matches the reference."""
    from cute_attn.kernels.common.device_planner import count_sort_policy

    q_lens, kv_lens, heads, kv_heads, mla = COUNT_SORT_CASES[name]
    with count_sort_policy():
        case, plan = _deal_first_case(q_lens, kv_lens, heads, kv_heads, mla)
        _assert_twin(plan, case.qo_indptr.tolist(), case.kv_indptr.tolist(), q_lens, kv_lens, f"count sort {name}")
        _assert_default_call_matches_reference(case, f"count sort {name}")


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=9000), mla=st.booleans())
def test_count_sort_lists_equal_the_twin_on_drawn_batches(batch, mla):
    from cute_attn.kernels.common.device_planner import count_sort_policy

    with count_sort_policy():
        _assert_drawn_batch_lists_equal_the_twin(batch, mla, "count sort")

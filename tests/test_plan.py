"""Planner properties: exact coverage, executor == reference, capacity, balance, schedule order, and the
fast LPT / sort formulations against their textbook forms."""

import dataclasses
import heapq
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cute_attn import plan as plan_module
from cute_attn import reference, testing
from cute_attn.plan import ItemField as F
from cute_attn.config import default_paged_config
from cute_attn.plan import PlanCapacity, PlanConfig, plan_work
from cute_attn.plan_executor import execute_plan, plan_coverage
from cute_attn.plan_partition import partition_plan

# the host planner (LPT) and the device planner's numpy twin (cuts of the cost line) keep the same contract
PLANNERS = pytest.mark.parametrize("planner", [plan_work, partition_plan], ids=["lpt", "partition"])


@st.composite
def plan_configs(draw, causal=None):
    num_kv = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 5, 8]))
    return PlanConfig(
        num_qo_heads=num_kv * group, num_kv_heads=num_kv,
        causal=draw(st.booleans()) if causal is None else causal,
        tile_q_rows=draw(st.sampled_from([4, 8, 16])), kv_tile=draw(st.sampled_from([2, 4, 8])),
        num_ctas=draw(st.integers(1, 12)), item_overhead_keys=draw(st.sampled_from([0, 4, 16])),
        min_chunk_keys=draw(st.sampled_from([0, 0, 8, 64])), zigzag=draw(st.booleans()),
        **{"none": {}, "sorted": dict(sorted_deal=True), "line": dict(line_deal=True)}[
            draw(st.sampled_from(["none", "sorted", "line"]))],
        even_pieces=draw(st.booleans()), max_slack_keys=draw(st.sampled_from([0, 0, 4, 16])),
        **(dict(host_deal=True, whole_deal=draw(st.sampled_from(["", "lap", "serpentine"])))
           if draw(st.booleans()) else {}),
        deal_whole_cuts=draw(st.booleans()), deal_first=draw(st.booleans()),
    )


def batches(**kwargs):
    """Ragged batches, or (half the time) batches of equal keys, the ones even pieces cut."""
    return st.one_of(testing.ragged_batches(**kwargs), testing.even_batches(
        max_batch=kwargs.get("max_batch", 8), max_q=min(4, kwargs.get("max_q", 4)), max_kv=kwargs.get("max_kv", 1024)))


def visible_keys(q_len, kv_len, causal):
    """[Lq, Lkv] mask of the definition: bottom-right causal."""
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    return (j <= i + kv_len - q_len) if causal else np.ones((q_len, kv_len), dtype=bool)


@PLANNERS
@given(cfg=plan_configs(), batch=batches(max_batch=5, max_q=12, max_kv=40, kv_at_least_q=False))
def test_every_visible_key_is_covered_exactly_once(planner, cfg, batch):
    q_lens, kv_lens = batch
    plan = planner(cfg, q_lens, kv_lens)
    counts = plan_coverage(plan, q_lens, kv_lens)
    for b, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        want = np.broadcast_to(visible_keys(lq, lk, cfg.causal), counts[b].shape).astype(np.int32)
        assert np.array_equal(counts[b], want), f"request {b}: coverage differs from the visible set"


@PLANNERS
@given(cfg=plan_configs(), batch=batches(max_batch=5, max_q=12, max_kv=40, kv_at_least_q=False))
def test_every_query_row_is_written_exactly_once(planner, cfg, batch):
    """Rows that see no key must still be written (0, -inf): exactly one final writer per row."""
    q_lens, kv_lens = batch
    plan = planner(cfg, q_lens, kv_lens)
    writes = [np.zeros((cfg.num_qo_heads, lq), dtype=np.int32) for lq in q_lens]
    g = cfg.group_size

    def mark(b, h, r0, nr):
        rows = np.arange(r0, r0 + nr)
        writes[b][h * g + rows % g, rows // g] += 1

    for it in plan.valid_items():
        if it[F.PARTIAL_SLOT] < 0:
            mark(*(int(x) for x in it[:4]))
    for m in plan.valid_merges():
        mark(*(int(x) for x in m[:4]))
    for w in writes:
        assert (w == 1).all()


@PLANNERS
@given(cfg=plan_configs(), batch=batches(max_batch=5, max_q=12, max_kv=200, kv_at_least_q=False))
def test_every_split_item_names_the_merge_that_lists_its_slot(planner, cfg, batch):
    """The fused merge (decode) relies on: MERGE = -1 iff PARTIAL_SLOT = -1; each merge's slots are a
    contiguous range holding exactly its split items' slots, and the merge covers the item's rows."""
    q_lens, kv_lens = batch
    plan = planner(cfg, q_lens, kv_lens)
    items = plan.valid_items()
    assert items.shape[1] == len(F)
    slots, merges = items[:, F.PARTIAL_SLOT], items[:, F.MERGE]
    assert np.array_equal(slots < 0, merges < 0)
    ptr = plan.merge_indptr
    assert ptr[0] == 0 and (np.diff(ptr) >= 0).all() and ptr[plan.num_merges] == plan.num_partials
    assert (ptr[plan.num_merges:] == plan.num_partials).all()
    split = items[slots >= 0]
    assert sorted(split[:, F.PARTIAL_SLOT].tolist()) == list(range(plan.num_partials))  # one item per slot
    for it in split:
        m = int(it[F.MERGE])
        assert 0 <= m < plan.num_merges
        assert ptr[m] <= it[F.PARTIAL_SLOT] < ptr[m + 1]
        assert np.array_equal(plan.merges[m, :4], it[[F.REQUEST, F.KV_HEAD, F.Q_ROW_START, F.Q_ROW_COUNT]])
    for m in range(plan.num_merges):
        assert (split[:, F.MERGE] == m).sum() == ptr[m + 1] - ptr[m] >= 2


@PLANNERS
@given(cfg=plan_configs(), batch=batches(max_batch=4, max_q=10, max_kv=30, kv_at_least_q=False),
       seed=st.integers(0, 1000))
def test_executing_the_plan_reproduces_the_reference(planner, cfg, batch, seed):
    q_lens, kv_lens = batch
    case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=cfg.num_qo_heads,
                                         num_kv_heads=cfg.num_kv_heads, head_dim=8, page_size=4, seed=seed)
    kvp = case.kv_indptr.tolist()
    k_rows = [reference.gather_paged_kv(case.k_cache, case.kv_indices[kvp[b]:kvp[b + 1]], n) for b, n in enumerate(kv_lens)]
    v_rows = [reference.gather_paged_kv(case.v_cache, case.kv_indices[kvp[b]:kvp[b + 1]], n) for b, n in enumerate(kv_lens)]
    plan = planner(cfg, q_lens, kv_lens)
    out, lse = execute_plan(plan, case.q, k_rows, v_rows, case.qo_indptr.tolist(), case.sm_scale)
    want_out, want_lse = reference.gqa_paged_prefill_ref(*case.inputs(), causal=cfg.causal)
    # compare in fp32 against the fp32 result before the reference's final bf16 cast
    qo = case.qo_indptr.tolist()
    for b in range(len(q_lens)):
        rows = slice(qo[b], qo[b + 1])
        kk, vv = k_rows[b], v_rows[b]
        ref_o, ref_l = reference.attend(case.q[rows], kk, vv, case.sm_scale,
                                        causal_offset=(kv_lens[b] - q_lens[b]) if cfg.causal else None)
        torch.testing.assert_close(out[rows], ref_o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[rows], ref_l, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.to(torch.bfloat16).float(), want_out.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))


@given(cfg=plan_configs(), max_batch=st.integers(1, 6), max_total_q=st.integers(0, 40), data=st.data())
def test_capacity_for_limits_holds_every_batch_within_them(cfg, max_batch, max_total_q, data):
    batch = data.draw(st.integers(1, max_batch))
    q_lens = data.draw(st.lists(st.integers(0, max_total_q), min_size=batch, max_size=batch))
    assume(sum(q_lens) <= max_total_q)
    kv_lens = data.draw(st.lists(st.integers(0, 200), min_size=batch, max_size=batch))
    cap = PlanCapacity.for_limits(cfg, max_batch=max_batch, max_total_q=max_total_q)
    plan = plan_work(cfg, q_lens, kv_lens, capacity=cap)
    assert plan.num_items <= cap.max_items and plan.num_partials <= cap.max_partials
    assert plan.num_merges <= cap.max_merges
    assert plan.items.shape[0] == cap.max_items and plan.merges.shape[0] == cap.max_merges
    assert plan.work_indptr.shape[0] == cfg.num_ctas + 1 and plan.work_indptr[-1] == plan.num_items


def test_too_small_capacity_is_a_clear_error():
    cfg = PlanConfig(8, 2, True, 16, 16, 4)
    with pytest.raises(ValueError, match="plan exceeds capacity"):
        plan_work(cfg, [64, 64], [64, 64], capacity=PlanCapacity(max_items=3, max_partials=0, max_merges=0))


@given(cfg=plan_configs(), batch=testing.ragged_batches(max_batch=12, max_q=64, max_kv=2000))
def test_balanced_when_there_is_more_work_than_ctas(cfg, batch):
    """max CTA cost / mean <= 1.3 once the mean CTA load is several split granules (a granule = the
    shortest chunk the planner may cut, kv_tile or min_chunk_keys, plus the item overhead: no schedule
    can balance below that grain)."""
    q_lens, kv_lens = batch
    # the serpentine trades balance for its pattern, within a sixteenth of the plan it replaces
    assume(cfg.whole_deal != "serpentine" and not cfg.deal_whole_cuts)
    plan = plan_work(cfg, q_lens, kv_lens)
    loads = plan.cta_cost
    granule = max(cfg.kv_tile, -(-cfg.min_chunk_keys // cfg.kv_tile) * cfg.kv_tile) + cfg.item_overhead_keys
    assume(loads.mean() >= 4 * granule and plan.num_items >= cfg.num_ctas)
    # the q-tile grain is not splittable along q: the largest unsplittable tile bounds the balance too
    assert loads.max() / loads.mean() <= 1.3


def test_seed_prefill_workloads_need_no_split_and_fill_the_gpu():
    cfg = PlanConfig(num_qo_heads=32, num_kv_heads=4, causal=True, tile_q_rows=128, kv_tile=128, num_ctas=132)
    for n in (4, 8, 16, 32):
        plan = plan_work(cfg, [992] * n, [992] * n)
        assert plan.num_partials == 0 and plan.num_ctas == 132
        assert plan.cta_cost.max() / plan.cta_cost.mean() <= 1.05


def test_batch_one_decode_is_split_across_the_gpu():
    cfg = PlanConfig(num_qo_heads=20, num_kv_heads=4, causal=False, tile_q_rows=64, kv_tile=64, num_ctas=132)
    plan = plan_work(cfg, [1], [3232])
    assert plan.num_merges == 4  # one per kv head
    split = plan.valid_items()
    assert sorted(set(split[:, F.MERGE].tolist())) == [0, 1, 2, 3]
    for m in range(4):  # each KV head's chunks fold into its own merge
        assert set(split[split[:, F.MERGE] == m, F.KV_HEAD].tolist()) == {plan.merges[m, 1]}
    assert plan.num_ctas >= 100
    # a large batch fills the GPU alone: no split
    plan = plan_work(cfg, [1] * 128, [4096] * 128)
    assert plan.num_partials == 0


def test_zigzag_pairs_a_long_causal_requests_tiles():
    """MLA prefill 1 x 1028 (16 heads, 64-row tiles: 257 tiles rising in cost over 132 CTAs): tile order cut
    97 tiles into split-KV chunks (194 partials of 64 x 512 fp32); short, long, short... pairs the tiles, so
    the cuts snap to tile edges: no merge, and the max CTA load within 5% of the host LPT plan's."""
    config = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                  head_dim_qk=576, head_dim_v=512, page_size=1, causal=True)
    cfg = config.plan_config(132)
    assert cfg.zigzag
    in_order = partition_plan(dataclasses.replace(cfg, zigzag=False, sorted_deal=False), [1028], [1038])
    zigzag = partition_plan(cfg, [1028], [1038])
    assert in_order.num_merges == 97 and zigzag.num_merges == 0
    assert zigzag.cta_cost.max() <= 1.05 * plan_work(cfg, [1028], [1038]).cta_cost.max()
    rows = sorted(int(r) for r in zigzag.valid_items()[:, F.Q_ROW_START])
    assert rows == [64 * t for t in range(257)]  # every q tile once, in whatever order


def test_partition_takes_whole_tiles_when_they_fit():
    """Decode 64 x 2048 and 128 x 4096 (the definition's config): cutting at tile edges leaves no CTA above
    W + W/8, so the device plan has no merges, as the host LPT plan; batch 1 still splits across the GPU."""
    from cute_attn.plan_partition import WHOLE_TILE_SHIFT

    cfg = PlanConfig(num_qo_heads=20, num_kv_heads=4, causal=False, tile_q_rows=60, kv_tile=64, num_ctas=132,
                     item_overhead_keys=128, min_chunk_keys=256)
    for batch, kv in ((64, 2048), (128, 4096)):
        plan = partition_plan(cfg, [1] * batch, [kv] * batch)
        assert plan.num_merges == 0 and plan.num_items == batch * 4
        cost = 4 * batch * (kv + 128)
        width = -(-cost // 132)
        assert plan.cta_cost.max() <= width + (width >> WHOLE_TILE_SHIFT)
        assert plan.cta_cost.max() == plan_work(cfg, [1] * batch, [kv] * batch).cta_cost.max()
    assert partition_plan(cfg, [1], [3232]).num_merges == 4


@settings(suppress_health_check=[HealthCheck.filter_too_much])  # most draws split: the assumes keep the rest
@given(cfg=plan_configs(), batch=testing.ragged_batches(max_batch=12, max_q=64, max_kv=2000))
def test_partition_whole_tile_plans_stay_within_their_bound(cfg, batch):
    """A partition plan that took the whole-tile rule never loads a CTA above its bound (W + W/8 of the cost line;
    capped slacks: ``whole_tile_bound``). Split cuts that merely snapped every cut (a cut key that rounds to 0 inside
    a tile shorter than the item overhead) are not the rule's and keep no such bound."""
    from cute_attn.plan_partition import line_cuts, min_width, piece_cost, q_tiles, whole_tile_bound

    q_lens, kv_lens = batch
    cfg = dataclasses.replace(cfg, sorted_deal=False)  # the deal's own bound: test_a_sorted_deal_...
    plan = partition_plan(cfg, q_lens, kv_lens)
    items = plan.valid_items()
    tiles_ = q_tiles(cfg, q_lens, kv_lens)
    assume(plan.num_merges == 0 and items.size and cfg.allow_split)
    assume(line_cuts(cfg, tiles_.kv_end, tiles_.cost)[3])  # the whole-tile rule took them
    rows = np.asarray(q_lens) * cfg.group_size
    tiles = -(-rows // cfg.tile_q_rows)
    total = 0
    for q, kv, n in zip(q_lens, kv_lens, tiles):  # the line: every tile's cost, every KV head
        for r in range(n):
            count = min(cfg.tile_q_rows, q * cfg.group_size - r * cfg.tile_q_rows)
            end = kv if not cfg.causal else int(np.clip((r * cfg.tile_q_rows + count - 1) // cfg.group_size + 1
                                                        + kv - q, 0, kv))
            total += cfg.num_kv_heads * int(piece_cost(cfg, end))
    width = max(-(-total // cfg.num_ctas), min_width(cfg))
    assert plan.cta_cost.max() <= whole_tile_bound(cfg, width) or plan.cta_cost.max() <= max(
        piece_cost(cfg, items[:, F.KV_END] - items[:, F.KV_START]))


def test_empty_batch_and_empty_requests():
    cfg = PlanConfig(8, 2, True, 16, 16, 4)
    plan = plan_work(cfg, [0, 0], [5, 0])
    assert plan.num_items == 0 and plan.num_ctas == 0 and plan.work_indptr[-1] == 0
    plan = plan_work(cfg, [3], [0])
    assert plan.num_items == 2 and (plan.valid_items()[:, F.KV_END] == 0).all()


def test_bad_config_and_lengths_are_rejected():
    with pytest.raises(ValueError, match="num_qo_heads .* multiple of num_kv_heads"):
        PlanConfig(7, 2, True, 16, 16, 4)
    with pytest.raises(ValueError, match="num_ctas must be >= 1"):
        PlanConfig(8, 2, True, 16, 16, 0)
    cfg = PlanConfig(8, 2, True, 16, 16, 4)
    with pytest.raises(ValueError, match="one entry per request"):
        plan_work(cfg, [1, 2], [3])
    with pytest.raises(ValueError, match=">= 0"):
        plan_work(cfg, [-1], [3])


@given(cfg=plan_configs(), page_size=st.sampled_from([1, 2, 4, 8, 16]),
       batch=testing.ragged_batches(max_batch=6, max_q=4, max_kv=70, kv_at_least_q=False))
def test_kv_page_start_is_the_kv_indices_position_of_the_first_key(cfg, page_size, batch):
    """The kernels read page ids from KV_PAGE_START instead of kv_indptr[REQUEST] + KV_START // page_size:
    the two must agree for every item, with kv_indptr as the entry rules allow it (0-based, ceil pages)."""
    q_lens, kv_lens = batch
    cfg = dataclasses.replace(cfg, page_size=page_size)
    plan = plan_work(cfg, q_lens, kv_lens)
    kv_indptr = [0]
    for kv in kv_lens:
        kv_indptr.append(kv_indptr[-1] + (kv + page_size - 1) // page_size)
    for item in plan.valid_items():
        b, start = int(item[F.REQUEST]), int(item[F.KV_START])
        assert item[F.KV_PAGE_START] == kv_indptr[b] + start // page_size, item.tolist()
        if item[F.KV_END] > start:  # the key exists, so its page lies inside the request's pages
            assert kv_indptr[b] <= item[F.KV_PAGE_START] < kv_indptr[b + 1]


def test_kv_page_start_is_minus_one_without_a_page_size():
    plan = plan_work(PlanConfig(8, 2, False, 16, 16, 4), [1, 1], [40, 7])
    assert (plan.valid_items()[:, F.KV_PAGE_START] == -1).all()
    with pytest.raises(ValueError, match="page_size must be >= 0"):
        PlanConfig(8, 2, False, 16, 16, 4, page_size=-1)


# ---------------------------------------------------------------------------------------------
# Schedule order and the LPT, against the textbook formulation
# ---------------------------------------------------------------------------------------------
def item_costs(cfg, items):
    keys = items[:, F.KV_END].astype(np.int64) - items[:, F.KV_START]
    return -(-keys // cfg.kv_tile) * cfg.kv_tile + cfg.item_overhead_keys


def item_ctas(plan):
    return np.repeat(np.arange(plan.config.num_ctas), np.diff(plan.work_indptr))


def assert_schedule_is_cta_major_and_longest_first(plan):
    items = plan.valid_items()
    costs, ctas = item_costs(plan.config, items), item_ctas(plan)
    assert plan.work_indptr[0] == 0 and (np.diff(plan.work_indptr) >= 0).all()
    assert np.array_equal(np.bincount(ctas, weights=costs, minlength=plan.config.num_ctas), plan.cta_cost)
    same_cta = ctas[1:] == ctas[:-1]
    assert (costs[1:][same_cta] <= costs[:-1][same_cta]).all(), "inside a CTA, items run longest first"
    assert plan.num_ctas == int((np.diff(plan.work_indptr) > 0).sum())


def textbook_lpt(costs, num_ctas, exact):
    """The LPT as first written: a heap of (load, cta) tuples, or per round of num_ctas items (largest
    first) an argsort of the loads. Returns (cta of each item, load of each CTA)."""
    order = np.argsort(-costs, kind="stable")
    cta = np.empty(costs.size, dtype=np.int64)
    loads = np.zeros(num_ctas, dtype=np.int64)
    if exact:
        heap = [(0, c) for c in range(num_ctas)]
        for i in order.tolist():
            load, c = heap[0]
            cta[i] = c
            heapq.heapreplace(heap, (load + int(costs[i]), c))
        np.add.at(loads, cta, costs)
    else:
        for r0 in range(0, order.size, num_ctas):
            idx = order[r0 : r0 + num_ctas]
            targets = np.argsort(loads, kind="stable")[: idx.size]
            cta[idx] = targets
            loads[targets] += costs[idx]
    return cta, loads


@given(cfg=plan_configs(), batch=testing.ragged_batches(max_batch=12, max_q=64, max_kv=2000, kv_at_least_q=False))
def test_items_are_cta_major_longest_first_and_cta_cost_adds_up(cfg, batch):
    # the LPT's own schedule (host_twin may hand the twin's cuts back instead: tested below)
    lpt = dataclasses.replace(cfg, host_twin=False, host_deal=False)
    assert_schedule_is_cta_major_and_longest_first(plan_work(lpt, *batch))


@given(cfg=plan_configs(), batch=testing.ragged_batches(max_batch=12, max_q=64, max_kv=2000, kv_at_least_q=False))
def test_host_plans_take_the_twin_only_when_it_models_better(cfg, batch):
    """``host_twin``: the host plan is the LPT's unless the device twin's busiest CTA is strictly lower (ties keep the
    LPT, which measured as fast or faster where they tie); with ``host_deal`` a dealt twin is taken as it is."""
    from cute_attn.plan_partition import partition

    q_lens, kv_lens = batch
    cfg = dataclasses.replace(cfg, host_twin=True, host_deal=False)
    lpt = plan_work(dataclasses.replace(cfg, host_twin=False), q_lens, kv_lens)
    twin, _ = partition(cfg, q_lens, kv_lens)
    plan = plan_work(cfg, q_lens, kv_lens)
    expected = twin if twin.cta_cost.max() < lpt.cta_cost.max() and sum(q_lens) else lpt
    assert np.array_equal(plan.items, expected.items) and np.array_equal(plan.work_indptr, expected.work_indptr)
    assert plan.cta_cost.max() == min(lpt.cta_cost.max(), twin.cta_cost.max()) or not sum(q_lens)


def test_mla_decode_host_plans_cut_long_requests_in_halves_where_that_models_as_well():
    """MLA decode 64 x 8192 (one-token tiles). The LPT's caps from the total cut every request into 4 chunks on 2
    chunks a CTA (busiest 4352); the twin's line cuts give 132 CTAs a near-equal stretch (4224) but leave each request
    a short third chunk (192 partials). The cap of half the longest tile models the same 4224 on 128 CTAs with 2
    chunks a request (128 partials), which the H200 ran 2.7 us faster (session 18); the tie keeps the LPT's."""
    from cute_attn.config import default_paged_config
    from cute_attn.ops.mla_decode import ONE_TOKEN_SPEC
    from cute_attn.plan_partition import partition

    config = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                  head_dim_qk=576, head_dim_v=512, page_size=64, causal=True, spec=ONE_TOKEN_SPEC)
    pc = config.plan_config(132)
    assert pc.host_twin
    twin, _ = partition(dataclasses.replace(pc, even_pieces=False), [1] * 64, [8192] * 64)  # the line's cuts
    plan = plan_work(dataclasses.replace(pc, even_pieces=False), [1] * 64, [8192] * 64)
    assert twin.cta_cost.max() == 4224 and (twin.num_items, twin.num_partials) == (192, 192)
    assert plan.cta_cost.max() == 4224 and (plan.num_items, plan.num_partials, plan.num_merges) == (128, 128, 64)
    assert plan.num_ctas == 128
    items, field = plan.items[:plan.num_items], plan_module.ItemField
    keys = items[:, field.KV_END] - items[:, field.KV_START]
    assert (keys == 4096).all()


@given(max_len=st.sampled_from([100, 5000, 10**6, 2**50]), data=st.data(), num_ctas=st.integers(1, 300),
       kv_tile=st.sampled_from([1, 16, 64, 128]), overhead=st.sampled_from([0, 7, 128]), exact=st.booleans())
def test_lpt_and_longest_first_match_the_textbook_formulation(max_len, data, num_ctas, kv_tile, overhead, exact):
    """Costs spanning 8, 16 and more bits (the radix-sort ranks and their fallback) and keys past int64
    (lengths near 2**50: the Python-int keys), through both the exact and the round-based LPT."""
    lengths = np.array(data.draw(st.lists(st.integers(0, max_len), max_size=400)), dtype=np.int64)
    costs = -(-lengths // kv_tile) * kv_tile + overhead
    order = plan_module._longest_first(costs, kv_tile)
    assert np.array_equal(order, np.argsort(-costs, kind="stable"))
    with mock.patch.object(plan_module, "_EXACT_LPT_MAX_ITEMS", costs.size if exact else -1):
        cta_of, loads = plan_module._lpt(costs[order], num_ctas)
    want_cta, want_loads = textbook_lpt(costs, num_ctas, exact)
    assert np.array_equal(cta_of, want_cta[order]) and np.array_equal(loads, want_loads)


@pytest.mark.parametrize("num_kv_heads,group,num_ctas", [(4, 5, 132), (1, 16, 132), (8, 4, 264), (2, 8, 7)])
def test_large_decode_batch_is_whole_tiles_in_textbook_round_lpt_order(num_kv_heads, group, num_ctas):
    """4096 decode requests: past _EXACT_LPT_MAX_ITEMS tiles (the round-based LPT) unless one KV head.
    Every (request, head) is one whole tile, placed as the textbook LPT places it."""
    cfg = PlanConfig(num_qo_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, causal=False,
                     tile_q_rows=64, kv_tile=64, num_ctas=num_ctas, min_chunk_keys=256)
    rng = np.random.default_rng(num_ctas)
    kv_lens = rng.integers(0, 16 * 1024, size=4096)
    kv_lens[:7] = 0
    plan = plan_work(cfg, np.ones(4096, dtype=np.int64), kv_lens)
    assert plan.num_partials == 0 and plan.num_items == 4096 * num_kv_heads
    assert_schedule_is_cta_major_and_longest_first(plan)
    items = plan.valid_items()
    tile = items[:, F.REQUEST].astype(np.int64) * num_kv_heads + items[:, F.KV_HEAD]
    assert np.array_equal(np.sort(tile), np.arange(plan.num_items))  # each tile exactly once
    assert (items[:, F.KV_START] == 0).all() and np.array_equal(items[:, F.KV_END], kv_lens[items[:, F.REQUEST]])
    costs = -(-np.repeat(kv_lens, num_kv_heads) // 64) * 64 + cfg.item_overhead_keys
    want_cta, want_loads = textbook_lpt(costs, num_ctas, exact=plan.num_items <= plan_module._EXACT_LPT_MAX_ITEMS)
    assert np.array_equal(item_ctas(plan), want_cta[tile]) and np.array_equal(plan.cta_cost, want_loads)


@settings(max_examples=40, deadline=None)
@given(group=st.integers(1, 16), num_kv=st.sampled_from([1, 2, 4]),
       q_lens=st.lists(st.integers(0, 400), min_size=1, max_size=6))
def test_prefill_tiles_hold_whole_tokens_for_any_group(group, num_kv, q_lens):
    """The prefill Q box loads whole tokens: every tile starts on a token and packs at most 128 // group of them."""
    from cute_attn.config import default_paged_config

    config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=group * num_kv,
                                  num_kv_heads=num_kv, head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)
    rows = config.packed_rows_per_tile
    assert rows % group == 0 and rows <= config.tile_q_rows and rows // group == config.tile_q_rows // group
    plan = plan_work(config.plan_config(8), q_lens, [q + 5 for q in q_lens])
    items = plan.valid_items()
    assert (items[:, F.Q_ROW_START] % rows == 0).all()
    assert (items[:, F.Q_ROW_COUNT] <= rows).all()


@given(cfg=plan_configs(causal=True), batch=testing.ragged_batches(max_batch=12, max_q=64, max_kv=2000))
def test_cut_loads_are_the_cut_plans_cta_costs(cfg, batch):
    """The device decides between cuts and the sorted deal from each CTA's cut load without building the cut
    plan's items: ``cut_loads`` must equal the cost of the items the cuts make."""
    from cute_attn.plan_partition import cut_loads, line_cuts, q_tiles

    q_lens, kv_lens = batch
    cfg = dataclasses.replace(cfg, sorted_deal=False, line_deal=False)
    tiles = q_tiles(cfg, q_lens, kv_lens)
    cut_tile, cut_key, _, _ = line_cuts(cfg, tiles.kv_end, tiles.cost)
    assert np.array_equal(cut_loads(cfg, tiles.cost, cut_tile, cut_key), partition_plan(cfg, q_lens, kv_lens).cta_cost)


@given(cfg=plan_configs(causal=True), batch=testing.ragged_batches(max_batch=12, max_q=64, max_kv=2000))
def test_a_sorted_deal_is_never_worse_than_the_cuts_it_replaces(cfg, batch):
    """A dealt plan (no merges) loads no CTA above the bound ``deal_bound`` gives: where the cuts split, their busiest
    or W + W/8; where they took whole tiles, strictly below their busiest, and only when that exceeds W + W/32 (else
    the cuts stay; with ``deal_whole_cuts``, any whole-tile cuts within a sixteenth of their busiest). Each CTA takes
    its tiles longest first, one a lap."""
    from cute_attn.plan import SERPENTINE_SLACK_SHIFT
    from cute_attn.plan_partition import (DEAL_WHOLE_SHIFT, WHOLE_TILE_SHIFT, cut_loads, line_cuts, partition,
                                          piece_cost, q_tiles)

    q_lens, kv_lens = batch
    # the cuts-first rule (a deal made first may be kept before any cut: test_plan_whole_deal's deal-first tests)
    cfg = dataclasses.replace(cfg, sorted_deal=True, line_deal=False, deal_first=False)
    cuts = partition_plan(dataclasses.replace(cfg, sorted_deal=False), q_lens, kv_lens)
    plan, dealt = partition(cfg, q_lens, kv_lens)
    tiles = q_tiles(cfg, q_lens, kv_lens)
    cut_tile, cut_key, width, whole = line_cuts(cfg, tiles.kv_end, tiles.cost)
    cut_max = cuts.cta_cost.max()
    if not cfg.allow_split or (whole and not cfg.deal_whole_cuts and cut_max <= width + (width >> DEAL_WHOLE_SHIFT)):
        assert not dealt
        return
    if whole and cfg.deal_whole_cuts:
        assert not dealt or plan.cta_cost.max() <= cut_max + (cut_max >> SERPENTINE_SLACK_SHIFT)
    elif whole:
        assert not dealt or plan.cta_cost.max() < cut_max
    else:
        assert plan.cta_cost.max() <= max(cut_max, width + (width >> WHOLE_TILE_SHIFT))
    if dealt:
        assert plan.num_merges == 0
        assert cut_loads(cfg, tiles.cost, cut_tile, cut_key).max() == cut_max
        for c in range(cfg.num_ctas):
            rows = plan.items[plan.work_indptr[c]:plan.work_indptr[c + 1]]
            costs = piece_cost(cfg, rows[:, F.KV_END])
            assert (np.diff(costs) <= 0).all() and (rows[:, F.KV_START] == 0).all()


@given(cfg=plan_configs(causal=False), batch=testing.ragged_batches(max_batch=12, max_q=1, max_kv=2000))
def test_a_line_deal_is_never_worse_than_the_cuts_it_replaces(cfg, batch):
    """The line deal (small-page decode) keeps the line order, deals it serpentine, and replaces the cuts only when its
    busiest CTA is no worse: whole-tile cuts' busiest, or split cuts' busiest or W + W/8."""
    from cute_attn.plan_partition import WHOLE_TILE_SHIFT, line_cuts, partition, q_tiles

    q_lens, kv_lens = batch
    cfg = dataclasses.replace(cfg, sorted_deal=False, line_deal=True)
    cuts = partition_plan(dataclasses.replace(cfg, line_deal=False), q_lens, kv_lens)
    plan, dealt = partition(cfg, q_lens, kv_lens)
    tiles = q_tiles(cfg, q_lens, kv_lens)
    _, _, width, whole = line_cuts(cfg, tiles.kv_end, tiles.cost)
    if not dealt:
        return
    assert cfg.allow_split and plan.num_merges == 0
    bound = cuts.cta_cost.max() if whole else max(cuts.cta_cost.max(), width + (width >> WHOLE_TILE_SHIFT))
    assert plan.cta_cost.max() <= bound
    for c in range(cfg.num_ctas):  # lap k of CTA c is line position k * m + (c or m - 1 - c): line order kept
        rows = plan.items[plan.work_indptr[c]:plan.work_indptr[c + 1]]
        # line order: request, q tile, KV head (a group wider than tile_q_rows gives a request several q tiles)
        line = [(int(r[F.REQUEST]), int(r[F.Q_ROW_START]), int(r[F.KV_HEAD])) for r in rows]
        assert line == sorted(set(line))


def test_the_line_deal_runs_a_requests_kv_heads_together():
    """Decode 64 x 2048 at page 1, h20/kv4 (256 whole tiles on 132 CTAs): the cuts give a CTA one request's heads in
    turn; the line deal puts every request's four heads in the same lap, on neighbouring CTAs, no CTA busier."""
    from cute_attn.config import default_paged_config

    config = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                  head_dim_v=128, page_size=1, causal=False)
    pc = dataclasses.replace(config.plan_config(132), line_deal=True)
    cuts = partition_plan(dataclasses.replace(pc, line_deal=False), [1] * 64, [2048] * 64)
    plan = partition_plan(pc, [1] * 64, [2048] * 64)
    assert plan.cta_cost.max() <= cuts.cta_cost.max() and plan.num_merges == 0
    lap_of = {}
    for c in range(132):
        for lap, row in enumerate(plan.items[plan.work_indptr[c]:plan.work_indptr[c + 1]]):
            lap_of.setdefault(int(row[F.REQUEST]), set()).add(lap)
    assert len(lap_of) == 64 and all(len(laps) == 1 for laps in lap_of.values())
    first = {int(r[F.REQUEST]) for c in range(0, 132, 2) for r in cuts.items[cuts.work_indptr[c]:cuts.work_indptr[c + 1]]}
    assert len(first) > 32  # the cuts: each CTA's items are one request's heads, so a lap spans twice the requests


def test_whole_tile_cuts_that_snap_unevenly_are_dealt():
    """GQA prefill 8 x 992 at h20/kv4 (1280 tiles of 64..1024 keys): the whole-tile cuts leave max / mean 1.12; the
    deal takes over at 1.03 (the host LPT: 1.02). At h32/kv4 the cuts are within W/32 and stay (no sort) unless
    ``deal_whole_cuts`` (``ops/gqa_prefill.DEVICE_WHOLE_DEAL``, on since session 21) lets the serpentine in within W/16
    (``test_plan_whole_deal.py``); here it is off, the rule this test is about."""
    from cute_attn.config import default_paged_config

    for heads, expect_deal in ((20, True), (32, False)):
        config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=heads, num_kv_heads=4,
                                      head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)
        pc = dataclasses.replace(config.plan_config(132), deal_whole_cuts=False, deal_first=False)  # cuts first
        cuts = partition_plan(dataclasses.replace(pc, sorted_deal=False), [992] * 8, [992] * 8)
        plan = partition_plan(pc, [992] * 8, [992] * 8)
        balance = plan.cta_cost.max() / plan.cta_cost.mean()
        if expect_deal:
            assert cuts.cta_cost.max() / cuts.cta_cost.mean() > 1.1 and balance < 1.04 and plan.num_merges == 0
        else:
            assert np.array_equal(plan.items, cuts.items)


def test_the_sorted_deal_packs_the_mla_seed_without_merges():
    """MLA prefill 28 / 1954 / 2044 (500 q tiles of 192..350 keys against a CTA width of ~870): the cuts split 21
    tiles and leave max / mean 1.18; the deal: no merge, within 1% of the host LPT's busiest CTA."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import bench_workloads as bw

    seed = next(w for w in bw._mla_workloads() if w.label == "n28_q1954_kv2044")
    config = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                  head_dim_qk=576, head_dim_v=512, page_size=1, causal=True)
    cfg = config.plan_config(132)
    assert cfg.sorted_deal
    cuts = partition_plan(dataclasses.replace(cfg, sorted_deal=False), seed.q_lens, seed.kv_lens)
    dealt = partition_plan(cfg, seed.q_lens, seed.kv_lens)
    assert cuts.num_merges == 21 and dealt.num_merges == 0 and dealt.num_items == 500
    assert dealt.cta_cost.max() <= 1.01 * plan_work(cfg, seed.q_lens, seed.kv_lens).cta_cost.max()


def test_sorted_deal_orders_by_kv_tiles_capped_as_the_device_keys_hold_them():
    """The deal's order is longest first by kv tiles, capped at SORT_TILE_CAP (the device's Int32 keys hold 21 bits
    of them): tiles past the cap tie and keep their line order; below it the order is by cost."""
    from cute_attn.plan_partition import SORT_TILE_CAP, sorted_deal

    cfg = PlanConfig(num_qo_heads=16, num_kv_heads=1, causal=True, tile_q_rows=64, kv_tile=64, num_ctas=2,
                     item_overhead_keys=128)
    cost = np.array([(SORT_TILE_CAP + 5) * 64 + 128, (SORT_TILE_CAP + 9) * 64 + 128, 3 * 64 + 128, 7 * 64 + 128])
    order, _ = sorted_deal(cfg, cost)
    assert order.tolist() == [0, 1, 3, 2]


def test_line_deal_policy_reaches_the_decode_plan_config_only_inside_the_block():
    from cute_attn.config import default_paged_config
    from cute_attn.ops import gqa_decode

    def config(page_size, kind="gqa_paged_decode", causal=False):
        return default_paged_config(kind, arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                    head_dim_v=128, page_size=page_size, causal=causal)

    # measured on the H200 (session 16): pages 1 and 2 with any heads, any page from 8 KV heads
    assert gqa_decode.LINE_DEAL_PAGE_SIZES == (1, 2) and gqa_decode.LINE_DEAL_MIN_KV_HEADS == 8
    assert config(1).plan_config(132).line_deal and not config(64).plan_config(132).line_deal  # h20/kv4
    assert gqa_decode.line_deals(64, 8) and gqa_decode.line_deals(2, 4) and not gqa_decode.line_deals(4, 4)
    with gqa_decode.line_deal_policy(()):
        assert not config(1).plan_config(132).line_deal
    with gqa_decode.line_deal_policy((1, 2)):
        assert config(1).plan_config(132).line_deal and config(2).plan_config(132).line_deal
        assert not config(64).plan_config(132).line_deal
        assert not config(1, "gqa_paged_prefill", True).plan_config(132).line_deal
    assert config(2).plan_config(132).line_deal and not config(1, "gqa_paged_prefill", True).plan_config(132).line_deal

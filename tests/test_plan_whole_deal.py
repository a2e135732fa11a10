"""Whole-tile deals of GQA prefill host plans (``PlanConfig.whole_deal``): "lap" (lap by lap onto the least loaded
CTAs, taken where it models strictly better; counts within one a CTA, each CTA's items longest first) and "serpentine" (the
device twin's deal, always)."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn import testing
from cute_attn.config import default_paged_config, lap_turn_policy
from cute_attn.ops.gqa_prefill import whole_deal_policy
from cute_attn.plan import ItemField as F
from cute_attn.plan import plan_work
from cute_attn.plan_partition import lap_deal, partition, q_tiles, sorted_deal

from test_plan import batches, plan_configs


def _prefill(num_qo_heads=32, num_kv_heads=4, mode="lap"):
    """The default config with ``whole_deal`` ``mode``; its sorted deal the serpentine (lap turns:
    test_plan_lap_turn.py)."""
    with whole_deal_policy(mode), lap_turn_policy(False):
        config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=num_qo_heads,
                                      num_kv_heads=num_kv_heads, head_dim_qk=128, head_dim_v=128, page_size=64,
                                      causal=True)
        return config.plan_config(132)


def _items_per_cta(plan):
    return np.diff(plan.work_indptr)


@settings(max_examples=60, deadline=None)
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=3000), num_ctas=st.integers(1, 40),
       heads=st.sampled_from([(32, 4), (16, 1), (20, 4)]))
def test_every_position_once_a_lap_on_distinct_ctas_longest_first(batch, num_ctas, heads):
    config = dataclasses.replace(_prefill(*heads), num_ctas=num_ctas)
    q_lens, kv_lens = (np.asarray(x) for x in batch)
    cost = q_tiles(config, q_lens, kv_lens, np.zeros(q_lens.size, bool)).cost
    tile, cta = lap_deal(config, cost)
    serpentine_tile, _ = sorted_deal(config, cost)
    assert np.array_equal(tile, serpentine_tile)  # the same positions, only the CTAs differ
    for start in range(0, cta.size, num_ctas):
        lap = cta[start:start + num_ctas]
        assert np.unique(lap).size == lap.size  # one position a CTA a lap: counts within one
    for c in range(num_ctas):
        mine = cost[tile[cta == c]]
        assert (np.diff(mine) <= 0).all()  # lap order is longest first


@pytest.mark.parametrize("heads, n, before, after", [
    ((32, 4), 4, 7168, 6784), ((32, 4), 16, 27328, 26816), ((16, 1), 8, 7168, 6784), ((20, 4), 8, 8960, 8832),
    ((32, 16), 8, 14336, 14080), ((32, 4), 32, 53312, 53312),
])
def test_the_bench_rows_the_serpentine_leaves_uneven_deal_to_the_lpts_balance(heads, n, before, after):
    """x 992 causal batches: the serpentine's busiest CTA (host plans with ``host_deal``) against the lap deal's; both
    give every CTA the same item count within one, no merges."""
    lens = [992] * n
    off, on = (plan_work(_prefill(*heads, mode=mode), lens, lens) for mode in ("", "lap"))
    assert (off.cta_cost.max(), on.cta_cost.max()) == (before, after)
    counts = _items_per_cta(on)
    assert counts.max() - counts.min() <= 1 and on.num_merges == 0
    items = on.valid_items()
    assert (items[:, F.KV_START] == 0).all() and (items[:, F.PARTIAL_SLOT] == -1).all()


@settings(max_examples=40, deadline=None)
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=3000))
def test_taken_only_where_strictly_better_and_the_device_twin_ignores_it(batch):
    q_lens, kv_lens = batch
    on, off = _prefill(mode="lap"), _prefill(mode="")
    plan_on, plan_off = plan_work(on, q_lens, kv_lens), plan_work(off, q_lens, kv_lens)
    same = (np.array_equal(plan_on.items, plan_off.items) and np.array_equal(plan_on.work_indptr,
                                                                            plan_off.work_indptr))
    assert same or plan_on.cta_cost.max() < plan_off.cta_cost.max()
    twin_on, twin_off = partition(on, q_lens, kv_lens)[0], partition(off, q_lens, kv_lens)[0]
    assert np.array_equal(twin_on.items, twin_off.items) and np.array_equal(twin_on.work_indptr, twin_off.work_indptr)


@pytest.mark.parametrize("heads, n", [((32, 4), 8), ((32, 8), 8), ((24, 8), 8), ((32, 4), 1)])
def test_serpentine_host_plans_are_the_twins_deal_whatever_the_model_says(heads, n):
    """"serpentine": host plans take the twin's serpentine deal of whole tiles even where the twin cuts the line
    (8 x 992 h32/kv4: the cuts model 1.024 of the mean, the serpentine 1.082)."""
    lens = [992] * n
    config = _prefill(*heads, mode="serpentine")
    plan = plan_work(config, lens, lens)
    cost = q_tiles(config, np.asarray(lens), np.asarray(lens), np.zeros(n, bool)).cost
    tile, cta = sorted_deal(config, cost)
    assert np.array_equal(plan.cta_cost, np.bincount(cta, weights=cost[tile], minlength=132).astype(np.int64))
    assert plan.num_merges == 0 and np.diff(plan.work_indptr).max() - np.diff(plan.work_indptr).min() <= 1


def test_serpentine_host_plans_leave_batches_past_the_sort_limit_to_the_lpt():
    lens = [992] * 32  # 1984 q tiles: past deal_max_q_tiles 1024, the device would not deal them either
    narrow = [dataclasses.replace(_prefill(mode=mode), deal_max_q_tiles=1024) for mode in ("serpentine", "")]
    assert np.array_equal(plan_work(narrow[0], lens, lens).items, plan_work(narrow[1], lens, lens).items)
    lens = [992] * 40  # 2480 q tiles: past the default 2048 as well
    assert np.array_equal(plan_work(_prefill(mode="serpentine"), lens, lens).items,
                          plan_work(_prefill(mode=""), lens, lens).items)


def test_a_2048_key_sort_deals_32_x_992_where_1024_keys_keep_the_cuts():
    """``deal_max_q_tiles`` 2048 (``ops/gqa_prefill.DEAL_MAX_Q_TILES``): the twin deals 32 x 992's 1984 q tiles
    (serpentine, 1.006 of the mean: the host LPT's balance) where 1024 keys left it its cuts (1.013), and host plans
    take that deal; every key of every row is covered once."""
    from cute_attn.plan_executor import plan_coverage

    lens = [992] * 32
    config = dataclasses.replace(_prefill(mode="serpentine"), deal_whole_cuts=True, deal_max_q_tiles=1024)
    assert not partition(config, lens, lens)[1]
    wide = dataclasses.replace(config, deal_max_q_tiles=2048)
    twin, dealt = partition(wide, lens, lens)
    assert dealt and twin.num_merges == 0 and twin.cta_cost.max() / twin.cta_cost.mean() < 1.007
    assert np.array_equal(plan_work(wide, lens, lens).items, twin.items)
    assert all(hits.max() == 1 for hits in plan_coverage(twin, lens, lens))
    with pytest.raises(ValueError, match="deal_max_q_tiles"):
        dataclasses.replace(config, deal_max_q_tiles=4096)


@pytest.mark.parametrize("heads, n", [((32, 4), 8), ((32, 8), 8)])
def test_the_twin_deals_whole_tile_cuts_within_a_sixteenth_with_deal_whole_cuts(heads, n):
    """``deal_whole_cuts`` (device plans, ``DEVICE_WHOLE_DEAL``): 8 x 992 at h32/kv4 and h32/kv8, whose cuts are whole
    tiles within W/32 (1.024 of the mean), give way to the serpentine deal (1.082), which the host plans take too."""
    lens = [992] * n
    config = dataclasses.replace(_prefill(*heads, mode="serpentine"), deal_whole_cuts=True)
    twin, dealt = partition(config, lens, lens)
    assert dealt and twin.cta_cost.max() == 14336
    # without it the cuts-first rule keeps them (deal_first, the default, keeps the deal before any cut is made)
    assert not partition(dataclasses.replace(config, deal_whole_cuts=False, deal_first=False), lens, lens)[1]
    host = plan_work(config, lens, lens)
    assert np.array_equal(host.items, twin.items) and np.array_equal(host.work_indptr, twin.work_indptr)


# ----------------------------------------------------------------------------- deal first (PlanConfig.deal_first)


@settings(max_examples=200, deadline=None)
@given(cfg=plan_configs(causal=True), batch=batches(max_batch=6, max_q=40, max_kv=120))
def test_a_deal_made_first_is_kept_only_near_the_mean_and_else_the_cuts_decide(cfg, batch):
    """``deal_first``: the plan is the cuts-first rule's, or the sorted deal kept before any cut with its busiest CTA
    within ``W + W / 8`` (``plan_partition.deal_first_bound``) -- never anything else."""
    from cute_attn.plan_partition import deal_first_bound, line_width

    q_lens, kv_lens = batch
    first, first_dealt = partition(dataclasses.replace(cfg, deal_first=True), q_lens, kv_lens)
    cuts_first, _ = partition(dataclasses.replace(cfg, deal_first=False), q_lens, kv_lens)
    same = (first.num_items == cuts_first.num_items and np.array_equal(first.work_indptr, cuts_first.work_indptr)
            and np.array_equal(first.valid_items(), cuts_first.valid_items()))
    if not same:
        cost = q_tiles(cfg, q_lens, kv_lens).cost
        assert first_dealt and first.num_merges == 0
        assert first.cta_cost.max() <= deal_first_bound(line_width(cfg, int(cost.sum()) * cfg.num_kv_heads))


def test_deal_first_changes_no_plan_of_the_bench_prefill_rows():
    """On the bench's GQA prefill and MLA prefill workloads the deal made first changes no device plan (the twin),
    and it is kept with no cuts made on the FIB seed rows it was built for (8 x 992 at h32/kv4, MLA 1 / 1028)."""
    import sys
    from pathlib import Path

    from cute_attn.plan_partition import deal_first_bound, line_width

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import bench_workloads as bw

    kept = set()
    for w in bw.all_workloads():
        if w.kernel not in (bw.PREFILL, bw.MLA):
            continue
        mla = w.kernel == bw.MLA
        config = default_paged_config("mla_paged_prefill" if mla else "gqa_paged_prefill", arch="sm_90a", causal=True,
                                      num_qo_heads=16 if mla else 32, num_kv_heads=1 if mla else 4,
                                      head_dim_qk=576 if mla else 128, head_dim_v=512 if mla else 128,
                                      page_size=1 if mla else 64).plan_config(132)
        q_lens, kv_lens = list(w.q_lens), list(w.kv_lens)
        first, _ = partition(dataclasses.replace(config, deal_first=True), q_lens, kv_lens)
        cuts_first, _ = partition(dataclasses.replace(config, deal_first=False), q_lens, kv_lens)
        assert np.array_equal(first.valid_items(), cuts_first.valid_items()), w.label
        cost = q_tiles(config, q_lens, kv_lens).cost
        tile, cta = sorted_deal(config, cost)
        if np.bincount(cta, weights=cost[tile]).max() <= deal_first_bound(line_width(config, int(cost.sum()) *
                                                                                     config.num_kv_heads)):
            kept.add(("mla " if mla else "") + w.label)
    assert {"n8_q992_kv992", "mla n1_q1028_kv1038"} <= kept, kept

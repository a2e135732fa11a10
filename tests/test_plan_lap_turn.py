"""Lap turns of the sorted deal (``PlanConfig.lap_turn``, ``plan_partition.turned_deal``): lap ``k``'s position
``k * m + r`` to CTA ``(r + shift_k) mod m``, each lap moving the CTAs that drew its longest cost to the back, taken
only where its busiest CTA is strictly below the serpentine's and the deal has at most ``LAP_TURN_MAX_LAPS`` laps."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn import testing
from cute_attn.config import default_paged_config, lap_turn_policy
from cute_attn.plan import PlanCapacity
from cute_attn.plan_executor import plan_coverage
from cute_attn.plan_partition import (LAP_TURN_MAX_LAPS, lap_shifts, partition, partition_plan, q_tiles, sorted_deal,
                                      turned_deal, turns_laps)


def _prefill(num_qo_heads=32, num_kv_heads=4, turn=True, num_ctas=132):
    with lap_turn_policy(turn):
        config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=num_qo_heads,
                                      num_kv_heads=num_kv_heads, head_dim_qk=128, head_dim_v=128, page_size=64,
                                      causal=True)
        return config.plan_config(num_ctas)


def test_only_gqa_prefill_turns_and_only_inside_the_policy():
    assert not _prefill(turn=False).lap_turn and _prefill().lap_turn
    with lap_turn_policy():
        mla = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                   head_dim_qk=576, head_dim_v=512, page_size=1, causal=True).plan_config(132)
    assert not mla.lap_turn
    assert turns_laps(_prefill()) and not turns_laps(dataclasses.replace(_prefill(), sorted_deal=False,
                                                                         line_deal=True))


def test_each_lap_moves_the_ctas_of_its_longest_cost_to_the_back():
    """m = 4: lap 0 holds three positions of the longest cost, so lap 1 starts at CTA 3; lap 1 holds three of its
    first cost, so lap 2 starts at CTA (3 + 3) mod 4 = 2. A lap of one cost keeps the order."""
    assert lap_shifts(np.array([5, 5, 5, 4, 4, 4, 4, 3, 3, 2, 1]), 4).tolist() == [0, 3, 2]
    assert lap_shifts(np.array([7, 7, 7, 7, 6, 6, 5, 5]), 4).tolist() == [0, 0]


@settings(max_examples=80, deadline=None)
@given(batch=testing.ragged_batches(max_batch=12, max_q=700, max_kv=3000), num_ctas=st.sampled_from([1, 7, 40, 132]),
       heads=st.sampled_from([(32, 4), (16, 1), (20, 4), (5, 1)]))
def test_a_turned_deal_is_taken_only_where_its_busiest_cta_is_lower(batch, num_ctas, heads):
    """The serpentine's positions, one a CTA a lap, each CTA's longest first; the turned CTAs where their busiest
    CTA is strictly below the serpentine's, else the serpentine's."""
    config = dataclasses.replace(_prefill(*heads), num_ctas=num_ctas)
    q_lens, kv_lens = (np.asarray(x) for x in batch)
    cost = q_tiles(config, q_lens, kv_lens).cost
    serpentine = sorted_deal(dataclasses.replace(config, lap_turn=False), cost)
    tile, cta = turned_deal(config, cost)
    assert np.array_equal(tile, serpentine[0])
    position = np.arange(tile.size)
    rotated = (position % num_ctas + lap_shifts(cost[tile], num_ctas)[position // num_ctas]) % num_ctas
    busiest = lambda ctas: np.bincount(ctas, weights=cost[tile], minlength=num_ctas).max()  # noqa: E731
    if busiest(rotated) < busiest(serpentine[1]):
        assert np.array_equal(cta, rotated)
    else:
        assert np.array_equal(cta, serpentine[1])
    for start in range(0, cta.size, num_ctas):
        lap = cta[start:start + num_ctas]
        assert np.unique(lap).size == lap.size
    for c in range(num_ctas):
        assert (np.diff(cost[tile[cta == c]]) <= 0).all()


def test_deals_past_the_laps_the_device_keeps_stay_serpentine():
    config = dataclasses.replace(_prefill(num_qo_heads=4, num_kv_heads=1), num_ctas=2)
    cost = np.repeat(np.arange(2 * LAP_TURN_MAX_LAPS + 2, 0, -1) * 128 + 320, 1)[:2 * LAP_TURN_MAX_LAPS + 2]
    tile, cta = turned_deal(config, cost)
    assert np.array_equal(cta, sorted_deal(dataclasses.replace(config, lap_turn=False), cost)[1])


@pytest.mark.parametrize("heads, n, serpentine, turned", [
    ((32, 4), 8, 1.082, 1.024), ((32, 4), 4, 1.082, 1.024), ((16, 1), 8, 1.082, 1.024), ((32, 4), 16, 1.031, 1.012),
    ((20, 4), 8, 1.031, 1.017), ((32, 16), 8, 1.031, 1.013), ((5, 1), 8, 1.149, 1.149),
])
def test_the_bench_rows_deal_to_the_lap_deals_balance(heads, n, serpentine, turned):
    """x 992 causal batches (the device twin, deal first): the serpentine's busiest CTA against the turned deal's
    (the lap deal's on every row it takes; h5/kv1 keeps the serpentine)."""
    lens = [992] * n
    for turn, want in ((False, serpentine), (True, turned)):
        plan, dealt = partition(_prefill(*heads, turn=turn), lens, lens)
        assert dealt and plan.num_merges == 0
        assert plan.cta_cost.max() / plan.cta_cost.mean() == pytest.approx(want, abs=5e-4)


@settings(max_examples=40, deadline=None)
@given(batch=testing.ragged_batches(max_batch=8, max_q=300, max_kv=1200), num_ctas=st.sampled_from([3, 16, 132]))
def test_turned_plans_cover_every_visible_key_once(batch, num_ctas):
    q_lens, kv_lens = batch
    config = dataclasses.replace(_prefill(num_qo_heads=8, num_kv_heads=2), num_ctas=num_ctas)
    plan = partition_plan(config, q_lens, kv_lens, capacity=PlanCapacity.for_limits(
        config, max_batch=len(q_lens), max_total_q=max(1, sum(q_lens))))
    for counts, lq, lk in zip(plan_coverage(plan, q_lens, kv_lens), q_lens, kv_lens):
        visible = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq  # bottom-right causal
        assert np.array_equal(counts, np.broadcast_to(visible, counts.shape).astype(counts.dtype))

"""The planner-free schedule model (``tools/dynamic_schedule_model.py``): its orders and its list scheduling."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import dynamic_schedule_model as model  # noqa: E402


def test_greedy_list_scheduling():
    # in order, each unit to the CTA that frees first: 5 | 4, then 4+3, 5+3, 7+3
    assert model.greedy_makespan(np.array([5, 4, 3, 3, 3]), 2) == 10
    assert model.greedy_makespan(np.array([7]), 4) == 7
    assert model.greedy_makespan(np.array([1] * 10), 3) == 4


def test_claiming_a_unit_ahead_pairs_the_longest_units():
    """Claimed a unit ahead, both CTAs hold two units before either finishes: 4 + 2 | 3 + 1 (the built kernel's
    schedule); claimed as a CTA frees (late with no lead), 4 + 1 | 3 + 2; a lead of a whole unit claims as early as
    the ahead schedule does, after the first round."""
    costs = np.array([4, 3, 2, 1])
    assert model.claim_ahead_makespan(costs, 2) == 6
    assert model.claim_late_makespan(costs, 2, 0) == model.greedy_makespan(costs, 2) == 5
    assert model.claim_late_makespan(costs, 2, 4) == 6
    assert model.claim_ahead_makespan(np.array([5, 4, 3, 3, 3]), 2) == 10  # 5 + 3 | 4 + 3 + 3
    for claim in (lambda c, n: model.claim_ahead_makespan(c, n), lambda c, n: model.claim_late_makespan(c, n, 2)):
        assert claim(np.array([7]), 4) == 7
        assert claim(np.array([1] * 10), 3) == 4


def _config():
    from cute_attn import tuning

    workload = tuning.Workload.for_kind("gqa_paged_prefill", [992, 300], [992, 900])
    return tuning.api_config("gqa_paged_prefill", workload, "sm_90a").plan_config(132)


@pytest.mark.parametrize("order", ["request_major", "rank_major"])
def test_orders_are_permutations_of_the_units(order):
    from cute_attn.plan import _cost, _tiles

    config = _config()
    q, kv = np.array([992, 300]), np.array([992, 900])
    costs = model.unit_costs(config, q, kv, order)
    tiles = _tiles(config, q, kv)
    expected = np.repeat(_cost(tiles.kv_end.astype(np.int64), config), tiles.num_heads)
    assert sorted(costs.tolist()) == sorted(expected.tolist())
    if order == "rank_major":  # equal-rank tiles of one request come before the next rank: first units are longest
        assert costs[0] == costs.max()


def test_request_major_takes_each_requests_longest_tile_first():
    config = _config()
    costs = model.unit_costs(config, np.array([992, 300]), np.array([992, 900]), "request_major")
    heads = config.num_kv_heads
    first_request = costs[: costs.size - heads * -(-300 * config.group_size // config.tile_q_rows)]
    assert (np.diff(first_request[::heads]) <= 0).all()  # causal tiles shrink from the request's end

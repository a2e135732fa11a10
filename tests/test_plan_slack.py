"""``PlanConfig.max_slack_keys``: the slack that buys a device plan without a split (the snap window, the whole-tile
rule) capped in keys, so very long batches split instead of leaving a CTA thousands of keys above the mean."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn import config as config_module
from cute_attn.config import default_paged_config
from cute_attn.plan import PlanConfig
from cute_attn.plan_partition import SNAP_SHIFT, WHOLE_TILE_SHIFT, partition, snap_slack, whole_tile_bound


def _mla_prefill(num_ctas=132):
    config = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                  head_dim_qk=576, head_dim_v=512, page_size=1, causal=True)
    return config.plan_config(num_ctas)


def _balance(plan):
    loads = plan.cta_cost[plan.cta_cost > 0]
    return loads.max() / loads.mean()


@pytest.mark.parametrize("q_lens, kv_lens", [([16384], [16387]), ([12000], [12000])])
def test_a_long_batch_splits_under_the_cap_and_takes_whole_tiles_without_it(q_lens, kv_lens):
    """MLA prefill 16K: whole-tile cuts 3.1% above the mean (the host LPT: 0.1%); capped at 1024 keys the cuts split
    and the busiest CTA sits within 0.8% of the mean."""
    pc = _mla_prefill()
    whole, _ = partition(pc, q_lens, kv_lens)
    capped, dealt = partition(dataclasses.replace(pc, max_slack_keys=1024), q_lens, kv_lens)
    assert whole.num_merges == 0 and _balance(whole) > 1.03
    assert not dealt and capped.num_merges > 0 and _balance(capped) < 1.008


@pytest.mark.parametrize("q_lens, kv_lens", [([8192], [8192]), ([6000, 10], [6000, 5000]), ([2048] * 4, [2048] * 4)])
def test_the_cap_keeps_whole_tiles_where_a_split_would_buy_nothing(q_lens, kv_lens):
    """Where whole tiles sit within what split cuts may leave themselves (both edges snapped outward plus an item's
    overhead), the capped rule keeps them: no merges for nothing."""
    pc = _mla_prefill()
    off, _ = partition(pc, q_lens, kv_lens)
    on, _ = partition(dataclasses.replace(pc, max_slack_keys=1024), q_lens, kv_lens)
    assert on.num_merges == off.num_merges and on.cta_cost.max() == off.cta_cost.max()


@settings(max_examples=200, deadline=None)
@given(width=st.integers(1, 10**7), cap=st.sampled_from([0, 1, 64, 1024, 10**6]), overhead=st.sampled_from([0, 128]))
def test_the_bounds_are_the_uncapped_ones_without_a_cap_and_never_below_a_splits_worst(width, cap, overhead):
    pc = PlanConfig(num_qo_heads=1, num_kv_heads=1, causal=True, tile_q_rows=16, kv_tile=64, num_ctas=8,
                    item_overhead_keys=overhead, max_slack_keys=cap)
    assert snap_slack(pc, width) == (min(width >> SNAP_SHIFT, cap) if cap else width >> SNAP_SHIFT)
    if not cap:
        assert whole_tile_bound(pc, width) == width + (width >> WHOLE_TILE_SHIFT)
    else:
        assert whole_tile_bound(pc, width) >= width + 2 * snap_slack(pc, width) + overhead
        assert whole_tile_bound(pc, width) <= width + max(width >> WHOLE_TILE_SHIFT, 2 * cap + overhead)


def test_max_slack_keys_policy_reaches_the_plan_config_only_inside_the_block():
    default = config_module.MAX_SLACK_KEYS
    with config_module.max_slack_keys_policy(1024):
        assert _mla_prefill().max_slack_keys == 1024
    assert _mla_prefill().max_slack_keys == default

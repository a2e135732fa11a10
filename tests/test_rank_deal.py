"""The ranked deal (``PlanConfig.rank_deal_max_q_tiles``, ``kernels/common/rank_sort.py``): each q tile's place in
the deal order from the requests' shapes equals the twin's stable sort, zigzag lines included; where it lets the deal
take a batch past the sort's keys (MLA prefill 1 x 16384) the twin deals and balances better than the cuts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn.plan import PlanConfig
from cute_attn.plan_partition import dealable, deal_rank, partition, q_tiles, sort_tile_cap


def _ranks_and_sorted(config: PlanConfig, q_lens, kv_lens, faulted):
    tiles = q_tiles(config, q_lens, kv_lens, np.asarray(faulted, dtype=bool))
    n = [-(-q * config.group_size // config.tile_q_rows) for q in q_lens]
    first = np.cumsum([0] + n)[:-1]
    ranks = [deal_rank(config, q_lens, kv_lens, faulted, int(b), i - int(first[b]), int(e))
             for i, (b, e) in enumerate(zip(tiles.request, tiles.kv_end))]
    cap = sort_tile_cap(config.deal_max_q_tiles)
    order = np.argsort(-np.minimum(-(-tiles.kv_end // config.kv_tile), cap), kind="stable")
    expected = np.empty_like(order)
    expected[order] = np.arange(order.size)
    return np.asarray(ranks, dtype=np.int64), expected


@settings(max_examples=300, deadline=None)
@given(data=st.data(), group=st.sampled_from([1, 2, 3, 5, 8, 16]), tokens=st.integers(1, 16),
       kv_tile=st.sampled_from([16, 64, 128]), zigzag=st.booleans(), tiny_cap=st.booleans())
def test_ranks_are_the_stable_deal_order(data, group, tokens, kv_tile, zigzag, tiny_cap):
    batch = data.draw(st.integers(1, 8))
    q_lens = data.draw(st.lists(st.integers(0, 400), min_size=batch, max_size=batch))
    # mostly kv >= q (the bottom-right causal rule), some shorter (the key end clamps at 0)
    kv_lens = [max(0, q + data.draw(st.integers(-8, 700))) for q in q_lens]
    faulted = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    config = PlanConfig(num_qo_heads=group, num_kv_heads=1, causal=True, tile_q_rows=group * tokens,
                        kv_tile=kv_tile, num_ctas=132, zigzag=zigzag)
    if tiny_cap:  # kv tiles past the cap tie (keep their line order): checked with a cap the draws reach
        config = dataclasses.replace(config)
        object.__setattr__(config, "deal_max_q_tiles", 1 << 27)  # sort_tile_cap(2**27) = 14
        assert sort_tile_cap(config.deal_max_q_tiles) == 14
    ranks, expected = _ranks_and_sorted(config, q_lens, kv_lens, faulted)
    assert np.array_equal(ranks, expected)


def _mla_16k_config(rank: int) -> PlanConfig:
    """The MLA prefill default config's plan rules (h16, zigzag lines, the 1024-key sort) under the policy."""
    from cute_attn.config import default_paged_config, rank_deal_policy

    with rank_deal_policy(rank):
        config = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                      head_dim_qk=576, head_dim_v=512, page_size=1, causal=True)
        plan_config = config.plan_config(132)
    assert plan_config.zigzag and plan_config.deal_max_q_tiles == 1024
    return plan_config


def test_ranked_deal_takes_mla_16k_past_the_sort():
    q, kv = [16384], [16387]
    cut_plan, cut_dealt = partition(_mla_16k_config(0), q, kv)
    deal_plan, dealt = partition(_mla_16k_config(4096), q, kv)
    assert not cut_dealt and dealt and deal_plan.num_merges == 0
    balance = {name: p.cta_cost.max() / p.cta_cost.mean() for name, p in (("cuts", cut_plan), ("deal", deal_plan))}
    assert balance["deal"] < 1.005 < 1.03 < balance["cuts"], balance


def test_dealable_bounds_the_ranked_deals_work():
    config = _mla_16k_config(4096)
    assert dealable(config, 1, 4096) and not dealable(config, 1, 4097)
    assert dealable(config, 8, 4096) and not dealable(config, 9, 4096)  # 9 x 8 q tiles a thread > 64
    assert not dealable(_mla_16k_config(0), 1, 1025)
    with pytest.raises(ValueError, match="rank_deal_max_q_tiles"):
        dataclasses.replace(config, rank_deal_max_q_tiles=2048)

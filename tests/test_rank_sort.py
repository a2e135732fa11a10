"""The rank sort's closed form (``kernels/common/rank_sort.py``): each q tile's rank from the requests' shapes equals
its place in the deal order the numpy twin builds (a stable argsort by capped kv tiles, most first)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn.kernels.common.rank_sort import tiles_reaching_py
from cute_attn.plan import PlanConfig
from cute_attn.plan_partition import q_tiles


def _ranks(config: PlanConfig, q_lens, kv_lens, faulted, cap):
    tiles = q_tiles(config, q_lens, kv_lens, np.asarray(faulted, dtype=bool))
    g, rows, kv_tile = config.group_size, config.tile_q_rows, config.kv_tile
    n = [-(-q * g // rows) for q in q_lens]
    first = np.cumsum([0] + n)[:-1]
    bucket = np.minimum(-(-tiles.kv_end // kv_tile), cap)

    def reach(b, x):
        return tiles_reaching_py(q_lens[b], kv_lens[b], faulted[b], int(x), group=g, rows=rows, kv_tile=kv_tile,
                                 cap=cap)

    ranks = []
    for i, (b, k) in enumerate(zip(tiles.request, bucket)):
        rank = i - first[b] - n[b] + reach(b, k)
        rank += sum(reach(other, k) if other < b else reach(other, k + 1) for other in range(len(q_lens)))
        ranks.append(rank)
    order = np.argsort(-bucket, kind="stable")
    expected = np.empty_like(order)
    expected[order] = np.arange(order.size)
    return np.asarray(ranks, dtype=np.int64), expected


@settings(max_examples=300, deadline=None)
@given(data=st.data(), group=st.sampled_from([1, 2, 3, 5, 8, 16]), tokens=st.integers(1, 16),
       kv_tile=st.sampled_from([16, 64, 128]), cap=st.sampled_from([2, 5, 1 << 20]))
def test_ranks_are_the_stable_deal_order(data, group, tokens, kv_tile, cap):
    batch = data.draw(st.integers(1, 8))
    q_lens = data.draw(st.lists(st.integers(0, 400), min_size=batch, max_size=batch))
    # mostly kv >= q (the bottom-right causal rule), some shorter (the key end clamps at 0)
    kv_lens = [max(0, q + data.draw(st.integers(-8, 700))) for q in q_lens]
    faulted = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    config = PlanConfig(num_qo_heads=group, num_kv_heads=1, causal=True, tile_q_rows=group * tokens,
                        kv_tile=kv_tile, num_ctas=132)
    ranks, expected = _ranks(config, q_lens, kv_lens, faulted, cap)
    assert np.array_equal(ranks, expected)

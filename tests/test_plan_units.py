"""The planner-free prefill's units (``plan_units``, the numpy twin of ``kernels/common/unit_schedule.py``): every
(request, q tile, KV head) exactly once, every query row written once, the causal key ends of the host plan's
unsplit items, and the producer warp's windowed search equal to a direct one."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn import testing
from cute_attn.config import default_paged_config
from cute_attn.plan import ItemField as F
from cute_attn.plan import _tiles
from cute_attn.plan_units import locate_as_the_kernel_does, request_units, unit_items

# GQA layouts (128-row tiles), then MLA's 16 heads on one latent KV head (64-row tiles: 4 tokens a unit)
LAYOUTS = [(32, 4), (20, 4), (5, 1), (16, 16), (24, 8), (6, 1), (16, 1, "mla_paged_prefill")]


def _plan_config(heads, kv_heads, kind="gqa_paged_prefill"):
    dims = (576, 512) if kind == "mla_paged_prefill" else (128, 128)
    config = default_paged_config(kind, arch="sm_90a", num_qo_heads=heads, num_kv_heads=kv_heads,
                                  head_dim_qk=dims[0], head_dim_v=dims[1], page_size=64, causal=True)
    return config.plan_config(132)


@settings(max_examples=60, deadline=None)
@given(batch=testing.ragged_batches(max_batch=40, max_q=900, max_kv=5000), layout=st.sampled_from(LAYOUTS))
def test_units_are_the_host_plans_unsplit_items_each_row_once(batch, layout):
    q_lens, kv_lens = batch
    config = _plan_config(*layout)
    items = unit_items(config, q_lens, kv_lens)
    assert len(items) == int(request_units(config, q_lens).sum())
    tiles = _tiles(config, np.asarray(q_lens), np.asarray(kv_lens))
    expected = np.repeat(tiles.q_tiles, config.num_kv_heads, axis=0)
    expected[:, F.KV_HEAD] = np.tile(np.arange(config.num_kv_heads), len(tiles.q_tiles))
    expected[:, F.KV_PAGE_START] = -1
    assert sorted(map(tuple, items.tolist())) == sorted(map(tuple, expected.tolist()))
    covered = {}
    for row in items:  # every packed query row of every KV head exactly once
        for r in range(row[F.Q_ROW_START], row[F.Q_ROW_START] + row[F.Q_ROW_COUNT]):
            key = (row[F.REQUEST], row[F.KV_HEAD], r)
            covered[key] = covered.get(key, 0) + 1
    want = {(b, h, r) for b, q in enumerate(q_lens) for h in range(config.num_kv_heads)
            for r in range(q * config.group_size)}
    assert set(covered) == want and set(covered.values()) <= {1}
    for row in items:  # the causal bound of the unit's last token, clipped to the request's keys
        b = row[F.REQUEST]
        last_token = (row[F.Q_ROW_START] + row[F.Q_ROW_COUNT] - 1) // config.group_size
        assert row[F.KV_END] == min(max(last_token + 1 + kv_lens[b] - q_lens[b], 0), kv_lens[b])
        assert row[F.KV_START] == 0 and row[F.PARTIAL_SLOT] == -1


@settings(max_examples=60, deadline=None)
@given(batch=testing.ragged_batches(max_batch=100, max_q=300, max_kv=600), layout=st.sampled_from(LAYOUTS),
       data=st.data())
def test_the_kernels_search_finds_each_units_request_and_item(batch, layout, data):
    """A CTA's increasing unit indices (random gaps, some past the end) through the windowed search: each lands on
    the request a direct search finds, and the kernel's decode of ``local`` (q tile ``tiles - 1 - local // heads``,
    head ``local % heads``) is that unit's item."""
    q_lens, kv_lens = batch
    config = _plan_config(*layout)
    per_request = request_units(config, q_lens)
    total = int(per_request.sum())
    items = unit_items(config, q_lens, kv_lens)
    gaps = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=60))
    indices = np.cumsum(gaps) - 1
    starts = np.concatenate([[0], np.cumsum(per_request)])
    heads, rows = config.num_kv_heads, config.tile_q_rows
    for u, (request, local) in zip(indices, locate_as_the_kernel_does(per_request, indices)):
        if u >= total:
            assert request == len(q_lens)
            continue
        direct = int(np.searchsorted(starts, u, side="right") - 1)
        assert (request, local) == (direct, u - starts[direct])
        tiles = per_request[request] // heads
        row = items[u]
        assert row[F.REQUEST] == request and row[F.KV_HEAD] == local % heads
        assert row[F.Q_ROW_START] == (tiles - 1 - local // heads) * rows


def _late_claims_by_scan(costs, num_ctas, lead):
    """The late claim, CTA by CTA with a linear scan: each next unit goes to the CTA whose claim comes first (its
    current unit's end less ``lead``, never before that unit's start; ties to the lower CTA)."""
    starts, ends = [0] * num_ctas, [0] * num_ctas
    for u, cost in enumerate(costs):
        if u < num_ctas:
            ends[u] = cost
            continue
        cta = min(range(num_ctas), key=lambda c: (max(starts[c], ends[c] - lead), c))
        starts[cta], ends[cta] = ends[cta], ends[cta] + cost
    return max(ends)


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.integers(1, 5000), min_size=1, max_size=300), num_ctas=st.integers(1, 40),
       lead=st.integers(0, 400))
def test_the_late_claim_model_is_the_scan(costs, num_ctas, lead):
    """``plan_units.claim_late_makespan`` (a heap, the route-plan rule's host time) equals the linear scan."""
    from cute_attn.plan_units import claim_late_makespan

    assert claim_late_makespan(np.asarray(costs), num_ctas, lead) == _late_claims_by_scan(costs, num_ctas, lead)

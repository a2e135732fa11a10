"""Even pieces (``PlanConfig.even_pieces``): device plans of equal one-tile requests cut each tile in even pieces at
CTA edges, the chunks the host planner's caps cut, and never model worse than the line's cuts."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn import config as config_module
from cute_attn.config import default_paged_config
from cute_attn.plan import ItemField as F
from cute_attn.plan import PlanConfig, plan_work
from cute_attn.plan_partition import SNAP_SHIFT, cut_loads, even_pieces, line_cuts, partition, q_tiles


def _mla_decode(page_size=64):
    from cute_attn.ops.mla_decode import ONE_TOKEN_SPEC

    return default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576,
                                head_dim_v=512, page_size=page_size, causal=True, spec=ONE_TOKEN_SPEC)


def _gqa_decode(page_size=64):
    return default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                head_dim_v=128, page_size=page_size, causal=False)


def _chunk_keys(plan):
    items = plan.items[:plan.num_items]
    return sorted((items[:, F.KV_END] - items[:, F.KV_START]).tolist())


@pytest.mark.parametrize("make, batch, kv", [
    (_mla_decode, 1, 4096), (_mla_decode, 16, 4096), (_mla_decode, 64, 8192),
    (_gqa_decode, 1, 3232), (_gqa_decode, 16, 2048),
])
def test_even_pieces_cut_the_bench_rows_as_the_host_plan_does(make, batch, kv):
    """The bench's split decode rows: the line's edges leave odd pieces (MLA decode 64 x 8192: 192 partials, GQA
    decode 16 x 2048: 186 items, busiest 1216); even pieces give the host plan's chunks and busiest CTA."""
    pc = make().plan_config(132)
    host = plan_work(dataclasses.replace(pc, host_twin=False), [1] * batch, [kv] * batch)
    line, _ = partition(dataclasses.replace(pc, even_pieces=False), [1] * batch, [kv] * batch)
    even, dealt = partition(dataclasses.replace(pc, even_pieces=True), [1] * batch, [kv] * batch)
    assert not dealt
    assert _chunk_keys(even) == _chunk_keys(host)
    assert (even.num_items, even.num_partials, even.num_merges) == (host.num_items, host.num_partials, host.num_merges)
    assert even.cta_cost.max() <= line.cta_cost.max()
    assert even.num_partials <= line.num_partials


def test_a_batch_that_fills_the_gpu_with_whole_tiles_is_not_cut():
    pc = dataclasses.replace(_gqa_decode().plan_config(132), even_pieces=True)
    for batch, kv in ((64, 2048), (128, 4096)):
        plan = partition(pc, [1] * batch, [kv] * batch)[0]
        assert plan.num_merges == 0


@pytest.mark.parametrize("kv_lens", [[4096] * 15 + [4095], [4096] * 8 + [0] * 8])
def test_unequal_or_empty_requests_keep_the_lines_cuts(kv_lens):
    pc = _mla_decode().plan_config(132)
    on, _ = partition(dataclasses.replace(pc, even_pieces=True), [1] * len(kv_lens), kv_lens)
    off, _ = partition(dataclasses.replace(pc, even_pieces=False), [1] * len(kv_lens), kv_lens)
    assert np.array_equal(on.valid_items(), off.valid_items())


@settings(max_examples=200, deadline=None)
@given(num_ctas=st.integers(1, 300), num_kv_heads=st.sampled_from([1, 2, 4, 8]), batch=st.integers(1, 100),
       kv=st.integers(1, 40000), kv_tile=st.sampled_from([16, 32, 64]), min_chunk=st.sampled_from([0, 256, 1024]),
       overhead=st.sampled_from([0, 128]))
def test_even_pieces_are_equal_whole_kv_tiles_and_model_no_worse_than_the_line(num_ctas, num_kv_heads, batch, kv,
                                                                               kv_tile, min_chunk, overhead):
    pc = PlanConfig(num_qo_heads=num_kv_heads, num_kv_heads=num_kv_heads, causal=False, tile_q_rows=16,
                    kv_tile=kv_tile, num_ctas=num_ctas, item_overhead_keys=overhead, min_chunk_keys=min_chunk,
                    even_pieces=True)
    tiles = q_tiles(pc, [1] * batch, [kv] * batch)
    cut_tile, cut_key, width, whole = line_cuts(pc, tiles.kv_end, tiles.cost, uniform_keys=kv)
    even = even_pieces(pc, kv, batch * num_kv_heads, width)
    if even is None:
        return
    pieces, piece = even
    assert not whole and 2 <= pieces and batch * num_kv_heads * pieces <= num_ctas
    assert piece % kv_tile == 0 and (pieces - 1) * piece < kv <= pieces * piece
    assert piece <= width + (width >> SNAP_SHIFT)
    loads = cut_loads(pc, tiles.cost, cut_tile, cut_key)
    assert loads.max() == piece + overhead  # every CTA one piece: the busiest is a whole piece and its start
    plan = partition(pc, [1] * batch, [kv] * batch)[0]
    assert plan.num_ctas == batch * num_kv_heads * pieces and plan.num_merges == batch * num_kv_heads


def test_even_pieces_policy_reaches_the_plan_config_only_inside_the_block():
    default = config_module.EVEN_PIECES
    assert _mla_decode().plan_config(132).even_pieces is default
    with config_module.even_pieces_policy(not default):
        assert _mla_decode().plan_config(132).even_pieces is (not default)
    assert _mla_decode().plan_config(132).even_pieces is default

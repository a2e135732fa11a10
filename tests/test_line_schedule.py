"""The planner-free decode's per-CTA derivation (``cute_attn/line_schedule.py``) equals the device plan CTA by CTA.

Each CTA makes the edge table alone and keeps only its stretch; these tests run that for every CTA of drawn batches
and compare its items, merges and partial slots with ``plan_partition.partition`` (the device planner's oracle)."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn.config import default_paged_config
from cute_attn.line_schedule import cta_items, cta_merge, edge_table, line_reason, request_keys
from cute_attn.plan import ItemField as F
from cute_attn.plan import MergeField as MF
from cute_attn.plan_partition import partition


def _decode_config(heads=(20, 4), page_size=64, num_ctas=132, even=True, split=True, line_deal=False):
    qo, kv = heads
    pc = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=qo, num_kv_heads=kv, head_dim_qk=128,
                              head_dim_v=128, page_size=page_size, causal=False).plan_config(num_ctas)
    return dataclasses.replace(pc, line_deal=line_deal, even_pieces=even, allow_split=split)


def _mla_decode_config(heads=16, page_size=1, num_ctas=132):
    """The MLA decode entry's one-token config's plan, without the sorted deal (``line_schedule.cuts_only``)."""
    from cute_attn.line_schedule import cuts_only
    from cute_attn.ops.mla_decode import ONE_TOKEN_SPEC

    config = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=heads, num_kv_heads=1,
                                  head_dim_qk=576, head_dim_v=512, page_size=page_size, causal=True,
                                  spec=ONE_TOKEN_SPEC)
    return cuts_only(config.plan_config(num_ctas))


def _check_every_cta(pc, keys, faulted):
    """Every CTA's derived items and merge descriptors equal the partition plan's."""
    keys = np.asarray(keys, dtype=np.int64)
    faulted = np.asarray(faulted, dtype=bool)
    pages = -(-keys // pc.page_size)
    page_start = np.cumsum(pages) - pages
    plan, dealt = partition(pc, np.ones(keys.size, dtype=np.int64), keys, kv_page_start=page_start, faulted=faulted)
    table = edge_table(pc, np.where(faulted, 0, keys), faulted)
    assert table.dealt == dealt
    for c in range(pc.num_ctas):
        mine = cta_items(pc, table, np.where(faulted, 0, keys), page_start, c)
        theirs = plan.items[plan.work_indptr[c]:plan.work_indptr[c + 1]].copy()
        if pc.causal:  # a faulted request's items have no keys: their causal offset is never read
            empty = theirs[:, F.KV_END] == 0
            theirs[empty, F.CAUSAL_OFFSET] = mine[empty, F.CAUSAL_OFFSET]
        np.testing.assert_array_equal(mine, theirs, err_msg=f"CTA {c}")
    assert table.merge_indptr.size - 1 == plan.num_merges
    np.testing.assert_array_equal(table.merge_indptr, plan.merge_indptr[:plan.num_merges + 1])
    for g in range(plan.num_merges):
        request, head, first, slots = cta_merge(pc, table, g)
        assert (request, head) == (plan.merges[g, MF.REQUEST], plan.merges[g, MF.KV_HEAD])
        assert (first, slots) == (plan.merge_indptr[g], plan.merge_indptr[g + 1] - plan.merge_indptr[g])
    return table


@pytest.mark.parametrize("batch, kv", [(1, 3232), (16, 2048), (64, 2048), (128, 4096), (1, 100), (3, 1)])
def test_the_bench_rows_derive_the_device_plan(batch, kv):
    _check_every_cta(_decode_config(), [kv] * batch, [False] * batch)


def test_a_uniform_batch_takes_even_pieces_and_a_ragged_one_the_line():
    even = _check_every_cta(_decode_config(), [3232], [False])
    assert even.even is not None and even.merge_indptr.size == 1 + 4  # a merge a tile (4 KV heads)
    ragged = _check_every_cta(_decode_config(), [3232, 17, 9000], [False] * 3)
    assert ragged.even is None and ragged.merge_indptr.size > 1


def test_whole_tiles_when_the_batch_fills_the_gpu():
    table = _check_every_cta(_decode_config(), [2048] * 64, [False] * 64)
    assert table.whole_tiles and table.merge_indptr.size == 1


def test_a_faulted_request_is_a_tile_with_no_keys():
    keys, faulted = [5000, 7000, 300, 4000], [False, True, False, False]
    table = _check_every_cta(_decode_config(), keys, faulted)
    assert table.even is None


def test_request_keys_apply_the_request_rules():
    pc = _decode_config(page_size=16)
    keys, faulted = request_keys(pc, [0, 2, 2, 5, 5], [16, 0, 3, 17])
    np.testing.assert_array_equal(keys, [32, 0, 35, 0])  # 2 pages of 16; empty; 3 pages, last 3; last 17 > 16
    np.testing.assert_array_equal(faulted, [False, False, False, True])
    keys, faulted = request_keys(pc, [0, 0, 0, 1], [1, 17, 0])  # no pages: last 0..16 passes; one page with last 0
    np.testing.assert_array_equal(faulted, [False, True, True])


def test_line_reason_refuses_plans_a_sorted_deal_may_replace():
    assert line_reason(_decode_config()) is None
    assert line_reason(_decode_config(line_deal=True)) is None
    assert "sort" in line_reason(dataclasses.replace(_decode_config(), sorted_deal=True))
    assert "causal" in line_reason(dataclasses.replace(_decode_config(), causal=True))


@pytest.mark.parametrize("batch, kv, heads, page_size", [(64, 2048, (32, 16), 64), (64, 2048, (24, 8), 64),
                                                         (64, 2048, (20, 4), 1), (128, 4096, (32, 8), 64)])
def test_the_line_deal_rows_derive_the_device_plan(batch, kv, heads, page_size):
    """The bench's line-deal rows (from 8 KV heads, page 1): deal or cuts as the device plan, CTA by CTA."""
    _check_every_cta(_decode_config(heads, page_size, line_deal=True), [kv] * batch, [False] * batch)


@pytest.mark.parametrize("batch, kv", [(1, 4096), (16, 4096), (64, 8192), (128, 4096), (64, None)])
@pytest.mark.parametrize("page_size", [1, 64])
def test_the_mla_decode_rows_derive_the_cuts_plan(batch, kv, page_size):
    """The bench's MLA decode rows (the ragged one: 64 requests of 1..32768 keys) derive the one-token plan's cuts."""
    keys = np.random.default_rng(64).integers(1, 32769, size=batch) if kv is None else [kv] * batch
    pc = _mla_decode_config(page_size=page_size)
    assert line_reason(pc, one_token=True) is None and "causal" in line_reason(pc)
    _check_every_cta(pc, keys, [False] * batch)


def test_the_mla_decode_plan_is_the_device_plans_on_the_bench_rows():
    """Without the sorted deal the device plan of the bench's MLA decode rows is unchanged: it took the cuts."""
    from cute_attn.ops.mla_decode import ONE_TOKEN_SPEC

    config = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                  head_dim_qk=576, head_dim_v=512, page_size=1, causal=True, spec=ONE_TOKEN_SPEC)
    for keys in ([4096], [4096] * 16, [8192] * 64, [4096] * 128, np.random.default_rng(64).integers(1, 32769, 64)):
        ones = np.ones(len(keys), dtype=np.int64)
        assert not partition(config.plan_config(132), ones, np.asarray(keys))[1]


def test_a_ragged_batch_the_line_deal_replaces():
    """A ragged batch whose serpentine deal is no worse than its split cuts: dealt, items lap by lap, no merges."""
    rng = np.random.default_rng(3)
    keys = rng.integers(1000, 1200, size=300).tolist()
    table = _check_every_cta(_decode_config((32, 8), line_deal=True), keys, [False] * 300)
    assert table.dealt and table.merge_indptr.size == 1


@settings(max_examples=40, deadline=None)
@given(data=st.data(), heads=st.sampled_from([8, 16]), page_size=st.sampled_from([1, 64]),
       num_ctas=st.sampled_from([7, 132]))
def test_drawn_mla_decode_batches_derive_the_cuts_plan(data, heads, page_size, num_ctas):
    batch = data.draw(st.integers(0, 70))
    keys = data.draw(st.lists(st.integers(0, 40000), min_size=batch, max_size=batch))
    faulted = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    _check_every_cta(_mla_decode_config(heads, page_size, num_ctas), keys, faulted)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 16, 64]), heads=st.sampled_from([(20, 4), (8, 1), (32, 8)]),
       num_ctas=st.sampled_from([1, 7, 132, 264]), even=st.booleans(), split=st.booleans(), deal=st.booleans())
def test_drawn_batches_derive_the_device_plan_on_every_cta(data, page_size, heads, num_ctas, even, split, deal):
    pc = _decode_config(heads, page_size, num_ctas, even, split, deal)
    batch = data.draw(st.integers(0, 80))
    uniform = data.draw(st.booleans())
    if uniform:
        keys = [data.draw(st.integers(0, 40000))] * batch
    else:
        keys = data.draw(st.lists(st.integers(0, 40000), min_size=batch, max_size=batch))
    faulted = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch)) if not uniform else [False] * batch
    _check_every_cta(pc, keys, faulted)


def _check_uniform(pc, keys, batch):
    """A uniform batch's closed form (``line_schedule.uniform_line``) takes the table's decisions and, where it needs
    no table, gives every CTA the table's stretch; returns the closed form."""
    from cute_attn.line_schedule import table_stretch, uniform_edge, uniform_line, uniform_stretch

    table = edge_table(pc, [keys] * batch)
    line = uniform_line(pc, keys, batch)
    assert (line.whole_tiles, line.dealt, line.pieces > 0) == (table.whole_tiles, table.dealt, table.even is not None)
    assert line.width == table.width
    for e in range(pc.num_ctas + 1):
        tile, key, snap_tile, _ = uniform_edge(pc, line, e)
        assert ((snap_tile, 0) if line.whole_tiles else (tile, key)) == (table.cut_tile[e], table.cut_key[e]), e
    inside = bool((table.cut_key > 0).any())
    assert line.needs_table == (not (table.whole_tiles or table.dealt or table.even) and inside)
    if not line.needs_table:
        num_tiles = batch * pc.num_kv_heads
        for c in range(pc.num_ctas):
            assert uniform_stretch(pc, line, c) == table_stretch(pc, table, num_tiles, c), f"CTA {c}"
    return line


def test_table_stretch_reads_the_items_of_every_cta():
    """The stretch the kernel keeps (``table_stretch``) holds each CTA's item count and its split items' merges."""
    from cute_attn.line_schedule import table_stretch

    for pc, keys in ((_decode_config(), [3232, 17, 9000]), (_decode_config(), [2048] * 64),
                     (_decode_config((32, 8), line_deal=True), list(range(1000, 1300))), (_decode_config(), [3232])):
        table = edge_table(pc, keys)
        pages = -(-np.asarray(keys) // pc.page_size)
        for c in range(pc.num_ctas):
            s = table_stretch(pc, table, len(keys) * pc.num_kv_heads, c)
            items = cta_items(pc, table, keys, np.cumsum(pages) - pages, c)
            assert s.count == len(items)
            split = [(int(r[F.MERGE]), int(r[F.PARTIAL_SLOT])) for r in items if r[F.MERGE] >= 0]
            assert split == [(m, slot) for m, slot in ((s.merge0, s.slot0), (s.merge1, s.begin1)) if m >= 0]


@pytest.mark.parametrize("batch, kv", [(1, 3232), (16, 2048), (64, 2048), (128, 4096), (1, 100), (3, 1), (37, 5000)])
@pytest.mark.parametrize("heads, deal", [((20, 4), False), ((8, 1), False), ((32, 16), True), ((32, 8), True)])
@pytest.mark.parametrize("page_size", [1, 64])
def test_a_uniform_batch_in_closed_form_is_the_tables(batch, kv, heads, deal, page_size):
    _check_uniform(_decode_config(heads, page_size, line_deal=deal), kv, batch)


def test_the_bench_rows_take_the_closed_form():
    """The seed decode rows need no table: 1 and 16 requests cut in even pieces, 64 and 128 in whole tiles; so do
    the MLA decode rows."""
    kinds = {}
    for batch, kv in ((1, 3232), (16, 2048), (64, 2048), (128, 4096)):
        line = _check_uniform(_decode_config(), kv, batch)
        kinds[batch] = "even" if line.pieces else "whole" if line.whole_tiles else "dealt" if line.dealt else "cuts"
        assert not line.needs_table
    assert kinds == {1: "even", 16: "even", 64: "whole", 128: "whole"}
    for batch, kv in ((1, 4096), (16, 4096), (64, 8192), (128, 4096)):
        for page_size in (1, 64):
            assert not _check_uniform(_mla_decode_config(page_size=page_size), kv, batch).needs_table


@settings(max_examples=300, deadline=None)
@given(keys=st.integers(1, 70000), batch=st.integers(1, 400), page_size=st.sampled_from([1, 16, 64]),
       heads=st.sampled_from([(20, 4), (8, 1), (32, 8), (32, 16)]), num_ctas=st.sampled_from([1, 7, 132, 264]),
       even=st.booleans(), split=st.booleans(), deal=st.booleans())
def test_drawn_uniform_batches_in_closed_form_are_the_tables(keys, batch, page_size, heads, num_ctas, even, split,
                                                            deal):
    _check_uniform(_decode_config(heads, page_size, num_ctas, even, split, deal), keys, batch)


@settings(max_examples=60, deadline=None)
@given(keys=st.integers(1, 70000), batch=st.integers(1, 200), page_size=st.sampled_from([1, 64]),
       heads=st.sampled_from([8, 16]), num_ctas=st.sampled_from([7, 132]))
def test_drawn_uniform_mla_batches_in_closed_form_are_the_tables(keys, batch, page_size, heads, num_ctas):
    _check_uniform(_mla_decode_config(heads, page_size, num_ctas), keys, batch)

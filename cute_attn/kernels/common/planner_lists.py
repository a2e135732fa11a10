"""The device planner's item rows (its lists phase, :meth:`device_planner.DevicePlanner.write_lists`): one row built
from the cuts or the deal, the CTA of several items searched side by side, and the rows' way to global memory (one
``cp.async.bulk`` a pass, or word stores where the destination is not 16-byte aligned). ``lap_lists`` builds (the
deal-first planners', since session 26): a dealt plan that fits both stage buffers is built in one pass by (lap, CTA)
slots, with no search for an item's CTA, and stored by one bulk copy (:func:`write_dealt_rows`)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan import NOT_CAUSAL_OFFSET, ItemField, MergeField
from .planner_collectives import NUM_THREADS, last_at_most
from .sorted_deal import deal_turned, dealt_tile


@cute.jit
def row_share(num_items, writer, writers):
    """Writer ``writer``'s rows of ``writers``: ``(first, end)``, an even count each (so each share's first row is
    16-byte aligned for its bulk copy) but the last; writers past the rows get none."""
    per = ((num_items + writers - 1) // writers + 1) // 2 * 2
    first = cutlass.min(writer * per, num_items)
    return first, cutlass.min(first + per, num_items)


def row_share_host(num_items: int, writer: int, writers: int) -> tuple[int, int]:
    """:func:`row_share` in Python (tests)."""
    per = (-(-num_items // writers) + 1) // 2 * 2
    first = min(writer * per, num_items)
    return first, min(first + per, num_items)


@cute.jit
def build_item(c: cutlass.Constexpr, stage, row, i, cta, q_tiles, requests, cut_tile, cut_key, cta_items,
               merge_first_cut, merge_slot, cut_merge, sort_keys, deal, turned, num_ctas):
    """Item ``i`` (CTA ``cta``'s) into ``stage`` row ``row``: its tile from the cuts or the deal (``turned``: the lap
    turn's vote, :func:`sorted_deal.deal_turned`), its key range, merge and partial slot, and its request's page
    start."""
    heads = c.num_kv_heads
    t = cut_tile[cta] + (i - cta_items[cta])
    if cutlass.const_expr(sort_keys is not None):
        if deal != 0:  # the CTA's items are its laps of the deal
            t = dealt_tile(c, sort_keys, i - cta_items[cta], cta, num_ctas, turned)
    j = t // heads
    b = q_tiles[j, 0]
    kv_end = q_tiles[j, 3]
    key_start = Int32(0)
    if t == cut_tile[cta] and deal == 0:
        key_start = cut_key[cta]
    key_end = kv_end
    if t == cut_tile[cta + 1] and cut_key[cta + 1] > 0 and deal == 0:
        key_end = cut_key[cta + 1]
    slot = Int32(-1)
    merge = Int32(-1)
    if key_start > 0:
        merge = cut_merge[cta]
        slot = merge_slot[merge] + cta - merge_first_cut[merge] + 1
    elif key_end < kv_end:
        merge = cut_merge[cta + 1]
        slot = merge_slot[merge]
    if requests[b, 3] != 0:  # a faulted request's items (split pieces too) keep their merges, with no keys
        key_end = key_start
    offset = Int32(NOT_CAUSAL_OFFSET)
    if cutlass.const_expr(c.causal):
        offset = requests[b, 1] - requests[b, 2]
    stage[row, ItemField.REQUEST] = b
    stage[row, ItemField.KV_HEAD] = t % heads
    stage[row, ItemField.Q_ROW_START] = q_tiles[j, 1]
    stage[row, ItemField.Q_ROW_COUNT] = q_tiles[j, 2]
    stage[row, ItemField.KV_START] = key_start
    stage[row, ItemField.KV_END] = key_end
    stage[row, ItemField.PARTIAL_SLOT] = slot
    stage[row, ItemField.CAUSAL_OFFSET] = offset
    stage[row, ItemField.MERGE] = merge
    stage[row, ItemField.KV_PAGE_START] = requests[b, 4] + key_start // c.page_size



@cute.jit
def build_dealt_rows(c: cutlass.Constexpr, stage, tidx, q_tiles, requests, cut_tile, cut_key, cta_items,
                     merge_first_cut, merge_slot, cut_merge, sort_keys, num_ctas, num_items, first_row, end_row):
    """A dealt plan's item rows ``first_row .. end_row - 1`` (a row writer's share) into ``stage`` rows ``0 .. end_row -
    first_row - 1`` (``DevicePlannerConfig.lap_lists``): one (CTA, lap) slot a thread a step, over the CTAs that hold
    those rows, so item ``cta_items[cta] + lap`` needs no search for its CTA (the chunked build's binary search of
    ``cta_items`` a row; here two searches, for the share's first and last CTA). A deal's items are its tiles, so
    ``num_items`` positions make ``ceil(num_items / num_ctas)`` laps; a CTA has ``cta_items[cta + 1] - cta_items[cta]``
    of them. The slots run CTA-major, so a warp's threads build consecutive rows (10 words apart: 2-way bank conflicts
    on the stage stores); lap-major slots put them a CTA's items apart, every row of a warp in the same two banks where
    CTAs hold 8 items (16-way, the phase's 3.8 k cycles at GQA prefill 4 x 992 in session 28)."""
    laps = (num_items + num_ctas - 1) // num_ctas
    turned = deal_turned(c, sort_keys)
    first_cta = Int32(0)
    end_cta = num_ctas
    if cutlass.const_expr(c.row_writers > 1):  # the CTAs that hold this writer's share
        if first_row > 0:
            first_cta = last_at_most(cta_items, num_ctas, first_row)
        if end_row < num_items:
            end_cta = last_at_most(cta_items, num_ctas, end_row - 1) + 1
        if end_row <= first_row:
            end_cta = first_cta
    for slot in range(first_cta * laps + tidx, end_cta * laps, NUM_THREADS):
        cta = slot // laps
        lap = slot - cta * laps
        first = cta_items[cta]
        row = first + lap
        if cutlass.const_expr(c.row_writers > 1):
            if lap < cta_items[cta + 1] - first and row >= first_row and row < end_row:
                build_item(c, stage, row - first_row, row, cta, q_tiles, requests, cut_tile, cut_key, cta_items,
                           merge_first_cut, merge_slot, cut_merge, sort_keys, Int32(1), turned, num_ctas)
        else:
            if lap < cta_items[cta + 1] - first:
                build_item(c, stage, row, row, cta, q_tiles, requests, cut_tile, cut_key, cta_items,
                           merge_first_cut, merge_slot, cut_merge, sort_keys, Int32(1), turned, num_ctas)


@cute.jit
def ctas_of_items(cta_items: cute.Tensor, num_ctas, first_item, ctas: cute.Tensor):
    """``ctas[k]`` = the CTA of item ``first_item + k * NUM_THREADS`` (:func:`last_at_most` of ``cta_items`` over its
    first ``num_ctas`` entries) for every k, by fixed-step searches run side by side: each step's loads of all k
    issue together, so the k searches cost one search's latency (the data-dependent loop ran them one after another)."""
    n = cute.size(ctas)
    for k in cutlass.range_constexpr(n):
        ctas[k] = Int32(0)
    step = NUM_THREADS // 2  # num_ctas <= MAX_CTAS < NUM_THREADS: log2(NUM_THREADS) steps cover every entry
    while step > 0:
        for k in cutlass.range_constexpr(n):
            probe = ctas[k] + step
            value = cta_items[cutlass.min(probe, Int32(NUM_THREADS - 1))]
            if probe < num_ctas and value <= first_item + k * NUM_THREADS:
                ctas[k] = probe
        step = step // 2


@cute.jit
def bulk_store(items: cute.Tensor, stage: cute.Tensor, first_word, first_stage_word, words):
    """One thread: ``words`` (a multiple of 4) int32 of ``stage`` from word ``first_stage_word`` to ``items`` from flat
    word ``first_word``, as one ``cp.async.bulk`` shared -> global copy, committed as its own bulk group."""
    if words > 0:
        src = (stage.iterator + first_stage_word).toint()
        dst = (items.iterator + first_word).toint()
        cute.arch.inline_ptx("cp.async.bulk.global.shared::cta.bulk_group [{$r0}], [{$r1}], {$r2};",
                             read_only_args=[Int64(dst), Int32(src), Int32(words * 4)])
        cute.arch.cp_async_bulk_commit_group()


@cute.jit
def store_words(items: cute.Tensor, stage: cute.Tensor, first_word, first_stage_word, done, words, tidx):
    """Words ``done .. words`` of the chunk, one a thread (the tail a bulk copy leaves, or all of a chunk whose
    destination is not 16-byte aligned)."""
    flat_items = cute.make_tensor(items.iterator, cute.make_layout(items.shape[0] * items.shape[1]))
    flat_stage = cute.make_tensor(stage.iterator, cute.make_layout(cute.size(stage)))
    for e in range(done + tidx, words, NUM_THREADS):
        flat_items[first_word + e] = flat_stage[first_stage_word + e]


@cute.jit
def write_dealt_rows(c: cutlass.Constexpr, stamp: cutlass.Constexpr, tidx, items, q_tiles, requests, cut_tile, cut_key,
                     cta_items, merge_first_cut, merge_slot, cut_merge, stage, sort_keys, num_items, num_ctas, bulk,
                     first_row, end_row, trace):
    """``lap_lists``: a dealt plan's rows ``first_row .. end_row - 1`` in one pass over both stage buffers
    (``build_dealt_rows``: no CTA search), then one bulk copy. (Measured against it on the H200 in session 29 and
    reverted: each warp storing its own rows, and a copy a build step of 512 slots; both made the build slower by
    more than they took off the copy's tail.)"""
    build_dealt_rows(c, stage, tidx, q_tiles, requests, cut_tile, cut_key, cta_items, merge_first_cut,
                     merge_slot, cut_merge, sort_keys, num_ctas, num_items, first_row, end_row)
    stamp(trace, 9, tidx)
    store_built_rows(stamp, tidx, items, stage, first_row, 0, (end_row - first_row) * len(ItemField), bulk, trace,
                     False)


@cute.jit
def write_row_chunks(c: cutlass.Constexpr, stamp: cutlass.Constexpr, tidx, items, q_tiles, requests, cut_tile, cut_key,
                     cta_items, merge_first_cut, merge_slot, cut_merge, stage, sort_keys, deal, num_items, num_ctas,
                     bulk, first_row, end_row, trace):
    """Rows ``first_row .. end_row - 1`` a pass of ``rows_per_thread`` a thread at a time (their CTAs searched side
    by side), each pass one bulk copy from one stage buffer while the next is built in the other."""
    fields = len(ItemField)
    per_thread = c.rows_per_thread
    rows_per_pass = NUM_THREADS * per_thread
    buffer = Int32(0)
    ctas = cute.make_rmem_tensor((per_thread,), Int32)
    turned = Int32(0)
    if deal != 0:
        turned = deal_turned(c, sort_keys)
    for chunk in range(first_row, end_row, rows_per_pass):
        if cutlass.const_expr(per_thread == 1):
            ctas[0] = last_at_most(cta_items, num_ctas, chunk + tidx)
        else:
            ctas_of_items(cta_items, num_ctas, chunk + tidx, ctas)
        for k in cutlass.range_constexpr(per_thread):
            i = chunk + k * NUM_THREADS + tidx
            if i < end_row:
                build_item(c, stage, buffer * rows_per_pass + k * NUM_THREADS + tidx, i, ctas[k], q_tiles,
                           requests, cut_tile, cut_key, cta_items, merge_first_cut, merge_slot, cut_merge,
                           sort_keys, deal, turned, num_ctas)
        stamp(trace, 9, tidx)  # trace builds: the last pass's build, barrier and store
        words = cutlass.min(Int32(rows_per_pass), end_row - chunk) * fields
        first = buffer * (rows_per_pass * fields)  # the buffer's first word in the stage
        store_built_rows(stamp, tidx, items, stage, chunk, first, words, bulk, trace, True)
        buffer = 1 - buffer
        cute.arch.sync_threads()


@cute.jit
def write_lists(c: cutlass.Constexpr, stamp: cutlass.Constexpr, tidx, items, merge_indptr, merges, q_tiles, requests,
                cut_tile, cut_key, cta_items, merge_first_cut, merge_slot, cut_merge, stage, sort_keys, deal, num_items,
                num_merges, num_partials, num_ctas, writer, writers, trace):
    """The lists phase (:class:`device_planner.DevicePlanner`): the merges (writer 0's), then this writer's share of
    the item rows (:func:`row_share`; all of them with one writer) and their way to global memory."""
    heads = c.num_kv_heads
    merge_end = merge_indptr.shape[0]  # the merges are writer 0's
    if cutlass.const_expr(c.row_writers > 1):
        if writer != 0:
            merge_end = Int32(0)
    for g in range(tidx, merge_end, NUM_THREADS):
        if g < num_merges:
            merge_indptr[g] = merge_slot[g]
            t = cut_tile[merge_first_cut[g]]
            j = t // heads
            b = q_tiles[j, 0]
            merges[g, MergeField.REQUEST] = b
            merges[g, MergeField.KV_HEAD] = t % heads
            merges[g, MergeField.Q_ROW_START] = q_tiles[j, 1]
            merges[g, MergeField.Q_ROW_COUNT] = q_tiles[j, 2]
            merges[g, MergeField.TOKEN_START] = requests[b, 5]
        else:
            merge_indptr[g] = num_partials
    stamp(trace, 14, tidx)
    # Each thread builds ITEMS_PER_THREAD rows in shared memory (their CTA searches run side by side, the chain
    # that dominated a row's build); thread 0 then stores the pass's rows as one bulk copy (cp.async.bulk, the TMA
    # engine) while the CTA builds the next pass in the other stage buffer. (Before: the CTA's 16-byte stores, a
    # 512-row chunk a pass; a row per thread straight to global was 10 scattered 4-byte stores a row.)
    per_thread = c.rows_per_thread
    rows_per_pass = NUM_THREADS * per_thread
    # bulk stores need 16-byte aligned rows: our buffers always are (a pass starts at a multiple of
    # rows_per_pass * fields words); a caller's view may not be, and then every thread stores words itself
    bulk = Int32(0)
    if (items.iterator.toint() & 15) == 0:
        bulk = Int32(1)
    first_row = Int32(0)  # this writer's rows: first_row .. end_row - 1
    end_row = num_items
    if cutlass.const_expr(c.row_writers > 1):
        first_row, end_row = row_share(num_items, writer, writers)
    whole = Int32(0)  # lap_lists: a dealt plan's share that fits both stage buffers, built in one pass (uniform)
    if cutlass.const_expr(c.lap_lists and sort_keys is not None):
        if deal != 0 and end_row - first_row <= 2 * rows_per_pass:
            whole = Int32(1)
    if whole != 0:
        write_dealt_rows(c, stamp, tidx, items, q_tiles, requests, cut_tile, cut_key, cta_items,
                         merge_first_cut, merge_slot, cut_merge, stage, sort_keys, num_items, num_ctas, bulk,
                         first_row, end_row, trace)
    else:
        write_row_chunks(c, stamp, tidx, items, q_tiles, requests, cut_tile, cut_key, cta_items,
                         merge_first_cut, merge_slot, cut_merge, stage, sort_keys, deal, num_items, num_ctas, bulk,
                         first_row, end_row, trace)
    if bulk != 0 and tidx == 0:
        cute.arch.cp_async_bulk_wait_group(0)  # every row in global before the grid ends (the kernel that reads
        # them waits for this grid's completion)


@cute.jit
def store_built_rows(stamp: cutlass.Constexpr, tidx, items, stage, first_row, first_stage_word, words, bulk, trace,
                     double_buffered: cutlass.Constexpr):
    """The rows every thread built in ``stage`` from word ``first_stage_word``, ``words`` of them, to ``items`` from
    row ``first_row``: one barrier, then one bulk copy by thread 0 and the < 4-word tail by all (``bulk``), or word
    stores by all where the destination is not 16-byte aligned (:func:`write_dealt_rows`, :func:`write_row_chunks`).
    ``double_buffered``: the next pass builds in the other stage buffer, so after issuing its copy thread 0 waits
    until the copy before it has read that buffer."""
    if bulk != 0:
        cute.arch.fence_proxy("async.shared", space="cta")  # the rows, visible to the bulk copy's reads
    cute.arch.sync_threads()
    stamp(trace, 10, tidx)
    if bulk != 0:
        if tidx == 0:
            bulk_store(items, stage, first_row * len(ItemField), first_stage_word, words // 4 * 4)
            if cutlass.const_expr(double_buffered):
                cute.arch.cp_async_bulk_wait_group(1, read=True)
        # the < 4-word tail
        store_words(items, stage, first_row * len(ItemField), first_stage_word, words // 4 * 4, words, tidx)
    else:
        store_words(items, stage, first_row * len(ItemField), first_stage_word, 0, words, tidx)
    stamp(trace, 11, tidx)

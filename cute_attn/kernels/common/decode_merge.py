"""Split-KV merge fused into the decode kernels (both arches): the last CTA of a merge folds its slots.

Used, after the item loop, by the 128 threads that wrote the CTA's partials (o, lse) and can sync on a named
barrier (sm_90a: the consumer warpgroup; sm_100a: the softmax warps). Replaces the separate combine
launch for decode, whose launch gap cost more than the fold itself (``docs/perf-history.md``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ...plan import ItemField as F

FOLD_ROW_LANES = 16  # lanes per row (8 rows in flight per 128 threads; decode has ~5)
FOLD_SLOTS = 8  # slots whose loads are in flight at once
WIDE_VEC = 4  # fold_wide_merge: fp32 columns a 16-byte load
WIDE_SLOTS = 4  # fold_wide_merge: slots whose rows a lane loads before it accumulates any


@cute.jit
def fold_completed_merges(items, item_begin, item_end, merge_indptr, merge_counters, arrival, group,
                          partial_out, partial_lse, output, lse, lse_out_scale, tidx,
                          barrier_id: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int], qo_indptr=None,
                          wide: cutlass.Constexpr[bool] = False):
    """After the CTA's item loop: count each of its partials in its merge; the last arrival folds the merge.

    Ordering: every thread's partial stores (all items), its fence.acq_rel.gpu, the named barrier, then per
    split item one thread's ``old = atom.add.acq_rel.gpu(merge_counters[MERGE], 1)``: the CTA's stores are
    released before its arrival is visible. The CTA that reads ``old == slots - 1`` acquired every earlier
    arrival (the counter's order), shares that through shared memory, fences again and folds; then it
    resets the counter to 0 (no other CTA touches it again in this launch: stream order makes it clean
    for the next launch or CUDA-graph replay). Exactly one CTA folds each merge; no CTA waits on another.
    Arriving after the loop rather than per item costs nothing (the fold would come after the loop anyway)
    and keeps atomics out of the KV loop; the fold itself must stay out of it: inlined there, its code
    cost the loop ~10% of its streaming rate on the H200 (``docs/perf-history.md``).
    ``arrival``: one smem Int32 that broadcasts thread 0's old value.
    ``qo_indptr`` (multi-token decode): packed row r of the merge is token ``qo_indptr[REQUEST] + (Q_ROW_START +
    r) // group``, head ``KV_HEAD * group + r % group`` (tiles hold whole tokens); None (decode): token REQUEST,
    head ``KV_HEAD * group + Q_ROW_START + r``. ``wide`` (MLA's 512-column rows, with ``qo_indptr``):
    :func:`fold_wide_merge` folds instead of :func:`fold_merge`."""
    cute.arch.fence_acq_rel_gpu()
    for it in cutlass.range(item_begin, item_end, unroll=1):
        if items[it, F.PARTIAL_SLOT] >= 0:
            merge = items[it, F.MERGE]
            slot_begin = merge_indptr[merge]
            arrive_and_fold(merge, slot_begin, merge_indptr[merge + 1] - slot_begin, items[it, F.REQUEST],
                            items[it, F.KV_HEAD], items[it, F.Q_ROW_START], items[it, F.Q_ROW_COUNT], merge_counters,
                            arrival, group, partial_out, partial_lse, output, lse, lse_out_scale, tidx, barrier_id,
                            num_threads, qo_indptr, wide)


@cute.jit
def arrive_and_fold(merge, slot_begin, num_slots, request, kv_head, q_row_start, row_count, merge_counters, arrival,
                    group, partial_out, partial_lse, output, lse, lse_out_scale, tidx,
                    barrier_id: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int], qo_indptr=None,
                    wide: cutlass.Constexpr[bool] = False):
    """One split item's arrival in ``merge`` (slots ``slot_begin ..`` of ``num_slots``), and the fold when it is the
    last (:func:`fold_completed_merges`' ordering: the caller fenced its partial stores first). The planner-free
    decode (``line_schedule.py``) calls it with the fields it derived, a planned kernel with its item's row."""
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)  # fences done; arrival free
    if tidx == 0:
        arrival[0] = cute.arch.atomic_add((merge_counters.iterator + merge).llvm_ptr, Int32(1),
                                          sem="acq_rel", scope="gpu")
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    if arrival[0] == num_slots - 1:
        cute.arch.fence_acq_rel_gpu()
        if cutlass.const_expr(qo_indptr is None):
            fold_merge(slot_begin, num_slots, request, kv_head * group + q_row_start, row_count, partial_out,
                       partial_lse, output, lse, lse_out_scale, tidx, num_threads)
        elif cutlass.const_expr(wide):
            fold_wide_merge(slot_begin, num_slots, qo_indptr[request] + q_row_start // group, kv_head * group,
                            row_count, partial_out, partial_lse, output, lse, lse_out_scale, tidx, num_threads, group)
        else:
            fold_merge(slot_begin, num_slots, qo_indptr[request] + q_row_start // group, kv_head * group,
                       row_count, partial_out, partial_lse, output, lse, lse_out_scale, tidx, num_threads, group)
        if tidx == 0:
            merge_counters[merge] = Int32(0)


@cute.jit
def announce_partials(items, item_begin, item_end, merge_counters, tidx, barrier_id: cutlass.Constexpr[int],
                      num_threads: cutlass.Constexpr[int]):
    """After the CTA's item loop (``eager_combine``): count each of its split items in its merge, for the combine
    that polls the counters (``common/combine.py``, ``eager``). Every thread's partial stores, its fence.acq_rel.gpu,
    the named barrier, then one thread's ``red.release.gpu`` per split item: the stores are visible to whoever
    acquires the count. No fold and no read back here; the combine sets each counter back to 0."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    if tidx == 0:
        for it in cutlass.range(item_begin, item_end, unroll=1):
            if items[it, F.PARTIAL_SLOT] >= 0:
                cute.arch.atomic_add((merge_counters.iterator + items[it, F.MERGE]).llvm_ptr, Int32(1),
                                     sem="release", scope="gpu")


@cute.jit
def fold_merge(slot_begin, num_slots, req, first_head, row_count, partial_out, partial_lse, output, lse,
               lse_out_scale, tidx, num_threads: cutlass.Constexpr[int], token_group: cutlass.Constexpr[int] = 0):
    """``reference.merge_partials`` of the slots into ``output[req, first_head + r]`` / ``lse`` (``token_group``
    g > 0, multi-token decode: into ``output[req + r // g, first_head + r % g]``, ``req`` the first token's row).

    Latency-bound (decode: ~5 rows, up to a few dozen slots), so every row gets its own half-warp and all
    rows run at once: 16 lanes take every 16th slot's LSE (online max/sum, then shuffles) for ``L`` (:func:`merged_row_lse`); then
    each lane owns every 16th column and sums ``2^(lse_s - L) * o_s`` over the slots, ``FOLD_SLOTS`` slots
    per step with indices clamped to the last slot (weight 0 past it), so a step's loads issue together
    and cost one round trip; the first step's loads go out before the LSE reduction. Rows past ``row_count`` compute on a clamped row and store nothing (both
    half-warps of a warp run the same loop: the shuffles need every lane). All-``-inf`` rows give 0 and
    ``-inf`` (their weights are 2^(-inf - 0) = 0)."""
    lane = tidx % FOLD_ROW_LANES
    half = (tidx % 32) // FOLD_ROW_LANES
    warp = tidx // 32
    cols = partial_out.shape[2] // FOLD_ROW_LANES
    unroll = max(1, min(FOLD_SLOTS, 64 // cols))  # bounds the registers in flight (64 floats)
    acc = cute.make_rmem_tensor((cols,), Float32)
    vals = cute.make_rmem_tensor((unroll * cols,), Float32)
    weights = cute.make_rmem_tensor((unroll,), Float32)
    rows_per_warp = 32 // FOLD_ROW_LANES
    for r0 in cutlass.range(warp * rows_per_warp, row_count, num_threads // FOLD_ROW_LANES, unroll=1):
        r = r0 + half
        rr = cutlass.min(r, row_count - 1)
        # the first slot batch does not need L: its loads go out with the LSE loads (one round trip)
        for k in cutlass.range_constexpr(unroll):
            s = slot_begin + cutlass.min(k, num_slots - 1)
            weights[k] = partial_lse[s, rr]
            for i in cutlass.range_constexpr(cols):
                vals[k * cols + i] = partial_out[s, rr, lane + i * FOLD_ROW_LANES]
        merged, shift = merged_row_lse(partial_lse, slot_begin, num_slots, rr, lane)
        for i in cutlass.range_constexpr(cols):
            acc[i] = Float32(0.0)
        for k in cutlass.range_constexpr(unroll):
            w = cute.math.exp2(weights[k] - shift, fastmath=True)
            w = w if k < num_slots else Float32(0.0)
            for i in cutlass.range_constexpr(cols):
                acc[i] = acc[i] + w * vals[k * cols + i]
        for s0 in cutlass.range(unroll, num_slots, unroll, unroll=1):
            for k in cutlass.range_constexpr(unroll):
                s = slot_begin + cutlass.min(s0 + k, num_slots - 1)
                w = cute.math.exp2(partial_lse[s, rr] - shift, fastmath=True)
                weights[k] = w if s0 + k < num_slots else Float32(0.0)
                for i in cutlass.range_constexpr(cols):
                    vals[k * cols + i] = partial_out[s, rr, lane + i * FOLD_ROW_LANES]
            for k in cutlass.range_constexpr(unroll):
                for i in cutlass.range_constexpr(cols):
                    acc[i] = acc[i] + weights[k] * vals[k * cols + i]
        if r < row_count:
            token, head = req, first_head + r
            if cutlass.const_expr(token_group > 0):
                token, head = req + r // token_group, first_head + r % token_group
            for i in cutlass.range_constexpr(cols):
                output[token, head, lane + i * FOLD_ROW_LANES] = acc[i].to(output.element_type)
            if lane == 0:
                lse[token, head] = merged * lse_out_scale


@cute.jit
def fold_wide_merge(slot_begin, num_slots, first_token, first_head, row_count, partial_out, partial_lse, output, lse,
                    lse_out_scale, tidx, num_threads: cutlass.Constexpr[int], token_group: cutlass.Constexpr[int]):
    """:func:`fold_merge` for wide rows (MLA: 512 fp32 columns, 32 KiB a slot at 16 heads): packed row ``r`` of the
    merge into ``output[first_token + r // token_group, first_head + r % token_group]``.

    :func:`fold_merge` reads a 512-column row with 4-byte loads, two slots in flight, so an MLA fold was a chain of
    dependent L2 round trips (session 15: slower than the combine launch). Here a half-warp owns a row and a lane
    every 16th 16-byte vector of it (8 a row: a half-warp's loads are 256 contiguous bytes), ``WIDE_SLOTS`` slots'
    vectors are loaded before any is used (32 loads in flight a lane), the first batch before the LSE reduction, so
    a merge of ``n`` slots costs ``ceil(n / WIDE_SLOTS)`` round trips. A slot's weight is
    ``2^(lse - L)``; a slot that saw no key (``-inf``) and clamped loads past the last slot add nothing."""
    lane = tidx % FOLD_ROW_LANES
    half = (tidx % 32) // FOLD_ROW_LANES
    warp = tidx // 32
    vectors = partial_out.shape[2] // (FOLD_ROW_LANES * WIDE_VEC)  # a lane's vectors of one row
    acc = cute.make_rmem_tensor((WIDE_VEC, vectors), Float32)
    vals = cute.make_rmem_tensor((WIDE_VEC, vectors, WIDE_SLOTS), Float32)
    lses = cute.make_rmem_tensor((WIDE_SLOTS,), Float32)
    rows_per_warp = 32 // FOLD_ROW_LANES
    for r0 in cutlass.range(warp * rows_per_warp, row_count, num_threads // FOLD_ROW_LANES, unroll=1):
        r = r0 + half
        rr = cutlass.min(r, row_count - 1)
        wide_load_slots(partial_out, partial_lse, slot_begin, 0, num_slots, rr, lane, vals, lses)
        merged, shift = merged_row_lse(partial_lse, slot_begin, num_slots, rr, lane)
        acc.fill(0.0)
        wide_accumulate(acc, vals, lses, 0, num_slots, shift)
        for s0 in cutlass.range(WIDE_SLOTS, num_slots, WIDE_SLOTS, unroll=1):
            wide_load_slots(partial_out, partial_lse, slot_begin, s0, num_slots, rr, lane, vals, lses)
            wide_accumulate(acc, vals, lses, s0, num_slots, shift)
        if r < row_count:
            token, head = first_token + r // token_group, first_head + r % token_group
            for v in cutlass.range_constexpr(vectors):
                col0 = (v * FOLD_ROW_LANES + lane) * WIDE_VEC
                for i in cutlass.range_constexpr(WIDE_VEC):
                    output[token, head, col0 + i] = acc[i, v].to(output.element_type)
            if lane == 0:
                lse[token, head] = merged * lse_out_scale


@cute.jit
def wide_load_slots(partial_out, partial_lse, slot_begin, s0, num_slots, row, lane, vals, lses):
    """Slots ``s0 .. s0 + WIDE_SLOTS - 1`` of ``row`` (clamped to the last slot): this lane's 16-byte vectors into
    ``vals`` and the slots' LSEs into ``lses``, every load issued before any is used."""
    vectors = cute.size(vals, mode=[1])
    for k in cutlass.range_constexpr(WIDE_SLOTS):
        s = slot_begin + cutlass.min(s0 + k, num_slots - 1)
        lses[k] = partial_lse[s, row]
        for v in cutlass.range_constexpr(vectors):
            col0 = (v * FOLD_ROW_LANES + lane) * WIDE_VEC
            offset = (Int64(s) * partial_out.stride[0] + row * partial_out.stride[1] + col0) * 4
            src = cute.make_ptr(Float32, partial_out.iterator.toint() + offset, cute.AddressSpace.gmem,
                                assumed_align=4 * WIDE_VEC)
            cute.autovec_copy(cute.make_tensor(src, cute.make_layout(WIDE_VEC)), vals[None, v, k])


@cute.jit
def wide_accumulate(acc, vals, lses, s0, num_slots, shift):
    """``acc += 2^(lse - shift) * row`` over the loaded slots; past the last slot, or a slot that saw no key, adds
    nothing (its row is not read into the sum, whatever it holds)."""
    vectors = cute.size(vals, mode=[1])
    for k in cutlass.range_constexpr(WIDE_SLOTS):
        w = cute.math.exp2(lses[k] - shift, fastmath=True)
        w = w if s0 + k < num_slots else Float32(0.0)
        for v in cutlass.range_constexpr(vectors):
            for i in cutlass.range_constexpr(WIDE_VEC):
                term = w * vals[i, v, k]
                acc[i, v] = acc[i, v] + (term if w > 0.0 else Float32(0.0))


@cute.jit
def merged_row_lse(partial_lse, slot_begin, num_slots, row, lane):
    """``(L, shift)`` of one row of a merge, from its 16 lanes (:data:`FOLD_ROW_LANES`): each lane takes every 16th
    slot's LSE (online max and sum), then shuffles within the half-warp. ``L = -inf`` and ``shift = 0`` for a row whose
    slots all saw no key (its weights ``2^(lse - shift)`` are then 0); else ``shift = L``."""
    neg_inf = -Float32.inf
    lane_max = neg_inf
    lane_sum = Float32(0.0)
    for s in cutlass.range(lane, num_slots, FOLD_ROW_LANES, unroll=1):
        x = partial_lse[slot_begin + s, row]
        new_max = cute.arch.fmax(lane_max, x)
        base = new_max if new_max != neg_inf else Float32(0.0)
        lane_sum = (lane_sum * cute.math.exp2(lane_max - base, fastmath=True)
                    + cute.math.exp2(x - base, fastmath=True))
        lane_max = new_max
    row_max = cute.arch.warp_reduction_max(lane_max, threads_in_group=FOLD_ROW_LANES)
    row_base = row_max if row_max != neg_inf else Float32(0.0)
    total = cute.arch.warp_reduction_sum(lane_sum * cute.math.exp2(lane_max - row_base, fastmath=True),
                                         threads_in_group=FOLD_ROW_LANES)
    merged = neg_inf
    shift = Float32(0.0)
    if total > 0.0:
        merged = row_base + cute.math.log2(total, fastmath=True)
        shift = merged
    return merged, shift

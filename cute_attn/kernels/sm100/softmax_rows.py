"""Softmax-role steps shared by the sm_100a prefill kernels: one score row per thread, S in TMEM.

Per item every role derives the same key-tile count (:func:`num_key_tiles`) from the item's fields, so
the pipelines stay in lockstep without extra signalling. The softmax role starts each item with
:func:`begin_softmax_item` (item fields, tile count, this row's token, fresh row state). Per key tile
``j`` it waits for S_j and loads its row (:func:`load_s_row`), masks it and runs the online softmax
(:func:`online_softmax_row`), writes P (TMEM or shared memory: the kernel's own step), and for
``j >= 1`` sends the row's O scale to the correction role; after the item's last tile it sends the
final ``(row_sum, row_max)`` (both through :func:`send_row_values`, a small smem vector ring
``s_vec[row, value, stage]``).

Private math, not ``common/softmax.py``: that one works on Hopper wgmma fragments whose rows are spread
over 4 threads; here ``tcgen05.ld 32x32b`` gives each softmax thread whole rows, so row max and row sum
need no shuffles.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ...plan import ItemField as F
from ..common.mask import tile_needs_mask
from .tmem import fence_after_sync

NEG_INF = -Float32.inf


@cute.jit
def num_key_tiles(kv_start: Int32, kv_end: Int32, tile_n: cutlass.Constexpr[int]) -> Int32:
    """Key tiles of the item's range ``[kv_start, kv_end)`` (0 for an empty range)."""
    n = Int32(0)
    if kv_end > kv_start:
        n = (kv_end - kv_start + tile_n - 1) // tile_n
    return n


@cute.jit
def begin_softmax_item(items: cute.Tensor, it: Int32, row: Int32, group: cutlass.Constexpr[int],
                       tile_n: cutlass.Constexpr[int]):
    """The softmax role's per-item header: what packed row ``row`` needs of item ``it``, and a fresh row state.

    Returns ``(kv_start, kv_end, causal_offset, n, first_token, token, row_max, row_sum)``: ``n`` key tiles,
    ``first_token`` the tile's first query token (which tiles need the mask), ``token`` this row's query token
    (``group`` packed rows per token), ``row_max = -inf`` and ``row_sum = 0``.
    """
    return begin_softmax_unit(items[it, int(F.Q_ROW_START)], items[it, int(F.KV_START)], items[it, int(F.KV_END)],
                              items[it, int(F.CAUSAL_OFFSET)], row, group, tile_n)


@cute.jit
def begin_softmax_unit(r0: Int32, kv_start: Int32, kv_end: Int32, causal_offset: Int32, row: Int32,
                       group: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int]):
    """:func:`begin_softmax_item` of an item's fields (a self-scheduling build's unit: ``unit_schedule``)."""
    n = num_key_tiles(kv_start, kv_end, tile_n)
    return kv_start, kv_end, causal_offset, n, r0 // group, (r0 + row) // group, NEG_INF, Float32(0.0)


@cute.jit
def load_s_row(tiled_ld: cute.TiledCopy, t_ld_s: cute.Tensor, r_s: cute.Tensor, tile_n: cutlass.Constexpr[int],
               pipe_s, s_state):
    """Wait for S stage ``s_state`` (``tile_n`` TMEM columns per stage) and load this thread's row into ``r_s``."""
    pipe_s.consumer_wait(s_state)
    fence_after_sync()
    cute.copy(tiled_ld, cute.make_tensor(t_ld_s.iterator + s_state.index * tile_n, t_ld_s.layout), r_s)
    cute.arch.fence_view_async_tmem_load()


@cute.jit
def online_softmax_row(r_s: cute.Tensor, t_ld_c: cute.Tensor, kv_base: Int32, kv_end: Int32, first_token: Int32,
                       token: Int32, causal_offset: Int32, row_max: Float32, row_sum: Float32, scale_log2: Float32,
                       tile_n: cutlass.Constexpr[int]):
    """One key tile ``[kv_base, kv_base + tile_n)`` of the row of query ``token`` held by this thread, in place.

    Masks keys past the causal diagonal or ``kv_end`` (only on tiles of the item that need it), then the
    base-2 online softmax: ``r_s`` becomes ``exp2(s * scale_log2 - max * scale_log2)``. Returns
    ``(row_max, row_sum, scale)`` where ``scale`` rescales the previous O. A max still ``-inf`` uses 0 in
    the exponent, so nothing is NaN.
    """
    needs_mask = tile_needs_mask(kv_base, tile_n, kv_end, first_token, causal_offset)
    limit = cutlass.min(kv_end, token + causal_offset + 1) - kv_base  # first masked column
    if needs_mask:
        for i in cutlass.range_constexpr(cute.size(r_s)):
            if t_ld_c[i][1] >= limit:
                r_s[i] = NEG_INF
    new_max = cute.arch.fmax(row_max, r_s.load().reduce(cute.ReductionOp.MAX, NEG_INF, 0))
    safe_max = Float32(0.0) if new_max == NEG_INF else new_max
    max_scaled = safe_max * scale_log2
    # old max -inf: exp2(-inf) = 0 (the running sum and O are zero anyway), never NaN
    scale = cute.math.exp2(row_max * scale_log2 - max_scaled, fastmath=True)
    total = row_sum * scale
    for i in cutlass.range_constexpr(cute.size(r_s)):
        p = cute.math.exp2(r_s[i] * scale_log2 - max_scaled, fastmath=True)
        r_s[i] = p
        total += p
    return new_max, total, scale


@cute.jit
def send_row_values(pipe_c, c_state, s_vec: cute.Tensor, row: Int32, values: tuple, owns_row=None):
    """Hand ``values`` of ``row`` (its O scale, or its final ``(row_sum, row_max)``) to the correction role.

    ``owns_row``: None when every softmax thread holds a real row, else this thread's predicate (threads
    without one still join the ring's arrive). The caller advances ``c_state`` itself: the
    tracer carries a pipeline state through the caller's runtime loop only if the loop body advances it.
    """
    pipe_c.producer_acquire(c_state)
    if cutlass.const_expr(owns_row is None):
        for i in cutlass.range_constexpr(len(values)):
            s_vec[row, i, c_state.index] = values[i]
    else:
        if owns_row:
            for i in cutlass.range_constexpr(len(values)):
                s_vec[row, i, c_state.index] = values[i]
    pipe_c.producer_commit(c_state)

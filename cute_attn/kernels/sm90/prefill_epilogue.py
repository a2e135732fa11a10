"""Epilogues of the sm_90a prefill kernels: an item's normalised O (wgmma accumulator) and lse to memory.

:func:`store_output_rows` (final items: bf16 ``output`` and ``lse * lse_out_scale``) and
:func:`store_partial_rows` (split items: fp32 ``partial_out[slot]`` and base-2 ``partial_lse[slot]``)
are used by both prefill kernels and store straight from the registers, rows ``< Q_ROW_COUNT`` only
(later rows belong to the next request, or to nothing). A thread owns column pairs of its rows, so a
row of 256 bytes is written by 32 ``st.global.b32`` of 4 threads.

:func:`store_output_via_smem` (the GQA kernel's ``PagedAttentionConfig.smem_epilogue``) writes the
final bf16 output through shared memory instead:

1. each consumer warpgroup converts its 64 x d O rows to bf16 and writes them with ``stmatrix`` into
   its own 64 rows of the item's Q stage (that warpgroup's last QK GEMM has completed, and the other
   warpgroup's GEMMs read only its own 64 Q rows, so no other reader is left);
2. a named barrier over the warpgroup (128 threads);
3. each thread reads 16 bytes (8 bf16 of one packed row) with a vector shared load and writes them
   with one 16-byte global store: 16 threads cover a 256-byte row, a warp writes two whole rows.
   Rows ``>= Q_ROW_COUNT`` are skipped (they belong to the next request).

The caller releases the Q stage only after this (``fence.proxy.async`` first: the next TMA load
into the stage is an async-proxy write after these generic-proxy accesses), then calls
:func:`store_output_rows` with ``write_output=False`` for the lse.

The MLA score-warpgroup kernel (``mla_prefill_score_wg.py``) uses it with ``split_columns``: its warpgroups own
the 256-column halves of the same 64 rows, so each writes and reads back its half of the item's last K stage's ckv
block (the V columns it alone read in its last PV GEMM), and stores 512-byte row halves.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.named_barrier import warpgroup_barrier_sync
from ..common.softmax import acc_mn_view

EPILOGUE_BARRIER = 4  # ids 4, 5: one named barrier per consumer warpgroup
_VEC = 8  # bf16 per 16-byte access


def smem_store_atom(dtype) -> cute.CopyAtom:
    """``stmatrix.x4`` for the accumulator -> shared memory step."""
    return cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)


def row_copy(dtype, head_dim: int) -> cute.TiledCopy:
    """A 128-thread tiled copy of 16-byte vectors: ``head_dim / 8`` threads per row, rows stacked."""
    per_row = head_dim // _VEC
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=16 * _VEC)
    thr = cute.make_ordered_layout((128 // per_row, per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, _VEC)))


@cute.jit
def store_output_via_smem(acc_o: cute.Tensor, s_o: cute.Tensor, tiled_mma_pv: cute.TiledMma, ctid: Int32, wg: Int32,
                          token0: Int32, h: Int32, row_count: Int32, output: cute.Tensor,
                          group: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                          split_columns: cutlass.Constexpr[bool] = False):
    """Write this warpgroup's normalised O rows (bf16) to ``output`` through ``s_o`` (tile_m x d, swizzled).

    Packed row ``r`` is token ``token0 + r // group``, head ``h * group + r % group``. The warpgroup's part of the
    tile: rows ``64 wg ..`` (both warpgroups' C layout stacks rows), or with ``split_columns`` columns
    ``d / 2 * wg ..`` of the 64 rows (the C layout splits columns).
    """
    dtype = output.element_type
    o_bf = cute.make_rmem_tensor(acc_o.layout, dtype)
    o_bf.store(acc_o.load().to(dtype))
    atom = smem_store_atom(dtype)
    thr_s = cute.make_tiled_copy_C(atom, tiled_mma_pv).get_slice(ctid)
    cute.copy(atom, thr_s.retile(o_bf), thr_s.partition_D(s_o))
    warpgroup_barrier_sync(EPILOGUE_BARRIER, wg, 128)

    width = head_dim // 2 if cutlass.const_expr(split_columns) else head_dim
    g_copy = row_copy(dtype, width)
    thr_g = g_copy.get_slice(ctid % 128)
    part = (0, wg) if cutlass.const_expr(split_columns) else (wg, 0)
    t_s = thr_g.partition_S(cute.local_tile(s_o, (64, width), part))
    t_c = thr_g.partition_S(cute.make_identity_tensor((64, width)))
    row0 = 0 if cutlass.const_expr(split_columns) else wg * 64
    col0 = wg * width if cutlass.const_expr(split_columns) else 0
    t_r = cute.make_rmem_tensor_like(t_s)
    cute.autovec_copy(t_s, t_r)
    num_heads = output.shape[1]
    row_stride = num_heads * head_dim
    for m in cutlass.range_constexpr(cute.size(t_r, mode=[1])):
        row = row0 + t_c[0, m, 0][0]
        if row < row_count:
            token = token0 + row // group
            head = h * group + row % group
            for k in cutlass.range_constexpr(cute.size(t_r, mode=[2])):
                col = col0 + t_c[0, m, k][1]
                offset = cutlass.Int64(token) * row_stride + head * head_dim + col
                ptr = cute.make_ptr(dtype, (output.iterator + offset).toint(), cute.AddressSpace.gmem,
                                    assumed_align=16)
                cute.copy(thr_g, t_r[None, m, k], cute.make_tensor(ptr, cute.make_layout(_VEC)))


@cute.jit
def store_output_rows(acc_o: cute.Tensor, c_o: cute.Tensor, row_lse: cute.Tensor, q_start: Int32, kv_head,
                      r0: Int32, row_count: Int32, output: cute.Tensor, lse: cute.Tensor, lse_out_scale: Float32,
                      group: cutlass.Constexpr[int], write_output: cutlass.Constexpr[bool] = True):
    """A final item: bf16 ``output`` and ``lse * lse_out_scale`` of rows ``< row_count``, from the registers.

    ``c_o``: the accumulator's (row, column) coordinates. Packed row ``r0 + row`` is token
    ``q_start + (r0 + row) // group``, head ``kv_head * group + (r0 + row) % group``.
    ``write_output=False`` stores only the lse (the smem epilogue wrote O).
    """
    o_mn = acc_mn_view(acc_o)
    c_mn = acc_mn_view(c_o)
    o_bf = cute.make_rmem_tensor(acc_o.layout, output.element_type)
    if cutlass.const_expr(write_output):
        o_bf.store(acc_o.load().to(output.element_type))
    ob_mn = acc_mn_view(o_bf)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        row = c_mn[r, 0][0]
        if row < row_count:
            token = q_start + (r0 + row) // group
            head = kv_head * group + (r0 + row) % group
            if cutlass.const_expr(write_output):
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    output[token, head, c_mn[r, c][1]] = ob_mn[r, c]
            if c_mn[r, 0][1] == 0:  # one thread of the row's quad
                lse[token, head] = row_lse[r] * lse_out_scale


@cute.jit
def store_item_rows(acc_o: cute.Tensor, c_o: cute.Tensor, row_lse: cute.Tensor, slot: Int32, qo_indptr: cute.Tensor,
                    b: Int32, kv_head, r0: Int32, row_count: Int32, output: cute.Tensor, lse: cute.Tensor,
                    lse_out_scale: Float32, partial_out: cute.Tensor, partial_lse: cute.Tensor,
                    group: cutlass.Constexpr[int], write_output: cutlass.Constexpr[bool] = True, q_start=None):
    """An item's rows, whichever kind it is: :func:`store_output_rows` when it is final (``slot < 0``; request ``b``'s
    first token ``qo_indptr[b]`` read only then, unless the caller read it already: ``q_start``), else
    :func:`store_partial_rows` into ``slot``."""
    if slot < 0:
        first_token = qo_indptr[b] if cutlass.const_expr(q_start is None) else q_start
        store_output_rows(acc_o, c_o, row_lse, first_token, kv_head, r0, row_count, output, lse, lse_out_scale,
                          group, write_output=write_output)
    else:
        store_partial_rows(acc_o, c_o, row_lse, row_count, slot, partial_out, partial_lse)


@cute.jit
def store_partial_rows(acc_o: cute.Tensor, c_o: cute.Tensor, row_lse: cute.Tensor, row_count: Int32, slot: Int32,
                       partial_out: cute.Tensor, partial_lse: cute.Tensor):
    """A split item: ``partial_out[slot]`` (fp32, or bf16 with ``bf16_partials``) and base-2 fp32
    ``partial_lse[slot]`` of rows ``< row_count``."""
    o_mn = acc_mn_view(acc_o)
    c_mn = acc_mn_view(c_o)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        row = c_mn[r, 0][0]
        if row < row_count:
            for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                partial_out[slot, row, c_mn[r, c][1]] = o_mn[r, c].to(partial_out.element_type)
            if c_mn[r, 0][1] == 0:
                partial_lse[slot, row] = row_lse[r]

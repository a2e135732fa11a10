"""Shared-memory epilogue of the sm_90a GQA prefill (``PagedAttentionConfig.smem_epilogue``).

The direct epilogue stores each consumer thread's wgmma accumulator straight to global memory: a
thread owns column pairs, so a row of 256 bytes is written by 32 ``st.global.b32`` of 4 threads.
This one goes through shared memory instead:

1. each consumer warpgroup converts its 64 x d O rows to bf16 and writes them with ``stmatrix`` into
   its own 64 rows of the item's Q stage (that warpgroup's last QK GEMM has completed, and the other
   warpgroup's GEMMs read only its own 64 Q rows, so no other reader is left);
2. a named barrier over the warpgroup (128 threads);
3. each thread reads 16 bytes (8 bf16 of one packed row) with a vector shared load and writes them
   with one 16-byte global store: 16 threads cover a 256-byte row, a warp writes two whole rows.
   Rows ``>= Q_ROW_COUNT`` are skipped (they belong to the next request).

The caller releases the Q stage only after this (``fence.proxy.async`` first: the next TMA load
into the stage is an async-proxy write after these generic-proxy accesses).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

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
                          group: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int]):
    """Write this warpgroup's normalised O rows (bf16) to ``output`` through ``s_o`` (tile_m x d, swizzled).

    Packed row ``r`` is token ``token0 + r // group``, head ``h * group + r % group``.
    """
    dtype = output.element_type
    o_bf = cute.make_rmem_tensor(acc_o.layout, dtype)
    o_bf.store(acc_o.load().to(dtype))
    atom = smem_store_atom(dtype)
    thr_s = cute.make_tiled_copy_C(atom, tiled_mma_pv).get_slice(ctid)
    cute.copy(atom, thr_s.retile(o_bf), thr_s.partition_D(s_o))
    cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg, number_of_threads=128)

    g_copy = row_copy(dtype, head_dim)
    thr_g = g_copy.get_slice(ctid % 128)
    t_s = thr_g.partition_S(cute.local_tile(s_o, (64, head_dim), (wg, 0)))
    t_c = thr_g.partition_S(cute.make_identity_tensor((64, head_dim)))
    t_r = cute.make_rmem_tensor_like(t_s)
    cute.autovec_copy(t_s, t_r)
    num_heads = output.shape[1]
    row_stride = num_heads * head_dim
    for m in cutlass.range_constexpr(cute.size(t_r, mode=[1])):
        row = wg * 64 + t_c[0, m, 0][0]
        if row < row_count:
            token = token0 + row // group
            head = h * group + row % group
            for k in cutlass.range_constexpr(cute.size(t_r, mode=[2])):
                col = t_c[0, m, k][1]
                offset = cutlass.Int64(token) * row_stride + head * head_dim + col
                ptr = cute.make_ptr(dtype, (output.iterator + offset).toint(), cute.AddressSpace.gmem,
                                    assumed_align=16)
                cute.copy(thr_g, t_r[None, m, k], cute.make_tensor(ptr, cute.make_layout(_VEC)))

"""Warpgroup MMA (wgmma) issue helper shared by the sm_90a kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def wgmma_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, t_a: cute.Tensor, t_b: cute.Tensor,
               zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[bool] = True,
               k_blocks: cutlass.Constexpr = None):
    """acc (+)= A @ B over the k blocks of one warpgroup MMA, as one commit group.

    ``wait=False`` leaves the group in flight, so the caller can issue another GEMM or run the softmax
    before its own ``warpgroup.wait_group``. ``k_blocks``: ``(first, end)`` of the k blocks to sum (all by
    default), for a product split over K between warpgroups.
    """
    warpgroup.fence()
    # a local atom: its ACCUMULATE field never leaks into the next GEMM issued with the same tiled_mma
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    first, end = 0, cute.size(t_a.shape[2])
    if cutlass.const_expr(k_blocks is not None):
        first, end = k_blocks
    for k in cutlass.range_constexpr(first, end):
        cute.gemm(atom, acc, t_a[None, None, k], t_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait):
        warpgroup.wait_group(0)

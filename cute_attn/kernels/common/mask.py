"""Causal and sequence-end masks on Hopper wgmma score fragments (device helpers).

Packed GQA rows (docs/kernel-contract.md): packed row ``r`` of a work item is query token
``r // group``. Key ``j`` is visible to token ``t`` iff ``j < kv_end`` and ``j <= t + causal_offset``
(``causal_offset`` is huge when the kernel is not causal). Masked scores become ``-inf``.

``coords`` is the identity tensor of the score tile partitioned like the accumulator
(``thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n)))``): element ``i`` holds the
``(row, col)`` of ``acc[i]`` inside the tile.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .softmax import acc_mn_view


@cute.jit
def tile_needs_mask(kv_base: Int32, tile_n: cutlass.Constexpr[int], kv_end: Int32, first_token: Int32,
                    causal_offset: Int32) -> cutlass.Boolean:
    """True when some key of ``[kv_base, kv_base + tile_n)`` is hidden from some row of the item.

    ``first_token`` is the smallest query token of the item (every other row sees at least as much).
    """
    limit = cutlass.min(kv_end, first_token + causal_offset + 1)
    return kv_base + tile_n > limit


@cute.jit
def apply_causal_seqend_mask(acc_s: cute.Tensor, coords: cute.Tensor, row_start: Int32,
                             group: cutlass.Constexpr[int], kv_base: Int32, kv_end: Int32,
                             causal_offset: Int32):
    """Set ``acc_s[i] = -inf`` where key ``kv_base + col`` is not visible to token ``(row_start + row) // group``."""
    acc_mn = acc_mn_view(acc_s)
    crd_mn = acc_mn_view(coords)
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        token = (row_start + crd_mn[r, 0][0]) // group
        limit = cutlass.min(kv_end, token + causal_offset + 1) - kv_base
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            if crd_mn[r, c][1] >= limit:
                acc_mn[r, c] = -Float32.inf


@cute.jit
def apply_seqend_mask(acc_s: cute.Tensor, coords: cute.Tensor, kv_base: Int32, kv_end: Int32):
    """Set ``acc_s[i] = -inf`` for keys ``>= kv_end`` (non-causal kernels, e.g. decode)."""
    acc_mn = acc_mn_view(acc_s)
    crd_mn = acc_mn_view(coords)
    limit = kv_end - kv_base
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            if crd_mn[r, c][1] >= limit:
                acc_mn[r, c] = -Float32.inf

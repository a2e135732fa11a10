"""TMA page boxes issued by one lane, without the DSL's per-copy election (device helpers, sm_90a / sm_100a).

``cute.copy`` with a TMA atom wraps every copy in its own ``elect.sync`` and branch: a stage of 256 one-row page
boxes (decode, page 1) is then 256 warp-wide elect-and-reconverge sequences, ~30 cycles each in one warp, which
is what page 1 costs on the H200 (docs/perf-notes.md, session 7). Here one elected lane issues all of a stage's
boxes back to back as raw ``cp.async.bulk.tensor`` on the atom's own descriptor (``get_tma_desc_addr``).
"""

from __future__ import annotations

import cutlass
import cutlass._mlir.dialects.cute as _cute_ir
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.typing import AddressSpace, _to_mlir_address_space
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def tma_descriptor_address(atom: cute.CopyAtom, *, loc=None, ip=None) -> Int64:
    """The generic address of ``atom``'s tensor map (a kernel parameter), for raw TMA issue."""
    ptr_ty = _cute_ir.PtrType.get(T.i8(), _to_mlir_address_space(AddressSpace.generic), 64, None)
    executable = _cute_nvgpu_ir.atom_make_exec_tma(atom._trait.value, loc=loc, ip=ip)
    ptr = _cute_nvgpu_ir.get_tma_desc_addr(ptr_ty, executable, loc=loc, ip=ip)
    return ptr.toint(loc=loc, ip=ip)  # the dialect hands back a cute Pointer (generic: 64-bit)


@cute.jit
def tma_load_3d(dst_smem: Int32, descriptor: Int64, c0: Int32, c1: Int32, c2: Int32, mbar_smem: Int32):
    """One 3-D tile box into shared memory, completing ``mbar_smem``'s transaction bytes (one thread calls it)."""
    cute.arch.inline_ptx(
        "cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes "
        "[{$r0}], [{$r1}, {{$r2}, {$r3}, {$r4}}], [{$r5}];",
        read_only_args=[dst_smem, descriptor, c0, c1, c2, mbar_smem],
    )


@cute.jit
def issue_row_boxes(descriptor: Int64, stage_addr: Int32, pages: cute.Tensor, head: Int32, mbar: Int32,
                    rows: cutlass.Constexpr[int], col_blocks: cutlass.Constexpr[int],
                    block_bytes: cutlass.Constexpr[int]):
    """Page 1: a stage's ``rows`` one-row boxes (``col_blocks`` 64-column blocks each, ``block_bytes`` apart; row
    ``i`` at ``i * 128`` bytes of its block, where the 128B-swizzled layout starts it) for KV head ``head``, row
    ``i`` from page ``pages[i]`` (registers of every lane), issued back to back by one elected lane."""
    with cute.arch.elect_one():
        for i in cutlass.range_constexpr(rows):
            for h in cutlass.range_constexpr(col_blocks):
                tma_load_3d(stage_addr + (h * block_bytes + i * 128), descriptor, Int32(h * 64), head, pages[i], mbar)

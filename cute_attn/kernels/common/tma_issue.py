"""TMA page boxes issued by one lane, without the DSL's per-copy election (device helpers, sm_90a / sm_100a).

``cute.copy`` with a TMA atom wraps every copy in its own ``elect.sync`` and branch: a stage of 256 one-row page
boxes (decode, page 1) is then 256 warp-wide elect-and-reconverge sequences, ~30 cycles each in one warp, which
is what page 1 costs on the H200 (docs/perf-history.md, session 7). Here one elected lane issues all of a stage's
boxes back to back as raw ``cp.async.bulk.tensor`` on the atom's own descriptor (``get_tma_desc_addr``).
On sm_100a also ``tile::gather4`` (:func:`tma_gather4`): four rows by index per instruction, for row pools the DSL's
gather4 atoms do not describe (the MLA latent rows).
"""

from __future__ import annotations

import cutlass
import cutlass._mlir.dialects.cute as _cute_ir
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass import Int32, Int64
from cutlass.cute.typing import AddressSpace, _to_mlir_address_space
from cutlass.cutlass_dsl import T, dsl_user_op

from .page_ids import lane_page_id

#: small-page producers issue a stage's boxes from one elected lane; False restores the DSL's per-box ``cute.copy``
#: (the H200 A/B, session 8: decode page 1 245 -> 172 us, prefill page 1 655 -> 484 us with one election)
ONE_ELECTION = True


@dsl_user_op
def tma_descriptor_address(atom: cute.CopyAtom, *, loc=None, ip=None) -> Int64:
    """The generic address of ``atom``'s tensor map (a kernel parameter), for raw TMA issue."""
    ptr_ty = _cute_ir.PtrType.get(T.i8(), _to_mlir_address_space(AddressSpace.generic), 64, None)
    executable = _cute_nvgpu_ir.atom_make_exec_tma(atom._trait.value, loc=loc, ip=ip)
    ptr = _cute_nvgpu_ir.get_tma_desc_addr(ptr_ty, executable, loc=loc, ip=ip)
    return ptr.toint(loc=loc, ip=ip)  # the dialect hands back a cute Pointer (generic: 64-bit)


def _tma_load_ptx(rank: int) -> str:
    coords = ", ".join(f"{{$r{2 + d}}}" for d in range(rank))
    return (f"cp.async.bulk.tensor.{rank}d.shared::cta.global.tile.mbarrier::complete_tx::bytes "
            f"[{{$r0}}], [{{$r1}}, {{{coords}}}], [{{$r{2 + rank}}}];")


def tma_load(dst_smem: Int32, descriptor: Int64, coords: list, mbar_smem: Int32):
    """One tile box into shared memory at ``coords`` (innermost first, as many as the descriptor has dims),
    completing ``mbar_smem``'s transaction bytes (one thread calls it; traced inline, the rank fixed by ``coords``)."""
    cute.arch.inline_ptx(_tma_load_ptx(len(coords)), read_only_args=[dst_smem, descriptor, *coords, mbar_smem])


#: page sizes whose sm_100a pages go by ``tile::gather4`` (four one-key pages an instruction; :func:`issue_page_gather4`):
#: only one-key pages put consecutive gathered rows on consecutive stage rows
GATHER4_PAGE_SIZES = (1,)
GATHER4_IDS = 16  # page ids shuffled out per election of the gather4 issue

#: ``tile::gather4`` (sm_100a): four rows of a 2-D tensor map, picked by row index, one box of columns each, land
#: as four consecutive 128-byte rows of the destination (the map's box is one row of ``box_cols`` columns)
_GATHER4_PTX = ("cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4.mbarrier::complete_tx::bytes "
                "[{$r0}], [{$r1}, {{$r2}, {$r3}, {$r4}, {$r5}, {$r6}}], [{$r7}];")


def tma_gather4(dst_smem: Int32, descriptor: Int64, col: Int32, rows: list, mbar_smem: Int32):
    """Rows ``rows[0..3]`` (columns ``col ..`` of the map's box) into ``dst_smem`` .. + 4 box rows, completing
    ``mbar_smem``'s transaction bytes (one thread; a row outside the map, e.g. -1, is zero-filled and counted)."""
    cute.arch.inline_ptx(_GATHER4_PTX, read_only_args=[dst_smem, descriptor, col, *rows, mbar_smem])


@cute.jit
def issue_page_boxes(descriptor: Int64, stage_addr: Int32, pages: cute.Tensor, head: Int32, mbar: Int32,
                     num_pages: cutlass.Constexpr[int], page_rows: cutlass.Constexpr[int],
                     col_blocks: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int],
                     num_kv_heads: cutlass.Constexpr[int]):
    """A stage's ``num_pages`` page boxes of ``page_rows`` rows (``col_blocks`` 64-column blocks each,
    ``block_bytes`` apart; page ``i`` at row ``i * page_rows``, 128 bytes a row, where the 128B-swizzled layout
    starts it) for KV head ``head``, page ``i`` from ``pages[i]`` (registers of every lane), issued back to back
    by one elected lane. The coordinates follow the dims of the DSL's tensor map for the page view: (column, row,
    head, page), less the static modes of size 1 (the row at page 1, the head with one KV head), which the DSL
    leaves out of the map."""
    with cute.arch.elect_one():
        for i in cutlass.range_constexpr(num_pages):
            for h in cutlass.range_constexpr(col_blocks):
                dst = stage_addr + (h * block_bytes + i * page_rows * 128)
                coords = [Int32(h * 64)]
                if cutlass.const_expr(page_rows > 1):
                    coords.append(Int32(0))
                if cutlass.const_expr(num_kv_heads > 1):
                    coords.append(head)
                coords.append(pages[i])
                tma_load(dst, descriptor, coords, mbar)


def make_row_box_atom(op, rows: cute.Tensor, stage_rows_layout, box_rows: int = 1):
    """``(atom, tma tensor)`` of 2-D ``rows`` for raw issue: a box of ``box_rows`` rows x 64 columns where the stage's
    ``(rows, columns[, stage])`` 128B-swizzled layout puts it (rows 128 bytes apart in each 64-column block). Only
    the atom's descriptor is used (:func:`tma_load`, :func:`tma_gather4`)."""
    tile_rows = cute.size(stage_rows_layout, mode=[0])
    box = cute.composition(cute.select(stage_rows_layout, mode=[0, 1]),
                           cute.make_layout((box_rows, 64), stride=(1, tile_rows)))
    return cpasync.make_tiled_tma_atom(op, rows, box, (box_rows, 64))


def make_gather4_atom(op, rows: cute.Tensor, stage_rows_layout):
    """The gather4 map (:func:`tma_gather4`): a box of one row x 64 columns (:func:`make_row_box_atom`)."""
    return make_row_box_atom(op, rows, stage_rows_layout, 1)


def pages_as_rows(cache: cute.Tensor) -> cute.Tensor:
    """A ``[num_pages, page_size, Hkv, D]`` cache with compact pages (any page stride) as 2-D rows of pages,
    ``[num_pages, page_size * Hkv * D]``: the tensor map :func:`issue_page_gather4` gathers from."""
    width = cache.shape[1] * cache.shape[2] * cache.shape[3]
    return cute.make_tensor(cache.iterator, cute.make_layout((cache.shape[0], width), stride=(cache.stride[0], 1)))


@cute.jit
def issue_page_gather4(descriptor: Int64, stage_addr: Int32, lane_pages: cute.Tensor, lane_offset, head: Int32,
                       mbar: Int32, num_pages: cutlass.Constexpr[int], col_blocks: cutlass.Constexpr[int],
                       block_bytes: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int]):
    """Page 1 on sm_100a: a stage's ``num_pages`` one-key pages as ``tile::gather4`` boxes, four pages an
    instruction. ``descriptor``: the cache as rows of pages (:func:`pages_as_rows`), a box of one row x 64
    columns; KV head ``head``'s block ``c`` is column ``head * head_dim + 64 c``. Page ``i`` is
    ``lane_page_id(lane_pages, i, lane_offset)`` (``common/page_ids.py``) and lands at stage row ``i`` (128 bytes a
    row, 64-column blocks ``block_bytes`` apart: where the 128B-swizzled layout puts key ``i``); an id of -1 (or any
    id outside the map) is zero-filled and counted. The ids are shuffled out 16 at a time by the whole warp
    (shuffles cannot sit under an election), then one elected lane issues their 4 x ``col_blocks`` boxes: 16
    registers of ids live, not ``num_pages`` (128 spilled at a load warp's 64 registers)."""
    for chunk in cutlass.range_constexpr(num_pages // GATHER4_IDS):
        ids = []
        for j in cutlass.range_constexpr(GATHER4_IDS):
            ids.append(lane_page_id(lane_pages, chunk * GATHER4_IDS + j, lane_offset))
        with cute.arch.elect_one():
            for q in cutlass.range_constexpr(GATHER4_IDS // 4):
                row = chunk * GATHER4_IDS + 4 * q
                for c in cutlass.range_constexpr(col_blocks):
                    tma_gather4(stage_addr + (c * block_bytes + row * 128), descriptor, head * head_dim + c * 64,
                                ids[4 * q:4 * q + 4], mbar)

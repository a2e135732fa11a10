"""The sm_90a GQA decode kernel's producer role (``kernels/sm90/gqa_decode.py``): K/V stages into the ring.

* pages of 16..128 keys (``produce``): one page a stage, its K and V as two TMA boxes, page ids 32 a load;
* pages of 4 or 8 keys, and 16 in 64-key stages (``produce_pages``): a stage of ``kv_tile / page_size`` page boxes
  issued by one elected lane (``common/tma_issue.py``), ids one per lane;
* pages of 1 or 2 keys (``produce_rows``): 16-byte ``cp.async`` rows completing on the stage's full mbarrier
  (``PipelineCpAsync``, one ``noinc`` arrival a producer thread), by the producer warp, or with ``gather_warps`` 4 by
  a producer warpgroup, a quarter of every stage's rows a warp.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from ...plan import ItemField as F
from ..common.page_ids import IDS_PER_LOAD, id_loads, lane_page_id, load_lane_page_ids, rotate_lane_page_ids
from ..common.row_gather import ROW_CHUNK, gather_one_row_pages
from ..common.tma_issue import ONE_ELECTION, issue_page_boxes, tma_descriptor_address
from ..common.line_schedule import line_item
from ..common.work_items import load_item

ITEM_FIELDS = tuple(F)  # an item's row in registers is indexed by ItemField (unused fields are dead loads)
PAGE_IDS_PER_LOAD = 32  # produce: one page id per lane of the producer warp


class DecodeProducer:
    """The producer role of ``GqaDecodeSm90`` (a mixin: the kernel object holds the compile-time constants)."""

    @cute.jit
    def fetch_item(self, items, it, item_begin, guess, row):
        """Item ``it`` into ``row``: the plan's row (``work_items.load_item``), or in a ``line_schedule`` build
        (``items`` is the CTA's ``LineStretch``) derived from the stretch and its request's indptr words."""
        if cutlass.const_expr(self.line_schedule):
            line_item(items, it, row)
        else:
            load_item(items, it, item_begin, guess, ITEM_FIELDS, row)

    @cute.jit
    def produce(self, tma_atom_k, tma_k, tma_atom_v, tma_v, sK, sV, kv_indices, items, item_begin, item_end,
                guess, row, pipe):
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(tma_k, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(tma_v, 0, 2)
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        lane = cute.arch.lane_idx()
        for it in cutlass.range(item_begin, item_end, unroll=1):
            self.fetch_item(items, it, item_begin, guess, row)
            head = row[F.KV_HEAD]
            n_tiles = (cutlass.max(row[F.KV_END] - row[F.KV_START], 0) + self.tile_n - 1) // self.tile_n
            first_page = row[F.KV_PAGE_START]
            # Page ids 32 at a time: lane l loads the id of tile t0 + l (one coalesced load), and each
            # tile's id is shuffled out of its lane. Loading the id inside the per-tile loop put one
            # dependent global round trip in front of every TMA issue.
            for t0 in cutlass.range(0, n_tiles, PAGE_IDS_PER_LOAD, unroll=1):
                lane_page = Int32(0)
                if t0 + lane < n_tiles:
                    lane_page = kv_indices[first_page + t0 + lane]
                for j in cutlass.range(cutlass.min(PAGE_IDS_PER_LOAD, n_tiles - t0), unroll=1):
                    page = cute.arch.shuffle_sync(lane_page, j)
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    cute.copy(tma_atom_k, tKgK[None, head, page], tKsK[None, state.index], tma_bar_ptr=bar)
                    cute.copy(tma_atom_v, tVgV[None, head, page], tVsV[None, state.index], tma_bar_ptr=bar)
                    pipe.producer_commit(state)
                    state.advance()

    @cute.jit
    def produce_pages(self, tma_atom_k, tma_k, tma_atom_v, tma_v, sK, sV, kv_indices, items, item_begin, item_end,
                      guess, row, pipe):
        """Pages of fewer than 16 keys: each stage (``tile_n`` keys) is ``pages_per_stage`` page boxes of K and V.

        Page ids one per lane (``common/page_ids.py``): one coalesced load covers ``32 / pages_per_stage`` whole
        stages (page 8: 4), or a stage takes ``pages_per_stage / 32`` loads (page 1: 2); each box's id is shuffled
        out to the issuing lane. Pages wholly past KV_END get id -1 (TMA zero-fills the box and counts its bytes),
        so the stage's full mbarrier always expects ``2 * tile_bytes``.
        """
        P, npg = self.page_size, self.pages_per_stage
        stages_per_round = max(1, IDS_PER_LOAD // npg)
        # smem pages: (box, page in stage, 1, stage)
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(cute.flat_divide(sK, (P, self.head_dim)), 0, 2),
            cute.group_modes(tma_k, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1), cute.group_modes(cute.flat_divide(sV, (P, self.head_dim)), 0, 2),
            cute.group_modes(tma_v, 0, 2)
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        lane = cute.arch.lane_idx()
        lane_pages = cute.make_rmem_tensor((id_loads(npg),), Int32)
        next_pages = cute.make_rmem_tensor((id_loads(npg),), Int32)
        pages = cute.make_rmem_tensor((npg,), Int32)
        desc_k = tma_descriptor_address(tma_atom_k)
        desc_v = tma_descriptor_address(tma_atom_v)
        for it in cutlass.range(item_begin, item_end, unroll=1):
            self.fetch_item(items, it, item_begin, guess, row)
            head = row[F.KV_HEAD]
            n_keys = cutlass.max(row[F.KV_END] - row[F.KV_START], 0)
            n_tiles = (n_keys + self.tile_n - 1) // self.tile_n
            n_pages = (n_keys + P - 1) // P  # pages holding keys of the item (the last may be partial)
            first_page = row[F.KV_PAGE_START]
            load_lane_page_ids(kv_indices, next_pages, first_page, n_pages, lane)
            for t0 in cutlass.range(0, n_tiles, stages_per_round, unroll=1):
                t1 = t0 + stages_per_round
                rotate_lane_page_ids(kv_indices, lane_pages, next_pages, first_page + t1 * npg, n_pages - t1 * npg, lane)
                for j in cutlass.range(cutlass.min(stages_per_round, n_tiles - t0), unroll=1):
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    if cutlass.const_expr(ONE_ELECTION):
                        self.issue_pages(desc_k, desc_v, sK, sV, lane_pages, pages, j * npg, head, bar, state.index)
                    else:
                        for i in cutlass.range_constexpr(npg):
                            page = lane_page_id(lane_pages, i, j * npg)
                            cute.copy(tma_atom_k, tKgK[None, head, page], tKsK[None, i, 0, state.index], tma_bar_ptr=bar)
                            cute.copy(tma_atom_v, tVgV[None, head, page], tVsV[None, i, 0, state.index], tma_bar_ptr=bar)
                    pipe.producer_commit(state)
                    state.advance()

    @cute.jit
    def produce_rows(self, k_rows, v_rows, sK, sV, kv_indices, items, item_begin, item_end, guess, row, pipe,
                     warp: Int32):
        """Pages of 1 or 2 keys: each stage's ``tile_n`` K and V rows as 16-byte ``cp.async`` copies
        (``common/row_gather.gather_one_row_pages``), page ids one per lane loaded a round ahead; the consumers
        fence the rows into the async proxy before their wgmmas read them. ``gather_warps`` warps share a stage:
        warp ``warp`` of them copies rows ``warp * tile_n / gather_warps ..`` of it with its own slice's ids (one warp:
        the whole stage; four: a quarter each, as the prefill kernel's producer warpgroup)."""
        N, P = self.tile_n, self.page_size
        npg = N // P
        rows = N // self.gather_warps  # a warp's slice of every stage
        slice_pages = rows // P
        sK_chunks = cute.flat_divide(sK, (1, ROW_CHUNK))  # (1, vec, row, chunk, stage)
        sV_chunks = cute.flat_divide(sV, (1, ROW_CHUNK))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        lane = cute.arch.lane_idx()
        lane_pages = cute.make_rmem_tensor((id_loads(slice_pages),), Int32)
        next_pages = cute.make_rmem_tensor((id_loads(slice_pages),), Int32)
        slice_row0 = None  # one warp: the stage from row 0
        if cutlass.const_expr(self.gather_warps > 1):
            slice_row0 = warp * rows
        for it in cutlass.range(item_begin, item_end, unroll=1):
            self.fetch_item(items, it, item_begin, guess, row)
            n_keys = cutlass.max(row[F.KV_END] - row[F.KV_START], 0)
            n_pages = (n_keys + P - 1) // P
            first_page = row[F.KV_PAGE_START]
            if cutlass.const_expr(self.gather_warps > 1):  # this warp's slice: its pages of every stage
                first_page = first_page + warp * slice_pages
                n_pages = n_pages - warp * slice_pages
            load_lane_page_ids(kv_indices, next_pages, first_page, self.slice_count(n_pages, slice_pages), lane)
            for t in cutlass.range((n_keys + N - 1) // N, unroll=1):
                t1 = t + 1
                rotate_lane_page_ids(kv_indices, lane_pages, next_pages, first_page + t1 * npg,
                                     self.slice_count(n_pages - t1 * npg, slice_pages), lane)
                pipe.producer_acquire(state)
                gather_one_row_pages(k_rows, sK_chunks[None, None, None, None, state.index], lane_pages,
                                     row[F.KV_HEAD], lane, rows, self.head_dim, v_rows,
                                     sV_chunks[None, None, None, None, state.index], P, tile_row0=slice_row0,
                                     segments=self.row_segments)
                pipe.producer_commit(state)
                state.advance()

    def slice_count(self, pages_left, slice_pages: int):
        """Ids a warp loads for one stage: the pages left, capped at its slice when several warps share a stage (one
        warp: a stage's ids, unchanged)."""
        if cutlass.const_expr(self.gather_warps > 1):
            return cutlass.min(pages_left, slice_pages)
        return pages_left

    @cute.jit
    def issue_pages(self, desc_k, desc_v, sK, sV, lane_pages, pages, first, head, bar, stage):
        """Every lane shuffles out the stage's page ids, then one elected lane issues all its page boxes back to
        back (``common/tma_issue.py``: no election per box), where the DSL's partition puts them: page ``i`` at row
        ``i * page_size``, 64-column blocks ``tile_n * 128`` bytes apart, stages ``tile_n * D * 2`` bytes apart."""
        N, D = self.tile_n, self.head_dim
        for i in cutlass.range_constexpr(self.pages_per_stage):
            pages[i] = lane_page_id(lane_pages, i, first)
        mbar = bar.toint()
        for s_tile, desc in ((sK, desc_k), (sV, desc_v)):
            issue_page_boxes(desc, s_tile.iterator.toint() + stage * (N * D * 2), pages, head, mbar,
                             self.pages_per_stage, self.page_size, D // 64, N * 128, self.num_kv_heads)

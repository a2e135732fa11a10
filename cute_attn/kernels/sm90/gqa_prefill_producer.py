"""The sm_90a GQA prefill kernel's producer warpgroup (WG0 in ``gqa_prefill.py``'s docstring), as a mixin.

Two ways to get work, one way to load it:

* a plan: CTA ``c`` runs items ``work_indptr[c] .. work_indptr[c+1]-1`` (``items`` rows);
* ``dynamic_schedule``: warp 0 takes units from the counter (``common/unit_schedule.py``), decodes each from the
  indptrs and hands it to the consumers in its Q stage's slot; with row gathers, warps 1-3 get it from warp 0 through
  ``row_slots`` and a named barrier over the four warps (they must not wait for the Q tile to land: they gather
  their quarter of the unit's first key tile beside warp 0).

Either way a unit's loads are :meth:`load_item_tiles` (TMA page boxes, warp 0) or :meth:`gather_item_tiles` (16-byte
cp.async rows, each warp a quarter of every tile).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass import pipeline as cpipe
from cutlass.cute.nvgpu import cpasync

from ...plan import ItemField as F
from ..common.packed_q import q_box_rows
from ..common.page_ids import (LANE_IDS_BELOW, id_loads, lane_page_id, load_lane_page_ids, load_tile_page_ids,
                               rotate_lane_page_ids)
from ..common.row_gather import ROW_CHUNK, gather_one_row_pages
from ..common.tma_issue import ONE_ELECTION, issue_page_boxes, tma_descriptor_address
from ..common.unit_schedule import (UnitSource, check_lane_ids, check_tile_ids, end_of_work, find_unit,
                                    publish_unit, take_unit, unit_fields)

_ROW_SLOT_BARRIER = 7  # dynamic_schedule row gathers: warp 0 hands each unit to warps 1-3 (the four producer warps)


class GqaPrefillProducer:
    """Producer roles; the kernel class sets the compile-time constants they read (``group``, ``page_size``, ...)."""

    @cute.jit
    def find_unit(self, u, qo_indptr, source: UnitSource, base, before, lane):
        """``(request, local, base, before)`` of unit ``u`` (``unit_schedule.find_unit``)."""
        return find_unit(u, qo_indptr, source, base, before, lane, self.group, self.q_rows, self.num_kv_heads)

    @cute.jit
    def fields_of(self, request, local, qo_indptr, kv_indptr, source: UnitSource):
        return unit_fields(request, local, qo_indptr, kv_indptr, source.kv_last_page_len, self.group, self.q_rows,
                           self.num_kv_heads, self.page_size, self.tile_n)

    @cute.jit
    def produce(self, tma_atom_q: cute.CopyAtom, tma_q: cute.Tensor, tma_atom_k: cute.CopyAtom, tma_k: cute.Tensor,
                tma_atom_v: cute.CopyAtom, tma_v: cute.Tensor, s_q: cute.Tensor, s_k: cute.Tensor,
                s_v: cute.Tensor, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor,
                items: cute.Tensor, item_begin: Int32, item_end: Int32, pipe_q, pipe_k, pipe_v,
                source: UnitSource = None):
        """Warp 0 with TMA page boxes: per item its Q box, then per key tile the K and V page boxes."""
        G, P = self.group, self.page_size
        # smem pages: (page box, page in tile, 1, stage)
        t_ks, t_kg = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(s_k, (P, self.head_dim)), 0, 2), cute.group_modes(tma_k, 0, 2))
        t_vs, t_vg = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1),
            cute.group_modes(cute.flat_divide(s_v, (P, self.head_dim)), 0, 2), cute.group_modes(tma_v, 0, 2))
        boxes = (t_ks, t_kg, t_vs, t_vg, tma_atom_k, tma_atom_v, s_k, s_v, tma_descriptor_address(tma_atom_k),
                 tma_descriptor_address(tma_atom_v))
        q_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, self.q_stages)
        kv_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, self.num_stages)
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                b = items[it, int(F.REQUEST)]
                h = items[it, int(F.KV_HEAD)]
                r0 = items[it, int(F.Q_ROW_START)]
                kv_start = items[it, int(F.KV_START)]
                kv_end = items[it, int(F.KV_END)]
                self.issue_q(tma_atom_q, tma_q, s_q, qo_indptr[b] + r0 // G, h, pipe_q, q_state)
                q_state.advance()
                kv_state = self.load_item_tiles(boxes, kv_indptr, kv_indices, b, h, kv_start, kv_end, lane, pipe_k,
                                                pipe_v, kv_state, None)
        else:
            request, local, base, before = self.find_unit(take_unit(source.unit_state, lane), qo_indptr, source,
                                                          Int32(0), Int32(0), lane)
            while request < source.batch:
                h, r0, rows, kv_end, offset, kv_len = self.fields_of(request, local, qo_indptr, kv_indptr, source)
                self.issue_q(tma_atom_q, tma_q, s_q, qo_indptr[request] + r0 // G, h, pipe_q, q_state,
                             (source.slots, request, rows, kv_end, offset, kv_len, r0))
                q_state.advance()
                u = Int32(0)
                if cutlass.const_expr(not self.late_claim):
                    u = take_unit(source.unit_state, lane)  # in flight under this unit's loads
                kv_state = self.load_item_tiles(boxes, kv_indptr, kv_indices, request, h, Int32(0), kv_end, lane,
                                                pipe_k, pipe_v, kv_state, source)
                if cutlass.const_expr(self.late_claim):  # config.late_claim: once the last K/V tile is issued
                    u = take_unit(source.unit_state, lane)
                request, local, base, before = self.find_unit(u, qo_indptr, source, base, before, lane)
            end_of_work(pipe_q, q_state, source.slots)

    @cute.jit
    def load_item_tiles(self, boxes, kv_indptr: cute.Tensor, kv_indices: cute.Tensor, b, h, kv_start, kv_end, lane,
                        pipe_k, pipe_v, kv_state, source: UnitSource = None):
        """One item's K and V key tiles as TMA page boxes (a page wholly past ``kv_end`` gets coordinate -1, which TMA
        zero-fills); returns the K/V pipeline state. ``source`` (self-scheduling builds): the page ids are checked
        against the pool (``unit_schedule.check_tile_ids`` / ``check_lane_ids``)."""
        t_ks, t_kg, t_vs, t_vg, tma_atom_k, tma_atom_v, s_k, s_v, desc_k, desc_v = boxes
        P, npg = self.page_size, self.pages_per_tile
        page_ids = cute.make_rmem_tensor(npg, Int32)
        lane_pages = cute.make_rmem_tensor(id_loads(npg), Int32)
        page_base = kv_indptr[b]
        num_tiles = cute.ceil_div(kv_end - kv_start, self.tile_n) if kv_end > kv_start else 0
        for t in cutlass.range(num_tiles, unroll=1):
            kv_base = kv_start + t * self.tile_n
            if cutlass.const_expr(P >= LANE_IDS_BELOW):
                load_tile_page_ids(kv_indices, page_ids, page_base, kv_base, kv_end, P)
                if cutlass.const_expr(source is not None):
                    check_tile_ids(page_ids, page_base, kv_base, kv_end, P, source.num_pages, source, b, lane)
                pipe_k.producer_acquire(kv_state)
                for i in cutlass.range_constexpr(npg):
                    cute.copy(tma_atom_k, t_kg[None, h, page_ids[i]], t_ks[None, i, 0, kv_state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                pipe_v.producer_acquire(kv_state)
                for i in cutlass.range_constexpr(npg):
                    cute.copy(tma_atom_v, t_vg[None, h, page_ids[i]], t_vs[None, i, 0, kv_state.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
            else:
                # pages 1, 2, 4: 32..128 boxes per tile; ids one per lane (coalesced), shuffled out per box
                load_lane_page_ids(kv_indices, lane_pages, page_base + kv_base // P, (kv_end - kv_base + P - 1) // P,
                                   lane)
                if cutlass.const_expr(source is not None):
                    check_lane_ids(lane_pages, page_base + kv_base // P, (kv_end - kv_base + P - 1) // P,
                                   source.num_pages, source, b, lane)
                if cutlass.const_expr(ONE_ELECTION):
                    # one elected lane per tile, not per box (common/tma_issue.py); boxes where the partition puts
                    # them: page i at row i * P, 64-column blocks tile_n * 128 bytes apart, stages tile_n * D * 2
                    # bytes apart
                    for i in cutlass.range_constexpr(npg):
                        page_ids[i] = lane_page_id(lane_pages, i)
                    stage_offset = kv_state.index * (self.tile_n * self.head_dim * 2)
                    pipe_k.producer_acquire(kv_state)
                    issue_page_boxes(desc_k, s_k.iterator.toint() + stage_offset,
                                     page_ids, h, pipe_k.producer_get_barrier(kv_state).toint(), npg, P,
                                     self.head_dim // 64, self.tile_n * 128, self.num_kv_heads)
                    pipe_v.producer_acquire(kv_state)
                    issue_page_boxes(desc_v, s_v.iterator.toint() + stage_offset,
                                     page_ids, h, pipe_v.producer_get_barrier(kv_state).toint(), npg, P,
                                     self.head_dim // 64, self.tile_n * 128, self.num_kv_heads)
                else:
                    pipe_k.producer_acquire(kv_state)
                    for i in cutlass.range_constexpr(npg):
                        cute.copy(tma_atom_k, t_kg[None, h, lane_page_id(lane_pages, i)],
                                  t_ks[None, i, 0, kv_state.index], tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                    pipe_v.producer_acquire(kv_state)
                    for i in cutlass.range_constexpr(npg):
                        cute.copy(tma_atom_v, t_vg[None, h, lane_page_id(lane_pages, i)],
                                  t_vs[None, i, 0, kv_state.index], tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
            kv_state.advance()
        return kv_state

    @cute.jit
    def issue_q(self, tma_atom_q: cute.CopyAtom, tma_q: cute.Tensor, s_q: cute.Tensor, token0: Int32, h: Int32,
                pipe_q, q_state, unit=None):
        """The item's Q box: tile_m packed rows from token ``token0`` of KV head ``h``. ``unit`` (self-scheduling
        builds: ``(slots, request, rows, kv_end, offset, kv_len, row_start)``) goes into the stage's slot between the
        wait for the free stage and the arrive that publishes the box."""
        g_q = cute.local_tile(cute.domain_offset(((0, token0), 0), tma_q[None, None, h]),
                              (self.q_rows, self.head_dim), (0, 0))
        t_qs, t_qg = cpasync.tma_partition(tma_atom_q, 0, cute.make_layout(1),
                                           cute.group_modes(q_box_rows(s_q, self.q_rows, self.tile_m, self.head_dim,
                                                                       self.q_stages), 0, 2),
                                           cute.group_modes(g_q, 0, 2))
        if cutlass.const_expr(unit is None):
            pipe_q.producer_acquire(q_state)
        else:
            slots, request, rows, kv_end, offset, kv_len, row_start = unit
            publish_unit(pipe_q, q_state, self.q_rows * self.head_dim * 2, slots, request, h, row_start, rows, kv_end,
                         offset, kv_len)
        cute.copy(tma_atom_q, t_qg, t_qs[None, q_state.index], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

    @cute.jit
    def produce_rows(self, warp: Int32, tma_atom_q: cute.CopyAtom, tma_q: cute.Tensor, k_rows: cute.Tensor,
                     v_rows: cute.Tensor, s_q: cute.Tensor, s_k: cute.Tensor, s_v: cute.Tensor,
                     qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor, items: cute.Tensor,
                     item_begin: Int32, item_end: Int32, pipe_q, pipe_k, pipe_v, source: UnitSource = None):
        """The row-gathering producer (pages in ``ROW_GATHER_PAGE_SIZES``), all four warps of WG0: warp ``w``
        copies rows ``w * kv_tile / 4 ..`` (a quarter) of every K and V tile (16-byte cp.async,
        ``gather_one_row_pages``), with its 32 rows' page ids loaded one tile ahead; warp 0 also issues Q. One warp
        gathering whole tiles at 24 registers moved ~9 GB/s a SM (8 x 992 page 1: 442 us against page 64's 195)."""
        G = self.group
        q_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, self.q_stages)
        kv_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, self.num_stages)
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                b = items[it, int(F.REQUEST)]
                h = items[it, int(F.KV_HEAD)]
                if warp == 0:
                    self.issue_q(tma_atom_q, tma_q, s_q, qo_indptr[b] + items[it, int(F.Q_ROW_START)] // G, h, pipe_q,
                                 q_state)
                q_state.advance()
                kv_state = self.gather_item_tiles(warp, k_rows, v_rows, s_k, s_v, kv_indptr, kv_indices, b, h,
                                                  items[it, int(F.KV_START)], items[it, int(F.KV_END)], lane, pipe_k,
                                                  pipe_v, kv_state, None)
        else:
            request = Int32(0)
            local = Int32(0)
            base = Int32(0)
            before = Int32(0)
            if warp == 0:
                request, local, base, before = self.find_unit(take_unit(source.unit_state, lane), qo_indptr, source,
                                                              Int32(0), Int32(0), lane)
            turn = Int32(0)  # the row slot of this hand-off (two, alternating: a slot is rewritten two turns later)
            request, h, kv_end = self.hand_off(warp, request, local, qo_indptr, kv_indptr, source, turn, tma_atom_q,
                                               tma_q, s_q, pipe_q, q_state)
            while request < source.batch:
                q_state.advance()
                u = Int32(0)
                if cutlass.const_expr(not self.late_claim):
                    if warp == 0:
                        u = take_unit(source.unit_state, lane)
                kv_state = self.gather_item_tiles(warp, k_rows, v_rows, s_k, s_v, kv_indptr, kv_indices, request, h,
                                                  Int32(0), kv_end, lane, pipe_k, pipe_v, kv_state, source)
                if warp == 0:
                    if cutlass.const_expr(self.late_claim):  # config.late_claim: once the last K/V rows are issued
                        u = take_unit(source.unit_state, lane)
                    request, local, base, before = self.find_unit(u, qo_indptr, source, base, before, lane)
                turn = 1 - turn
                request, h, kv_end = self.hand_off(warp, request, local, qo_indptr, kv_indptr, source, turn,
                                                   tma_atom_q, tma_q, s_q, pipe_q, q_state)
            if warp == 0:
                end_of_work(pipe_q, q_state, source.slots)

    @cute.jit
    def hand_off(self, warp, request, local, qo_indptr, kv_indptr, source: UnitSource, turn, tma_atom_q, tma_q, s_q,
                 pipe_q, q_state):
        """Row-gathering self-scheduling builds: warp 0 publishes its unit (``request == batch``: none left) in row
        slot ``turn`` and, for a unit, issues its Q box; every producer warp returns ``(request, kv_head, kv_end)``."""
        row_slots = source.row_slots
        batch = source.batch
        if warp == 0:
            h = Int32(0)
            kv_end = Int32(0)
            if request < batch:
                h, r0, rows, kv_end, offset, kv_len = self.fields_of(request, local, qo_indptr, kv_indptr, source)
                self.issue_q(tma_atom_q, tma_q, s_q, qo_indptr[request] + r0 // self.group, h, pipe_q, q_state,
                             (source.slots, request, rows, kv_end, offset, kv_len, r0))
            if cute.arch.lane_idx() == 0:
                row_slots[turn, 0] = request
                row_slots[turn, 1] = h
                row_slots[turn, 2] = kv_end
        cute.arch.barrier(barrier_id=_ROW_SLOT_BARRIER, number_of_threads=128)
        return row_slots[turn, 0], row_slots[turn, 1], row_slots[turn, 2]

    @cute.jit
    def gather_item_tiles(self, warp, k_rows, v_rows, s_k, s_v, kv_indptr, kv_indices, b, h, kv_start, kv_end, lane,
                          pipe_k, pipe_v, kv_state, source: UnitSource = None):
        """This warp's quarter of one item's K and V tiles as 16-byte cp.async rows; returns the K/V state.
        ``source`` (self-scheduling builds): each id is checked against the pool as it loads (an id outside it
        becomes -1, a zero-filled row, and marks the request)."""
        P = self.page_size
        rows = self.tile_n // 4  # a warp's slice of the tile (<= 32: its ids fit one register)
        lane_pages = cute.make_rmem_tensor(1, Int32)
        next_pages = cute.make_rmem_tensor(1, Int32)
        slice_rows = warp * rows
        s_k_chunks = cute.flat_divide(s_k, (1, ROW_CHUNK))  # (1, vec, row, chunk, stage)
        s_v_chunks = cute.flat_divide(s_v, (1, ROW_CHUNK))
        page_base = kv_indptr[b]
        num_tiles = cute.ceil_div(kv_end - kv_start, self.tile_n) if kv_end > kv_start else 0
        first = kv_start + slice_rows  # this warp's first key of tile 0
        load_lane_page_ids(kv_indices, next_pages, page_base + first // P, (kv_end - first + P - 1) // P, lane)
        if cutlass.const_expr(self.k_ahead):
            prev_pages = cute.make_rmem_tensor(1, Int32)
            v_state = self.gather_k_ahead(k_rows, v_rows, s_k_chunks, s_v_chunks, lane_pages, next_pages, prev_pages,
                                          kv_indices, h, lane, slice_rows, first, page_base, kv_end, num_tiles,
                                          pipe_k, pipe_v, kv_state, kv_state.clone(), source, b)
            kv_state = v_state.clone()  # both pipelines advanced once a tile
        else:
            for t in cutlass.range(num_tiles, unroll=1):
                self.rotate_tile_ids(kv_indices, lane_pages, next_pages, page_base, first + t * self.tile_n, kv_end,
                                     lane, source, b)
                self.gather_stage(pipe_k, kv_state, k_rows, s_k_chunks, lane_pages, h, lane, slice_rows)
                self.gather_stage(pipe_v, kv_state, v_rows, s_v_chunks, lane_pages, h, lane, slice_rows)
                kv_state.advance()
        return kv_state

    @cute.jit
    def rotate_tile_ids(self, kv_indices, lane_pages, next_pages, page_base, tile_first, kv_end, lane,
                        source: UnitSource, request):
        """This warp's ids of the tile whose first key is ``tile_first`` into ``lane_pages`` (loaded a tile ago) and
        the next tile's loading into ``next_pages`` under this tile's copies; self-scheduling builds check this tile's
        ids against the pool before any is read (``unit_schedule.check_lane_ids``)."""
        P = self.page_size
        nxt = tile_first + self.tile_n
        rotate_lane_page_ids(kv_indices, lane_pages, next_pages, page_base + nxt // P, (kv_end - nxt + P - 1) // P,
                             lane)
        if cutlass.const_expr(source is not None):
            check_lane_ids(lane_pages, page_base + tile_first // P, (kv_end - tile_first + P - 1) // P,
                           source.num_pages, source, request, lane)

    @cute.jit
    def gather_stage(self, pipe, state, rows_src, s_chunks, lane_pages, h, lane, slice_rows):
        """This warp's quarter of one K or V stage: acquire it, cp.async its rows, commit."""
        pipe.producer_acquire(state)
        gather_one_row_pages(rows_src, s_chunks[None, None, None, None, state.index], lane_pages, h, lane,
                             self.tile_n // 4, self.head_dim, page_rows=self.page_size, tile_row0=slice_rows,
                             segments=self.row_segments)
        pipe.producer_commit(state)

    @cute.jit
    def gather_k_ahead(self, k_rows, v_rows, s_k_chunks, s_v_chunks, lane_pages, next_pages, prev_pages, kv_indices,
                       h: Int32, lane: Int32, slice_rows: Int32, first: Int32,
                       page_base: Int32, kv_end: Int32, num_tiles: Int32, pipe_k, pipe_v, k_state, v_state,
                       source: UnitSource = None, request=None):
        """One item's tiles in the order K_0, K_1, V_0, K_2, V_1, ..., V_last (``k_ahead``); K and V keep their own
        pipeline states, each advanced once a tile (so they agree again after the item). Returns the V state."""
        for t in cutlass.range(num_tiles, unroll=1):
            prev_pages[0] = lane_pages[0]  # tile t - 1's ids, for its V
            self.rotate_tile_ids(kv_indices, lane_pages, next_pages, page_base, first + t * self.tile_n, kv_end, lane,
                                 source, request)
            self.gather_stage(pipe_k, k_state, k_rows, s_k_chunks, lane_pages, h, lane, slice_rows)
            k_state.advance()
            if t > 0:
                self.gather_stage(pipe_v, v_state, v_rows, s_v_chunks, prev_pages, h, lane, slice_rows)
                v_state.advance()
        if num_tiles > 0:
            self.gather_stage(pipe_v, v_state, v_rows, s_v_chunks, lane_pages, h, lane, slice_rows)
            v_state.advance()
        return v_state


__all__ = ["GqaPrefillProducer"]

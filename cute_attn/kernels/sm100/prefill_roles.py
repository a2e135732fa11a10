"""Warp roles of the sm_100a GQA paged prefill (``gqa_prefill.py`` holds the layout/pipeline design).

A mixin: :class:`GqaPagedPrefillSm100` inherits these ``@cute.jit`` methods; each runs one role's
persistent loop over the CTA's work items ``[item_begin, item_end)``. Every role reads the same item
fields and derives the same tile count, so the pipelines stay in lockstep without extra signalling.

Per item with ``n`` key tiles (``n = 0``: only the correction role acts, writing 0 / -inf):

* load   : Q; K0; then for j = 1..n-1: Kj, V(j-1); then V(n-1)   (K and V share the smem ring)
* mma    : S0 = Q K0^T; for j = 1..n-1: Sj = Q Kj^T, O (+)= P(j-1) V(j-1); release Q; then O += P(n-1) V(n-1)
* softmax: for each j: S -> mask -> online softmax -> P (bf16, into TMEM) ; row scale (j >= 1) and the
  final (row_sum, row_max) go to the correction role through a small smem vector ring
* correction: for j = 1..n-1: wait PV(j-1), O *= scale_j in TMEM; then the epilogue after PV(n-1)

Self-scheduling builds (``dynamic_schedule``; ``common/unit_schedule.py``): no plan. The load warp takes each unit
(an unsplit item) from the counter and sends it to the other three roles through a unit pipeline over a ring of
shared-memory entries (``send_ring_unit``: one producer arrival; ``wait_ring_unit`` / ``take_held_unit``: every
reading thread of the MMA warp, the softmax and the correction warps arrives after its reads), then loads it; each
role runs the same per-item body as for a plan's item (``_load_item``, ``_mma_item``, ``_softmax_item``,
``_correction_item``). An entry with ``VALID`` 0 ends every role's loop.

Shared with the MLA twin: the TMEM lifecycle and tcgen05 hand-off fences (``tmem.py``), the
softmax-role steps and the row-per-thread online softmax (``softmax_rows.py``); the kernel-entry
pipeline / TMEM setup is in ``prefill_setup.py``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass import pipeline as cpipe
from cutlass.cute.nvgpu import cpasync, tcgen05

from ...plan import ItemField as F
from ..common.kv_tail import garbage_rows, zero_rows
from ..common.packed_q import q_box_rows
from ..common.page_ids import LANE_IDS_BELOW, id_loads, lane_page_id, load_lane_page_ids, load_tile_page_ids
from ..common.tma_issue import ONE_ELECTION, issue_page_boxes, issue_page_gather4, tma_descriptor_address
from ..common.unit_schedule import (UNIT_RING, check_lane_ids, check_tile_ids, find_unit, first_ring_unit,
                                    send_ring_unit, take_held_unit, take_unit, wait_ring_unit)
from .softmax_rows import (NEG_INF, begin_softmax_item, begin_softmax_unit, load_s_row, num_key_tiles,
                           online_softmax_row, send_row_values)
from .tmem import fence_after_sync, fence_before_sync


class PrefillRoles:
    """Role bodies; constants (``self.tile_m`` ...) come from the kernel class."""

    # --------------------------------------------------------------------------------------- load
    @cute.jit
    def load_role(self, tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, s_q_rows, s_kv_rows,
                  qo_indptr, kv_indptr, kv_indices, items, item_begin: Int32, item_end: Int32,
                  pipe_q, pipe_kv, q_state, kv_state, source=None, pipe_u=None):
        """The plan's items in order, or (``source``: ``dynamic_schedule``) units from the counter, each first sent
        to the other roles through the unit pipeline ``pipe_u`` (``unit_schedule.send_ring_unit``), the next index
        fetched under this unit's loads; an entry with ``VALID`` 0 ends every role's loop."""
        G, P, npg, N, D = self.group, self.page_size, self.pages_per_tile, self.tile_n, self.head_dim
        # one page of one KV head = one TMA box; smem pages: (box, page in tile, 1, stage)
        t_ks, t_kg, t_vs, t_vg = s_kv_rows, None, s_kv_rows, None  # page 1 (gather4): the stages themselves
        if cutlass.const_expr(not self.gather4):
            s_pages = cute.group_modes(cute.flat_divide(s_kv_rows, (P, D)), 0, 2)
            t_ks, t_kg = cpasync.tma_partition(tma_atom_k, 0, cute.make_layout(1), s_pages,
                                               cute.group_modes(tma_k, 0, 2))
            t_vs, t_vg = cpasync.tma_partition(tma_atom_v, 0, cute.make_layout(1), s_pages,
                                               cute.group_modes(tma_v, 0, 2))
        page_ids = cute.make_rmem_tensor(npg, Int32)
        tma = (tma_atom_q, tma_q, tma_atom_k, t_kg, t_ks, tma_atom_v, t_vg, t_vs, s_q_rows)
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                q_state, kv_state = self._load_item(
                    tma, qo_indptr, kv_indptr, kv_indices, page_ids, items[it, int(F.REQUEST)],
                    items[it, int(F.KV_HEAD)], items[it, int(F.Q_ROW_START)], items[it, int(F.KV_START)],
                    items[it, int(F.KV_END)], pipe_q, pipe_kv, q_state, kv_state)
        else:
            lane = cute.arch.lane_idx()
            u_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, UNIT_RING)  # this role's own
            request, local, base, before = find_unit(take_unit(source.unit_state, lane), qo_indptr, source,
                                                     Int32(0), Int32(0), lane, G, self.q_rows, self.num_kv_heads)
            while request < source.batch:
                fields = send_ring_unit(pipe_u, u_state, source.slots, request, local, qo_indptr, kv_indptr, source,
                                        lane, G, self.q_rows, self.num_kv_heads, P, N)
                u_state.advance()
                h, r0, kv_end = fields[0], fields[1], fields[3]
                u = Int32(0)
                if cutlass.const_expr(not self.late_claim):
                    u = take_unit(source.unit_state, lane)  # in flight under this unit's loads
                q_state, kv_state = self._load_item(tma, qo_indptr, kv_indptr, kv_indices, page_ids, request, h, r0,
                                                    Int32(0), kv_end, pipe_q, pipe_kv, q_state, kv_state, source)
                if cutlass.const_expr(self.late_claim):  # config.late_claim: once the last K/V tile is issued
                    u = take_unit(source.unit_state, lane)
                request, local, base, before = find_unit(u, qo_indptr, source, base, before, lane, G, self.q_rows,
                                                         self.num_kv_heads)
            send_ring_unit(pipe_u, u_state, source.slots, request, local, qo_indptr, kv_indptr, source, lane, G,
                           self.q_rows, self.num_kv_heads, P, N)  # VALID 0: the end, for every role

    @cute.jit
    def _load_item(self, tma, qo_indptr, kv_indptr, kv_indices, page_ids, b: Int32, h: Int32, r0: Int32,
                   kv_start: Int32, kv_end: Int32, pipe_q, pipe_kv, q_state, kv_state, source=None):
        """One item's Q box, then K0, (Kj, V(j-1)) pairs and the last V (nothing for an item without keys).
        Returns the Q and K/V states."""
        G, N, D = self.group, self.tile_n, self.head_dim
        tma_atom_q, tma_q, tma_atom_k, t_kg, t_ks, tma_atom_v, t_vg, t_vs, s_q_rows = tma
        n = num_key_tiles(kv_start, kv_end, N)
        if n > 0:
            token0 = qo_indptr[b] + r0 // G
            g_q = cute.local_tile(cute.domain_offset(((0, token0), 0), tma_q[None, None, h]),
                                  (self.q_rows, D), (0, 0))
            q_box = q_box_rows(s_q_rows, self.q_rows, self.tile_m, D, cute.size(s_q_rows, mode=[2]))
            t_qs, t_qg = cpasync.tma_partition(tma_atom_q, 0, cute.make_layout(1), cute.group_modes(q_box, 0, 2),
                                               cute.group_modes(g_q, 0, 2))
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_atom_q, t_qg, t_qs[None, q_state.index],
                      tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            page_base = kv_indptr[b]
            # K0, then (Kj, V(j-1)) pairs, then the last V: the MMA warp consumes in this order
            kv_state = self._load_tile(tma_atom_k, t_kg, t_ks, kv_indices, page_ids, page_base, kv_start,
                                       kv_end, h, pipe_kv, kv_state, source, b)
            for j in cutlass.range(1, n, unroll=1):
                kv_state = self._load_tile(tma_atom_k, t_kg, t_ks, kv_indices, page_ids, page_base,
                                           kv_start + j * N, kv_end, h, pipe_kv, kv_state, source, b)
                kv_state = self._load_tile(tma_atom_v, t_vg, t_vs, kv_indices, page_ids, page_base,
                                           kv_start + (j - 1) * N, kv_end, h, pipe_kv, kv_state, source, b)
            kv_state = self._load_tile(tma_atom_v, t_vg, t_vs, kv_indices, page_ids, page_base,
                                       kv_start + (n - 1) * N, kv_end, h, pipe_kv, kv_state, source, b)
        return q_state, kv_state

    @cute.jit
    def _load_tile(self, atom, t_g, t_s, kv_indices, page_ids, page_base: Int32, kv_base: Int32, kv_end: Int32,
                   h: Int32, pipe_kv, kv_state, source=None, request=None):
        """One K or V tile's page boxes; ``source`` (self-scheduling builds): each id is checked against the pool
        first (``unit_schedule.check_tile_ids`` / ``check_lane_ids``: an id outside it marks ``request`` and becomes
        -1, a box TMA zero-fills)."""
        P, npg = self.page_size, self.pages_per_tile
        if cutlass.const_expr(P >= LANE_IDS_BELOW):
            load_tile_page_ids(kv_indices, page_ids, page_base, kv_base, kv_end, P)
            if cutlass.const_expr(source is not None):
                check_tile_ids(page_ids, page_base, kv_base, kv_end, P, source.num_pages, source, request,
                               cute.arch.lane_idx())
            pipe_kv.producer_acquire(kv_state)
            for i in cutlass.range_constexpr(npg):
                cute.copy(atom, t_g[None, h, page_ids[i]], t_s[None, i, 0, kv_state.index],
                          tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        else:
            # pages 1, 2, 4: 32..128 boxes per tile; ids one per lane (coalesced), shuffled out per box
            lane_pages = cute.make_rmem_tensor(id_loads(npg), Int32)
            load_lane_page_ids(kv_indices, lane_pages, page_base + kv_base // P, (kv_end - kv_base + P - 1) // P,
                               cute.arch.lane_idx())
            if cutlass.const_expr(source is not None):
                check_lane_ids(lane_pages, page_base + kv_base // P, (kv_end - kv_base + P - 1) // P,
                               source.num_pages, source, request, cute.arch.lane_idx())
            pipe_kv.producer_acquire(kv_state)
            if cutlass.const_expr(self.gather4):
                # four pages an instruction (tma_issue.py); t_s is the (rows, d, stage) ring itself
                issue_page_gather4(tma_descriptor_address(atom),
                                   t_s.iterator.toint() + kv_state.index * (self.tile_n * self.head_dim * 2),
                                   lane_pages, 0, h, pipe_kv.producer_get_barrier(kv_state).toint(), npg,
                                   self.head_dim // 64, self.tile_n * 128, self.head_dim)
            elif cutlass.const_expr(ONE_ELECTION):
                # one elected lane per tile, not per box (common/tma_issue.py): row i at i * 128 bytes of its
                # 64-column block, blocks tile_n * 128 bytes apart, from the stage's first box
                for i in cutlass.range_constexpr(npg):
                    page_ids[i] = lane_page_id(lane_pages, i)
                issue_page_boxes(tma_descriptor_address(atom), t_s[None, 0, 0, kv_state.index].iterator.toint(),
                                 page_ids, h, pipe_kv.producer_get_barrier(kv_state).toint(), npg, P,
                                 self.head_dim // 64, self.tile_n * 128, self.num_kv_heads)
            else:
                for i in cutlass.range_constexpr(npg):
                    cute.copy(atom, t_g[None, h, lane_page_id(lane_pages, i)], t_s[None, i, 0, kv_state.index],
                              tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        kv_state.advance()
        return kv_state

    # ---------------------------------------------------------------------------------------- mma
    @cute.jit
    def mma_role(self, tiled_mma_qk, tiled_mma_pv, s_q, s_k, s_v, s_kv_rows, tmem, items, qo_indptr, item_begin: Int32,
                 item_end: Int32, pipe_q, pipe_kv, pipe_s, pipe_p, pipe_o, q_state, kv_state, s_state, p_state,
                 o_state, source=None, pipe_u=None):
        tmem_ptr = tmem.base()
        t_s, t_o, p_layout = self.tmem_tensors(tiled_mma_qk, tiled_mma_pv, tmem_ptr)
        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        t_rq = thr_qk.make_fragment_A(s_q)
        t_rk = thr_qk.make_fragment_B(s_k)
        t_rv = thr_pv.make_fragment_B(s_v)
        mma = (tiled_mma_qk, tiled_mma_pv, t_rq, t_rk, t_rv, tmem_ptr, p_layout, t_s, t_o, s_kv_rows)
        pipes = (pipe_q, pipe_kv, pipe_s, pipe_p, pipe_o)
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                q_state, kv_state, s_state, p_state, o_state = self._mma_item(
                    mma, pipes, (q_state, kv_state, s_state, p_state, o_state), items[it, int(F.KV_START)],
                    items[it, int(F.KV_END)], items=items, it=it, qo_indptr=qo_indptr)
        else:
            u_state, valid = first_ring_unit(pipe_u, source.slots)
            while valid != 0:
                _, _, _, _, kv_end, _, kv_len = take_held_unit(pipe_u, u_state, source.slots)
                q_state, kv_state, s_state, p_state, o_state = self._mma_item(
                    mma, pipes, (q_state, kv_state, s_state, p_state, o_state), Int32(0), kv_end, kv_len=kv_len)
                valid = wait_ring_unit(pipe_u, u_state, source.slots)

    @cute.jit
    def _mma_item(self, mma, pipes, states, kv_start: Int32, kv_end: Int32, items=None, it=None, qo_indptr=None,
                  kv_len=None):
        """One item's GEMMs: S0; (Sj, PV(j-1)) pairs; Q released; the last PV. The request's key count ``kv_len``
        (a unit's field; for a plan's item read here, only where pages have a tail). Returns the pipeline states."""
        N = self.tile_n
        tiled_mma_qk, tiled_mma_pv, t_rq, t_rk, t_rv, tmem_ptr, p_layout, t_s, t_o, s_kv_rows = mma
        pipe_q, pipe_kv, pipe_s, pipe_p, pipe_o = pipes
        q_state, kv_state, s_state, p_state, o_state = states
        n = num_key_tiles(kv_start, kv_end, N)
        # the last tile's V rows that may hold pool garbage (common/kv_tail.py); pages of 1 have no tail
        zero_first, zero_end = Int32(0), Int32(0)
        if cutlass.const_expr(self.page_size > 1):
            if cutlass.const_expr(kv_len is None):  # causal: kv_len - q_len is CAUSAL_OFFSET
                b = items[it, int(F.REQUEST)]
                kv_len = items[it, int(F.CAUSAL_OFFSET)] + qo_indptr[b + 1] - qo_indptr[b]
            zero_first, zero_end = garbage_rows(kv_start + (n - 1) * N, kv_end, kv_len, N, self.page_size)
        if n > 0:
            pipe_q.consumer_wait(q_state)
            q_stage = q_state.index
            kv_state, s_state = self._mma_qk(tiled_mma_qk, t_rq, t_rk, t_s, q_stage, pipe_kv, pipe_s, kv_state,
                                             s_state)
            for j in cutlass.range(1, n, unroll=1):
                kv_state, s_state = self._mma_qk(tiled_mma_qk, t_rq, t_rk, t_s, q_stage, pipe_kv, pipe_s,
                                                 kv_state, s_state)
                kv_state, p_state, o_state = self._mma_pv(
                    tiled_mma_pv, t_rv, tmem_ptr, p_layout, t_o, s_kv_rows, j > 1, Int32(0), Int32(0), pipe_kv,
                    pipe_p, pipe_o, kv_state, p_state, o_state)
            # every QK GEMM of the item is issued: free the Q stage (its commit fires once they complete),
            # so the next item's Q loads under the last PV (with one Q stage, at head_dim 256, that matters)
            pipe_q.consumer_release(q_state)
            q_state.advance()
            # the last tile may read the request's last page: zero its rows past the keys first
            kv_state, p_state, o_state = self._mma_pv(
                tiled_mma_pv, t_rv, tmem_ptr, p_layout, t_o, s_kv_rows, n > 1, zero_first, zero_end,
                pipe_kv, pipe_p, pipe_o, kv_state, p_state, o_state)
        return q_state, kv_state, s_state, p_state, o_state

    @cute.jit
    def _mma_qk(self, tiled_mma, t_rq, t_rk, t_s, q_stage: Int32, pipe_kv, pipe_s, kv_state, s_state):
        pipe_kv.consumer_wait(kv_state)
        pipe_s.producer_acquire(s_state)
        fence_after_sync()
        acc = cute.make_tensor(t_s.iterator + s_state.index * self.tile_n, t_s.layout)
        mma = cute.make_mma_atom(tiled_mma.op)  # a local atom: its ACCUMULATE field never escapes this call
        for k in cutlass.range_constexpr(cute.size(t_rq, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(mma, acc, t_rq[None, None, k, q_stage], t_rk[None, None, k, kv_state.index], acc)
        pipe_s.producer_commit(s_state)
        s_state.advance()
        pipe_kv.consumer_release(kv_state)
        kv_state.advance()
        return kv_state, s_state

    @cute.jit
    def _mma_pv(self, tiled_mma, t_rv, tmem_ptr, p_layout, t_o, s_kv_rows, accumulate, zero_first: Int32,
                zero_end: Int32, pipe_kv, pipe_p, pipe_o, kv_state, p_state, o_state):
        pipe_kv.consumer_wait(kv_state)
        if zero_end > zero_first:
            self._zero_v_rows(s_kv_rows, kv_state.index, zero_first, zero_end)
        pipe_o.producer_acquire(o_state)  # the correction role is done with O (rescaled, or read out)
        pipe_p.consumer_wait(p_state)
        fence_after_sync()
        # P(j) sits in its S stage (offsets in 32-bit columns, then viewed as packed bf16)
        p = cute.make_tensor(cute.recast_ptr(tmem_ptr + p_state.index * self.tile_n + self.p_col, dtype=self.dtype),
                             p_layout)
        mma = cute.make_mma_atom(tiled_mma.op)
        for k in cutlass.range_constexpr(cute.size(p, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)
            cute.gemm(mma, t_o, p[None, None, k], t_rv[None, None, k, kv_state.index], t_o)
        pipe_p.consumer_release(p_state)
        p_state.advance()
        pipe_kv.consumer_release(kv_state)
        kv_state.advance()
        pipe_o.producer_commit(o_state)
        o_state.advance()
        return kv_state, p_state, o_state

    @cute.jit
    def _zero_v_rows(self, s_kv_rows, stage: Int32, first: Int32, end: Int32):
        """Zero V rows ``[first, end)`` of ``stage`` (one warp, 16-byte stores), then make them visible to tcgen05."""
        zero_rows(s_kv_rows[None, None, stage], first, end, cute.arch.lane_idx(), 32, self.head_dim)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()

    # ------------------------------------------------------------------------------------ softmax
    @cute.jit
    def softmax_role(self, tiled_mma_qk, tiled_mma_pv, tmem, s_vec, items, item_begin: Int32, item_end: Int32,
                     scale_log2: Float32, pipe_s, pipe_p, pipe_c, s_state, p_state, c_state, tid: Int32, source=None,
                     pipe_u=None):
        G, N = self.group, self.tile_n
        tmem_ptr = tmem.base()
        t_s, t_o, _ = self.tmem_tensors(tiled_mma_qk, tiled_mma_pv, tmem_ptr)
        thr_qk = tiled_mma_qk.get_slice(0)
        c_s = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, N)))
        # S: one 32x32b.x32 load per 32 columns; each thread owns one row
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        tiled_ld = tcgen05.make_tmem_copy(ld_atom, t_s)
        thr_ld = tiled_ld.get_slice(tid)
        t_ld_s = thr_ld.partition_S(t_s)
        t_ld_c = thr_ld.partition_D(c_s)
        # P: bf16 pairs packed in 32-bit TMEM columns, N/2 columns at P_COL of the S stage
        t_s_p = cute.make_tensor(t_s.iterator + self.p_col,
                                 cute.composition(t_s.layout, cute.make_layout((128, N // 2))))
        c_s_p = cute.make_tensor(c_s.iterator, cute.composition(c_s.layout, cute.make_layout((128, N // 2))))
        st_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        tiled_st = tcgen05.make_tmem_copy(st_atom, t_s_p)
        thr_st = tiled_st.get_slice(tid)
        t_st_p = thr_st.partition_D(t_s_p)
        r_s = cute.make_rmem_tensor(t_ld_c.shape, Float32)
        r_p32 = cute.make_rmem_tensor(thr_st.partition_S(c_s_p).shape, Float32)
        r_p = cute.make_tensor(cute.recast_ptr(r_p32.iterator, dtype=self.dtype), r_s.layout)
        row = t_ld_c[0][0]  # this thread's packed row (= TMEM lane = tid)

        tensors = (tiled_ld, t_ld_s, t_ld_c, r_s, r_p, r_p32, tiled_st, t_st_p, s_vec, row)
        pipes = (pipe_s, pipe_p, pipe_c)
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                s_state, p_state, c_state = self._softmax_item(
                    tensors, pipes, (s_state, p_state, c_state), begin_softmax_item(items, it, row, G, N), scale_log2)
        else:
            u_state, valid = first_ring_unit(pipe_u, source.slots)
            while valid != 0:
                _, _, r0, _, kv_end, offset, _ = take_held_unit(pipe_u, u_state, source.slots)
                s_state, p_state, c_state = self._softmax_item(
                    tensors, pipes, (s_state, p_state, c_state),
                    begin_softmax_unit(r0, Int32(0), kv_end, offset, row, G, N), scale_log2)
                valid = wait_ring_unit(pipe_u, u_state, source.slots)

    @cute.jit
    def _softmax_item(self, tensors, pipes, states, header, scale_log2: Float32):
        """One item's S rows -> P, row scales and the final (row_sum, row_max) (``header``: ``begin_softmax_item``'s).
        Returns the S, P and C states."""
        N = self.tile_n
        tiled_ld, t_ld_s, t_ld_c, r_s, r_p, r_p32, tiled_st, t_st_p, s_vec, row = tensors
        pipe_s, pipe_p, pipe_c = pipes
        s_state, p_state, c_state = states
        kv_start, kv_end, causal_offset, n, first_token, token, row_max, row_sum = header
        for j in cutlass.range(n, unroll=1):
            kv_base = kv_start + j * N
            load_s_row(tiled_ld, t_ld_s, r_s, N, pipe_s, s_state)
            row_max, row_sum, scale = online_softmax_row(r_s, t_ld_c, kv_base, kv_end, first_token, token,
                                                         causal_offset, row_max, row_sum, scale_log2, N)
            r_p.store(r_s.load().to(self.dtype))
            pipe_p.producer_acquire(p_state)
            cute.copy(tiled_st, r_p32, cute.make_tensor(t_st_p.iterator + p_state.index * N, t_st_p.layout))
            cute.arch.fence_view_async_tmem_store()
            fence_before_sync()
            pipe_p.producer_commit(p_state)
            p_state.advance()
            pipe_s.consumer_release(s_state)
            s_state.advance()
            if j > 0:  # O holds P(<j) V: the correction role rescales it before PV(j)
                send_row_values(pipe_c, c_state, s_vec, row, (scale,))
                c_state.advance()
        if n > 0:
            send_row_values(pipe_c, c_state, s_vec, row, (row_sum, row_max))
            c_state.advance()
        return s_state, p_state, c_state

    # --------------------------------------------------------------------------------- correction
    @cute.jit
    def correction_role(self, tiled_mma_qk, tiled_mma_pv, tmem, s_vec, items, item_begin: Int32,
                        item_end: Int32, qo_indptr, output, lse, partial_out, partial_lse, scale_log2: Float32,
                        lse_out_scale: Float32, pipe_o, pipe_c, o_state, c_state, tid: Int32, source=None,
                        pipe_u=None):
        """Per item (or unit, from the unit pipeline): the O rescales, then the epilogue (:meth:`_correction_item`)."""
        D, C = self.head_dim, self.epi_cols
        tmem_ptr = tmem.base()
        t_s, t_o, _ = self.tmem_tensors(tiled_mma_qk, tiled_mma_pv, tmem_ptr)
        thr_pv = tiled_mma_pv.get_slice(0)
        c_o = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, D)))
        # O in chunks of C columns: 32x32b.xC loads/stores, one row per thread
        t_o_c = cute.make_tensor(t_o.iterator, cute.composition(t_o.layout, cute.make_layout((128, C))))
        c_o_c = cute.make_tensor(c_o.iterator, cute.composition(c_o.layout, cute.make_layout((128, C))))
        tiled_ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(C)), Float32), t_o_c)
        tiled_st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(C)), Float32), t_o_c)
        thr_ld = tiled_ld.get_slice(tid)
        thr_st = tiled_st.get_slice(tid)
        t_ld_o = thr_ld.partition_S(t_o_c)
        t_st_o = thr_st.partition_D(t_o_c)
        c_ld_o = thr_ld.partition_D(c_o_c)
        r_o = cute.make_rmem_tensor(c_ld_o.shape, Float32)
        row = c_ld_o[0][0]  # this thread's packed row (= TMEM lane = tid)
        r_bf = cute.make_rmem_tensor(C, self.dtype)
        r_f32 = cute.make_rmem_tensor(C, Float32)

        tensors = (tiled_ld, tiled_st, t_ld_o, t_st_o, r_o, r_bf, r_f32, row, s_vec)
        outputs = (qo_indptr, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale)
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                o_state, c_state = self._correction_item(
                    tensors, outputs, pipe_o, pipe_c, o_state, c_state, items[it, int(F.REQUEST)],
                    items[it, int(F.KV_HEAD)], items[it, int(F.Q_ROW_START)], items[it, int(F.Q_ROW_COUNT)],
                    items[it, int(F.KV_START)], items[it, int(F.KV_END)], items[it, int(F.PARTIAL_SLOT)])
        else:
            u_state, valid = first_ring_unit(pipe_u, source.slots)
            while valid != 0:
                b, h, r0, rows, kv_end, _, _ = take_held_unit(pipe_u, u_state, source.slots)
                # partial slot -1 as a Python int: a unit is never split, so only the final stores are traced
                o_state, c_state = self._correction_item(tensors, outputs, pipe_o, pipe_c, o_state, c_state, b, h, r0,
                                                         rows, Int32(0), kv_end, -1)
                valid = wait_ring_unit(pipe_u, u_state, source.slots)

    @cute.jit
    def _correction_item(self, tensors, outputs, pipe_o, pipe_c, o_state, c_state, b: Int32, h: Int32, r0: Int32,
                         row_count: Int32, kv_start: Int32, kv_end: Int32, slot):
        """One item's O rescales (after each PV but the last), then its normalised rows (bf16 ``output`` and lse, or
        a split item's fp32 partials; 0 / -inf for a row that saw no key). Returns the O and C states."""
        G, N, D, C = self.group, self.tile_n, self.head_dim, self.epi_cols
        tiled_ld, tiled_st, t_ld_o, t_st_o, r_o, r_bf, r_f32, row, s_vec = tensors
        qo_indptr, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale = outputs
        n = num_key_tiles(kv_start, kv_end, N)
        for j in cutlass.range(1, n, unroll=1):
            pipe_c.consumer_wait(c_state)
            scale = s_vec[row, 0, c_state.index]
            pipe_c.consumer_release(c_state)
            c_state.advance()
            pipe_o.consumer_wait(o_state)  # PV(j-1) has landed in O
            fence_after_sync()
            if cute.arch.vote_any_sync(scale != Float32(1.0)):  # tcgen05.ld/st are warp-collective
                for c in cutlass.range_constexpr(D // C):
                    cute.copy(tiled_ld, cute.make_tensor(t_ld_o.iterator + c * C, t_ld_o.layout), r_o)
                    cute.arch.fence_view_async_tmem_load()
                    for i in cutlass.range_constexpr(cute.size(r_o)):
                        r_o[i] = r_o[i] * scale
                    cute.copy(tiled_st, r_o, cute.make_tensor(t_st_o.iterator + c * C, t_st_o.layout))
                cute.arch.fence_view_async_tmem_store()
            fence_before_sync()
            pipe_o.consumer_release(o_state)
            o_state.advance()
        row_sum = Float32(0.0)
        row_max = NEG_INF
        if n > 0:
            pipe_c.consumer_wait(c_state)
            row_sum = s_vec[row, 0, c_state.index]
            row_max = s_vec[row, 1, c_state.index]
            pipe_c.consumer_release(c_state)
            c_state.advance()
            pipe_o.consumer_wait(o_state)  # the last PV has landed
            fence_after_sync()
        empty = row_sum == Float32(0.0)
        o_scale = Float32(0.0) if empty else cute.arch.rcp_approx(row_sum)
        safe_sum = Float32(1.0) if empty else row_sum
        row_lse = row_max * scale_log2 + cute.math.log2(safe_sum, fastmath=True)
        row_lse = NEG_INF if empty else row_lse
        packed = r0 + row
        token = qo_indptr[b] + packed // G
        head = h * G + packed % G
        for c in cutlass.range_constexpr(D // C):
            if n > 0:
                cute.copy(tiled_ld, cute.make_tensor(t_ld_o.iterator + c * C, t_ld_o.layout), r_o)
                cute.arch.fence_view_async_tmem_load()
                for i in cutlass.range_constexpr(C):
                    r_f32[i] = r_o[i] * o_scale
            else:
                r_f32.fill(0.0)
            if row < row_count:  # rows past Q_ROW_COUNT belong to another request (or nothing)
                if cutlass.const_expr(partial_out is None):  # self-scheduling builds: every unit is final
                    self._store_output_chunk(r_f32, r_bf, output, token, head, c)
                else:
                    if slot < 0:
                        self._store_output_chunk(r_f32, r_bf, output, token, head, c)
                    else:
                        cute.autovec_copy(r_f32, cute.local_tile(partial_out[slot, row, None], (C,), (c,)))
        if n > 0:
            fence_before_sync()
            pipe_o.consumer_release(o_state)  # O may now be overwritten by the next item's PV
            o_state.advance()
        if row < row_count:
            if cutlass.const_expr(partial_out is None):
                lse[token, head] = row_lse * lse_out_scale
            else:
                if slot < 0:
                    lse[token, head] = row_lse * lse_out_scale
                else:
                    partial_lse[slot, row] = row_lse
        return o_state, c_state

    @cute.jit
    def _store_output_chunk(self, r_f32, r_bf, output, token, head, c):
        """One ``epi_cols``-column chunk of a final row: bf16, one vectorised store."""
        C = self.epi_cols
        for i in cutlass.range_constexpr(C):
            r_bf[i] = r_f32[i].to(self.dtype)
        cute.autovec_copy(r_bf, cute.local_tile(output[token, head, None], (C,), (c,)))

"""sm_90a absorbed-MLA paged prefill with a score warpgroup (``PagedAttentionConfig.score_warpgroup``).

The same kernel as ``mla_prefill.py`` (load role, plan contract, masks, epilogue; read its docstring first) with
the two consumer warpgroups given different jobs instead of the same one:

* **WG1, the score warpgroup**, computes all of ``S = Q K^T`` for the tile (64 x 64 over 576 dims: one chain of
  36 ``m64n64k16`` SS wgmmas), masks it, runs the online softmax on whole rows (``common/softmax.py``, the default
  kernel's helper: no exchange of row statistics), writes each row's O rescale factor to ``s_xchg[row, stage]`` and
  bf16 P with ``stmatrix`` into the stage's kpe block (columns 512..575: a 64 x 64 SW128 K-major block, exactly a
  64-row x 64-key A operand, dead once this warpgroup's S GEMM is done; V = ckv is columns 0..511), fences P into
  the async proxy, and meets WG2 at ``P_BARRIER``. Then it rescales and accumulates its half of O
  (``O[:, 0:256] += P V[:, 0:256]``: 4 ``m64n256k16`` SS wgmmas) and releases the stage.
* **WG2, the output warpgroup**, per tile: waits for the stage, meets WG1 at ``P_BARRIER``, reads its rows'
  factors, rescales and accumulates ``O[:, 256:512] += P V[:, 256:512]``, releases the stage.

Why: the ``share_scores`` kernel splits S by keys, so each warpgroup runs ``m64n32k16`` wgmmas whose A operand (Q,
2 KiB) is re-read from shared memory for every 16 columns of output (3 KiB per 16 tensor clocks against ~128 B/clk
of shared memory: S is shared-memory bound), and both warpgroups stop twice a tile for the row-max exchange and
the P handoff. Here S runs at N = 64 (4 KiB per 32 clocks: at the tensor rate), nothing is exchanged to compute the
softmax, and WG2's PV GEMM starts as soon as P exists. This is FlashInfer's Hopper MLA split of the work
(``mla_hopper.cuh``: one warpgroup computes QK + softmax, both compute half of PV), here beside a dedicated load
warpgroup.

Barriers (named, immediate ids, both warpgroups ``bar.sync``: a generation always holds both, so an early warpgroup
can never complete the next tile's barrier alone):

* ``P_BARRIER`` once a tile: P and the factors are written and fenced (orders WG1's own four warps' ``stmatrix``
  before its PV wgmma too).
* ``FINAL_BARRIER`` once an item: WG1 writes each row's ``1 / rowsum`` (0 for a row that saw no key) to
  ``s_xchg[row, stages + item % 2]``; WG2 normalises its half with it. lse is stored by WG1 (it owns column 0).

Why ``s_xchg`` needs no more: the factor slot of stage ``s`` is rewritten for tile ``t + stages`` only after the
stage was reloaded, i.e. after WG2 released tile ``t``, which it does after reading the slot. The final slot of
parity ``p`` is rewritten two items later, after WG1 passed the next item's ``FINAL_BARRIER``, which WG2 reaches
only after reading it.

Shared memory (kv_tile 64, the only kv_tile this variant builds: P's 64 x 64 must match the stage's kpe block):
Q 72 KiB + 2 stages x 72 KiB + row ids 512 B + mbarriers + ``s_xchg`` 64 x (stages + 2) fp32 + 1 KiB slack.
Registers per thread: WG1 O half 128 + S 32 fp32 + P 16; WG2 O half 128 (``setmaxnreg`` 232 for both).

Schedule per tile: WG1 ``wait stage -> S GEMM (wait) -> mask -> softmax -> factors + P to smem -> fence ->
P_BARRIER -> rescale O -> PV GEMM (wait) -> release``; with ``intra_wg_overlap`` (``pv_in_flight``) WG1 defers
each tile's PV GEMM to the start of the next tile, issues the next S GEMM right behind it, then waits for both
(``wait_group(1)``: the PV, whose stage it releases; ``wait_group(0)``: S), so the tensor core does not wait for
WG1's wait / release / stage-wait / issue round trip between the two GEMMs (nothing stays in flight across the
loop's back edge: ptxas would serialise the wgmmas); WG2 ``wait stage -> P_BARRIER -> rescale O -> PV GEMM (wait)
-> release``. The tensor core runs S (1152 clk at the tensor rate), then both PV halves together (1024), and idles
during WG1's softmax. Hiding that softmax under a GEMM needs a third K stage (S_{t+1} issued before PV_t holds both
stages), which does not fit next to Q.

Epilogue, ``smem_epilogue`` (split ``score_wg_sepi``, the default since session 13): each warpgroup keeps the item's
last K stage past its last PV GEMM, writes its bf16 O half with ``stmatrix`` over the ckv half it alone read there
(``store_output_via_smem(split_columns=True)``), meets its own warpgroup at a named barrier (ids 4, 5), stores
16-byte vectors and only then releases the stage; lse and split items' fp32 partials still leave from the registers
(``finish_item``). The register epilogue's 4-byte stores filled the global-memory queue the next item's gathers
wait in (ncu lg_throttle 23% at the seed): 1.09-1.40x on the H200.

Self-scheduling builds (``dynamic_schedule``, ``mla_prefill.py``): both roles run the same per-item bodies
(:meth:`score_item`, :meth:`output_item`) over units read from the load role's ring after each Q wait instead of the
plan's items; the final-slot parity is the CTA's unit count, and a unit is never split (only final stores are built).

Measured (H200, session 12, ``docs/perf-history.md``): 1.05-1.15x the ``share_scores`` kernel on every recorded
workload, the default since; ``intra_wg_overlap`` no better (slower at 1 / 1028). Under ncu the tensor pipe is busy
33% of the kernel and nothing saturates: latency-bound. ``PagedAttentionConfig.probe`` builds this kernel with only
its load role (``loads_only``: the consumers wait and release) or only its consumers (``compute_only``: stages
committed empty), to split a tile's period between the two.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass import pipeline as cpipe
from cutlass.cute.nvgpu import warpgroup

from ...plan import ItemField as F
from ..common.mask import apply_causal_seqend_mask, tile_needs_mask
from ..common.mla import CKV_DIM, KPE_DIM, QK_DIM
from ..common.unit_schedule import UNIT_RING, SlotField
from ..common.softmax import (acc_mn_view, make_softmax_state, rescale_rows, softmax_finalize, softmax_reset,
                              softmax_update)
from .mla_prefill import MAX_STAGES, MMA_THREADS, MlaPagedPrefillSm90
from .prefill_epilogue import (smem_store_atom, store_item_rows, store_output_rows, store_output_via_smem,
                               store_partial_rows)
from .wgmma import wgmma_gemm

P_BARRIER = 2  # both consumer warpgroups: P and the tile's O factors written and fenced (once a tile)
FINAL_BARRIER = 3  # both consumer warpgroups: the item's 1 / rowsum written (once an item)
#: the one kv_tile this variant builds (P's 64 x kv_tile bf16 lives in the stage's kv_tile x 64 kpe block)
KV_TILE = 64
#: bytes of ``s_xchg``: (64 rows, a factor slot per stage + two final slots) fp32, sized for ``MAX_STAGES``
EXCHANGE_BYTES = 64 * (MAX_STAGES + 2) * 4


def score_wg_reason(config) -> str | None:
    """Why ``score_warpgroup`` cannot build ``config`` (None when it can); on top of the default kernel's rules.
    ``intra_wg_overlap`` is this variant's knob: each tile's PV GEMM of the score warpgroup goes out just before the
    next tile's S GEMM."""
    if config.share_scores:
        return "score_warpgroup and share_scores are two ways to split the consumers' work: choose one"
    if config.kv_tile != KV_TILE or config.tile_q_rows != KV_TILE:
        return (f"score_warpgroup needs kv_tile = tile_q_rows = {KV_TILE} (got {config.kv_tile}, "
                f"{config.tile_q_rows}): the 64-row x 64-key P tile is stored in the K stage's 64 x 64 kpe block")
    if config.smem_epilogue and config.probe:
        return "smem_epilogue is not built into the probes (their consumers release every stage at once)"
    if config.smem_epilogue and config.intra_wg_overlap:
        return ("smem_epilogue holds the item's last K stage for O, which intra_wg_overlap's deferred release "
                "does not track: choose one")
    return None


class MlaPagedPrefillScoreWgSm90(MlaPagedPrefillSm90):
    """The ``score_warpgroup`` kernel object (the base class's constants and load role; its own consumers)."""

    def __init__(self, config):
        super().__init__(config)
        self.pv_in_flight = config.intra_wg_overlap
        self.smem_epilogue = config.smem_epilogue

    def __repr__(self) -> str:  # shows in the kernel symbol
        probe = "".join(w.title() for w in self.probe.split("_"))
        return (super().__repr__() + "_ScoreWg" + ("_OVL" if self.pv_in_flight else "")
                + ("_SEPI" if self.smem_epilogue else "")
                + (f"_Probe{probe}" if probe else ""))

    # ------------------------------------------------------------------------------- host side
    def tiled_mmas(self) -> tuple:
        """S by the score warpgroup alone (64 x kv_tile); O by V columns over both warpgroups, P from smem."""
        return self.qk_one_warpgroup(), self.pv_by_columns(p_in_registers=False)

    # ------------------------------------------------------------------------------- device side
    def allocate_exchange(self, smem):
        """``s_xchg[row, slot]``: slots ``0 .. stages-1`` a tile's O factors (by stage), then two final slots."""
        return smem.allocate_tensor(Float32, cute.make_layout((self.tile_m, self.num_stages + 2)), 16)

    @cute.jit
    def consume_items(self, ctid: Int32, s_q: cute.Tensor, s_k: cute.Tensor, s_xchg: cute.Tensor,
                      qo_indptr: cute.Tensor, items: cute.Tensor, item_begin: Int32, item_end: Int32,
                      output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor,
                      scale_log2: Float32, lse_out_scale: Float32, tiled_mma_qk: cute.TiledMma,
                      tiled_mma_pv: cute.TiledMma, pipe_q, pipe_k, source=None):
        wg = cute.arch.make_warp_uniform(ctid // 128)
        thr_pv = tiled_mma_pv.get_slice(ctid)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        # V^T: (ckv column, key, stage) over the K stages' first 512 columns (MN-major B operand)
        s_vt = cute.composition(s_k, cute.make_layout((CKV_DIM, self.tile_n, self.num_stages),
                                                      stride=(self.tile_n, 1, self.tile_n * QK_DIM)))
        # P: (q row, key, stage) = the stage's kpe block, columns 512..575 of its 64 rows (a K-major SW128 tile)
        s_p = cute.flat_divide(s_k, (self.tile_n, KPE_DIM))[None, None, 0, CKV_DIM // KPE_DIM, None]
        t_sp = wg_pv.make_fragment_A(wg_pv.partition_A(s_p))
        t_ovt = wg_pv.make_fragment_B(wg_pv.partition_B(s_vt))
        acc_o = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((self.tile_m, CKV_DIM)), Float32)
        c_o = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, CKV_DIM)))
        # smem_epilogue: O (bf16) staged in the item's last stage's ckv block, (q row, column, stage)
        s_o = cute.flat_divide(s_k, (self.tile_n, CKV_DIM))[None, None, 0, 0, None]
        if wg == 0:
            self.score_role(ctid, s_q, s_k, s_xchg, s_p, s_o, t_sp, t_ovt, acc_o, c_o, qo_indptr, items, item_begin,
                            item_end, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale,
                            tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, source)
        else:
            self.output_role(ctid, s_xchg, s_o, t_sp, t_ovt, acc_o, c_o, qo_indptr, items, item_begin, item_end,
                             output, lse, partial_out, partial_lse, lse_out_scale, tiled_mma_pv, pipe_q, pipe_k,
                             source)

    @cute.jit
    def release_tile(self, pipe_k, k_state, t: Int32, num_tiles: Int32):
        """A consumed tile's stage back to the load role; with ``smem_epilogue`` not the item's last, which
        :meth:`finish_item` stages O in and releases."""
        if cutlass.const_expr(self.smem_epilogue):
            if t < num_tiles - 1:
                pipe_k.consumer_release(k_state)
        else:
            pipe_k.consumer_release(k_state)

    @cute.jit
    def finish_item(self, ctid: Int32, wg: Int32, acc_o: cute.Tensor, c_o: cute.Tensor, row_lse: cute.Tensor,
                    s_o: cute.Tensor, tiled_mma_pv: cute.TiledMma, pipe_k, k_state, num_tiles: Int32,
                    qo_indptr: cute.Tensor, b: Int32, r0: Int32, row_count: Int32, slot: Int32, output: cute.Tensor,
                    lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor, lse_out_scale: Float32):
        """This warpgroup's half of a normalised item to memory. ``smem_epilogue``: a final item's O goes through
        its last K stage (held since its last PV GEMM: this warpgroup's half of the ckv block is the V it alone
        read), 16 bytes a thread a store, and the stage is released after; lse and split items from the
        registers (``prefill_epilogue``)."""
        G = self.group
        # one KV head: packed row p is head p % G of token p // G
        if cutlass.const_expr(not self.smem_epilogue):
            if cutlass.const_expr(partial_out is None):  # self-scheduling builds: every unit is final
                store_output_rows(acc_o, c_o, row_lse, qo_indptr[b], 0, r0, row_count, output, lse, lse_out_scale, G)
            else:
                store_item_rows(acc_o, c_o, row_lse, slot, qo_indptr, b, 0, r0, row_count, output, lse,
                                lse_out_scale, partial_out, partial_lse, G)
        else:
            q_start = qo_indptr[b]
            staged = Int32(0)
            if num_tiles > 0:
                last = k_state.clone()
                last.reverse()
                if slot < 0:
                    store_output_via_smem(acc_o, s_o[None, None, last.index], tiled_mma_pv, ctid, wg,
                                          q_start + r0 // G, 0, row_count, output, G, CKV_DIM, split_columns=True)
                    staged = Int32(1)
                cute.arch.fence_view_async_shared()  # generic accesses to the stage before its next (TMA) load
                pipe_k.consumer_release(last)
            if cutlass.const_expr(partial_out is None):  # self-scheduling builds: every unit is final
                self.store_final_rows(acc_o, c_o, row_lse, staged, q_start, r0, row_count, output, lse,
                                      lse_out_scale)
            else:
                if slot < 0:
                    self.store_final_rows(acc_o, c_o, row_lse, staged, q_start, r0, row_count, output, lse,
                                          lse_out_scale)
                else:
                    store_partial_rows(acc_o, c_o, row_lse, row_count, slot, partial_out, partial_lse)

    @cute.jit
    def store_final_rows(self, acc_o, c_o, row_lse, staged, q_start, r0, row_count, output, lse, lse_out_scale):
        """A final item's lse (WG1) and, unless its O went through the stage (``staged``), its O rows."""
        if staged != 0:  # O went through the stage: the lse is left
            store_output_rows(acc_o, c_o, row_lse, q_start, 0, r0, row_count, output, lse, lse_out_scale, self.group,
                              write_output=False)
        else:
            store_output_rows(acc_o, c_o, row_lse, q_start, 0, r0, row_count, output, lse, lse_out_scale, self.group)

    @cute.jit
    def score_role(self, ctid: Int32, s_q: cute.Tensor, s_k: cute.Tensor, s_xchg: cute.Tensor, s_p: cute.Tensor,
                   s_o: cute.Tensor, t_sp: cute.Tensor, t_ovt: cute.Tensor, acc_o: cute.Tensor, c_o: cute.Tensor,
                   qo_indptr: cute.Tensor, items: cute.Tensor, item_begin: Int32, item_end: Int32,
                   output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor,
                   scale_log2: Float32, lse_out_scale: Float32, tiled_mma_qk: cute.TiledMma,
                   tiled_mma_pv: cute.TiledMma, pipe_q, pipe_k, source=None):
        """WG1: S, the softmax, P and the factors for WG2, and O columns 0..255, item by item (:meth:`score_item`)
        from the plan or (``source``) unit by unit from the load role's ring."""
        thr_qk = tiled_mma_qk.get_slice(ctid)
        wg_qk = tiled_mma_qk.get_slice(0)
        t_sq = wg_qk.make_fragment_A(wg_qk.partition_A(s_q))
        t_sk = wg_qk.make_fragment_B(wg_qk.partition_B(s_k))
        acc_s = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        c_s = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        c_s_mn = acc_mn_view(c_s)
        # P -> shared memory: stmatrix in the S accumulator's layout
        p_atom = smem_store_atom(self.dtype)
        p_copy = cute.make_tiled_copy_C(p_atom, tiled_mma_qk).get_slice(ctid)
        t_pd = p_copy.partition_D(s_p)
        p_bf = cute.make_rmem_tensor(acc_s.layout, self.dtype)

        row_max, row_sum = make_softmax_state(cute.size(acc_mn_view(acc_s), mode=[0]))
        num_rows = cute.size(row_max)
        deferred_scale = cute.make_rmem_tensor(num_rows, Float32)  # pv_in_flight: the factors of the deferred PV
        q_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, 1)
        k_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, self.num_stages)
        k_done = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, self.num_stages)  # pv_in_flight: lags
        tensors = (s_q, s_k, s_xchg, s_p, s_o, t_sp, t_ovt, acc_o, c_o, thr_qk, t_sq, t_sk, acc_s, c_s, c_s_mn, p_atom,
                   p_copy, t_pd, p_bf, row_max, row_sum, num_rows, deferred_scale)
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                # read only after the main loop: fewer registers live across it
                late = lambda: (items[it, int(F.REQUEST)], items[it, int(F.Q_ROW_COUNT)],  # noqa: E731
                                items[it, int(F.PARTIAL_SLOT)])
                q_state, k_state, k_done = self.score_item(
                    ctid, it, tensors, items[it, int(F.Q_ROW_START)], items[it, int(F.KV_START)],
                    items[it, int(F.KV_END)], items[it, int(F.CAUSAL_OFFSET)], late, qo_indptr, output, lse,
                    partial_out, partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k,
                    q_state, k_state, k_done)
        else:
            ring = source.slots
            n = Int32(0)
            pipe_q.consumer_wait(q_state)
            valid = ring[0, int(SlotField.VALID)]
            while valid != 0:
                entry = n % UNIT_RING
                # partial slot -1 as a Python int: a unit is never split, so only the final store is traced
                late = lambda: (ring[entry, int(SlotField.REQUEST)], ring[entry, int(SlotField.Q_ROW_COUNT)],  # noqa
                                -1)
                q_state, k_state, k_done = self.score_item(
                    ctid, n, tensors, ring[entry, int(SlotField.Q_ROW_START)], Int32(0),
                    ring[entry, int(SlotField.KV_END)], ring[entry, int(SlotField.CAUSAL_OFFSET)], late, qo_indptr,
                    output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv,
                    pipe_q, pipe_k, q_state, k_state, k_done)
                n = n + 1
                pipe_q.consumer_wait(q_state)
                valid = ring[n % UNIT_RING, int(SlotField.VALID)]

    @cute.jit
    def score_item(self, ctid: Int32, it: Int32, tensors, r0: Int32, kv_start: Int32, kv_end: Int32,
                   causal_offset: Int32, late_fields, qo_indptr: cute.Tensor, output: cute.Tensor, lse: cute.Tensor,
                   partial_out: cute.Tensor, partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32,
                   tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, pipe_q, pipe_k, q_state, k_state,
                   k_done):
        """WG1's share of one item (or unit): its key tiles, then its epilogue (``it``'s parity picks the final factor
        slot). ``late_fields()``: ``(request, q_row_count, partial_slot)``. Returns the Q and K states (and
        ``pv_in_flight``'s lagging one)."""
        G = self.group
        (s_q, s_k, s_xchg, s_p, s_o, t_sp, t_ovt, acc_o, c_o, thr_qk, t_sq, t_sk, acc_s, c_s, c_s_mn, p_atom, p_copy,
         t_pd, p_bf, row_max, row_sum, num_rows, deferred_scale) = tensors
        first_token = r0 // G
        softmax_reset(row_max, row_sum)
        acc_o.fill(0.0)
        num_tiles = cute.ceil_div(kv_end - kv_start, self.tile_n) if kv_end > kv_start else 0
        pipe_q.consumer_wait(q_state)
        deferred_stage = Int32(0)
        for t in cutlass.range(num_tiles, unroll=1):
            if cutlass.const_expr(self.probe == "loads_only"):  # the load role's own period: wait, release
                pipe_k.consumer_wait(k_state)
                if t == num_tiles - 1:
                    pipe_q.consumer_release(q_state)
                pipe_k.consumer_release(k_state)
                k_state.advance()
            else:
                kv_base = kv_start + t * self.tile_n
                stage = k_state.index
                if cutlass.const_expr(self.pv_in_flight):
                    if t > 0:  # the previous tile's PV GEMM first: this tile's S GEMM queues right behind it
                        rescale_rows(acc_o, deferred_scale)
                        wgmma_gemm(tiled_mma_pv, acc_o, t_sp[None, None, None, deferred_stage],
                                   t_ovt[None, None, None, deferred_stage], False, wait=False)
                pipe_k.consumer_wait(k_state)
                cute.arch.fence_view_async_shared()  # the producers' cp.async rows, seen by this warp's wgmmas
                wgmma_gemm(tiled_mma_qk, acc_s, t_sq, t_sk[None, None, None, stage], True,
                           wait=not self.pv_in_flight)
                if cutlass.const_expr(self.pv_in_flight):  # both GEMMs done before the back edge (ptxas C7514)
                    warpgroup.wait_group(1)  # the previous tile's PV GEMM: its stage is free
                    if t > 0:
                        pipe_k.consumer_release(k_done)
                        k_done.advance()
                    warpgroup.wait_group(0)
                if t == num_tiles - 1:  # the item's last read of Q: the next item's Q may load now
                    pipe_q.consumer_release(q_state)
                if tile_needs_mask(kv_base, self.tile_n, kv_end, first_token, causal_offset):
                    apply_causal_seqend_mask(acc_s, c_s, r0, G, kv_base, kv_end, causal_offset)
                row_scale = softmax_update(acc_s, row_max, row_sum, scale_log2)
                if ctid % 4 == 0:  # one thread of each row's quad hands the row's factor to WG2
                    for r in cutlass.range_constexpr(num_rows):
                        s_xchg[c_s_mn[r, 0][0], stage] = row_scale[r]
                p_bf.store(acc_s.load().to(self.dtype))
                cute.copy(p_atom, p_copy.retile(p_bf), t_pd[None, None, None, stage])
                cute.arch.fence_view_async_shared()  # generic P stores -> the PV wgmmas (async proxy)
                cute.arch.barrier(barrier_id=P_BARRIER, number_of_threads=MMA_THREADS)
                if cutlass.const_expr(self.pv_in_flight):
                    for r in cutlass.range_constexpr(num_rows):
                        deferred_scale[r] = row_scale[r]
                    deferred_stage = stage
                else:
                    rescale_rows(acc_o, row_scale)
                    wgmma_gemm(tiled_mma_pv, acc_o, t_sp[None, None, None, stage], t_ovt[None, None, None, stage],
                               False)
                    self.release_tile(pipe_k, k_state, t, num_tiles)
                k_state.advance()
        if cutlass.const_expr(self.pv_in_flight):
            if num_tiles > 0:  # the item's last PV GEMM
                rescale_rows(acc_o, deferred_scale)
                wgmma_gemm(tiled_mma_pv, acc_o, t_sp[None, None, None, deferred_stage],
                           t_ovt[None, None, None, deferred_stage], False)
                pipe_k.consumer_release(k_done)
                k_done.advance()
        if num_tiles == 0:
            pipe_q.consumer_release(q_state)
        q_state.advance()

        b, row_count, slot = late_fields()
        o_scale, row_lse = softmax_finalize(row_max, row_sum, scale_log2)
        final_slot = self.num_stages + it % 2
        if ctid % 4 == 0:
            for r in cutlass.range_constexpr(num_rows):
                s_xchg[c_s_mn[r, 0][0], final_slot] = o_scale[r]
        cute.arch.barrier(barrier_id=FINAL_BARRIER, number_of_threads=MMA_THREADS)
        rescale_rows(acc_o, o_scale)
        self.finish_item(ctid, 0, acc_o, c_o, row_lse, s_o, tiled_mma_pv, pipe_k, k_state, num_tiles,
                         qo_indptr, b, r0, row_count, slot, output, lse, partial_out, partial_lse, lse_out_scale)
        return q_state, k_state, k_done

    @cute.jit
    def output_role(self, ctid: Int32, s_xchg: cute.Tensor, s_o: cute.Tensor, t_sp: cute.Tensor, t_ovt: cute.Tensor,
                    acc_o: cute.Tensor, c_o: cute.Tensor, qo_indptr: cute.Tensor, items: cute.Tensor,
                    item_begin: Int32, item_end: Int32, output: cute.Tensor, lse: cute.Tensor,
                    partial_out: cute.Tensor, partial_lse: cute.Tensor, lse_out_scale: Float32,
                    tiled_mma_pv: cute.TiledMma, pipe_q, pipe_k, source=None):
        """WG2: O columns 256..511 from WG1's P and factors, item by item (:meth:`output_item`) from the plan or
        (``source``) unit by unit from the load role's ring (each entry read after the unit's Q wait)."""
        c_o_mn = acc_mn_view(c_o)
        num_rows = cute.size(acc_mn_view(acc_o), mode=[0])
        factors = cute.make_rmem_tensor(num_rows, Float32)
        q_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, 1)
        k_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, self.num_stages)
        tensors = (s_xchg, s_o, t_sp, t_ovt, acc_o, c_o, c_o_mn, num_rows, factors)
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                late = lambda: (items[it, int(F.REQUEST)], items[it, int(F.Q_ROW_START)],  # noqa: E731
                                items[it, int(F.Q_ROW_COUNT)], items[it, int(F.PARTIAL_SLOT)])
                q_state, k_state = self.output_item(
                    ctid, it, tensors, items[it, int(F.KV_START)], items[it, int(F.KV_END)], late, qo_indptr, output,
                    lse, partial_out, partial_lse, lse_out_scale, tiled_mma_pv, pipe_q, pipe_k, q_state, k_state)
        else:
            ring = source.slots
            n = Int32(0)
            pipe_q.consumer_wait(q_state)
            valid = ring[0, int(SlotField.VALID)]
            while valid != 0:
                entry = n % UNIT_RING
                late = lambda: (ring[entry, int(SlotField.REQUEST)], ring[entry, int(SlotField.Q_ROW_START)],  # noqa
                                ring[entry, int(SlotField.Q_ROW_COUNT)], -1)  # never split: final stores only
                q_state, k_state = self.output_item(
                    ctid, n, tensors, Int32(0), ring[entry, int(SlotField.KV_END)], late, qo_indptr, output, lse,
                    partial_out, partial_lse, lse_out_scale, tiled_mma_pv, pipe_q, pipe_k, q_state, k_state)
                n = n + 1
                pipe_q.consumer_wait(q_state)
                valid = ring[n % UNIT_RING, int(SlotField.VALID)]

    @cute.jit
    def output_item(self, ctid: Int32, it: Int32, tensors, kv_start: Int32, kv_end: Int32, late_fields,
                    qo_indptr: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor,
                    partial_lse: cute.Tensor, lse_out_scale: Float32, tiled_mma_pv: cute.TiledMma, pipe_q, pipe_k,
                    q_state, k_state):
        """WG2's share of one item (or unit). ``late_fields()``: ``(request, q_row_start, q_row_count,
        partial_slot)``. Returns the Q and K states."""
        s_xchg, s_o, t_sp, t_ovt, acc_o, c_o, c_o_mn, num_rows, factors = tensors
        acc_o.fill(0.0)
        num_tiles = cute.ceil_div(kv_end - kv_start, self.tile_n) if kv_end > kv_start else 0
        # WG2 never reads Q; its arrival is the Q stage's second half of the 256 the pipeline counts
        pipe_q.consumer_wait(q_state)
        pipe_q.consumer_release(q_state)
        q_state.advance()
        for t in cutlass.range(num_tiles, unroll=1):
            stage = k_state.index
            pipe_k.consumer_wait(k_state)
            if cutlass.const_expr(self.probe != "loads_only"):  # (the probe: the stage is released untouched)
                cute.arch.fence_view_async_shared()  # the producers' cp.async rows, seen by this warp's wgmmas
                cute.arch.barrier(barrier_id=P_BARRIER, number_of_threads=MMA_THREADS)
                for r in cutlass.range_constexpr(num_rows):
                    factors[r] = s_xchg[c_o_mn[r, 0][0], stage]
                rescale_rows(acc_o, factors)
                wgmma_gemm(tiled_mma_pv, acc_o, t_sp[None, None, None, stage], t_ovt[None, None, None, stage],
                           False)
            self.release_tile(pipe_k, k_state, t, num_tiles)
            k_state.advance()

        b, r0, row_count, slot = late_fields()
        final_slot = self.num_stages + it % 2
        cute.arch.barrier(barrier_id=FINAL_BARRIER, number_of_threads=MMA_THREADS)
        for r in cutlass.range_constexpr(num_rows):
            factors[r] = s_xchg[c_o_mn[r, 0][0], final_slot]
        rescale_rows(acc_o, factors)
        # lse is WG1's to store (it owns column 0): these rows' lse never leaves the registers
        self.finish_item(ctid, 1, acc_o, c_o, factors, s_o, tiled_mma_pv, pipe_k, k_state, num_tiles,
                         qo_indptr, b, r0, row_count, slot, output, lse, partial_out, partial_lse, lse_out_scale)
        return q_state, k_state

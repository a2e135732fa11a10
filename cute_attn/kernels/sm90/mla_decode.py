"""sm_90a absorbed-MLA decode, the swapped product: one query token per tile, keys as the wgmma M dimension.

The MLA prefill kernel (``mla_prefill.py``: read its docstring first; same load role, plan contract, pipelines and
registration) with ``tile_q_rows`` = the head count (16 or 8): a tile is ONE query token's heads. There, the 64-row
M tile of a decode holds 16 live rows and 48 of padding: 3/4 of every MMA is waste. Here the products are
transposed so that the 16 (8) heads are the wgmma N dimension:

* ``S^T (64 keys x N) = K (64 x 576) . Q^T``: A = the K stage (K-major), B = the Q tile (N x 576, K-major),
  36 ``m64nNk16`` per tile. Both consumer warpgroups compute all of S^T (2 x 1.2 MFLOP), so their softmax
  states are identical without an exchange between them. ``share_scores``: warpgroup ``w`` sums only the 18
  k-steps of dims ``288 w .. 288 w + 287`` and adds the other's partial S^T from ``s_split`` (a 4 KiB fp32
  exchange a warpgroup, two buffers by tile parity, one barrier of both warpgroups a tile). The sums are
  ``mine + other`` in each, equal bit for bit (fp32 addition commutes), so the states stay identical; the
  tensor pipe runs 18 + 16 instead of 36 + 16 wgmma a warpgroup, which shortens the time a stage is held.
* Softmax along M (keys) per column (head): a thread's 2 rows, ``shfl.xor`` 4, 8, 16 over the lanes of one
  column, then the warpgroup's 4 warps through ``s_red`` and a warpgroup named barrier. Every thread then holds
  the same new max for each of its columns, so O^T's columns rescale locally (the same N layout). Column sums
  stay per-thread partials until the item ends, then the same reduction.
* ``O^T (512 x N) = V^T . P^T``: A = the stage's ckv columns viewed as V^T (MN-major), B = P^T (N x 64 keys,
  K-major, 2 KiB of bf16 per warpgroup in ``s_pt``, written from the S^T accumulator, fenced into the async proxy
  and ordered by the warpgroup barrier). Warpgroup ``w`` owns V columns ``256 w .. 256 w + 255`` (4 M-tiles).
  2.2 MFLOP a tile in all instead of 8.9, under the ~2.8 µs a 72 KiB tile takes at 3.5 TB/s per SM share.
* Epilogue from the coordinate tensor of the O^T partition: element (d, n) → ``output[token, head n, d]`` or
  ``partial_out[slot, n, d]`` (16 KiB / 32 KiB an item), lse per column (warpgroup 0).
* ``cluster_merge`` (k CTAs a cluster, host plans of the cluster shape only: ``plan_clusters.py``): a split item's
  O^T and LSEs stay in this CTA's shared memory (``fold``), and after every role every thread of the CTA runs
  :meth:`fold_split_request`: a cluster barrier, the consumers fold 512 / k columns of every head from the k peers'
  pieces (``common/cluster_merge.py``, ``ld.shared::cluster``), a second cluster barrier. No combine launch follows.
  ``cluster_merge_flags`` (device plans, clusters of 2): each CTA first checks from the plan whether its cluster
  holds one whole merge in that shape (:meth:`with_cluster_check`, the same answer in every CTA of the cluster); only
  those keep their pieces and fold, other split items store global partials, every merge's flag goes to
  ``merge_counters`` and the combine launch that follows skips the flagged merges.

Runs on the H200 (GPU tier, memcheck + racecheck clean, session 9). ``tile_q_rows`` = heads selects it
(``mla_prefill._kernel_for``); the MLA decode entry asks for it on one-token batches (``ops/mla_decode.py``).

* Short stages (``kv_tile`` 32, :data:`SHORT_KV_TILE`): 4 K stages of 32 keys (36 KiB, each followed by a 4 KiB
  pad) instead of 2 of 64, so three stages (108 KiB) load while the consumers hold one, where 64-key stages leave
  one (72 KiB) in flight. S^T keeps its 64-row M tile: a view of the ring with the same 1 KiB row-group stride,
  whose rows 32..63 are the next 64-column block's rows 0..31 of the same stage (the pad after its last block);
  their scores are set to -inf, P^T's rows 32..63 are 0 and O^T sums only the stage's 2 k-blocks of 16 keys. The
  wasted half of S^T costs tensor-pipe time a decode has to spare; the stage is held about as long as a 64-key one.

Shared memory: Q N x 576 bf16 (18 KiB at h16), 2 K stages of 72 KiB (short: 4 of 36 + 4 KiB), ``s_pt`` 2 x 2 KiB,
``s_red`` 2 x 2 x 4 x N fp32 (and ``s_split`` 2 x 2 x 64 x N fp32, 16 KiB at h16, with ``share_scores``), the row-id
table and mbarriers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass import pipeline as cpipe
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from ...plan import ItemField as F
from ..common.cluster_merge import allocate_fold_buffers, cluster_sync, fold_buffer_bytes, fold_cluster_columns
from ..common.mla import CKV_DIM, QK_DIM
from ..common.softmax import acc_mn_view
from .mla_prefill import MMA_THREADS, PRODUCER_THREADS, MlaPagedPrefillSm90
from .wgmma import wgmma_gemm

#: the head counts this kernel builds (wgmma N: a multiple of 8)
HEAD_COUNTS = (8, 16)
KV_TILE = 64  # wgmma M: S^T's M tile of keys (a K stage of 64 keys is one M tile)
#: short K stages (``kv_tile`` 32): S^T still runs as one 64-row M tile, whose rows past the stage's keys read the
#: next 64-column block of the same stage (and, after its last block, the stage's pad), always masked to -inf
SHORT_KV_TILE = 32
WG_COLUMNS = CKV_DIM // (MMA_THREADS // 128)  # V columns per consumer warpgroup
RED_BARRIER = 2  # + warpgroup: the named barrier of one consumer warpgroup (1 is the producers')
SPLIT_BARRIER = 4  # share_scores: both consumer warpgroups' partial S^T written (once a tile)


def swapped_reason(config) -> str | None:
    """Why this variant cannot run ``config`` (None when it can)."""
    if config.tile_q_rows != config.group_size or config.group_size not in HEAD_COUNTS:
        return (f"the swapped MLA decode kernel takes one query token per tile: tile_q_rows must equal the head "
                f"count, one of {HEAD_COUNTS} (got tile_q_rows={config.tile_q_rows}, {config.group_size} heads)")
    if config.kv_tile not in (KV_TILE, SHORT_KV_TILE):
        return (f"kv_tile={config.kv_tile}: the swapped MLA decode kernel's K stages hold {KV_TILE} keys (one S^T M "
                f"tile) or {SHORT_KV_TILE} (short stages, read as a {KV_TILE}-row tile whose extra rows are masked)")
    if config.score_warpgroup:
        return ("score_warpgroup is the 64-row prefill kernel's variant; the swapped decode kernel computes S^T in "
                "both consumer warpgroups (share_scores: half the dims each)")
    return None


def score_pad_bytes(kv_tile: int) -> int:
    """Shared memory after each K stage that S^T's 64-row view reads past the stage's last 64-column block: the
    ``64 - kv_tile`` rows of 128 bytes (0 for 64-key stages). Never written; those rows are masked."""
    return (KV_TILE - kv_tile) * 128


def exchange_bytes(num_heads: int, share_scores: bool = False, cluster_merge: int = 0) -> int:
    """``s_pt`` (2 warpgroups x heads x 64 keys bf16), ``s_red`` (2 x (max, sum) x 4 warps x heads fp32), 1 KiB of
    alignment (``s_pt`` is a 128B-swizzled operand), with ``share_scores`` ``s_split`` (2 tile parities x 2
    warpgroups x 64 keys x heads fp32), and with ``cluster_merge`` the kept piece (heads x 516 fp32, rows padded,
    and its LSEs)."""
    split = 2 * 2 * KV_TILE * num_heads * 4 if share_scores else 0
    fold = fold_buffer_bytes(num_heads, CKV_DIM) if cluster_merge else 0
    return 2 * num_heads * KV_TILE * 2 + 2 * 2 * 4 * num_heads * 4 + 1024 + split + fold


class MlaPagedDecodeSwappedSm90(MlaPagedPrefillSm90):
    """MLA decode with S^T = K Q^T (module docstring); the host side, load role and pipelines are the prefill
    kernel's."""

    def __init__(self, config):
        super().__init__(config)
        self.split_scores = config.share_scores

    def __repr__(self) -> str:
        return (f"MlaPagedDecodeSwappedSm90_H{self.num_heads}_N{self.tile_n}_S{self.num_stages}"
                + ("_SplitK" if self.split_scores else "") + ("_Line" if self.line else "")
                + (f"_Cluster{self.cluster_merge}" if self.cluster_merge else "")
                + ("_Checked" if self.cluster_flags else ""))

    def smem_layouts(self):
        """The prefill kernel's Q tile and, for short stages, a ring of ``kv_tile``-row stages each followed by its
        pad (:func:`score_pad_bytes`); 64-key stages keep the prefill kernel's ring."""
        s_q, s_k = super().smem_layouts()
        if self.tile_n == KV_TILE:
            return s_q, s_k
        return s_q, cute.make_composed_layout(s_k.inner, 0, self.stage_ring(self.tile_n))

    def stage_ring(self, rows: int) -> cute.Layout:
        """The short-stage ring seen as ``rows``-row stages: 128 bytes a row, row groups of 8 one 1 KiB swizzle atom
        apart, 64-column blocks ``kv_tile`` rows apart, stages ``kv_tile`` x 576 + pad apart. ``rows`` = kv_tile is
        the stages as loaded; ``rows`` = 64 is S^T's M tile over them (its cosize spans the last stage's pad)."""
        stage = (self.tile_n * QK_DIM * 2 + score_pad_bytes(self.tile_n)) // 2
        return cute.make_layout(((8, rows // 8), (64, QK_DIM // 64), (1, self.num_stages)),
                                stride=((64, 512), (1, self.tile_n * 64), (0, stage)))

    def allocate_k_stages(self, smem, s_k_layout):
        """Short stages: the ring allocated as S^T's 64-row view (so the last stage's pad is allocated too) and
        returned as ``kv_tile``-row stages."""
        if self.tile_n == KV_TILE:
            return super().allocate_k_stages(smem, s_k_layout)
        rows = smem.allocate_tensor(self.dtype, self.stage_ring(KV_TILE), 1024, s_k_layout.inner)
        return cute.make_tensor(rows.iterator, s_k_layout.outer)

    def tiled_mmas(self) -> tuple:
        """The swapped products: S^T = K Q^T (M = 64 keys from the stage, N = heads from the Q tile) and O^T = V^T
        P^T (M = V columns, MN-major from the stage; N = heads, P^T K-major), one warpgroup each."""
        n = self.tile_m
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(KV_TILE, n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, n))
        return tiled_mma_qk, tiled_mma_pv

    def allocate_exchange(self, smem):
        """``(s_pt, s_red, s_split, fold)``: each warpgroup's P^T operand (heads x 64 keys, 128B-swizzled K-major),
        its (max | sum, warp, head) column reduction buffer, (``share_scores``, else None) the partial S^T exchange
        (thread, value, warpgroup, tile parity): a thread's values at one thread stride, no bank conflicts, and
        (``cluster_merge``, else None) the kept piece ``(O, LSE)`` its cluster folds (``common/cluster_merge.py``)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, KV_TILE), self.dtype)
        pt_layout = cute.tile_to_shape(atom, (self.tile_m, KV_TILE, MMA_THREADS // 128), (0, 1, 2))
        s_pt = smem.allocate_tensor(self.dtype, pt_layout.outer, 1024, pt_layout.inner)
        s_red = smem.allocate_tensor(Float32, cute.make_layout((2, 4, self.tile_m, MMA_THREADS // 128)), 16)
        s_split = None
        if cutlass.const_expr(self.split_scores):
            values = KV_TILE * self.tile_m // 128
            s_split = smem.allocate_tensor(Float32, cute.make_layout((128, values, MMA_THREADS // 128, 2)), 16)
        fold = None
        if cutlass.const_expr(self.cluster_merge > 0):
            fold = allocate_fold_buffers(smem, self.tile_m, CKV_DIM)
        return s_pt, s_red, s_split, fold

    @cute.jit
    def consume_items(self, ctid, s_q, s_k, s_red, qo_indptr, items, item_begin, item_end, output, lse, partial_out,
                      partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k):
        s_pt, s_cols, s_split, fold = s_red
        N, K = self.tile_m, self.tile_n  # K: keys a stage; S^T has KV_TILE rows either way
        wg = cute.arch.make_warp_uniform(ctid // 128)
        wtid = ctid % 128
        warp = wtid // 32
        lane = wtid % 32
        thr_qk = tiled_mma_qk.get_slice(wtid)
        wg_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(wtid)
        wg_pv = tiled_mma_pv.get_slice(0)
        # V^T of this warpgroup's 256 columns: (column, key, stage) over the stages' ckv part (MN-major A)
        s_vt = cute.composition(s_k, cute.make_layout((CKV_DIM, K, self.num_stages),
                                                      stride=(K, 1, K * QK_DIM)))
        s_vt_wg = cute.local_tile(s_vt, (WG_COLUMNS, K, self.num_stages), (wg, 0, 0))
        s_pt_wg = s_pt[None, None, wg]  # (head, key) K-major: the B operand of O^T
        # P^T written from the S^T accumulator: (key, head) -> s_pt_wg[head, key]
        s_pt_store = cute.composition(s_pt_wg, cute.make_layout((KV_TILE, N), stride=(N, 1)))
        s_score_rows = s_k  # S^T's A operand: 64 rows a stage (short stages: the ring's 64-row view)
        if cutlass.const_expr(K != KV_TILE):
            s_score_rows = cute.make_tensor(s_k.iterator, self.stage_ring(KV_TILE))

        t_sk = wg_qk.make_fragment_A(wg_qk.partition_A(s_score_rows))
        t_sq = wg_qk.make_fragment_B(wg_qk.partition_B(s_q))
        t_svt = wg_pv.make_fragment_A(wg_pv.partition_A(s_vt_wg))
        t_spt = wg_pv.make_fragment_B(wg_pv.partition_B(s_pt_wg))
        acc_s = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((KV_TILE, N)), Float32)
        acc_o = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((WG_COLUMNS, N)), Float32)
        c_s = thr_qk.partition_C(cute.make_identity_tensor((KV_TILE, N)))
        c_o = thr_pv.partition_C(cute.make_identity_tensor((WG_COLUMNS, N)))
        t_pt = thr_qk.partition_C(s_pt_store)
        s_mn = acc_mn_view(acc_s)
        o_mn = acc_mn_view(acc_o)
        c_mn = acc_mn_view(c_s)
        cols = cute.size(s_mn, mode=[1])
        col_max = cute.make_rmem_tensor(cols, Float32)  # running max of the raw logits, per column
        col_sum = cute.make_rmem_tensor(cols, Float32)  # this thread's partial sum of p, per column
        scale = cute.make_rmem_tensor(cols, Float32)
        neg_inf = -Float32.inf

        q_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, 1)
        k_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, self.num_stages)
        for it in cutlass.range(item_begin, item_end, unroll=1):
            r0 = items[it, int(F.Q_ROW_START)]
            kv_start = items[it, int(F.KV_START)]
            kv_end = items[it, int(F.KV_END)]
            causal_offset = items[it, int(F.CAUSAL_OFFSET)]
            # one token a tile: every column sees keys < min(KV_END, its causal limit + 1)
            key_end = cutlass.min(kv_end, r0 // self.group + causal_offset + 1)
            col_max.fill(neg_inf)
            col_sum.fill(0.0)
            acc_o.fill(0.0)
            num_tiles = cute.ceil_div(kv_end - kv_start, K) if kv_end > kv_start else 0
            pipe_q.consumer_wait(q_state)
            for t in cutlass.range(num_tiles, unroll=1):
                kv_base = kv_start + t * K
                stage = k_state.index
                pipe_k.consumer_wait(k_state)
                cute.arch.fence_view_async_shared()  # the producers' cp.async rows, seen by this warp's wgmmas
                if cutlass.const_expr(self.split_scores):
                    self.split_k_scores(tiled_mma_qk, acc_s, t_sk[None, None, None, stage], t_sq, s_split,
                                        k_state.count % 2, wg, wtid)
                else:
                    wgmma_gemm(tiled_mma_qk, acc_s, t_sk[None, None, None, stage], t_sq, True)
                if t == num_tiles - 1:  # the item's last read of Q
                    pipe_q.consumer_release(q_state)
                tile_end = key_end
                if cutlass.const_expr(K != KV_TILE):  # S^T's rows past the stage's keys: masked as past the end
                    tile_end = cutlass.min(key_end, kv_base + K)
                self.column_softmax(acc_s, s_mn, c_mn, o_mn, col_max, col_sum, scale, s_cols, kv_base, tile_end,
                                    scale_log2, wg, warp, lane)
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    t_pt[i] = acc_s[i].to(self.dtype)
                cute.arch.fence_view_async_shared()  # generic P^T stores -> the PV wgmma (async proxy)
                cute.arch.barrier(barrier_id=RED_BARRIER + wg, number_of_threads=128)
                wgmma_gemm(tiled_mma_pv, acc_o, t_svt[None, None, None, stage], t_spt, False)
                pipe_k.consumer_release(k_state)
                k_state.advance()
            if num_tiles == 0:
                pipe_q.consumer_release(q_state)
            q_state.advance()

            b = items[it, int(F.REQUEST)]
            row_count = items[it, int(F.Q_ROW_COUNT)]
            slot = items[it, int(F.PARTIAL_SLOT)]
            self.column_totals(col_sum, s_cols, c_mn, wg, warp, lane)
            token = qo_indptr[b] + r0 // self.group
            for c in cutlass.range_constexpr(cols):
                inv = Float32(0.0)
                if col_sum[c] > 0.0:
                    inv = 1.0 / col_sum[c]
                scale[c] = inv
            for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
                for c in cutlass.range_constexpr(cols):
                    o_mn[r, c] = o_mn[r, c] * scale[c]
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                d, head = c_o[i]
                column = wg * WG_COLUMNS + d
                if head < row_count:
                    if slot < 0:
                        output[token, (r0 + head) % self.group, column] = acc_o[i].to(output.element_type)
                    else:
                        if cutlass.const_expr(self.cluster_merge > 0):  # kept for the cluster's fold
                            if cutlass.const_expr(self.cluster_flags):  # where the cluster holds the whole merge
                                if fold[2] != 0:
                                    fold[0][head, column] = acc_o[i]
                                else:
                                    partial_out[slot, head, column] = acc_o[i].to(partial_out.element_type)
                            else:
                                fold[0][head, column] = acc_o[i]
                        else:
                            partial_out[slot, head, column] = acc_o[i].to(partial_out.element_type)
            # lse per column, by warpgroup 0's lanes holding row 0 of the tile (lane // 4 == 0, warp 0)
            if wg == 0:
                if warp == 0:
                    if lane < 4:
                        for c in cutlass.range_constexpr(cols):
                            head = c_mn[0, c][1]
                            col_lse = neg_inf
                            if col_sum[c] > 0.0:
                                col_lse = col_max[c] * scale_log2 + cute.math.log2(col_sum[c], fastmath=True)
                            if head < row_count:
                                if slot < 0:
                                    lse[token, (r0 + head) % self.group] = col_lse * lse_out_scale
                                else:
                                    if cutlass.const_expr(self.cluster_merge > 0):
                                        if cutlass.const_expr(self.cluster_flags):
                                            if fold[2] != 0:
                                                fold[1][head] = col_lse
                                            else:
                                                partial_lse[slot, head] = col_lse
                                        else:
                                            fold[1][head] = col_lse
                                    else:
                                        partial_lse[slot, head] = col_lse

    @cute.jit
    def with_cluster_check(self, s_red, cta, work_indptr, items, merge_indptr) -> tuple:
        """``cluster_merge_flags``: ``s_red`` with the fold buffers' third entry, :meth:`cluster_holds_merge` (the
        consumers' epilogue keeps a split piece in shared memory where it is 1). Read before the first K stage lands,
        so its loads hide under that wait."""
        s_pt, s_cols, s_split, fold = s_red
        return s_pt, s_cols, s_split, (fold[0], fold[1], self.cluster_holds_merge(cta, work_indptr, items,
                                                                                  merge_indptr))

    @cute.jit
    def cluster_holds_merge(self, cta, work_indptr, items, merge_indptr) -> Int32:
        """1 where this CTA's cluster holds one whole merge in the ``plan_clusters`` shape (each of its ``k`` CTAs one
        item, rank ``r`` the merge's slot ``r`` of exactly ``k``), else 0 (``plan_clusters.merges_held_by_clusters``
        mirrors it). Every CTA of a cluster reads the same ``k`` rows of the plan, so the value is the cluster's: its
        barriers are taken by all of its CTAs or by none."""
        k = self.cluster_merge
        first = cta - cta % k
        holds = Int32(1)
        slot0 = Int32(-1)
        merge = Int32(-1)
        begin0 = work_indptr[first]
        if work_indptr[first + 1] - begin0 == 1:
            slot0 = items[begin0, int(F.PARTIAL_SLOT)]
            merge = items[begin0, int(F.MERGE)]
        if slot0 < 0:
            holds = Int32(0)
        else:
            if merge_indptr[merge] != slot0:
                holds = Int32(0)
            if merge_indptr[merge + 1] - slot0 != k:
                holds = Int32(0)
        for p in cutlass.range_constexpr(1, k):
            begin = work_indptr[first + p]
            if work_indptr[first + p + 1] - begin != 1:
                holds = Int32(0)
            else:
                if items[begin, int(F.MERGE)] != merge:
                    holds = Int32(0)
                if items[begin, int(F.PARTIAL_SLOT)] != slot0 + p:
                    holds = Int32(0)
        return holds

    @cute.jit
    def fold_checked(self, tidx, s_red, holds, qo_indptr, work_indptr, items, item_begin, item_end, output, lse,
                     lse_out_scale, merge_indptr, merge_counters):
        """``cluster_merge_flags``: each role at its own end. The consumers pass the check they made before their
        first tile (``holds``); the producers (``holds`` None) make it now, after their last load, while the consumers
        still work on the last tiles, and write every merge's flag for the combine (:meth:`flag_merges`). A cluster
        that holds one whole merge folds it (:meth:`fold_split_request`: its barriers, every thread of every CTA)."""
        if cutlass.const_expr(holds is None):
            cta, _, _ = cute.arch.block_idx()
            producer_holds = self.cluster_holds_merge(cta, work_indptr, items, merge_indptr)
            self.flag_merges(tidx, items, item_begin, item_end, merge_indptr, merge_counters, producer_holds)
            if producer_holds != 0:  # the fold's two barriers; the producers fold nothing
                cluster_sync()
                cluster_sync()
        else:
            if holds != 0:
                self.fold_split_request(tidx, s_red, qo_indptr, items, item_begin, item_end, output, lse, lse_out_scale)

    @cute.jit
    def flag_merges(self, ptid, items, item_begin, item_end, merge_indptr, merge_counters, holds):
        """``merge_counters[m] = holds`` for each merge ``m`` whose first slot one of this CTA's items holds (the
        producer threads, ``ptid`` their index): every merge of the plan gets its flag every launch (1: folded by its
        cluster, the combine skips it)."""
        for it in cutlass.range(item_begin + ptid, item_end, PRODUCER_THREADS, unroll=1):
            slot = items[it, int(F.PARTIAL_SLOT)]
            if slot >= 0:
                merge = items[it, int(F.MERGE)]
                if merge_indptr[merge] == slot:
                    merge_counters[merge] = holds

    @cute.jit
    def fold_split_request(self, tidx, s_red, qo_indptr, items, item_begin, item_end, output, lse, lse_out_scale):
        """``cluster_merge``: after every role of the CTA, the cluster folds its split request from the pieces its
        CTAs kept (``common/cluster_merge.py``: barrier, this rank's columns, barrier). Every thread of the CTA calls
        it. One token a tile: a piece's packed row ``head`` is head ``head`` (``Q_ROW_START`` 0)."""
        piece_o, piece_lse = s_red[3][0], s_red[3][1]
        cta, _, _ = cute.arch.block_idx()
        cluster_sync()  # every peer's piece written (release) and visible here (acquire)
        if tidx >= PRODUCER_THREADS:
            if item_end > item_begin:
                if items[item_begin, int(F.PARTIAL_SLOT)] >= 0:
                    token = qo_indptr[items[item_begin, int(F.REQUEST)]]
                    fold_cluster_columns(piece_o, piece_lse, cta % self.cluster_merge, token,
                                         items[item_begin, int(F.Q_ROW_COUNT)], output, lse, lse_out_scale,
                                         tidx - PRODUCER_THREADS, self.cluster_merge, MMA_THREADS)
        cluster_sync()  # no CTA leaves (its shared memory) while a peer still reads it

    @cute.jit
    def split_k_scores(self, tiled_mma_qk, acc_s, t_sk_stage, t_sq, s_split, parity, wg, wtid):
        """S^T with ``share_scores``: this warpgroup's half of the k-steps, its partial through ``s_split[.., wg,
        parity]``, the other's added after one barrier of both (``mine + other``: the same bits in both). The
        parity buffers make the barrier enough: a buffer is written again two tiles on, after the other warpgroup
        has passed the next tile's barrier, so after its read of this one."""
        half = cute.size(t_sk_stage.shape[2]) // 2
        if wg == 0:
            wgmma_gemm(tiled_mma_qk, acc_s, t_sk_stage, t_sq, True, k_blocks=(0, half))
        else:
            wgmma_gemm(tiled_mma_qk, acc_s, t_sk_stage, t_sq, True, k_blocks=(half, 2 * half))
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            s_split[wtid, i, wg, parity] = acc_s[i]
        cute.arch.barrier(barrier_id=SPLIT_BARRIER, number_of_threads=MMA_THREADS)
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = acc_s[i] + s_split[wtid, i, 1 - wg, parity]

    @cute.jit
    def column_softmax(self, acc_s, s_mn, c_mn, o_mn, col_max, col_sum, scale, s_cols, kv_base, key_end, scale_log2,
                       wg, warp, lane):
        """Mask keys >= ``key_end``, then the new running max per column over the 64 keys (2 rows a thread,
        3 shuffles, 4 warps through ``s_cols[0]``), p = 2^((s - max) * scale_log2) in place, the O^T rescale and
        this thread's column sums."""
        neg_inf = -Float32.inf
        rows, cols = cute.size(s_mn, mode=[0]), cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                if kv_base + c_mn[r, c][0] >= key_end:
                    s_mn[r, c] = neg_inf
        for c in cutlass.range_constexpr(cols):
            v = s_mn[0, c]
            for r in cutlass.range_constexpr(1, rows):
                v = cute.arch.fmax(v, s_mn[r, c])
            for x in (4, 8, 16):  # the lanes of one column: same lane % 4
                v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=x))
            if lane < 4:
                s_cols[0, warp, c_mn[0, c][1], wg] = v
        cute.arch.barrier(barrier_id=RED_BARRIER + wg, number_of_threads=128)
        for c in cutlass.range_constexpr(cols):
            head = c_mn[0, c][1]
            m = col_max[c]
            for w in cutlass.range_constexpr(4):
                m = cute.arch.fmax(m, s_cols[0, w, head, wg])
            safe = m if m != neg_inf else Float32(0.0)
            scale[c] = cute.math.exp2((col_max[c] - safe) * scale_log2, fastmath=True) if col_max[c] != neg_inf \
                else Float32(0.0)
            col_max[c] = m
            col_sum[c] = col_sum[c] * scale[c]
            for r in cutlass.range_constexpr(rows):
                p = cute.math.exp2((s_mn[r, c] - safe) * scale_log2, fastmath=True)
                s_mn[r, c] = p
                col_sum[c] = col_sum[c] + p
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            for c in cutlass.range_constexpr(cols):
                o_mn[r, c] = o_mn[r, c] * scale[c]

    @cute.jit
    def column_totals(self, col_sum, s_cols, c_mn, wg, warp, lane):
        """Every thread's partial column sums reduced to the column's total (3 shuffles, 4 warps through
        ``s_cols[1]``); the barriers order the buffer against the next item's first max exchange."""
        cols = cute.size(col_sum)
        for c in cutlass.range_constexpr(cols):
            v = col_sum[c]
            for x in (4, 8, 16):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=x)
            if lane < 4:
                s_cols[1, warp, c_mn[0, c][1], wg] = v
        cute.arch.barrier(barrier_id=RED_BARRIER + wg, number_of_threads=128)
        for c in cutlass.range_constexpr(cols):
            total = Float32(0.0)
            for w in cutlass.range_constexpr(4):
                total = total + s_cols[1, w, c_mn[0, c][1], wg]
            col_sum[c] = total
        cute.arch.barrier(barrier_id=RED_BARRIER + wg, number_of_threads=128)


__all__ = ["MlaPagedDecodeSwappedSm90", "swapped_reason", "exchange_bytes", "HEAD_COUNTS"]

"""sm_90a absorbed-MLA paged prefill, S = Q K^T computed once per tile (``PagedAttentionConfig.share_scores``).

The same kernel as ``mla_prefill.py`` (same load role, plan contract, masks, epilogue; read its docstring
first) except for the two consumer warpgroups' split of the work. There, both warpgroups compute the full
64 x kv_tile S over K = 576 and each owns 256 of O's 512 V columns: tensor work per key row is
2 * 576 + 512 = 1664 for 1088 useful (65%). Here:

* **S split by keys.** WG ``w`` computes ``S_w = Q K[32 w .. 32 w + 31]^T`` (one ``m64n32k16`` wgmma per 16 of
  the 576 dims: a tiled MMA of two warpgroups side by side along N, the way O is split). Tensor work per
  key row: 576 + 512 = 1088, all useful.
* **One online-softmax state in both warpgroups.** Each warpgroup reduces its 32 columns to a row max (from
  the running max, as ``common/softmax.py``), one thread per row quad writes it to ``s_red[row, w, 0]``,
  named barrier ``MAX_BARRIER`` (256 consumer threads), each reads the other's and takes the max. ``max`` is
  exact and both started from the same running max, so both warpgroups hold the same new max, the same O
  rescale factor and the same exponent offset: the states never diverge. Row sums stay per-warpgroup
  partials (each sums its own 32 columns; both are rescaled by the same factors) and are added once per
  item, before the epilogue (``s_red[row, w, 1]``, ``SUM_BARRIER``): ``own + other`` is the same sum in both
  (fp32 addition commutes), so both normalise O and form lse identically; the lse is stored by WG1 as before.
* **P through shared memory, in the stage's kpe block.** O_w += P V_w needs the whole 64 x 64 P, so each
  warpgroup writes its 64 x 32 bf16 P half (``stmatrix``) and the PV GEMM becomes SS (A = P from smem,
  4 k-steps of ``m64n256k16``). P lives in the K stage's own columns 512..575 (the kpe part): a 128B-swizzled
  K-major 64 x 64 bf16 block, exactly the layout of a 64-row x 64-key A operand, and dead once both S
  GEMMs of the tile are done (V = ckv is only columns 0..511). Writing P there is safe after
  ``MAX_BARRIER``: each warpgroup waited for its own S GEMM before arriving, so no wgmma still reads the
  block (either warpgroup's half of P spans all 64 K rows, i.e. both warpgroups' S operands). Then every
  writer fences (``fence.proxy.async.shared::cta``: generic writes -> wgmma's async proxy) and
  ``P_BARRIER`` orders them before either PV GEMM. P is per stage, so it is multi-buffered for free; the
  stage is released (256 arrivals, as before) after both PV GEMMs, and the next load overwrites it.

Barriers: two per tile (MAX, P), one per item (SUM, items with keys only). Why ``s_red`` needs no more:
a warpgroup rewrites its max slot for tile t+1 only after passing ``P_BARRIER`` of tile t, which the other
warpgroup reaches only after reading that slot; it rewrites its sum slot only after the next item's first
``MAX_BARRIER``, which the other reaches only after reading the sum (items without keys skip the exchange:
both partial sums are 0). The alternative split, by K-dimension halves (each warpgroup 64 x 64 over 288
dims, then add the two fp32 partial S tiles), needs a 16 KiB fp32 exchange buffer per direction that does
not fit next to Q and two stages (below), plus the same barriers; the key split needs 1 KiB.

Shared memory (kv_tile 64, the only kv_tile this variant builds: P's 64 rows x 64 keys must match the
kpe block's 64 key rows x 64 columns): Q 72 KiB + 2 stages x 72 KiB + row ids 512 B + mbarriers + ``s_red``
64 x 2 x 2 fp32 = 1 KiB + 1 KiB alignment slack = 218.5 KiB of 227 KiB; P costs nothing.
Registers per consumer thread: O 128 fp32 + S 16 fp32 (was 32) + 16 bf16 of P in flight to smem; the
producer keeps 40 (``setmaxnreg`` as the default kernel).

Schedule: per tile and warpgroup, wait stage -> S_w GEMM (wait) -> mask -> max exchange -> exp / partial
sums -> rescale O -> P half to smem -> fence + barrier -> PV GEMM (wait) -> release stage. No intra-
warpgroup overlap: issuing S_{t+1} before PV_t would keep both stages held by the consumers, leaving the
producer no stage to load into (two 72 KiB stages is all that fits). The next step is FlashMLA's
"seesaw" order (the warpgroups alternate key blocks and pass the max along, so one's softmax hides under
the other's GEMMs), which needs finer stage release (see docs/perf-history.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass import pipeline as cpipe

from ...plan import ItemField as F
from ..common.mla import CKV_DIM, KPE_DIM, QK_DIM
from ..common.mask import apply_causal_seqend_mask, tile_needs_mask
from ..common.softmax import (_row_max, acc_mn_view, exp_row_against_max, make_softmax_state, rescale_rows,
                              softmax_reset)
from .mla_prefill import MMA_THREADS, MlaPagedPrefillSm90
from .prefill_epilogue import smem_store_atom, store_item_rows
from .wgmma import wgmma_gemm

MAX_BARRIER = 2  # both consumer warpgroups: row maxes written
P_BARRIER = 3  # both consumer warpgroups: P halves written and fenced
SUM_BARRIER = 4  # both consumer warpgroups: partial row sums written (once per item)
#: bytes of ``s_red``: (64 rows, 2 warpgroups, max | sum) fp32
EXCHANGE_BYTES = 64 * 2 * 2 * 4
#: the one kv_tile this variant builds (P's 64 x kv_tile bf16 lives in the stage's kv_tile x 64 kpe block)
KV_TILE = 64


def shared_s_reason(config) -> str | None:
    """Why ``share_scores`` cannot build ``config`` (None when it can); on top of the default kernel's rules."""
    if config.kv_tile != KV_TILE or config.tile_q_rows != KV_TILE:
        return (f"share_scores needs kv_tile = tile_q_rows = {KV_TILE} (got {config.kv_tile}, {config.tile_q_rows}): "
                "the 64-row x 64-key P tile is stored in the K stage's 64 x 64 kpe block")
    return None


class MlaPagedPrefillSharedSSm90(MlaPagedPrefillSm90):
    """The ``share_scores`` kernel object (the base class's constants; its own MMAs and consumers)."""

    def __repr__(self) -> str:  # shows in the kernel symbol
        return super().__repr__() + "_SharedS"

    # ------------------------------------------------------------------------------- host side
    def tiled_mmas(self) -> tuple:
        """S split by keys: two warpgroups side by side along N, 64 x kv_tile/2 each; O by V columns, P from smem."""
        wgs = MMA_THREADS // 128
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, wgs, 1), tiler_mn=(64, self.tile_n // wgs))
        return tiled_mma_qk, self.pv_by_columns(p_in_registers=False)

    # ------------------------------------------------------------------------------- device side
    # The base class's kernel, with the row-statistics exchange buffer and this class's consumers.
    def allocate_exchange(self, smem):
        return smem.allocate_tensor(Float32, cute.make_layout((self.tile_m, 2, 2)), 16)

    # ------------------------------------------------------------------------------- consumers
    @cute.jit
    def consume_items(self, ctid: Int32, s_q: cute.Tensor, s_k: cute.Tensor, s_red: cute.Tensor,
                      qo_indptr: cute.Tensor, items: cute.Tensor, item_begin: Int32, item_end: Int32,
                      output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor,
                      scale_log2: Float32, lse_out_scale: Float32, tiled_mma_qk: cute.TiledMma,
                      tiled_mma_pv: cute.TiledMma, pipe_q, pipe_k):
        G = self.group
        wg = cute.arch.make_warp_uniform(ctid // 128)
        thr_qk = tiled_mma_qk.get_slice(ctid)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        thr_pv = tiled_mma_pv.get_slice(ctid)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        # V^T: (ckv column, key, stage) over the K stages' first 512 columns (MN-major B operand)
        s_vt = cute.composition(s_k, cute.make_layout((CKV_DIM, self.tile_n, self.num_stages),
                                                      stride=(self.tile_n, 1, self.tile_n * QK_DIM)))
        # P: (q row, key, stage) = the stage's kpe block, columns 512..575 of its 64 rows (a K-major SW128 tile)
        s_p = cute.flat_divide(s_k, (self.tile_n, KPE_DIM))[None, None, 0, CKV_DIM // KPE_DIM, None]

        t_sq = wg_qk.make_fragment_A(wg_qk.partition_A(s_q))
        t_sk = wg_qk.make_fragment_B(wg_qk.partition_B(s_k))
        t_sp = wg_pv.make_fragment_A(wg_pv.partition_A(s_p))
        t_ovt = wg_pv.make_fragment_B(wg_pv.partition_B(s_vt))
        acc_s = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_o = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((self.tile_m, CKV_DIM)), Float32)
        c_s = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        c_o = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, CKV_DIM)))
        # P half -> shared memory: stmatrix in the S accumulator's layout
        p_atom = smem_store_atom(self.dtype)
        p_copy = cute.make_tiled_copy_C(p_atom, tiled_mma_qk).get_slice(ctid)
        t_pd = p_copy.partition_D(s_p)
        p_bf = cute.make_rmem_tensor(acc_s.layout, self.dtype)

        row_max, row_sum = make_softmax_state(cute.size(acc_mn_view(acc_s), mode=[0]))
        q_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, 1)
        k_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, self.num_stages)
        for it in cutlass.range(item_begin, item_end, unroll=1):
            r0 = items[it, int(F.Q_ROW_START)]
            kv_start = items[it, int(F.KV_START)]
            kv_end = items[it, int(F.KV_END)]
            causal_offset = items[it, int(F.CAUSAL_OFFSET)]
            first_token = r0 // G
            softmax_reset(row_max, row_sum)
            acc_o.fill(0.0)
            num_tiles = cute.ceil_div(kv_end - kv_start, self.tile_n) if kv_end > kv_start else 0
            pipe_q.consumer_wait(q_state)
            for t in cutlass.range(num_tiles, unroll=1):
                kv_base = kv_start + t * self.tile_n
                stage = k_state.index
                pipe_k.consumer_wait(k_state)
                cute.arch.fence_view_async_shared()  # the producers' cp.async rows, seen by this warp's wgmmas
                wgmma_gemm(tiled_mma_qk, acc_s, t_sq, t_sk[None, None, None, stage], True)
                if t == num_tiles - 1:  # the item's last read of Q: the next item's Q may load now
                    pipe_q.consumer_release(q_state)
                if tile_needs_mask(kv_base, self.tile_n, kv_end, first_token, causal_offset):
                    apply_causal_seqend_mask(acc_s, c_s, r0, G, kv_base, kv_end, causal_offset)
                # both S GEMMs of this stage are done once MAX_BARRIER passes: its kpe block may take P
                row_scale = shared_softmax_update(acc_s, c_s, row_max, row_sum, scale_log2, s_red, wg, ctid)
                rescale_rows(acc_o, row_scale)
                p_bf.store(acc_s.load().to(self.dtype))
                cute.copy(p_atom, p_copy.retile(p_bf), t_pd[None, None, None, stage])
                cute.arch.fence_view_async_shared()  # generic P stores -> the PV wgmma (async proxy)
                cute.arch.barrier(barrier_id=P_BARRIER, number_of_threads=MMA_THREADS)
                wgmma_gemm(tiled_mma_pv, acc_o, t_sp[None, None, None, stage], t_ovt[None, None, None, stage], False)
                pipe_k.consumer_release(k_state)
                k_state.advance()
            if num_tiles == 0:
                pipe_q.consumer_release(q_state)
            q_state.advance()

            # read only now: fewer registers live across the main loop
            b = items[it, int(F.REQUEST)]
            row_count = items[it, int(F.Q_ROW_COUNT)]
            slot = items[it, int(F.PARTIAL_SLOT)]
            o_scale, row_lse = shared_softmax_finalize(row_max, row_sum, c_s, scale_log2, s_red, wg, ctid,
                                                       num_tiles > 0)
            rescale_rows(acc_o, o_scale)
            # one KV head: packed row p is head p % G of token p // G
            store_item_rows(acc_o, c_o, row_lse, slot, qo_indptr, b, 0, r0, row_count, output, lse, lse_out_scale,
                            partial_out, partial_lse, G)


# ----------------------------------------------------------------------------------- shared softmax state
@cute.jit
def shared_softmax_update(acc_s: cute.Tensor, c_s: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                          scale_log2: Float32, s_red: cute.Tensor, wg: Int32, ctid: Int32) -> cute.Tensor:
    """``common/softmax.py``'s online update over this warpgroup's S columns, with the row max taken over
    both warpgroups' columns (``s_red[row, wg, 0]``, ``MAX_BARRIER``); returns the per-row O factor.

    ``row_sum`` stays this warpgroup's partial sum (its own columns), rescaled by the shared factor."""
    acc_mn = acc_mn_view(acc_s)
    c_mn = acc_mn_view(c_s)
    num_rows = cute.size(row_max)
    ncol = cute.size(acc_mn, mode=[1])
    local = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        cur = _row_max(acc_mn[r, None], ncol, row_max[r])
        cur = cute.arch.warp_reduction_max(cur, threads_in_group=4)
        local[r] = cur
        if ctid % 4 == 0:  # one thread of the row's quad
            s_red[c_mn[r, 0][0], wg, 0] = cur
    cute.arch.barrier(barrier_id=MAX_BARRIER, number_of_threads=MMA_THREADS)
    row_scale = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        row = acc_mn[r, None]
        prev = row_max[r]
        cur = cute.arch.fmax(local[r], s_red[c_mn[r, 0][0], 1 - wg, 0])
        row_max[r] = cur
        row_scale[r], row_sum[r] = exp_row_against_max(row, ncol, prev, cur, row_sum[r], scale_log2)
    return row_scale


@cute.jit
def shared_softmax_finalize(row_max: cute.Tensor, row_sum: cute.Tensor, c_s: cute.Tensor, scale_log2: Float32,
                            s_red: cute.Tensor, wg: Int32, ctid: Int32, exchange) -> tuple[cute.Tensor, cute.Tensor]:
    """``(o_scale, lse)`` per row as ``softmax_finalize``, over the sum of both warpgroups' partial row sums
    (``s_red[row, wg, 1]``, ``SUM_BARRIER``; skipped when ``exchange`` is false: no key, both sums 0)."""
    c_mn = acc_mn_view(c_s)
    num_rows = cute.size(row_max)
    total = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        total[r] = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
    if exchange:
        for r in cutlass.range_constexpr(num_rows):
            if ctid % 4 == 0:
                s_red[c_mn[r, 0][0], wg, 1] = total[r]
        cute.arch.barrier(barrier_id=SUM_BARRIER, number_of_threads=MMA_THREADS)
        for r in cutlass.range_constexpr(num_rows):
            total[r] = total[r] + s_red[c_mn[r, 0][0], 1 - wg, 1]
    o_scale = cute.make_rmem_tensor(num_rows, Float32)
    lse = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        s = total[r]
        empty = s == Float32(0.0) or s != s
        inv = cute.arch.rcp_approx(Float32(1.0) if empty else s)
        o_scale[r] = Float32(0.0) if empty else inv
        l2 = row_max[r] * scale_log2 + cute.math.log2(Float32(1.0) if empty else s, fastmath=True)
        lse[r] = -Float32.inf if empty else l2
    return o_scale, lse

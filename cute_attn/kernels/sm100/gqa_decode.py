"""GQA paged decode for Blackwell (sm_100a): tcgen05 MMAs with TMEM accumulators, TMA page loads.

Definition: ``gqa_paged_decode_h20_kv4_d128_ps64`` and its family: other head counts, ``page_size``
1 / 2 / 4 / 8 / 16 / 32 / 64 / 128 and head_dim 64 / 128 / 256 (qk = v) where TMEM and shared memory hold them
(:func:`check_config`: page 128 with head_dim 256 does not fit TMEM); contract:
``docs/kernel-contract.md``. Compiled and inspected only (no Blackwell GPU in this project).

Work
    Persistent grid (``num_ctas`` from the plan): CTA ``c`` runs items ``work_indptr[c] ..
    work_indptr[c+1]-1`` in order. An item is (request b, KV head h, packed rows, keys
    [KV_START, KV_END), partial slot). Its ``group`` query heads are the rows of one 128-row MMA tile
    (decode: row r is head ``h*group + Q_ROW_START + r`` of token b; rows >= Q_ROW_COUNT are padding,
    never stored).
    The plan's ``tile_q_rows`` (64 by default) only bounds Q_ROW_COUNT: the MMA always uses M = 128,
    whose TMEM accumulator maps row r to lane r (one softmax thread per row). KV steps are one page
    (``page_size`` keys: S = Q.K^T is one MMA of N = page_size); KV_START is a multiple of ``kv_tile``
    (a multiple of the page size). Pages of 1, 2, 4 or 8 keys: a step is ``kv_tile`` keys (64 by default,
    :func:`step_keys`), built from ``kv_tile / page_size`` page boxes; below, "page" as the step's width
    (S/P TMEM columns, ring stage) then means the step.
    Same contract, roles and item loop as the Hopper twin ``kernels/sm90/gqa_decode.py``; only the
    MMA (tcgen05, TMEM accumulators, its own warp) and the pipeline differ. The shared softmax/mask
    helpers (``kernels/common``) work on wgmma register fragments, so this file keeps its own
    row-per-thread versions.

Warp roles (192 threads)
    warps 0-3  softmax + correction + epilogue (thread t owns row t): tcgen05.ld S, scale by
               ``sm_scale*log2(e)``, mask keys >= KV_END to -inf, online softmax with exp2, P -> TMEM
               (bf16, tcgen05.st); correction: wait for the previous P.V, rescale O in TMEM; on the
               last tile of an item zero the V rows >= KV_END in smem (pool tails are NaN). Epilogue:
               O / l -> bf16 ``output`` and ``lse * lse_out_scale``, or fp32 partial_out/partial_lse.
               Fused merge (no combine launch), as on sm_90a (``common/decode_merge.py``): after the
               item loop, fence.acq_rel.gpu + named barrier + one atom.add.acq_rel.gpu per split item on
               ``merge_counters[MERGE]``; the CTA that reads ``slots - 1`` folds the merge's slots (one
               row per half-warp, lanes over slots then columns) into ``output``/``lse`` and resets the
               counter to 0.
               (Correction shares these warps: decode has few KV steps per row, and this keeps the
               TMEM hand-offs to one barrier per step; a separate correction warpgroup is the next
               step if profiling shows the rescale on the critical path.)
    warp 4     MMA: owns TMEM (tcgen05.alloc / dealloc); per item waits Q, then S_0 = Q.K_0^T, and per
               step t issues S_{t+1} (double-buffered) before O += P_t.V_t; tcgen05.commit signals
               s_full / o_full / kv_empty / q_empty.
    warp 5     TMA producer: Q tile (128 rows x head_dim from the item's first head; rows past
               num_qo_heads are zero-filled by the TMA, rows of other heads are finite padding), then
               per page the K and V tiles (page_size tokens x head_dim of one KV head; the page id
               from ``kv_indices[KV_PAGE_START + page]``, read 32 at a time one per lane, is the TMA
               coordinate) into the smem ring. Each Q, K or V tile is head_dim / 64 TMA boxes of 64
               columns: the 128B swizzle caps a box's inner extent at 64 bf16.
               Small pages (``load_role_pages``): the ring is also viewed as (keys, D, stage) rows (the same
               bytes as the MMA layouts: K-major K and MN-major V both put key k at 128 B * k of each
               64-column chunk) and each page is a box of page_size rows at row ``i * page_size``, even below
               the 8-row swizzle atom (TMA swizzles by address; stages are 1024 B aligned). Ids one per lane
               (``common/page_ids.py``), shuffled out, then one elected lane issues the step's boxes
               (``common/tma_issue.py``); a page past KV_END gets id -1 (zero-filled, bytes counted). Page 1:
               TMA ``tile::gather4`` over the caches as 2-D rows of pages (``[num_pages, Hkv * D]`` with the
               page stride, whatever it is: pages are compact), four pages an instruction, KV head h's
               64-column block c at column h * D + 64 c: 64 instructions per 64-key K + V step at D 128,
               where one-row boxes took 256.

TMEM columns (:func:`tmem_plan`; P = page_size, D = head_dim; regions start on 32-column boundaries)
    S0 [0, P), S1 [s, s + P) with s = P rounded up to 32: fp32 scores, double-buffered
    P  [2s, 2s + P/2): bf16 probabilities, two keys per 32-bit column (the P.V MMA's A operand)
    O  [o, o + D): fp32 accumulator, o = the end of P rounded up to a multiple of D
    tcgen05.alloc takes the next power of two >= o + D, all within 512. Page 64 / D 128 (the
    definition): S0 [0, 64), S1 [64, 128), P [128, 160), O [256, 384), 512 allocated.

Shared memory (bf16, 128B swizzle; :func:`smem_bytes`): Q 128 x D (16 / 32 / 64 KiB), a ring of
:func:`kv_stages` stages of one K + one V page (2 x P x D x 2 B each), as many as fit in 128 KiB and
in the 227 KiB limit (at least 2), mbarriers (2 per stage + 6) + TMEM address + the fused merge's
arrival word. The definition: 4 stages of 32 KiB, ~164 KiB.

Pipeline (mbarriers; phases from running counters that carry across items)
    kv_full[s] / kv_empty[s]  TMA -> MMA (and softmax, for the V tail) / PV commit -> TMA
    q_full / q_empty          TMA -> MMA / last S MMA of the item -> TMA
    s_full[2]                 S MMA -> softmax (S buffer = global step % 2)
    p_full (128 arrivals)     softmax (P stored, O rescaled, V tail zeroed) -> MMA
    o_full                    PV commit -> softmax (rescale before the next P, epilogue)
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator

from ...config import PagedAttentionConfig
from ...plan import ItemField
from .. import register_paged_kernel
from ..common.paged_launch import gqa_decode_entry, gqa_multi_token_decode_entry
from ..common.decode_merge import fold_completed_merges
from ..common.kv_tail import garbage_rows
from ..common.page_ids import IDS_PER_LOAD, id_loads, lane_page_id, load_lane_page_ids, rotate_lane_page_ids
from ..common.tma_issue import (GATHER4_PAGE_SIZES, ONE_ELECTION, issue_page_boxes, issue_page_gather4,
                                make_gather4_atom, pages_as_rows, tma_descriptor_address)
from ..common.launch_chain import wait_for_previous_grid
from ..common.line_schedule import end_line, gqa_line_rules, start_line
from .tmem import fence_after_sync as _fence_after_sync, fence_before_sync as _fence_before_sync
from .decode_config import (  # noqa: F401  (re-exported: the kernel's constants and rules)
    ARCH, KIND, MULTI_TOKEN_KIND, Q_VEC, MMA_M, PAGE_SIZES,
    SMALL_PAGE_SIZES, SMALL_PAGE_STEPS, MAX_PAGES_PER_STEP, HEAD_DIMS, KV_RING_BYTES, MIN_KV_STAGES,
    PAGE_IDS_PER_LOAD, ELEM, TMA_BOX_COLS, TMEM_ALIGN, SOFTMAX_WARPS, MMA_WARP,
    LOAD_WARP, NUM_THREADS, Q_FULL, Q_EMPTY, S_FULL, P_FULL,
    O_FULL, NUM_MISC_BARRIERS, MERGE_BARRIER_ID, TmemPlan, _round_up, step_keys,
    tmem_plan, kv_stages, tma_boxes_per_tile, check_config, _kv_stage_bytes, _smem_bytes,
    smem_bytes, tmem_columns, configs, multi_token_configs, line_table_requests,
)


class GqaDecodeSm100:
    """The kernel object: compile-time constants live on ``self``."""

    def __init__(self, config: PagedAttentionConfig) -> None:
        self.releases_dependents = config.early_dependents  # config.EARLY_DEPENDENTS says why
        self.config = config
        self.multi_token = config.kind == MULTI_TOKEN_KIND  # compile time: q_len 1 decode's code is unchanged
        self.tile_rows = config.tile_q_rows  # multi-token: the Q rows an item may hold (the planner's bound)
        self.group = config.group_size
        self.num_qo_heads = config.num_qo_heads
        self.head_dim = config.head_dim_qk
        self.head_dim_v = config.head_dim_v
        self.page = config.page_size
        self.step = step_keys(config)  # keys per ring stage / S MMA N (the page for pages of 16..128 keys)
        self.pages_per_step = self.step // self.page
        self.gather4 = self.page in GATHER4_PAGE_SIZES  # steps of 32..128 keys: whole quads of pages
        self.qk_tiler = (MMA_M, self.step, self.head_dim)
        self.pv_tiler = (MMA_M, self.head_dim_v, self.step)
        self.q_bytes = MMA_M * self.head_dim * ELEM
        self.kv_bytes = self.step * (self.head_dim + self.head_dim_v) * ELEM
        self.kv_stages = kv_stages(config)
        self.tmem = tmem_plan(config)
        self.s_stride = self.tmem.s_col[1]  # S buffer i starts at column i * s_stride
        self.line = config.line_schedule  # compile time: the planned build's code is unchanged
        if config.line_schedule:
            self.line_rules = gqa_line_rules(config)
            self.line_requests = line_table_requests(config)

    def __repr__(self) -> str:
        c = self.config
        return (f"{type(self).__name__}_H{c.num_qo_heads}_KV{c.num_kv_heads}_D{c.head_dim_qk}_P{c.page_size}"
                + ("_Line" if self.line else ""))

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # [batch, num_qo_heads, head_dim] bf16
        k_cache: cute.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim] bf16
        v_cache: cute.Tensor,
        kv_indices: cute.Tensor,  # [kv_indptr[-1]] int32
        work_indptr: cute.Tensor,  # [num_ctas + 1] int32
        items: cute.Tensor,  # [max_items, len(ItemField)] int32
        merge_indptr: cute.Tensor,  # [max_merges + 1] int32
        merge_counters: cute.Tensor,  # [max(max_merges, 1)] int32, zero on entry and on exit
        output: cute.Tensor,  # [batch, num_qo_heads, head_dim_v] bf16
        lse: cute.Tensor,  # [batch, num_qo_heads] fp32
        partial_out: cute.Tensor,  # [slots, tile_q_rows, head_dim_v] fp32
        partial_lse: cute.Tensor,  # [slots, tile_q_rows] fp32
        scale_log2: cutlass.Float32,  # sm_scale * log2(e)
        lse_out_scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        self.launch_kernel(q, k_cache, v_cache, None, kv_indices, work_indptr, items, merge_indptr, merge_counters,
                           output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream)

    @cute.jit
    def call_line(self, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, merge_counters, request_faults,
                  unit_state, error_word, output, lse, partial_out, partial_lse, scale_log2: cutlass.Float32,
                  lse_out_scale: cutlass.Float32, num_pages: cutlass.Int32, num_ctas: cutlass.Int32,
                  stream: cuda.CUstream):
        """The ``line_schedule`` entry (the sm_90a twin's arguments: ``paged_launch.line_schedule_fake_args``), no
        plan: ``num_ctas`` CTAs (at most 191) each derive their stretch (``common/line_schedule.py``)."""
        line = (kv_indptr, kv_last_page_len, request_faults, unit_state, error_word, num_pages)
        self.launch_kernel(q, k_cache, v_cache, None, kv_indices, None, None, None, merge_counters, output, lse,
                           partial_out, partial_lse, scale_log2, lse_out_scale, stream, line, num_ctas)

    @cute.jit
    def launch_kernel(self, q, k_cache, v_cache, qo_indptr, kv_indices, work_indptr, items, merge_indptr,
                      merge_counters, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream,
                      line=None, num_ctas=None):
        """The host side of every entry (``qo_indptr`` is None for decode; ``line``: the line build's tensors, and
        its grid is ``num_ctas``)."""
        bf16 = cutlass.BFloat16
        one = tcgen05.CtaGroup.ONE
        qk_mma = sm100_utils.make_trivial_tiled_mma(
            bf16, bf16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32, one, self.qk_tiler[:2])
        pv_mma = sm100_utils.make_trivial_tiled_mma(
            bf16, bf16, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32, one, self.pv_tiler[:2],
            tcgen05.OperandSource.TMEM)
        q_layout = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, bf16, 1)
        k_layout = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, bf16, self.kv_stages)
        v_layout = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, bf16, self.kv_stages)
        p_layout = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, bf16, 1)

        # Global views in (rows, contiguous, batch...) order for the TMA atoms.
        q_view = cute.make_tensor(q.iterator, cute.select(q.layout, mode=[1, 2, 0]))  # (Hq, D, B)
        k_sel = cute.select(k_cache.layout, mode=[1, 3, 2, 0])  # (slot, D, Hkv, page)
        k_view = cute.make_tensor(k_cache.iterator, cute.group_modes(k_sel, 2, 4))
        v_sel = cute.select(v_cache.layout, mode=[3, 1, 2, 0])  # (D, slot, Hkv, page): MN-major B
        v_view = cute.make_tensor(v_cache.iterator, cute.group_modes(v_sel, 2, 4))

        op = cpasync.CopyBulkTensorTileG2SOp(one)
        tma_q, m_q = cute.nvgpu.make_tiled_tma_atom_A(
            op, q_view, cute.select(q_layout, mode=[0, 1, 2]), self.qk_tiler, qk_mma)
        if cutlass.const_expr(self.gather4):
            # Page 1: the caches as rows of pages ([num_pages, Hkv * D], any page stride: pages are compact), a
            # box of one row x 64 columns, for raw tile::gather4 (four pages an instruction; tma_issue.py)
            tma_k, m_k = make_gather4_atom(op, pages_as_rows(k_cache), self.kv_rows_layout())
            tma_v, m_v = make_gather4_atom(op, pages_as_rows(v_cache), self.kv_rows_layout())
        elif cutlass.const_expr(self.pages_per_step > 1):
            # Small pages: one TMA box per page of one KV head, (slot, D, Hkv, page) with the page id as coordinate,
            # into rows [i * page, (i + 1) * page) of the stage's (keys, D) row view (kv_rows_layout: the same
            # bytes as the MMA layouts of K and V). TMA swizzles by smem address and the stage is 1024 B aligned,
            # so a box of fewer than 8 rows lands where the 128B-swizzled layout expects it.
            page_layout = cute.composition(cute.select(self.kv_rows_layout(), mode=[0, 1]),
                                           cute.make_layout((self.page, self.head_dim), stride=(1, self.step)))
            k_rows = cute.make_tensor(k_cache.iterator, cute.select(k_cache.layout, mode=[1, 3, 2, 0]))
            v_rows = cute.make_tensor(v_cache.iterator, cute.select(v_cache.layout, mode=[1, 3, 2, 0]))
            tma_k, m_k = cpasync.make_tiled_tma_atom(op, k_rows, page_layout, (self.page, self.head_dim))
            tma_v, m_v = cpasync.make_tiled_tma_atom(op, v_rows, page_layout, (self.page, self.head_dim_v))
        else:
            tma_k, m_k = cute.nvgpu.make_tiled_tma_atom_B(
                op, k_view, cute.select(k_layout, mode=[0, 1, 2]), self.qk_tiler, qk_mma)
            tma_v, m_v = cute.nvgpu.make_tiled_tma_atom_B(
                op, v_view, cute.select(v_layout, mode=[0, 1, 2]), self.pv_tiler, pv_mma)

        q_rows = None  # decode loads Q by TMA (tma_q); multi-token decode reads q itself
        if cutlass.const_expr(self.multi_token):
            q_rows = q
        grid = num_ctas if cutlass.const_expr(line is not None) else work_indptr.shape[0] - 1
        self.kernel(
            qk_mma, pv_mma, q_rows, qo_indptr, tma_q, m_q, tma_k, m_k, tma_v, m_v, kv_indices, work_indptr, items,
            merge_indptr, merge_counters, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale,
            q_layout, k_layout, v_layout, p_layout, line,
        ).launch(grid=(grid, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(
        self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
        q,  # multi-token decode: [total_q, Hq, D] bf16, read directly (its Q rows are not one TMA box); decode: None
        qo_indptr,  # multi-token decode: [batch + 1] int32; decode: None
        tma_q: cute.CopyAtom, m_q: cute.Tensor, tma_k: cute.CopyAtom, m_k: cute.Tensor,
        tma_v: cute.CopyAtom, m_v: cute.Tensor,
        kv_indices: cute.Tensor, work_indptr: cute.Tensor, items: cute.Tensor,
        merge_indptr: cute.Tensor, merge_counters: cute.Tensor,
        output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor,
        scale_log2: cutlass.Float32, lse_out_scale: cutlass.Float32,
        q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout,
        p_layout: cute.ComposedLayout,
        line,  # line_schedule: (kv_indptr, kv_last_page_len, request_faults, unit_state, error_word, num_pages)
    ):
        bf16 = cutlass.BFloat16
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()

        smem = SmemAllocator()
        s_q = smem.allocate_tensor(bf16, q_layout.outer, byte_alignment=1024, swizzle=q_layout.inner)
        if cutlass.const_expr(self.pages_per_step > 1):
            # small pages: the ring as (keys, D, stage) rows for the page boxes; MMA views of the same bytes
            rows = self.kv_rows_layout()
            s_k_rows = smem.allocate_tensor(bf16, rows.outer, byte_alignment=1024, swizzle=rows.inner)
            s_v_rows = smem.allocate_tensor(bf16, rows.outer, byte_alignment=1024, swizzle=rows.inner)
            s_k = cute.make_tensor(cute.recast_ptr(s_k_rows.iterator, k_layout.inner, dtype=bf16), k_layout.outer)
            s_v = cute.make_tensor(cute.recast_ptr(s_v_rows.iterator, v_layout.inner, dtype=bf16), v_layout.outer)
        else:
            s_k = smem.allocate_tensor(bf16, k_layout.outer, byte_alignment=1024, swizzle=k_layout.inner)
            s_v = smem.allocate_tensor(bf16, v_layout.outer, byte_alignment=1024, swizzle=v_layout.inner)
            s_k_rows = s_k
            s_v_rows = s_v
        bars = smem.allocate_array(cutlass.Int64, 2 * self.kv_stages + NUM_MISC_BARRIERS, byte_alignment=8)
        tmem_holder = smem.allocate_array(cutlass.Int32, 1, byte_alignment=4)
        arrival = smem.allocate_array(cutlass.Int32, 1, byte_alignment=4)  # fused merge: counter's old value
        kv_full = bars
        kv_empty = bars + self.kv_stages
        misc = bars + 2 * self.kv_stages

        if warp == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.kv_stages):
                    cute.arch.mbarrier_init(kv_full + s, 1)
                    cute.arch.mbarrier_init(kv_empty + s, 1)
                cute.arch.mbarrier_init(misc + Q_FULL, 1)
                cute.arch.mbarrier_init(misc + Q_EMPTY, 1)
                cute.arch.mbarrier_init(misc + S_FULL, 1)
                cute.arch.mbarrier_init(misc + S_FULL + 1, 1)
                cute.arch.mbarrier_init(misc + P_FULL, 32 * SOFTMAX_WARPS)
                cute.arch.mbarrier_init(misc + O_FULL, 1)
            cute.arch.mbarrier_init_fence()
        if warp == MMA_WARP:
            cute.arch.alloc_tmem(self.tmem.alloc, tmem_holder)
        _fence_before_sync()
        cute.arch.sync_threads()
        _fence_after_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(cutlass.Float32, 16, tmem_holder)

        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        # Launched with programmatic dependent launch (it may start while the device planner runs): nothing
        # global is read before this wait, which returns once the previous grid has finished and flushed.
        wait_for_previous_grid(self.releases_dependents)
        item_begin = cutlass.Int32(0)
        item_end = cutlass.Int32(0)
        if cutlass.const_expr(self.line):  # every thread derives the CTA's stretch; items[it, field] derives item it
            items = start_line(line, s_k_rows.iterator, kv_indices, output, lse, tidx, NUM_THREADS, self.head_dim_v,
                               self.line_rules, self.line_requests)
            item_end = items.count
        else:
            item_begin = work_indptr[cta]
            item_end = work_indptr[cta + 1]

        if warp == LOAD_WARP:
            if cutlass.const_expr(self.pages_per_step > 1):  # single-token only (check_config)
                self.load_role_pages(qk_thr, tma_q, m_q, tma_k, m_k, tma_v, m_v, s_q, s_k_rows, s_v_rows,
                                     kv_indices, items, item_begin, item_end, kv_full, kv_empty, misc)
            else:
                self.load_role(qk_thr, pv_thr, tma_q, m_q, tma_k, m_k, tma_v, m_v, s_q, s_k, s_v,
                               kv_indices, items, item_begin, item_end, kv_full, kv_empty, misc, q, qo_indptr)
        if warp == MMA_WARP:
            self.mma_role(qk_mma, pv_mma, qk_thr, pv_thr, s_q, s_k, s_v, p_layout, tmem_ptr,
                          items, item_begin, item_end, kv_full, kv_empty, misc)
        if warp < SOFTMAX_WARPS:
            self.softmax_role(qk_thr, pv_thr, s_v, tmem_ptr, tidx, items, item_begin, item_end, merge_indptr,
                              merge_counters, arrival, partial_out, partial_lse, output, lse, scale_log2,
                              lse_out_scale, kv_full, misc, qo_indptr, line)

        # Every TMEM access has completed (softmax waited for the last PV and its loads) before this.
        _fence_before_sync()
        cute.arch.sync_threads()
        if warp == MMA_WARP:
            _fence_after_sync()
            cute.arch.relinquish_tmem_alloc_permit()
            cute.arch.dealloc_tmem(tmem_ptr, self.tmem.alloc)

    # ------------------------------------------------------------------------------------------ helpers
    @cute.jit
    def item_steps(self, items: cute.Tensor, it):
        """(kv_start, kv_end, number of page steps) of item ``it``."""
        kv_start = items[it, ItemField.KV_START]
        kv_end = items[it, ItemField.KV_END]
        steps = cutlass.Int32(0)
        if kv_end > kv_start:
            steps = (kv_end - kv_start + self.step - 1) // self.step
        return kv_start, kv_end, steps

    # ------------------------------------------------------------------------------------------ multi-token Q
    def q_rows_view(self, s_q):
        """(row, 16-byte vector) view of the MMA's Q tile in smem: ((1, Q_VEC), (MMA_M, head_dim / Q_VEC)).
        ``s_q`` is ((MMA_M, 16), 1, K blocks, 1) (one 16-column K block per MMA); the 128B swizzle keeps each
        16-byte vector whole, so the copies stay st.shared.v4."""
        shape, stride = s_q.layout.shape, s_q.layout.stride
        rows = cute.make_layout((shape[0][0], (shape[0][1], shape[2])),
                                stride=(stride[0][0], (stride[0][1], stride[2])))
        return cute.zipped_divide(cute.make_tensor(s_q.iterator, rows), (1, Q_VEC))

    @cute.jit
    def zero_q_padding(self, s_q, lane):
        """Multi-token decode: Q rows tile_q_rows..MMA_M-1 never hold a packed row; zero them once, so their
        (never stored) S/O rows stay finite. The first item's Q_FULL arrival publishes them with its rows."""
        s_qv = self.q_rows_view(s_q)
        vecs = self.head_dim // Q_VEC
        zero = cute.make_rmem_tensor((Q_VEC,), cutlass.BFloat16)
        zero.fill(0.0)
        for j in cutlass.range_constexpr((MMA_M - self.tile_rows) * vecs // 32):
            e = lane + j * 32
            s_qv[None, (self.tile_rows + e // vecs, e % vecs)].store(zero.load())

    @cute.jit
    def load_q_rows(self, q, qo_indptr, s_q, items, it, lane, misc):
        """Multi-token decode: the item's packed rows -> Q rows 0..tile_q_rows-1 (16-byte loads by the load warp;
        row r is token qo_indptr[b] + (Q_ROW_START + r) // group, head KV_HEAD * group + r % group; rows past
        Q_ROW_COUNT repeat the last real one), then Q_FULL (every lane fences its stores into the async proxy,
        the warp syncs, one lane arrives: the barrier's count is 1, as for the TMA)."""
        rows = items[it, ItemField.Q_ROW_COUNT]
        token0 = qo_indptr[items[it, ItemField.REQUEST]] + items[it, ItemField.Q_ROW_START] // self.group
        head0 = items[it, ItemField.KV_HEAD] * self.group
        s_qv = self.q_rows_view(s_q)
        g_qv = cute.zipped_divide(q, (1, 1, Q_VEC))
        vecs = self.head_dim // Q_VEC
        for j in cutlass.range_constexpr(self.tile_rows * vecs // 32):
            e = lane + j * 32
            r = e // vecs
            cv = e % vecs
            src = cutlass.min(r, rows - 1)
            s_qv[None, (r, cv)].store(g_qv[None, (token0 + src // self.group, head0 + src % self.group, cv)].load())
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(misc + Q_FULL)

    # ------------------------------------------------------------------------------------------ TMA warp
    @cute.jit
    def load_role(self, qk_thr, pv_thr, tma_q, m_q, tma_k, m_k, tma_v, m_v, s_q, s_k, s_v,
                  kv_indices, items, item_begin, item_end, kv_full, kv_empty, misc, q, qo_indptr):
        # K: (slot, D, (Hkv, page)) tiles of one page; V: (D, slot, (Hkv, page)).
        t_k_s, t_k_g = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(s_k, 0, 3),
            cute.group_modes(qk_thr.partition_B(cute.flat_divide(m_k, (self.page, self.head_dim))), 0, 3))
        t_v_s, t_v_g = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(s_v, 0, 3),
            cute.group_modes(pv_thr.partition_B(cute.flat_divide(m_v, (self.head_dim_v, self.page))), 0, 3))
        step = cutlass.Int32(0)  # global page step: ring slot step % kv_stages
        q_count = cutlass.Int32(0)
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.multi_token):
            self.zero_q_padding(s_q, lane)
        for it in cutlass.range(item_begin, item_end, unroll=1):
            kv_start, kv_end, steps = self.item_steps(items, it)
            if steps > 0:
                b = items[it, ItemField.REQUEST]
                h = items[it, ItemField.KV_HEAD]
                if cutlass.const_expr(self.multi_token):
                    if q_count > 0:
                        cute.arch.mbarrier_wait(misc + Q_EMPTY, (q_count - 1) % 2)
                    self.load_q_rows(q, qo_indptr, s_q, items, it, lane, misc)
                else:
                    first_head = h * self.group + items[it, ItemField.Q_ROW_START]
                    # Q rows = heads first_head + r of token b: offset the coordinate tensor; rows past Hq are
                    # zero-filled by the TMA, rows of other heads are finite padding (never stored).
                    m_q_item = cute.domain_offset((first_head, 0, 0), m_q)
                    t_q_s, t_q_g = cpasync.tma_partition(
                        tma_q, 0, cute.make_layout(1), cute.group_modes(s_q, 0, 3),
                        cute.group_modes(qk_thr.partition_A(cute.flat_divide(m_q_item, (MMA_M, self.head_dim))),
                                         0, 3))
                    if q_count > 0:
                        cute.arch.mbarrier_wait(misc + Q_EMPTY, (q_count - 1) % 2)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(misc + Q_FULL, self.q_bytes)
                    cute.copy(tma_q, t_q_g[None, 0, 0, b], t_q_s[None, 0], tma_bar_ptr=misc + Q_FULL)
                q_count += 1
                first_page = items[it, ItemField.KV_PAGE_START]  # kv_indptr[b] + kv_start // page, planned
                # page ids 32 at a time (one per lane, shuffled out): no global round trip per page
                for t0 in cutlass.range(0, steps, PAGE_IDS_PER_LOAD, unroll=1):
                    lane_page = cutlass.Int32(0)
                    if t0 + lane < steps:
                        lane_page = kv_indices[first_page + t0 + lane]
                    for j in cutlass.range(cutlass.min(PAGE_IDS_PER_LOAD, steps - t0), unroll=1):
                        page = cute.arch.shuffle_sync(lane_page, j)
                        stage = step % self.kv_stages
                        cute.arch.mbarrier_wait(kv_empty + stage, ((step // self.kv_stages) % 2) ^ 1)
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(kv_full + stage, self.kv_bytes)
                        cute.copy(tma_k, t_k_g[None, 0, 0, (h, page)], t_k_s[None, stage],
                                  tma_bar_ptr=kv_full + stage)
                        cute.copy(tma_v, t_v_g[None, 0, 0, (h, page)], t_v_s[None, stage],
                                  tma_bar_ptr=kv_full + stage)
                        step += 1

    def kv_rows_layout(self):
        """Small pages: the K (or V) ring as (keys, D, stage) rows, 128B-swizzled K-major atoms tiled keys first, so
        key k of a 64-column chunk sits at 128 B * k: the bytes of the MMA layouts of K (K-major) and V (MN-major,
        whose tile order puts keys first too)."""
        atom = sm100_utils.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, cutlass.BFloat16)
        return cute.tile_to_shape(atom, (self.step, self.head_dim, self.kv_stages), (0, 1, 2))

    @cute.jit
    def load_role_pages(self, qk_thr, tma_q, m_q, tma_k, m_k, tma_v, m_v, s_q, s_k_rows, s_v_rows,
                        kv_indices, items, item_begin, item_end, kv_full, kv_empty, misc):
        """Small pages: as :meth:`load_role`, but a step's K and V are ``pages_per_step`` page boxes each.

        Page ids one per lane (``common/page_ids.py``): one coalesced load covers ``32 / pages_per_step`` whole
        steps, or a step takes ``pages_per_step / 32`` loads; each box's id is shuffled out to the issuing lane
        (the DSL's TMA copy elects one lane). A page wholly past KV_END gets id -1: TMA zero-fills the box and
        still counts its bytes, so each step's kv_full expects ``kv_bytes``.
        """
        P, D, npg = self.page, self.head_dim, self.pages_per_step
        steps_per_round = max(1, IDS_PER_LOAD // npg)
        t_k_s, t_k_g, t_v_s, t_v_g = None, None, None, None
        if cutlass.const_expr(not self.gather4):
            t_k_s, t_k_g = cpasync.tma_partition(
                tma_k, 0, cute.make_layout(1), cute.group_modes(cute.flat_divide(s_k_rows, (P, D)), 0, 2),
                cute.group_modes(m_k, 0, 2))
            t_v_s, t_v_g = cpasync.tma_partition(
                tma_v, 0, cute.make_layout(1),
                cute.group_modes(cute.flat_divide(s_v_rows, (P, self.head_dim_v)), 0, 2), cute.group_modes(m_v, 0, 2))
        step = cutlass.Int32(0)  # global step: ring slot step % kv_stages
        q_count = cutlass.Int32(0)
        lane = cute.arch.lane_idx()
        lane_pages = cute.make_rmem_tensor((id_loads(npg),), cutlass.Int32)
        next_pages = cute.make_rmem_tensor((id_loads(npg),), cutlass.Int32)
        pages = cute.make_rmem_tensor((npg,), cutlass.Int32)
        desc_k = tma_descriptor_address(tma_k)
        desc_v = tma_descriptor_address(tma_v)
        for it in cutlass.range(item_begin, item_end, unroll=1):
            kv_start, kv_end, steps = self.item_steps(items, it)
            if steps > 0:
                b = items[it, ItemField.REQUEST]
                h = items[it, ItemField.KV_HEAD]
                first_head = h * self.group + items[it, ItemField.Q_ROW_START]
                m_q_item = cute.domain_offset((first_head, 0, 0), m_q)
                t_q_s, t_q_g = cpasync.tma_partition(
                    tma_q, 0, cute.make_layout(1), cute.group_modes(s_q, 0, 3),
                    cute.group_modes(qk_thr.partition_A(cute.flat_divide(m_q_item, (MMA_M, self.head_dim))), 0, 3))
                if q_count > 0:
                    cute.arch.mbarrier_wait(misc + Q_EMPTY, (q_count - 1) % 2)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(misc + Q_FULL, self.q_bytes)
                cute.copy(tma_q, t_q_g[None, 0, 0, b], t_q_s[None, 0], tma_bar_ptr=misc + Q_FULL)
                q_count += 1
                first_page = items[it, ItemField.KV_PAGE_START]
                n_pages = (kv_end - kv_start + P - 1) // P  # pages holding the item's keys
                load_lane_page_ids(kv_indices, next_pages, first_page, n_pages, lane)
                for t0 in cutlass.range(0, steps, steps_per_round, unroll=1):
                    t1 = t0 + steps_per_round
                    rotate_lane_page_ids(kv_indices, lane_pages, next_pages, first_page + t1 * npg, n_pages - t1 * npg,
                                         lane)
                    for j in cutlass.range(cutlass.min(steps_per_round, steps - t0), unroll=1):
                        stage = step % self.kv_stages
                        cute.arch.mbarrier_wait(kv_empty + stage, ((step // self.kv_stages) % 2) ^ 1)
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(kv_full + stage, self.kv_bytes)
                        if cutlass.const_expr(self.gather4):
                            mbar = (kv_full + stage).toint()
                            issue_page_gather4(desc_k, s_k_rows.iterator.toint() + stage * (self.step * D * 2),
                                               lane_pages, j * npg, h, mbar, npg, D // 64, self.step * 128, D)
                            issue_page_gather4(desc_v,
                                               s_v_rows.iterator.toint() + stage * (self.step * self.head_dim_v * 2),
                                               lane_pages, j * npg, h, mbar, npg, self.head_dim_v // 64,
                                               self.step * 128, self.head_dim_v)
                        elif cutlass.const_expr(ONE_ELECTION):
                            # one elected lane per step, not per box (common/tma_issue.py), where the partition puts
                            # the boxes: 64-column blocks step * 128 bytes apart, stages step * D * 2 bytes apart
                            for i in cutlass.range_constexpr(npg):
                                pages[i] = lane_page_id(lane_pages, i, j * npg)
                            mbar = (kv_full + stage).toint()
                            issue_page_boxes(desc_k, s_k_rows.iterator.toint() + stage * (self.step * D * 2), pages, h,
                                             mbar, npg, P, D // 64, self.step * 128, self.config.num_kv_heads)
                            issue_page_boxes(desc_v, s_v_rows.iterator.toint() + stage * (self.step * self.head_dim_v * 2),
                                             pages, h, mbar, npg, P, self.head_dim_v // 64, self.step * 128,
                                             self.config.num_kv_heads)
                        else:
                            for i in cutlass.range_constexpr(npg):
                                page = lane_page_id(lane_pages, i, j * npg)
                                cute.copy(tma_k, t_k_g[None, h, page], t_k_s[None, i, 0, stage],
                                          tma_bar_ptr=kv_full + stage)
                                cute.copy(tma_v, t_v_g[None, h, page], t_v_s[None, i, 0, stage],
                                          tma_bar_ptr=kv_full + stage)
                        step += 1

    # ------------------------------------------------------------------------------------------ MMA warp
    @cute.jit
    def mma_role(self, qk_mma, pv_mma, qk_thr, pv_thr, s_q, s_k, s_v, p_layout, tmem_ptr,
                 items, item_begin, item_end, kv_full, kv_empty, misc):
        t_s_q = qk_thr.make_fragment_A(s_q)
        t_s_k = qk_thr.make_fragment_B(s_k)
        t_o_v = pv_thr.make_fragment_B(s_v)
        s_acc = qk_thr.make_fragment_C(qk_thr.partition_shape_C(self.qk_tiler[:2]))
        o_acc = pv_thr.make_fragment_C(pv_thr.partition_shape_C(self.pv_tiler[:2]))
        t_o = cute.make_tensor(tmem_ptr + self.tmem.o_col, o_acc.layout)
        p_frag = pv_thr.make_fragment_A(cute.make_tensor(tmem_ptr, p_layout.outer))[None, None, None, 0]
        t_p = cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem.p_col, dtype=p_frag.element_type), p_frag.layout)
        num_k_qk = cute.size(t_s_q, mode=[2])
        num_k_pv = cute.size(t_p, mode=[2])

        s_step = cutlass.Int32(0)  # next S to issue (global page step)
        pv_step = cutlass.Int32(0)  # next PV to issue
        q_count = cutlass.Int32(0)
        for it in cutlass.range(item_begin, item_end, unroll=1):
            kv_start, kv_end, steps = self.item_steps(items, it)
            if steps > 0:
                cute.arch.mbarrier_wait(misc + Q_FULL, q_count % 2)
                q_count += 1
                for t in cutlass.range(steps + 1, unroll=1):
                    # S_t (issued one step ahead of PV_{t-1}, so softmax overlaps the PV)
                    if t < steps:
                        stage = s_step % self.kv_stages
                        buf = s_step % 2
                        cute.arch.mbarrier_wait(kv_full + stage, (s_step // self.kv_stages) % 2)
                        t_s = cute.make_tensor(tmem_ptr + buf * self.s_stride, s_acc.layout)
                        for kb in cutlass.range_constexpr(num_k_qk):
                            qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                            cute.gemm(qk_mma, t_s, t_s_q[None, None, kb, 0], t_s_k[None, None, kb, stage], t_s)
                        with cute.arch.elect_one():
                            tcgen05.commit(misc + S_FULL + buf)
                            if t == steps - 1:
                                tcgen05.commit(misc + Q_EMPTY)  # the item's last read of Q
                        s_step += 1
                    # O += P_{t-1} . V_{t-1}
                    if t > 0:
                        stage = pv_step % self.kv_stages
                        cute.arch.mbarrier_wait(misc + P_FULL, pv_step % 2)
                        _fence_after_sync()
                        for kb in cutlass.range_constexpr(num_k_pv):
                            if cutlass.const_expr(kb == 0):
                                pv_mma.set(tcgen05.Field.ACCUMULATE, t > 1)
                            else:
                                pv_mma.set(tcgen05.Field.ACCUMULATE, True)
                            cute.gemm(pv_mma, t_o, t_p[None, None, kb], t_o_v[None, None, kb, stage], t_o)
                        with cute.arch.elect_one():
                            tcgen05.commit(kv_empty + stage)
                            tcgen05.commit(misc + O_FULL)
                        pv_step += 1

    # ------------------------------------------------------------------------------------------ softmax WG
    @cute.jit
    def softmax_role(self, qk_thr, pv_thr, s_v, tmem_ptr, tidx, items, item_begin, item_end, merge_indptr,
                     merge_counters, arrival, partial_out, partial_lse, output, lse, scale_log2, lse_out_scale,
                     kv_full, misc, qo_indptr, line=None):
        f32 = cutlass.Float32
        neg_inf = -cutlass.Float32.inf
        # S: one tcgen05.ld 32x32b.x{page} per row; P: one tcgen05.st 32x32b.x{page/2} (bf16 pairs).
        s_acc = qk_thr.make_fragment_C(qk_thr.partition_shape_C(self.qk_tiler[:2]))
        t_s0 = cute.make_tensor(tmem_ptr + self.tmem.s_col[0], s_acc.layout)
        ld_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(self.step)), f32), t_s0)
        thr_ld_s = ld_s.get_slice(tidx)
        t_ld_s = thr_ld_s.partition_S(t_s0)
        c_s = qk_thr.partition_C(cute.make_identity_tensor(self.qk_tiler[:2]))
        t_c_s = thr_ld_s.partition_D(c_s)
        r_s = cute.make_rmem_tensor(t_c_s.shape, f32)

        p_cols = self.step // 2
        t_p = cute.make_tensor(tmem_ptr + self.tmem.p_col,
                               cute.composition(t_s0.layout, cute.make_layout((MMA_M, p_cols))))
        c_p = cute.make_tensor(c_s.iterator, cute.composition(c_s.layout, cute.make_layout((MMA_M, p_cols))))
        st_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(p_cols)), f32), t_p)
        thr_st_p = st_p.get_slice(tidx)
        t_st_p = thr_st_p.partition_D(t_p)
        r_p = cute.make_rmem_tensor(thr_st_p.partition_S(c_p).shape, f32)
        r_p_bf16 = cute.make_tensor(cute.recast_ptr(r_p.iterator, dtype=cutlass.BFloat16), r_s.layout)

        # O in chunks of 32 columns.
        o_chunk = 32
        o_acc = pv_thr.make_fragment_C(pv_thr.partition_shape_C(self.pv_tiler[:2]))
        t_o = cute.make_tensor(tmem_ptr + self.tmem.o_col,
                               cute.composition(o_acc.layout, cute.make_layout((MMA_M, o_chunk))))
        c_o = pv_thr.partition_C(cute.make_identity_tensor(self.pv_tiler[:2]))
        c_o = cute.make_tensor(c_o.iterator, cute.composition(c_o.layout, cute.make_layout((MMA_M, o_chunk))))
        ld_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(o_chunk)), f32), t_o)
        st_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(o_chunk)), f32), t_o)
        t_ld_o = ld_o.get_slice(tidx).partition_S(t_o)
        t_st_o = st_o.get_slice(tidx).partition_D(t_o)
        r_o = cute.make_rmem_tensor(ld_o.get_slice(tidx).partition_D(c_o).shape, f32)
        num_o_chunks = self.head_dim_v // o_chunk

        step = cutlass.Int32(0)  # global page step (S buffer, ring slot, p_full/o_full phases)
        for it in cutlass.range(item_begin, item_end, unroll=1):
            kv_start, kv_end, steps = self.item_steps(items, it)
            row_limit = kv_end  # one past the last key of this thread's row: KV_END, or its causal limit
            if cutlass.const_expr(self.multi_token):
                # token t of the request sees keys <= t + CAUSAL_OFFSET; a padding row takes the last real row's
                r = cutlass.min(tidx, items[it, ItemField.Q_ROW_COUNT] - 1)
                token = (items[it, ItemField.Q_ROW_START] + r) // self.group
                row_limit = cutlass.min(kv_end, token + items[it, ItemField.CAUSAL_OFFSET] + 1)
            row_max = neg_inf
            row_sum = f32(0.0)
            for t in cutlass.range(steps, unroll=1):
                buf = step % 2
                cute.arch.mbarrier_wait(misc + S_FULL + buf, (step // 2) % 2)
                cute.copy(ld_s, cute.make_tensor(t_ld_s.iterator + buf * self.s_stride, t_ld_s.layout), r_s)
                cute.arch.fence_view_async_tmem_load()
                key0 = kv_start + t * self.step
                tile_max = neg_inf
                for i in cutlass.range_constexpr(cute.size(r_s)):
                    x = r_s[i] * scale_log2
                    if key0 + t_c_s[i][1] >= row_limit:
                        x = neg_inf
                    r_s[i] = x
                    tile_max = cute.arch.fmax(tile_max, x)
                new_max = cute.arch.fmax(row_max, tile_max)
                safe_max = new_max
                if new_max == neg_inf:
                    safe_max = f32(0.0)
                alpha = cute.math.exp2(row_max - safe_max, fastmath=True)  # 0 while row_max is -inf
                tile_sum = f32(0.0)
                for i in cutlass.range_constexpr(cute.size(r_s)):
                    p = cute.math.exp2(r_s[i] - safe_max, fastmath=True)
                    r_s[i] = p
                    tile_sum = tile_sum + p
                row_sum = row_sum * alpha + tile_sum
                row_max = new_max
                r_p_bf16.store(r_s.load().to(cutlass.BFloat16))

                if t > 0:  # correction: O holds P_{t-1}.V_{t-1}; rescale before PV_t accumulates
                    cute.arch.mbarrier_wait(misc + O_FULL, (step - 1) % 2)
                    _fence_after_sync()
                    if cute.arch.vote_any_sync(alpha != 1.0):  # warp-uniform: TMEM ld/st are warp-collective
                        for c in cutlass.range_constexpr(num_o_chunks):
                            cute.copy(ld_o, cute.make_tensor(t_ld_o.iterator + c * o_chunk, t_ld_o.layout), r_o)
                            cute.arch.fence_view_async_tmem_load()
                            for i in cutlass.range_constexpr(cute.size(r_o)):
                                r_o[i] = r_o[i] * alpha
                            cute.copy(st_o, r_o, cute.make_tensor(t_st_o.iterator + c * o_chunk, t_st_o.layout))
                if key0 + self.step > kv_end:  # last step: zero V rows >= KV_END (NaN poison)
                    stage = step % self.kv_stages
                    cute.arch.mbarrier_wait(kv_full + stage, (step // self.kv_stages) % 2)
                    self.zero_v_tail(s_v, stage, key0, kv_end, tidx)
                cute.copy(st_p, r_p, t_st_p)
                cute.arch.fence_view_async_tmem_store()
                _fence_before_sync()
                cute.arch.mbarrier_arrive(misc + P_FULL)
                step += 1

            self.epilogue(items, it, steps, step, row_max, row_sum, tidx, ld_o, t_ld_o, r_o, num_o_chunks,
                          o_chunk, partial_out, partial_lse, output, lse, lse_out_scale, misc, qo_indptr)
        if cutlass.const_expr(self.line):
            end_line(items, line, merge_counters, arrival, partial_out, partial_lse, output, lse, lse_out_scale, tidx,
                     MERGE_BARRIER_ID, 32 * SOFTMAX_WARPS, self.head_dim_v)
        else:
            fold_completed_merges(items, item_begin, item_end, merge_indptr, merge_counters, arrival, self.group,
                                  partial_out, partial_lse, output, lse, lse_out_scale, tidx, MERGE_BARRIER_ID,
                                  32 * SOFTMAX_WARPS, qo_indptr)

    @cute.jit
    def zero_v_tail(self, s_v, stage, key0, kv_end, tidx):
        """Zero ring slot ``stage``'s V rows that may hold pool garbage (``common/kv_tail.py``, ``kv_end`` for
        ``kv_len`` as on sm_90a), a head-dim column a thread, then fence them into the async proxy."""
        first, end = garbage_rows(key0, kv_end, kv_end, self.step, self.page)
        for col0 in cutlass.range_constexpr(0, self.head_dim_v, 32 * SOFTMAX_WARPS):
            col = tidx + col0
            if col < self.head_dim_v:
                # V's smem mode 0 is one MMA atom: (head_dim columns, 16 keys of a K block)
                for j in cutlass.range(first, end, unroll=1):
                    s_v[((col, j % 16), 0, j // 16, stage)] = cutlass.BFloat16(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def epilogue(self, items, it, steps, step, row_max, row_sum, tidx, ld_o, t_ld_o, r_o, num_o_chunks, o_chunk,
                 partial_out, partial_lse, output, lse, lse_out_scale, misc, qo_indptr):
        """Final normalisation and stores of row ``tidx`` (0 and -inf for a row that saw no key)."""
        f32 = cutlass.Float32
        neg_inf = -cutlass.Float32.inf
        rows = items[it, ItemField.Q_ROW_COUNT]
        b = items[it, ItemField.REQUEST]  # decode: packed row r is head h*group + Q_ROW_START + r of token b
        head = items[it, ItemField.KV_HEAD] * self.group + items[it, ItemField.Q_ROW_START] + tidx
        if cutlass.const_expr(self.multi_token):  # row r: token qo_indptr[b] + (Q_ROW_START + r) // group
            b = qo_indptr[b] + (items[it, ItemField.Q_ROW_START] + tidx) // self.group
            head = items[it, ItemField.KV_HEAD] * self.group + tidx % self.group
        slot = items[it, ItemField.PARTIAL_SLOT]
        if steps > 0:
            cute.arch.mbarrier_wait(misc + O_FULL, (step - 1) % 2)
            _fence_after_sync()
        inv_sum = f32(0.0)
        row_lse = neg_inf
        if row_sum > 0.0:
            inv_sum = 1.0 / row_sum
            row_lse = row_max + cute.math.log2(row_sum, fastmath=True)
        for c in cutlass.range_constexpr(num_o_chunks):
            if steps > 0:  # tcgen05.ld is warp-collective: every row loads, only real rows store
                cute.copy(ld_o, cute.make_tensor(t_ld_o.iterator + c * o_chunk, t_ld_o.layout), r_o)
                cute.arch.fence_view_async_tmem_load()
            if tidx < rows:
                for i in cutlass.range_constexpr(cute.size(r_o)):
                    o = f32(0.0)
                    if steps > 0:
                        o = r_o[i] * inv_sum
                    if slot < 0:
                        output[b, head, c * o_chunk + i] = o.to(cutlass.BFloat16)
                    else:
                        partial_out[slot, tidx, c * o_chunk + i] = o
        if tidx < rows:
            if slot < 0:
                lse[b, head] = row_lse * lse_out_scale
            else:
                partial_lse[slot, tidx] = row_lse
        _fence_before_sync()


class GqaMultiTokenDecodeSm100(GqaDecodeSm100):
    """Multi-token (speculative) decode: the decode kernel with ``qo_indptr`` (packed rows are q_len tokens'
    heads, loaded by the load warp with 16-byte loads instead of one TMA box) and a per-row causal mask."""

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # [total_q, num_qo_heads, head_dim] bf16
        k_cache: cute.Tensor,
        v_cache: cute.Tensor,
        qo_indptr: cute.Tensor,  # [batch + 1] int32
        kv_indices: cute.Tensor,
        work_indptr: cute.Tensor,
        items: cute.Tensor,
        merge_indptr: cute.Tensor,
        merge_counters: cute.Tensor,
        output: cute.Tensor,  # [total_q, num_qo_heads, head_dim_v] bf16
        lse: cute.Tensor,  # [total_q, num_qo_heads] fp32
        partial_out: cute.Tensor,
        partial_lse: cute.Tensor,
        scale_log2: cutlass.Float32,
        lse_out_scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        self.launch_kernel(q, k_cache, v_cache, qo_indptr, kv_indices, work_indptr, items, merge_indptr,
                           merge_counters, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream)


# ---------------------------------------------------------------------------------------------- API
build, launch = gqa_decode_entry(GqaDecodeSm100, check_config)
multi_token_build, multi_token_launch = gqa_multi_token_decode_entry(GqaMultiTokenDecodeSm100, check_config)


register_paged_kernel(KIND, ARCH, build=build, launch=launch, configs=configs, check_config=check_config)
register_paged_kernel(MULTI_TOKEN_KIND, ARCH, build=multi_token_build, launch=multi_token_launch,
                      configs=multi_token_configs, check_config=check_config)

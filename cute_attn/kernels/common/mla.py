"""What the sm_90a and sm_100a absorbed-MLA paged prefill kernels share: the definition and the load role.

Definition: 16 query heads share one latent KV row per key; ``s = sm_scale * (q_nope . ckv + q_pe . kpe)``
(``QK_DIM`` = 576 wide), ``o = softmax(s) @ ckv`` (V = ckv, 512 wide). Packed rows: group = all heads, one KV
head, so packed row ``p`` of request ``b`` is element row ``qo_indptr[b] * heads + p`` of ``q_nope`` viewed as
``[*, 512]`` (and of ``q_pe``). Caches ``[num_pages, page_size, 512]`` / ``[num_pages, page_size, 64]``
(contiguous), ``page_size`` a power of two in 1..128 (a compile-time constant of the config): key ``j`` of
request ``b`` is slot ``j % page_size`` of page ``kv_indices[kv_indptr[b] + j // page_size]``, i.e. latent row
``page * page_size + slot`` of the caches viewed as ``[num_pages * page_size, *]``.

Load role (:func:`load_q_and_kv_tiles`, one warpgroup, every thread gathering with 16-byte ``cp.async``,
``common/row_gather.py``). Per item: the Q tile (``tile_m`` packed rows x (512 nope + 64 pe) into one
576-wide smem tile; rows >= ``Q_ROW_COUNT`` zero-filled), then per ``kv_tile`` keys one K stage holding
the keys' ckv and kpe rows side by side. Row ids: the first ``kv_tile`` threads turn their key into a
latent row id (page id from ``kv_indices``, loaded one tile ahead, an item's first ones before its Q tile from the
item's ``KV_PAGE_START``; slot from the key) in a double-buffered smem table
(double-buffered so that a fast thread filling the next tile's ids cannot overwrite ids a slow thread
still gathers from), then a named barrier of the load threads; keys >= ``KV_END`` get id -1 and are
zero-filled: the pool holds NaN in rows no request owns, and V = ckv feeds the P V MMA, where 0 * NaN would
poison O. Each thread then waits for its copies, fences them into the async proxy and arrives on the
stage's full barrier; or (``async_kv``, sm_90a) the K stage's rows, zero-fills included, are all cp.async and
complete on the full barrier by themselves (``noinc``), so two stages load at once, and the consumers fence.

Bounds (defence in depth, issue 9): a page id outside ``[0, num_pages)`` (``num_pages`` = the cache's
extent, a runtime value) also gets id -1, so the gathers never dereference it, even when the host skipped
the index checks (``check_indices=False`` with a ``plan=``): the key then reads as a zero ckv / kpe row
(logit 0, V 0), so only the request holding the bad id gets an unspecified (finite) result. One compare
pair per key per tile, on the id-table threads only.

Self-scheduling builds (``dynamic_schedule``, sm_90a) run :func:`load_units` instead: the same loads, unit by unit
from a counter (``unit_schedule.py``), no plan.

Row gathers work for every page size. On sm_90a pages of >= 8 keys take TMA tile boxes instead
(:func:`box_latent_tile`: 8-row boxes, whole 128B-swizzle atoms, 1-row boxes for an item's partial last group),
issued from one thread: 72 instructions a 64-key stage instead of 4608 16-byte cp.async.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ...config import PagedAttentionConfig, default_paged_config
from ...plan import ItemField as F
from .paged_launch import checked_build, launch_paged
from .row_gather import (ROW_CHUNK, commit_rows, gather_row_segments, gather_rows, gather_rows_zero_fill,
                         make_row_copy_atom, segments_fit)
from .tma_issue import tma_gather4, tma_load

KIND = "mla_paged_prefill"
CKV_DIM = 512
KPE_DIM = 64
QK_DIM = CKV_DIM + KPE_DIM
NUM_HEADS = 16  # the definition's; head counts that divide the 64-row tile work too (rows pack whole tokens)


# ----------------------------------------------------------------------------------------- host side
def definition_config(arch: str, page_size: int = 1) -> PagedAttentionConfig:
    """The definition's config (``mla_paged_prefill_causal_h16_ckv512_kpe64_ps<page_size>``) for ``arch``."""
    return default_paged_config(KIND, arch=arch, num_qo_heads=NUM_HEADS, num_kv_heads=1, head_dim_qk=QK_DIM,
                                head_dim_v=CKV_DIM, page_size=page_size, causal=True)


#: the page sizes of the FlashInfer-Bench MLA definitions (ps1, ps64): the configs each arch registers
DEFINITION_PAGE_SIZES = (1, 64)
#: every page size the load role gathers (row gathers: any power of two; the planner's tiles are 64 keys)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def fake_args(config: PagedAttentionConfig) -> tuple:
    """Fake tensors (symbolic token, page, index and plan extents) in the kernels' entry argument order
    (``fused_merge``, ``eager_combine``, ``cluster_merge_flags``: ``merge_indptr, merge_counters`` after ``items``)."""
    bf16, i32, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Float32
    h = config.num_qo_heads
    fake = cute.runtime.make_fake_compact_tensor
    rows = cute.sym_int(symbol="total_q")
    num_pages = cute.sym_int(symbol="num_pages")
    slots = cute.sym_int(symbol="partial_slots")
    return (
        fake(bf16, (rows, h, CKV_DIM), stride_order=(2, 1, 0), assumed_align=16),
        fake(bf16, (rows, h, KPE_DIM), stride_order=(2, 1, 0), assumed_align=16),
        fake(bf16, (num_pages, config.page_size, CKV_DIM), stride_order=(2, 1, 0), assumed_align=16),
        fake(bf16, (num_pages, config.page_size, KPE_DIM), stride_order=(2, 1, 0), assumed_align=16),
        fake(i32, (cute.sym_int(symbol="batch_plus_1"),)),
        fake(i32, (cute.sym_int(symbol="kv_indptr_len"),)),
        fake(i32, (cute.sym_int(symbol="num_indices"),)),
        fake(i32, (cute.sym_int(symbol="ctas_plus_1"),)),
        fake(i32, (cute.sym_int(symbol="max_items"), len(F)), stride_order=(1, 0)),
        *((fake(i32, (cute.sym_int(symbol="max_merges_plus_1"),)), fake(i32, (cute.sym_int(symbol="merge_counters"),)))
          if config.fused_merge or config.eager_combine or config.cluster_merge_flags else ()),
        fake(bf16, (rows, h, CKV_DIM), stride_order=(2, 1, 0), assumed_align=16),
        fake(f32, (rows, h), stride_order=(1, 0)),
        fake(bf16 if config.bf16_partials else f32, (slots, config.tile_q_rows, CKV_DIM),
             stride_order=(2, 1, 0), assumed_align=16),
        fake(f32, (slots, config.tile_q_rows), stride_order=(1, 0)),
        f32(1.0),
        f32(1.0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )


def dynamic_fake_args(config: PagedAttentionConfig) -> tuple:
    """Fake arguments of a self-scheduling build's ``call_dynamic`` entry (sm_90a ``dynamic_schedule``): ``q_nope,
    q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, request_faults, unit_state,
    error_word, output, lse, scale_log2, lse_out_scale, num_pages, num_ctas, stream`` (no plan)."""
    from .unit_schedule import UNIT_STATE_WORDS

    base = fake_args(config)
    i32 = cutlass.Int32
    fake = cute.runtime.make_fake_compact_tensor
    output, lse, scale_log2, lse_out_scale, stream = base[9], base[10], base[13], base[14], base[15]
    return (*base[:7], fake(i32, (cute.sym_int(symbol="batch"),)), fake(i32, (cute.sym_int(symbol="request_faults"),)),
            fake(i32, (UNIT_STATE_WORDS,)), fake(i32, (4,)), output, lse, scale_log2, lse_out_scale, i32(1), i32(1),
            stream)


def line_fake_args(config: PagedAttentionConfig) -> tuple:
    """Fake arguments of a ``line_schedule`` build's ``call_line`` entry (the MLA decode's one-token configs):
    ``q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, merge_counters,
    request_faults, unit_state, error_word, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale,
    num_pages, num_ctas, stream`` (no plan: ``kernels/common/line_schedule.py``)."""
    from .unit_schedule import UNIT_STATE_WORDS

    base = fake_args(config)
    i32 = cutlass.Int32
    fake = cute.runtime.make_fake_compact_tensor
    output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream = base[9:16]
    return (*base[:7], fake(i32, (cute.sym_int(symbol="batch"),)), fake(i32, (cute.sym_int(symbol="merge_counters"),)),
            fake(i32, (cute.sym_int(symbol="request_faults"),)), fake(i32, (UNIT_STATE_WORDS,)), fake(i32, (4,)),
            output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, i32(1), i32(1), stream)


def mla_line_reason(config: PagedAttentionConfig, table_requests: int) -> str | None:
    """Why an MLA kernel (either arch) does not make the ``line_schedule`` build of a one-token decode ``config``
    (None: it does): the build folds its own merges (no cluster fold, eager combine, self-scheduling units or probe),
    its plan is derivable per CTA, and its table (``table_requests`` of them, over the K stages) holds a request."""
    from ...line_schedule import cuts_only, line_reason
    from .line_schedule import baked_rules_reason, mla_line_rules

    if (config.cluster_merge or config.eager_combine or config.dynamic_schedule or config.probe or config.fused_merge
            or config.bf16_partials):
        return ("line_schedule folds its merges in the kernel from fp32 partials (its own entry and scratch): no "
                "cluster_merge, eager_combine, fused_merge, bf16_partials, dynamic_schedule or probe")
    plan_config = cuts_only(config.plan_config(1))
    if (reason := line_reason(plan_config, one_token=True)) is not None:
        return reason
    if (reason := baked_rules_reason(plan_config, mla_line_rules(config))) is not None:
        return reason
    if table_requests < 1:
        return "the K stages are too small for the line table"
    return None


def fold_arrival_bytes(config: PagedAttentionConfig) -> int:
    """Shared memory of the in-kernel fold's arrival word (``fused_merge``, ``line_schedule``; 16-byte aligned), 0
    without one."""
    return 16 if config.fused_merge or config.line_schedule else 0


class MlaEntries:
    """The host entries of every MLA kernel class, in :func:`fake_args` order: ``__call__`` (the combine follows),
    ``call_fused`` (``fused_merge``: ``merge_indptr, merge_counters`` after ``items``; the kernel folds its merges) and
    ``call_dynamic`` (``dynamic_schedule``: :func:`dynamic_fake_args`, no plan). A class implements ``launch_kernel``
    with the merge table as two arguments after ``items`` (None: no fold) and ``units`` (the self-scheduling
    build's arguments, None otherwise)."""

    @cute.jit
    def __call__(self, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
                 qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor,
                 items: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor,
                 partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32, stream: cuda.CUstream):
        self.launch_kernel(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, work_indptr, items,
                           None, None, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream)

    @cute.jit
    def call_fused(self, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
                   qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor,
                   items: cute.Tensor, merge_indptr: cute.Tensor, merge_counters: cute.Tensor, output: cute.Tensor,
                   lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor, scale_log2: Float32,
                   lse_out_scale: Float32, stream: cuda.CUstream):
        self.launch_kernel(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, work_indptr, items,
                           merge_indptr, merge_counters, output, lse, partial_out, partial_lse, scale_log2,
                           lse_out_scale, stream)

    @cute.jit
    def call_dynamic(self, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
                     qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor,
                     kv_last_page_len: cute.Tensor, request_faults: cute.Tensor, unit_state: cute.Tensor,
                     error_word: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, scale_log2: Float32,
                     lse_out_scale: Float32, num_pages: Int32, num_ctas: Int32, stream: cuda.CUstream):
        """``dynamic_schedule``: no plan, one launch (``common/unit_schedule.py``, :func:`load_units`):
        ``num_ctas`` CTAs check the batch's rules and scan its page ids (of a pool of ``num_pages``), then take units
        from ``unit_state``. ``kv_last_page_len``: ones at page size 1 when the caller has none."""
        self.launch_kernel(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, None, None, None,
                           None, output, lse, None, None, scale_log2, lse_out_scale, stream,
                           units=(kv_last_page_len, request_faults, unit_state, num_ctas, error_word, num_pages))

    @cute.jit
    def call_line(self, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
                  qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor,
                  kv_last_page_len: cute.Tensor, merge_counters: cute.Tensor, request_faults: cute.Tensor,
                  unit_state: cute.Tensor, error_word: cute.Tensor, output: cute.Tensor, lse: cute.Tensor,
                  partial_out: cute.Tensor, partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32,
                  num_pages: Int32, num_ctas: Int32, stream: cuda.CUstream):
        """``line_schedule`` (the MLA decode's one-token configs): no plan, one launch; each of ``num_ctas`` CTAs
        derives its stretch of the cost line (``common/line_schedule.py``) and folds its split items in the kernel
        (``merge_counters``, ``partial_out`` / ``partial_lse`` of ``2 * num_ctas`` slots)."""
        self.launch_kernel(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, None, None, None,
                           merge_counters, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream,
                           units=(kv_last_page_len, request_faults, unit_state, num_ctas, error_word, num_pages))


def mla_entry(kernel_cls, check_config) -> tuple:
    """``(build, launch)`` of an MLA prefill kernel class (the arguments of :func:`fake_args`; the combine after,
    or with ``config.fused_merge`` the kernel's ``call_fused`` entry, which folds its merges itself)."""

    def build(config: PagedAttentionConfig) -> tuple:
        if config.dynamic_schedule:  # no plan: the kernel schedules itself (load_units)
            kernel, fake = checked_build(kernel_cls, check_config, config, dynamic_fake_args(config))
            return kernel.call_dynamic, fake
        if config.line_schedule:  # no plan: each CTA derives its stretch (common/line_schedule.py)
            kernel, fake = checked_build(kernel_cls, check_config, config, line_fake_args(config))
            return kernel.call_line, fake
        kernel, fake = checked_build(kernel_cls, check_config, config, fake_args(config))
        # call_fused: the merge table after items, for the kernel's fold (fused_merge), its arrivals (eager_combine)
        # or its cluster-fold flags (cluster_merge_flags)
        with_merges = config.fused_merge or config.eager_combine or config.cluster_merge_flags
        return (kernel.call_fused if with_merges else kernel), fake

    def launch(device_plan, q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, *rest,
               natural_lse: bool = False, planned=None) -> None:
        """Run the plan's items, then the combine kernel if the plan split any item.

        ``rest``: ``sm_scale, output, lse`` or ``kv_last_page_len, sm_scale, output, lse`` (the kernels take
        no ``kv_last_page_len``: the plan's ``KV_END`` holds each request's key count)."""
        sm_scale, output, lse = rest[-3:]
        launch_paged(device_plan, check_config, (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr,
                                                 kv_indices), sm_scale, output, lse, natural_lse,
                     fused_merge=device_plan.config.fused_merge, planned=planned)

    return build, launch


# ----------------------------------------------------------------------------------------- load role
@cute.jit
def load_q_and_kv_tiles(tid: Int32, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor,
                        kpe_cache: cute.Tensor, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor,
                        kv_indices: cute.Tensor, items: cute.Tensor, item_begin: Int32, item_end: Int32,
                        s_q: cute.Tensor, s_k: cute.Tensor, s_ids: cute.Tensor, pipe_q, pipe_kv, q_state, kv_state,
                        group: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int],
                        ids_barrier: cutlass.Constexpr[int], q_for_keyless_items: cutlass.Constexpr[bool],
                        async_kv: cutlass.Constexpr[bool] = False, kv_gather4=None, kv_boxes=None,
                        skip_kv_copies: cutlass.Constexpr[bool] = False,
                        row_segments: cutlass.Constexpr[bool] = False,
                        early_page_ids: cutlass.Constexpr[bool] = True,
                        early_first_stage: cutlass.Constexpr[bool] = False):
    """The load role over items ``item_begin .. item_end - 1`` (thread ``tid`` of ``num_threads``).

    ``s_q``: ``(tile_m, 576)`` smem tile; ``s_k``: ``(kv_tile, 576, stage)``; ``s_ids``: ``(kv_tile, 2)``
    Int32 row-id table; ``ids_barrier``: a named barrier id free for the load threads.
    ``q_for_keyless_items``: load Q for items without keys too (their consumers still wait on Q).
    ``async_kv``: K stages gathered by :func:`gather_rows_zero_fill` and committed with the pipeline's own producer
    commit (``PipelineCpAsync``: ``cp.async.mbarrier.arrive.noinc``), so the thread does not wait for a tile to land
    before gathering the next one (two tiles in flight instead of one); the consumers fence after their wait.
    ``kv_gather4`` (sm_100a): ``(ckv, kpe)`` tensor-map addresses of the caches as rows (:func:`row_view`, boxes of
    one row x 64 columns); the K stages are then TMA ``gather4`` boxes from one elected thread of warp 0
    (:func:`gather4_latent_tile`; ``pipe_kv`` a TMA pipeline counting the stage's bytes), not cp.async.
    ``kv_boxes`` (sm_90a, pages of >= ``BOX_ROWS`` keys): ``(ckv, kpe)`` pairs of tensor-map addresses ``((ckv 8-row,
    ckv 1-row), (kpe 8-row, kpe 1-row))`` over the caches as rows; the K stages are then TMA tile boxes from one
    elected thread of warp 0 (:func:`box_latent_tile`; ``pipe_kv`` a ``PipelineTmaAsync`` counting the stage's bytes).
    ``skip_kv_copies`` (with ``async_kv``; the ``compute_only`` probe): each K stage is acquired and committed without
    a copy (the commit's ``noinc`` arrival then completes at once), so the consumers run on whatever it holds.
    ``row_segments`` (sm_90a, with ``async_kv``): the cp.async rows of the K stages and of Q are dealt by 128-byte
    segments (:func:`gather_row_segments`: 4 row ids and addresses a thread a tile, not 36).
    ``early_page_ids`` (``PagedAttentionConfig.early_page_ids``): an item's first page ids load before its Q tile,
    from the item's ``KV_PAGE_START``; else after Q's wait, from ``kv_indptr`` (the order before session 43).
    ``early_first_stage`` (``PagedAttentionConfig.early_first_stage``; TMA-box stages only): the thread waits for its
    Q copies after the item's first K stage is issued, not before.
    """
    gather = _gather_setup(s_q, s_k, ckv_cache, kpe_cache, kv_boxes, kv_gather4)
    copy_atom, zeros, s_q_chunks = gather[0], gather[1], gather[2]
    defer_q_wait = early_first_stage and q_for_keyless_items and gather[8] is not None
    tiles_done = Int32(0)
    for it in cutlass.range(item_begin, item_end, unroll=1):
        b = items[it, int(F.REQUEST)]
        r0 = items[it, int(F.Q_ROW_START)]
        row_count = items[it, int(F.Q_ROW_COUNT)]
        kv_start = items[it, int(F.KV_START)]
        kv_end = items[it, int(F.KV_END)]
        # the item's first page ids load before its Q does, from the item's own kv_indices position (no kv_indptr
        # load): they were the chain's last two dependent loads after Q's wait (work_indptr, the item, qo_indptr, Q,
        # kv_indptr, kv_indices, then the first TMA); now they run under Q's
        first_ids = None
        if cutlass.const_expr(early_page_ids):
            page_base = items[it, int(F.KV_PAGE_START)] - (kv_start >> gather[4])
            first_ids = (page_base, _key_page(kv_indices, page_base, kv_start + tid,
                                              kv_end if tid < cute.size(s_k, mode=[0]) else kv_start, gather[4]))
        # where every item needs Q, it is issued before the key count: the GPU-validated sm_90a kernel's
        # order (computing the count first changes that kernel's PTX). Issuing an item's first K tile before its Q
        # (Q completing on its barrier by itself) was measured slower on the H200: docs/perf-history.md, sessions 12-13;
        # early_first_stage keeps Q issued first and moves only its wait after the first K stage (session 44)
        if cutlass.const_expr(q_for_keyless_items):
            _load_q_tile(copy_atom, zeros, q_nope, q_pe, qo_indptr, b, r0, row_count, s_q_chunks, tid, group,
                         num_threads, pipe_q, q_state, row_segments=row_segments, wait=not defer_q_wait)
            if cutlass.const_expr(not defer_q_wait):
                q_state.advance()
        q_state, kv_state, tiles_done = _load_item_keys(
            gather, tid, q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, b, r0, row_count,
            kv_start, kv_end, s_k, s_ids, pipe_q, pipe_kv, q_state, kv_state, tiles_done, group, num_threads,
            ids_barrier, q_for_keyless_items, async_kv, skip_kv_copies, row_segments, first_ids, defer_q_wait)
        if cutlass.const_expr(defer_q_wait):
            q_state.advance()


@cute.jit
def _gather_setup(s_q: cute.Tensor, s_k: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor, kv_boxes,
                  kv_gather4):
    """What every item's loads share: ``(copy_atom, zeros, s_q_chunks, s_k_chunks, page_shift, ckv_stride,
    kpe_stride, num_pages, tma_tile, tma_maps)``."""
    copy_atom = make_row_copy_atom(s_q.element_type)
    zeros = cute.make_rmem_tensor((ROW_CHUNK,), s_q.element_type)
    zeros.fill(0.0)
    s_q_chunks = cute.flat_divide(s_q, (1, ROW_CHUNK))  # (1, vec, row, chunk)
    s_k_chunks = cute.flat_divide(s_k, (1, ROW_CHUNK))  # (1, vec, row, chunk, stage)
    # latent rows: ids index the caches as [num_pages * page_size, dim] (contiguous caches: row stride = dim)
    page_shift = ckv_cache.shape[1].bit_length() - 1  # a power of two: the static page size of the config
    ckv_stride = Int64(ckv_cache.stride[1])
    kpe_stride = Int64(kpe_cache.stride[1])
    num_pages = ckv_cache.shape[0]  # kpe_cache has as many (the entry rules)
    # the TMA K stage: one issuer for both arches' tensor maps (sm_90a 8-row boxes, sm_100a gather4), same arguments
    tma_tile, tma_maps = None, None
    if cutlass.const_expr(kv_boxes is not None):
        tma_tile, tma_maps = box_latent_tile, kv_boxes
    elif cutlass.const_expr(kv_gather4 is not None):
        tma_tile, tma_maps = gather4_latent_tile, kv_gather4
    return (copy_atom, zeros, s_q_chunks, s_k_chunks, page_shift, ckv_stride, kpe_stride, num_pages, tma_tile,
            tma_maps)


@cute.jit
def _load_item_keys(gather, tid: Int32, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor,
                    kpe_cache: cute.Tensor, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor,
                    b: Int32, r0: Int32, row_count: Int32, kv_start: Int32, kv_end: Int32, s_k: cute.Tensor,
                    s_ids: cute.Tensor, pipe_q, pipe_kv, q_state, kv_state, tiles_done: Int32,
                    group: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int],
                    ids_barrier: cutlass.Constexpr[int], q_for_keyless_items: cutlass.Constexpr[bool],
                    async_kv: cutlass.Constexpr[bool], skip_kv_copies: cutlass.Constexpr[bool],
                    row_segments: cutlass.Constexpr[bool], first_ids=None,
                    q_wait_pending: cutlass.Constexpr[bool] = False):
    """One item's K stages (and its Q where only items with keys load one): :func:`load_q_and_kv_tiles`' body after
    the Q tile. Returns ``(q_state, kv_state, tiles_done)``. ``first_ids``: ``(page_base, first_page)`` the caller
    loaded already (the ``kv_indices`` position of the request's page 0 and this thread's page id of the first tile,
    :func:`_key_page`), else they load here, from ``kv_indptr``. ``q_wait_pending``: the caller issued Q's copies
    without waiting for them (``early_first_stage``): the wait, fence and arrival on ``q_state`` follow the first K
    stage's issue (or come at once for an item without keys); the caller advances ``q_state``."""
    copy_atom, zeros, s_q_chunks, s_k_chunks, page_shift, ckv_stride, kpe_stride, num_pages, tma_tile, tma_maps = \
        gather
    tile_n = cute.size(s_k, mode=[0])
    stage_bytes = cute.crd2idx((0, 0, 1), s_k.layout) * 2  # stage 1's offset (a stage may end in a pad)
    page_base = kv_indptr[b] if cutlass.const_expr(first_ids is None) else first_ids[0]
    num_tiles = cute.ceil_div(kv_end - kv_start, tile_n) if kv_end > kv_start else 0
    if cutlass.const_expr(not q_for_keyless_items):
        if num_tiles > 0:  # Q's consumer skips items without keys
            _load_q_tile(copy_atom, zeros, q_nope, q_pe, qo_indptr, b, r0, row_count, s_q_chunks, tid, group,
                         num_threads, pipe_q, q_state, row_segments=row_segments)
            q_state.advance()
    # each thread's key of the next tile: its page id is loaded a tile ahead, so the load's latency runs under
    # this tile's copies instead of in front of them (every tile paid it, and the named barrier made every
    # load thread wait for the slowest)
    ids_end = kv_end if tid < tile_n else kv_start  # the id threads: one key a tile each
    if cutlass.const_expr(first_ids is None):
        next_page = _key_page(kv_indices, page_base, kv_start + tid, ids_end, page_shift)
    else:
        next_page = first_ids[1]
    for t in cutlass.range(num_tiles, unroll=1):
        kv_base = kv_start + t * tile_n
        page = next_page
        next_page = _key_page(kv_indices, page_base, kv_base + tile_n + tid, ids_end, page_shift)
        ids = s_ids[None, tiles_done % 2]
        if tid < tile_n:
            ids[tid] = _page_row(page, kv_base + tid, num_pages, page_shift)
        cute.arch.barrier(barrier_id=ids_barrier, number_of_threads=num_threads)
        tiles_done += 1
        if cutlass.const_expr(tma_tile is not None):
            if tid < 32:  # the TMA pipeline's producer: one elected thread of warp 0
                pipe_kv.producer_acquire(kv_state)
                tma_tile(tma_maps[0], tma_maps[1], s_k.iterator.toint() + kv_state.index * stage_bytes,
                         ids, pipe_kv.producer_get_barrier(kv_state).toint(), tile_n)
            if cutlass.const_expr(q_wait_pending):
                if t == 0:
                    commit_rows(pipe_q, q_state)
        elif cutlass.const_expr(async_kv):
            pipe_kv.producer_acquire(kv_state)
            if cutlass.const_expr(not skip_kv_copies):
                s_stage = s_k_chunks[None, None, None, None, kv_state.index]
                by_segments = row_segments and segments_fit(s_stage, KPE_DIM, num_threads)
                gather_fn = gather_row_segments if cutlass.const_expr(by_segments) else gather_rows_zero_fill
                gather_fn(ckv_cache, ckv_stride, s_stage, 0, CKV_DIM, tid, num_threads, ids)
                gather_fn(kpe_cache, kpe_stride, s_stage, CKV_DIM // ROW_CHUNK, KPE_DIM, tid, num_threads, ids)
            pipe_kv.producer_commit(kv_state)
        else:
            pipe_kv.producer_acquire(kv_state)
            s_stage = s_k_chunks[None, None, None, None, kv_state.index]
            gather_rows(copy_atom, zeros, ckv_cache, ckv_stride, s_stage, 0, CKV_DIM, tid, num_threads, ids=ids)
            gather_rows(copy_atom, zeros, kpe_cache, kpe_stride, s_stage, CKV_DIM // ROW_CHUNK, KPE_DIM, tid,
                        num_threads, ids=ids)
            commit_rows(pipe_kv, kv_state)
        kv_state.advance()
    if cutlass.const_expr(q_wait_pending):
        if num_tiles == 0:
            commit_rows(pipe_q, q_state)
    return q_state, kv_state, tiles_done


@cute.jit
def load_units(tid: Int32, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
               qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor, s_q: cute.Tensor,
               s_k: cute.Tensor, s_ids: cute.Tensor, pipe_q, pipe_kv, q_state, kv_state, source,
               group: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int],
               ids_barrier: cutlass.Constexpr[int], page_size: cutlass.Constexpr[int], kv_boxes=None,
               row_segments: cutlass.Constexpr[bool] = False, q_for_keyless_items: cutlass.Constexpr[bool] = True,
               kv_gather4=None, pipe_u=None, late_claim: cutlass.Constexpr[bool] = False):
    """The load role of a self-scheduling build (``dynamic_schedule``; ``common/unit_schedule.py``): no plan.

    Warp 0 takes each unit (one unsplit item: request, q tile; one KV head) from the counter, decodes it and writes
    it into ring entry ``n % UNIT_RING`` of ``source.slots`` (``unit_schedule.publish_ring_unit``); every load thread
    reads it behind the named barrier ``ids_barrier`` and loads the unit's Q and K stages as an item's
    (:func:`_load_item_keys`). The next unit's index is fetched under this unit's loads, or (``late_claim``) once its
    last K stage is issued. An entry with ``VALID`` 0 ends the work. The other roles learn each unit one of two ways:

    * sm_90a (``pipe_u`` None): the consumers read the entry after their Q wait (thread 0 wrote it before its Q
      arrive); at the end the load threads arrive on the Q stage with no copies, for the consumers' last wait;
    * sm_100a (``pipe_u``: a unit pipeline whose entries are the ring's, one producer arrival): warp 0 waits for the
      entry to be free and lane 0 arrives on its full barrier after writing it; the MMA, softmax and correction
      warps read it from there (``unit_schedule.wait_ring_unit``), and Q loads only for units with keys.

    Page ids need no check here: :func:`_page_row` turns an id outside the pool into -1 (never read), and the CTAs'
    scan at the kernel's start (``unit_schedule.scan_page_ids``) marked every request holding one."""
    from cutlass import pipeline as cpipe

    from .unit_schedule import UNIT_RING, SlotField, find_unit, take_unit

    gather = _gather_setup(s_q, s_k, ckv_cache, kpe_cache, kv_boxes, kv_gather4)
    copy_atom, zeros, s_q_chunks = gather[0], gather[1], gather[2]
    tile_m = cute.size(s_q, mode=[0])
    tile_n = cute.size(s_k, mode=[0])
    ring = source.slots
    lane = tid % 32
    u_state = None
    if cutlass.const_expr(pipe_u is not None):  # every load thread tracks it; warp 0 waits and lane 0 arrives
        u_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, UNIT_RING)
    request = Int32(0)
    local = Int32(0)
    base = Int32(0)
    before = Int32(0)
    if tid < 32:
        request, local, base, before = find_unit(take_unit(source.unit_state, lane), qo_indptr, source, base, before,
                                                 lane, group, tile_m, 1)
        _publish_unit(ring, 0, request, local, qo_indptr, kv_indptr, source, lane, group, tile_m, page_size, tile_n,
                      pipe_u, u_state)
    if cutlass.const_expr(pipe_u is not None):
        u_state.advance()
    cute.arch.barrier(barrier_id=ids_barrier, number_of_threads=num_threads)
    n = Int32(0)
    tiles_done = Int32(0)
    valid = ring[0, int(SlotField.VALID)]
    while valid != 0:
        entry = n % UNIT_RING
        request = ring[entry, int(SlotField.REQUEST)]
        r0 = ring[entry, int(SlotField.Q_ROW_START)]
        row_count = ring[entry, int(SlotField.Q_ROW_COUNT)]
        kv_end = ring[entry, int(SlotField.KV_END)]
        if cutlass.const_expr(q_for_keyless_items):
            _load_q_tile(copy_atom, zeros, q_nope, q_pe, qo_indptr, request, r0, row_count, s_q_chunks, tid, group,
                         num_threads, pipe_q, q_state, row_segments=row_segments)
            q_state.advance()
        u = Int32(0)
        if cutlass.const_expr(not late_claim):
            if tid < 32:
                u = take_unit(source.unit_state, lane)  # in flight under this unit's loads
        q_state, kv_state, tiles_done = _load_item_keys(
            gather, tid, q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, request, r0,
            row_count, Int32(0), kv_end, s_k, s_ids, pipe_q, pipe_kv, q_state, kv_state, tiles_done, group,
            num_threads, ids_barrier, q_for_keyless_items, True, False, row_segments)
        n = n + 1
        if tid < 32:
            if cutlass.const_expr(late_claim):  # config.late_claim: once the last K stage is issued
                u = take_unit(source.unit_state, lane)
            request, local, base, before = find_unit(u, qo_indptr, source, base, before, lane, group, tile_m, 1)
            _publish_unit(ring, n % UNIT_RING, request, local, qo_indptr, kv_indptr, source, lane, group, tile_m,
                          page_size, tile_n, pipe_u, u_state)
        if cutlass.const_expr(pipe_u is not None):
            u_state.advance()
        cute.arch.barrier(barrier_id=ids_barrier, number_of_threads=num_threads)
        valid = ring[n % UNIT_RING, int(SlotField.VALID)]
    if cutlass.const_expr(pipe_u is None):
        pipe_q.producer_acquire(q_state)  # the end: an arrive with no copies, whose entry says VALID 0
        commit_rows(pipe_q, q_state)


@cute.jit
def _publish_unit(ring: cute.Tensor, entry, request, local, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, source,
                  lane, group: cutlass.Constexpr[int], rows: cutlass.Constexpr[int], page_size: cutlass.Constexpr[int],
                  kv_tile: cutlass.Constexpr[int], pipe_u, u_state):
    """:func:`load_units`' hand-off of one unit by warp 0: into ring entry ``entry``, or (a unit pipeline) into entry
    ``u_state.index`` once it is free, announced on its full barrier (the caller advances ``u_state`` outside warp 0's
    branch, so every load thread tracks it)."""
    from .unit_schedule import publish_ring_unit, send_ring_unit

    if cutlass.const_expr(pipe_u is None):
        publish_ring_unit(ring, entry, request, local, qo_indptr, kv_indptr, source, lane, group, rows, 1, page_size,
                          kv_tile)
    else:
        send_ring_unit(pipe_u, u_state, ring, request, local, qo_indptr, kv_indptr, source, lane, group, rows, 1,
                       page_size, kv_tile)


def row_view(cache: cute.Tensor, dim: int) -> cute.Tensor:
    """A compact ``[pages, page_size, dim]`` cache as ``[pages * page_size, dim]`` rows (the latent row ids' index
    space), for a 2-D tensor map."""
    return cute.make_tensor(cache.iterator, cute.make_layout((cache.shape[0] * cache.shape[1], dim), stride=(dim, 1)))


@cute.jit
def gather4_latent_tile(desc_ckv: Int64, desc_kpe: Int64, stage_addr: Int32, ids: cute.Tensor, mbar: Int32,
                        tile_n: cutlass.Constexpr[int]):
    """One K stage by TMA ``gather4``: rows ``ids[4 q .. 4 q + 3]`` (-1: zero-filled, as out of the map) into stage
    rows ``4 q ..`` of each 64-column block (block ``c`` at ``c * tile_n * 128`` bytes, 128 bytes a row: the
    128B-swizzled stage, which TMA swizzles by address), 8 ckv blocks and 1 kpe block: ``tile_n / 4 * 9``
    instructions from one elected lane instead of ``tile_n * 72`` 16-byte cp.async from 128 threads."""
    with cute.arch.elect_one():
        for q in cutlass.range_constexpr(tile_n // 4):
            rows = []
            for j in cutlass.range_constexpr(4):
                rows.append(ids[4 * q + j])
            for c in cutlass.range_constexpr(CKV_DIM // 64):
                tma_gather4(stage_addr + (c * tile_n + 4 * q) * 128, desc_ckv, Int32(c * 64), rows, mbar)
            tma_gather4(stage_addr + ((CKV_DIM // 64) * tile_n + 4 * q) * 128, desc_kpe, Int32(0), rows, mbar)


#: rows of one latent box (one 128B-swizzle atom); pages of at least this many keys take boxes on sm_90a
BOX_ROWS = 8


@cute.jit
def box_latent_tile(descs_ckv, descs_kpe, stage_addr: Int32, ids: cute.Tensor, mbar: Int32,
                    tile_n: cutlass.Constexpr[int]):
    """One K stage by TMA tile boxes (sm_90a; pages of >= ``BOX_ROWS`` keys, so each 8-key group of a tile lies in
    one page): per group of ids ``ids[8 g .. 8 g + 7]`` (latent rows, -1: past the item or a page outside the
    pool), all valid: one 8-row box per 64-column block (8 ckv + 1 kpe) from row ``ids[8 g]``; none valid: the same
    boxes at row -8, outside the map, which TMA zero-fills (a bad page is never read); the item's last, partial
    group: 1-row boxes, row -1 for the keys past its end (pool rows there hold anything; V = ckv must be 0).
    Every stage thus counts the same bytes, whatever its tail. ``descs_*``: (8-row map, 1-row map) addresses;
    block ``c`` of the 128B-swizzled stage at ``c * tile_n * 128`` bytes, 128 bytes a row (TMA swizzles by
    address). With a third, ``tile_n``-row map each (``page_boxes``: pages of >= ``tile_n`` keys, and item starts on
    ``tile_n`` keys, so a stage lies in one page), a stage whose last key holds a row (so all do: one page, rows in
    order) is one box a 64-column block, 9 instructions instead of 72; the swizzle repeats every 8 rows, so the
    bytes land where the 8-row boxes put them."""
    if cutlass.const_expr(len(descs_ckv) == 3):
        groups = Int32(tile_n // BOX_ROWS)
        if ids[tile_n - 1] >= 0:
            groups = Int32(0)
        with cute.arch.elect_one():
            if groups == 0:
                _latent_boxes(descs_ckv[2], descs_kpe[2], stage_addr, 0, ids[0], mbar, tile_n)
            _box_groups(descs_ckv, descs_kpe, stage_addr, ids, mbar, tile_n, groups)
    else:
        with cute.arch.elect_one():
            _box_groups(descs_ckv, descs_kpe, stage_addr, ids, mbar, tile_n, tile_n // BOX_ROWS)


@cute.jit
def _box_groups(descs_ckv, descs_kpe, stage_addr: Int32, ids: cute.Tensor, mbar: Int32,
                tile_n: cutlass.Constexpr[int], groups):
    """:func:`box_latent_tile`'s 8-key groups ``0 .. groups - 1``, from the elected thread."""
    for g in cutlass.range(groups, unroll=1):
        first = ids[BOX_ROWS * g]
        last = ids[BOX_ROWS * g + BOX_ROWS - 1]
        dst = stage_addr + BOX_ROWS * g * 128
        if last >= 0 or first < 0:  # whole group: the keys of one page, all valid or none
            row = first if first >= 0 else Int32(-BOX_ROWS)
            _latent_boxes(descs_ckv[0], descs_kpe[0], dst, 0, row, mbar, tile_n)
        else:
            for i in cutlass.range_constexpr(BOX_ROWS):  # row -1 past the end: zero-filled
                _latent_boxes(descs_ckv[1], descs_kpe[1], dst, i * 128, ids[BOX_ROWS * g + i], mbar, tile_n)


@cute.jit
def _latent_boxes(desc_ckv, desc_kpe, dst: Int32, offset: cutlass.Constexpr[int], row, mbar: Int32,
                  tile_n: cutlass.Constexpr[int]):
    """One box of each 64-column block of latent ``row`` (8 ckv + 1 kpe, the maps' box height) into the stage at
    ``dst + offset``, block ``c`` at ``c * tile_n * 128`` bytes further."""
    blocks = CKV_DIM // 64
    for c in cutlass.range_constexpr(blocks):
        tma_load(dst + (c * tile_n * 128 + offset), desc_ckv, [Int32(c * 64), row], mbar)
    tma_load(dst + (blocks * tile_n * 128 + offset), desc_kpe, [Int32(0), row], mbar)


@cute.jit
def _key_page(kv_indices: cute.Tensor, page_base: Int32, key: Int32, kv_end: Int32,
              page_shift: cutlass.Constexpr[int]) -> Int32:
    """The page id of ``key`` (as ``kv_indices`` holds it, unchecked), or -1 for a key ``>= kv_end``."""
    page = Int32(-1)
    if key < kv_end:
        page = kv_indices[page_base + (key >> page_shift)]
    return page


@cute.jit
def _page_row(page: Int32, key: Int32, num_pages: Int32, page_shift: cutlass.Constexpr[int]) -> Int32:
    """Latent row of ``key`` in ``page`` (:func:`_key_page`), or -1 (zero-filled, never read) for a page id outside
    ``[0, num_pages)`` (a key past the item's end included)."""
    rid = Int32(-1)
    if page >= 0:
        if page < num_pages:
            rid = (page << page_shift) + (key & ((1 << page_shift) - 1))
    return rid


@cute.jit
def _load_q_tile(copy_atom: cute.CopyAtom, zeros: cute.Tensor, q_nope: cute.Tensor, q_pe: cute.Tensor,
                 qo_indptr: cute.Tensor, b: Int32, r0: Int32, row_count: Int32, s_q_chunks: cute.Tensor, tid: Int32,
                 group: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int], pipe_q, q_state,
                 row_segments: cutlass.Constexpr[bool] = False, wait: cutlass.Constexpr[bool] = True):
    """Q of the item's packed rows ``r0 .. r0 + row_count - 1`` of request ``b`` (the caller advances ``q_state``);
    the thread waits for its copies, fences them into the async proxy and arrives (``wait`` False: the caller does,
    :func:`commit_rows`). ``row_segments``: the rows by 128-byte segments (:func:`gather_row_segments`, rows past
    ``row_count`` zero-filled by ``src-size`` 0)."""
    q_row0 = Int64(qo_indptr[b]) * group + r0
    pipe_q.producer_acquire(q_state)
    by_segments = row_segments and segments_fit(s_q_chunks, KPE_DIM, num_threads)
    if cutlass.const_expr(by_segments):
        gather_row_segments(q_nope, Int64(CKV_DIM), s_q_chunks, 0, CKV_DIM, tid, num_threads, row0=q_row0,
                            valid_rows=row_count)
        gather_row_segments(q_pe, Int64(KPE_DIM), s_q_chunks, CKV_DIM // ROW_CHUNK, KPE_DIM, tid, num_threads,
                            row0=q_row0, valid_rows=row_count)
        if cutlass.const_expr(wait):  # zero-filled rows are cp.async too: waited for and fenced like the copies
            commit_rows(pipe_q, q_state)
    else:
        gather_rows(copy_atom, zeros, q_nope, Int64(CKV_DIM), s_q_chunks, 0, CKV_DIM, tid, num_threads, row0=q_row0,
                    valid_rows=row_count)
        gather_rows(copy_atom, zeros, q_pe, Int64(KPE_DIM), s_q_chunks, CKV_DIM // ROW_CHUNK, KPE_DIM, tid,
                    num_threads, row0=q_row0, valid_rows=row_count)
        if cutlass.const_expr(wait):
            commit_rows(pipe_q, q_state)

"""sm_90a GQA paged decode, driven by the plan (``docs/kernel-contract.md``).

Grid: the plan's persistent CTAs (``len(work_indptr) - 1``); CTA ``c`` runs items
``work_indptr[c] .. work_indptr[c+1]-1`` in order. One item = one (request, KV head, KV chunk): the
group's query heads are the rows of one 64-row wgmma M tile (rows >= Q_ROW_COUNT are padding that
repeat the last real row, so they stay finite and are never written), attending keys
``[KV_START, KV_END)``.

Warp roles (288 threads; 384 with ``gather_warps`` 4)
    warps 0-7  two consumer warpgroups (128 threads each) that split every item's KV tiles: warpgroup w
               takes the ring stages of global tiles w, w + 2, ... (the per-tile chain of two dependent
               wgmmas and a softmax is the critical path of the small batches; two warpgroups halve it).
               Per item, both load Q (packed rows) -> swizzled smem with 16-byte vector loads; per own KV
               tile: S = Q.K^T (wgmma SS, fp32), logits * ``sm_scale*log2(e)``, keys >= KV_END -> -inf,
               online softmax in base 2 on the live rows only (exp2; a row whose max is still -inf uses
               0 as the exponent's max, so it yields p = 0, never NaN), V rows >= KV_END zeroed in smem
               (the pool's tail slots hold NaN), O += P.V (wgmma RS: P stays in registers as bf16).
               Then warpgroup 1 hands its row maxima, partial sums and O fragment to warpgroup 0 through
               shared memory; warpgroup 0 merges them (the LSE rule) and stores the item:
               O / l and lse = m + log2(l) -> bf16 ``output`` + ``lse * lse_out_scale``
               (PARTIAL_SLOT = -1), else fp32 ``partial_out``/``partial_lse`` (base 2). Empty items
               (KV_END <= KV_START) write 0 / -inf.
               Fused merge (no combine launch, ``common/decode_merge.py``), by warpgroup 0: after its item
               loop, the CTA counts each of its partials in ``merge_counters[MERGE]`` (every thread:
               fence.acq_rel.gpu, warpgroup barrier, one atom.add.acq_rel.gpu per split item); the CTA
               that reads ``slots - 1`` is the last, folds the merge's slots into bf16 ``output``/``lse``
               (one packed row per half-warp, lanes over the slots' LSEs then over the head dim; slot
               order, whichever CTA folds) and resets the counter to 0.
    warp 8     producer: reads the item's page ids from ``kv_indices`` (from position KV_PAGE_START) 32 at a
               time (one per lane, then shuffled out), and for each KV tile (one page = ``kv_tile`` keys) issues two TMA loads (the page's K and V boxes for the item's KV head;
               the page id is the TMA coordinate) into the stage, completing on its full mbarrier.
               Pages of 4 or 8 keys (and 16 in 64-key stages; ``produce_pages``): a stage stays ``kv_tile``
               keys, built from ``kv_tile / page_size`` page boxes of K and of V at row offsets ``i * page_size``;
               one coalesced id load (one per lane, ``common/page_ids.py``) covers 32 / pages-per-stage stages; a
               page past KV_END gets id -1 (zero-filled, its bytes counted), so the full mbarrier keeps one
               expect-tx of the whole stage. Pages 1, 2 (``produce_rows``): 16-byte cp.async rows, below.
               The producer role lives in ``decode_producer.py``.
    warps 8-11 with ``gather_warps`` 4 (pages 1, 2 by default, ``ops/gqa_decode.GATHER_WARPS_PAGE_SIZES``): a
               producer warpgroup, each warp gathering a quarter of every stage's rows with its slice's page ids.

Small pages: a box of fewer rows than the 128B swizzle's 8-row atom (pages 2, 4) at a row offset inside a swizzled
stage is legal: TMA swizzles by shared-memory address and the stage is 1024 B aligned. The atom is built for the
``(page_size, D)`` slice (a composition) of the stage layout; one elected lane issues a stage's boxes as raw
``cp.async.bulk.tensor`` on the atoms' own descriptors (``common/tma_issue.py``: the DSL's ``cute.copy`` wraps
every box in its own ``elect.sync``). Page 1 would be 256 one-row boxes a stage, and the TMA unit's rate for them
held it to 172 us at 64 x 2048 (43% of page 64, H200) even from one election; every lane issuing its own boxes ran
2.2x slower. So page 1 gathers rows: each producer lane issues 64 branch-free 16-byte ``cp.async`` a stage
(``common/row_gather.gather_one_row_pages``: ids shuffled from registers, out-of-pool rows zero-filled by
``src-size`` 0, the 128B swizzle applied to the raw addresses), completing on the stage's full mbarrier through
``cp.async.mbarrier.arrive.noinc`` (``PipelineCpAsync``); the consumers fence them into the async proxy before
their wgmmas. 85 us at 64 x 2048 (88% of page 64).

Start: every thread loads ``work_indptr[cta]`` and, alongside, the item fields of row ``cta``
(``common/work_items.py``: CTA ``c``'s first item whenever every CTA before it has one item, as in the
split small batches), before the mbarrier setup; with KV_PAGE_START in the item, the first TMA waits on
two dependent loads (that row, then the page ids) instead of four.

Pipeline: ``num_stages`` smem stages of (K tile, V tile), one ``PipelineTmaAsync`` (full mbarrier with
tx-count = both boxes; empty mbarrier released by each warp of the consuming warpgroup once both MMAs of
the stage have completed). The producer runs ahead across item boundaries, so HBM streaming does not stall
between items. Q has its own buffer, guarded by a named barrier of both consumer warpgroups, which also
orders the hand-over buffer.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ...config import PagedAttentionConfig, default_paged_config
from ...plan import ItemField as F
from .. import register_paged_kernel
from ..common.decode_merge import FOLD_ROW_LANES, fold_completed_merges
from ..common.kv_tail import garbage_rows, zero_rows
from ..common.limits import SMEM_LIMIT_BYTES, row_gather_reason, target_reason, uses_row_gather
from ..common.named_barrier import warpgroup_barrier_sync
from ..common.work_items import guess_first_item
from .decode_producer import ITEM_FIELDS, DecodeProducer
from .wgmma import wgmma_gemm
from ..common.paged_launch import gqa_decode_entry, gqa_multi_token_decode_entry
from ..common.launch_chain import wait_for_previous_grid
from ..common.line_schedule import end_line, gqa_line_reason, gqa_line_rules, start_line, table_requests
from ...ops.gqa_multi_token_decode import MAX_QUERY_TOKENS

KIND = "gqa_paged_decode"
MULTI_TOKEN_KIND = "gqa_paged_multi_token_decode"  # the same kernel with qo_indptr and a per-row causal mask
ARCH = "sm_90a"
SMEM_PER_SM_BYTES = 228 * 1024  # per SM, of which each resident CTA reserves 1 KB
MAX_STAGES = 32  # small pages (16 keys a stage) need many stages in flight to stream
NUM_MMA_THREADS = 128  # one consumer warpgroup
NUM_CONSUMER_WG = 2
NUM_CONSUMER_THREADS = NUM_CONSUMER_WG * NUM_MMA_THREADS
PRODUCER_WARP = NUM_CONSUMER_THREADS // 32
WG_BARRIER_ID = 1  # + wg: named barrier of one consumer warpgroup (0 is __syncthreads)
BOTH_BARRIER_ID = WG_BARRIER_ID + NUM_CONSUMER_WG  # both consumer warpgroups
Q_VEC = 8  # bf16 per 16-byte Q load
MULTI_PAGE_BELOW = 16  # pages of fewer keys: a stage of kv_tile keys is kv_tile / page_size page boxes
# Stages of several pages are also built for pages of 16+ keys when asked for (kv_tile 64 or 128 with page 16 or
# 32: fewer, wider tiles, i.e. fewer wgmma pairs and softmaxes per key); the defaults keep one page per stage.
MULTI_PAGE_TILES = (64, 128)
# Pages of one or two keys: 16-byte cp.async rows from the producer warp (produce_rows), not page boxes (the TMA
# unit's rate for 128-byte boxes held page 1 to 43% of page 64 even with one election per stage; rows: 88%)
ROW_GATHER_PAGE_SIZES = (1, 2)


# --------------------------------------------------------------------------------------------- config
def smem_budget(config: PagedAttentionConfig) -> int:
    """Shared memory one CTA may use with ``ctas_per_sm`` CTAs resident on an SM."""
    return min(SMEM_LIMIT_BYTES, SMEM_PER_SM_BYTES // config.ctas_per_sm - 1024)


def live_rows(config: PagedAttentionConfig) -> int:
    """Packed rows an item may hold, a compile-time bound: the group (decode: one token), or (multi-token decode)
    up to MAX_QUERY_TOKENS whole tokens of the group, at most the planner's rows per tile."""
    if config.kind == MULTI_TOKEN_KIND:
        return min(config.packed_rows_per_tile, MAX_QUERY_TOKENS * config.group_size)
    return config.group_size


def exchange_shape(config: PagedAttentionConfig) -> tuple[int, int]:
    """(threads, floats) of the warpgroup hand-over: per thread of a warp holding a real row, its 2 row maxima,
    2 partial row sums and its O fragment (tile_q_rows x head_dim over the warpgroup's 128 threads)."""
    live_warps = min(NUM_MMA_THREADS // 32, -(-live_rows(config) // 16))
    return live_warps * 32, 4 + config.tile_q_rows * config.head_dim_v // NUM_MMA_THREADS


def _tile_pair_bytes(config: PagedAttentionConfig) -> int:
    """One ring stage's data: a K and a V tile (bf16); its two mbarriers add 16 bytes."""
    return 2 * config.kv_tile * config.head_dim_qk * 2


def _fixed_bytes(config: PagedAttentionConfig) -> int:
    """Everything but the ring: Q, the warpgroup hand-over (16 B aligned) and the fused merge's arrival word."""
    return config.tile_q_rows * config.head_dim_qk * 2 + 4 * math.prod(exchange_shape(config)) + 16 + 4


def num_stages(config: PagedAttentionConfig) -> int:
    """Ring stages: as many as shared memory holds, rounded down to an even count.

    Even, because the two consumer warpgroups split the ring by tile parity: with an even count each stage is
    always consumed by the same warpgroup. With an odd count a stage alternates between them, so a warpgroup
    waiting on a stage's full barrier for tile g has not itself seen the load of tile g - stages complete (the
    other warpgroup's), and its parity wait can succeed on the phase of tile g - 2 * stages (ABA): it then reads
    a stale or half-written stage and releases it early. Seen on the H200 with 3 stages (page 128): an
    unspecified launch failure within 80 calls at 64 x 2048, none with 2 stages (docs/perf-history.md).
    """
    # the 16 mbarrier bytes per stage are reserved for MAX_STAGES stages up front
    fit = (smem_budget(config) - _fixed_bytes(config) - 16 * MAX_STAGES) // _tile_pair_bytes(config)
    return min(MAX_STAGES, fit) // NUM_CONSUMER_WG * NUM_CONSUMER_WG


def smem_bytes(config: PagedAttentionConfig) -> int:
    """Shared memory the kernel allocates: Q, the K/V stages with their mbarriers (1 KB aligned), the
    warpgroup hand-over and the fused merge's 4-byte arrival word."""
    return _fixed_bytes(config) + num_stages(config) * (_tile_pair_bytes(config) + 16)


def check_config(config: PagedAttentionConfig) -> str | None:
    """None when this kernel implements ``config``, else why not (on top of ``config.can_implement``)."""
    kind = config.kind if config.kind in (KIND, MULTI_TOKEN_KIND) else KIND
    if (reason := target_reason(config, kind, ARCH)) is not None:
        return reason
    if config.tile_q_rows != 64:
        return f"decode packs one group into a single 64-row warpgroup tile; tile_q_rows={config.tile_q_rows}"
    if (reason := row_gather_reason(config, ROW_GATHER_PAGE_SIZES,
                                    rows_per_warp=config.kv_tile // config.gather_warps)) is not None:
        return reason
    if config.gather_warps != 1 and not uses_row_gather(config, ROW_GATHER_PAGE_SIZES):
        return (f"gather_warps={config.gather_warps}: page_size={config.page_size} stages are TMA page boxes, issued "
                "by one producer warp (the warps share the row gathers of pages 1 and 2)")
    if config.group_size > config.tile_q_rows:
        return f"group size {config.group_size} exceeds the {config.tile_q_rows}-row tile"
    if config.page_size >= MULTI_PAGE_BELOW and config.kv_tile not in (config.page_size, *MULTI_PAGE_TILES):
        return (f"kv_tile={config.kv_tile} must equal page_size={config.page_size} (one page is one TMA box per "
                f"stage) or be one of {MULTI_PAGE_TILES} (a stage of several page boxes)")
    if config.kv_tile % config.page_size:
        return (f"page_size={config.page_size}: a stage of kv_tile={config.kv_tile} keys must hold whole pages "
                "(kv_tile / page_size page boxes, or rows at pages 1 and 2)")
    if config.kv_tile < 16 or config.kv_tile > 256:
        return f"kv_tile={config.kv_tile} must be in 16..256 (wgmma N and TMA box limits)"
    if config.head_dim_qk != config.head_dim_v:
        return "head_dim_qk must equal head_dim_v"
    if config.head_dim_v % FOLD_ROW_LANES:
        return f"head_dim={config.head_dim_v} must be a multiple of {FOLD_ROW_LANES} (lanes per row in the merge fold)"
    if num_stages(config) < 2:
        return f"shared memory holds fewer than 2 K/V stages ({smem_bytes(config)} bytes)"
    if smem_bytes(config) > smem_budget(config):
        return f"needs {smem_bytes(config)} bytes of shared memory, more than {smem_budget(config)}"
    if config.line_schedule:
        return line_schedule_reason(config)
    return None


def line_schedule_reason(config: PagedAttentionConfig) -> str | None:
    """Why a ``line_schedule`` build of ``config`` is not made (None: it is)."""
    return gqa_line_reason(config, line_table_requests(config))


def line_table_requests(config: PagedAttentionConfig) -> int:
    """The most requests a line build's table holds (it aliases the K stages)."""
    threads = NUM_CONSUMER_THREADS + 32 * config.gather_warps
    return table_requests(threads, num_stages(config) * config.kv_tile * config.head_dim_qk * 2)


def line_capacity(config: PagedAttentionConfig) -> tuple[int, int]:
    """(requests the table holds, threads a CTA: its edges ``num_ctas + 1`` must not outnumber them)."""
    return line_table_requests(config), NUM_CONSUMER_THREADS + 32 * config.gather_warps


# --------------------------------------------------------------------------------------------- kernel
class GqaDecodeSm90(DecodeProducer):
    """The kernel object: compile-time constants live on ``self``."""

    def __init__(self, config: PagedAttentionConfig) -> None:
        self.releases_dependents = config.early_dependents  # config.EARLY_DEPENDENTS says why
        self.group = config.group_size
        self.multi_token = config.kind == MULTI_TOKEN_KIND  # compile time: q_len 1 decode's code is unchanged
        self.rows = live_rows(config)
        self.num_qo_heads = config.num_qo_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim_qk
        self.page_size = config.page_size
        self.tile_m = config.tile_q_rows
        self.tile_n = config.kv_tile
        self.pages_per_stage = config.kv_tile // config.page_size  # 1 for pages of 16..128 keys
        self.row_gather = uses_row_gather(config, ROW_GATHER_PAGE_SIZES)
        self.row_segments = self.row_gather and config.row_segments is not False  # policy (None): segments
        self.gather_warps = config.gather_warps if self.row_gather else 1  # check_config refuses 4 without rows
        self.num_threads = NUM_CONSUMER_THREADS + 32 * self.gather_warps
        self.stages = num_stages(config)
        self.dtype = cutlass.BFloat16
        self.tile_bytes = self.tile_n * self.head_dim * 2
        self.exchange_shape = exchange_shape(config)
        self.line_schedule = config.line_schedule  # compile time: the planned build's code is unchanged
        if config.line_schedule:
            self.line_rules = gqa_line_rules(config)
            self.line_requests = line_table_requests(config)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}_H{self.num_qo_heads}x{self.num_kv_heads}_D{self.head_dim}_P{self.page_size}"
                f"_M{self.tile_m}_N{self.tile_n}_S{self.stages}{'_RowSeg' if self.row_segments else ''}"
                f"{'_Line' if self.line_schedule else ''}")

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # [batch, Hq, D] bf16
        k_cache: cute.Tensor,  # [pages, page_size, Hkv, D] bf16
        v_cache: cute.Tensor,
        kv_indices: cute.Tensor,  # [n] int32 page ids
        work_indptr: cute.Tensor,  # [num_ctas + 1] int32
        items: cute.Tensor,  # [max_items, len(ItemField)] int32
        merge_indptr: cute.Tensor,  # [max_merges + 1] int32
        merge_counters: cute.Tensor,  # [max(max_merges, 1)] int32, zero on entry and on exit
        output: cute.Tensor,  # [batch, Hq, D] bf16
        lse: cute.Tensor,  # [batch, Hq] fp32
        partial_out: cute.Tensor,  # [slots, tile_m, D] fp32
        partial_lse: cute.Tensor,  # [slots, tile_m] fp32
        scale_log2: Float32,
        lse_out_scale: Float32,
        stream: cuda.CUstream,
    ):
        self.launch_kernel(q, k_cache, v_cache, None, kv_indices, work_indptr, items, merge_indptr, merge_counters,
                           output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream)

    @cute.jit
    def call_line(
        self,
        q: cute.Tensor,  # [batch, Hq, D] bf16
        k_cache: cute.Tensor,
        v_cache: cute.Tensor,
        kv_indptr: cute.Tensor,  # [batch + 1] int32
        kv_indices: cute.Tensor,
        kv_last_page_len: cute.Tensor,  # [batch] int32
        merge_counters: cute.Tensor,  # [max(num_ctas, 1)] int32, zero on entry and on exit
        request_faults: cute.Tensor,  # [max(batch, 1)] int32, zero on entry and on exit
        unit_state: cute.Tensor,  # [UNIT_STATE_WORDS] int32, zero on entry and on exit
        error_word: cute.Tensor,  # [4] int32
        output: cute.Tensor,
        lse: cute.Tensor,
        partial_out: cute.Tensor,  # [2 * num_ctas, tile_m, D] fp32
        partial_lse: cute.Tensor,
        scale_log2: Float32,
        lse_out_scale: Float32,
        num_pages: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        """The ``line_schedule`` entry: no plan; ``num_ctas`` CTAs (at most ``threads - 1``) derive their stretches."""
        line = (kv_indptr, kv_last_page_len, request_faults, unit_state, error_word, num_pages)
        self.launch_kernel(q, k_cache, v_cache, None, kv_indices, None, None, None, merge_counters, output, lse,
                           partial_out, partial_lse, scale_log2, lse_out_scale, stream, line, num_ctas)

    @cute.jit
    def launch_kernel(self, q, k_cache, v_cache, qo_indptr, kv_indices, work_indptr, items, merge_indptr,
                      merge_counters, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream,
                      line=None, num_ctas=None):
        """The host side of every entry (``qo_indptr`` is None for decode; ``line``: the line build's tensors, and
        its grid is ``num_ctas``)."""
        dtype = self.dtype
        atom = warpgroup.make_smem_layout_atom(
            sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, self.head_dim), dtype
        )
        sQ_layout = cute.tile_to_shape(atom, (self.tile_m, self.head_dim), order=(0, 1))
        sKV_layout = cute.tile_to_shape(atom, (self.tile_n, self.head_dim, self.stages), order=(0, 1, 2))
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = sm90_helpers.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.head_dim), a_source=warpgroup.OperandSource.RMEM,
        )
        # (page_size, D, Hkv, pages): the first two modes are the TMA box, the rest coordinates.
        order = [1, 3, 2, 0]
        k_view = cute.make_tensor(k_cache.iterator, cute.select(k_cache.layout, mode=order))
        v_view = cute.make_tensor(v_cache.iterator, cute.select(v_cache.layout, mode=order))
        stage_layout = cute.select(sKV_layout, mode=[0, 1])
        if cutlass.const_expr(self.pages_per_stage > 1):
            # one page = page_size rows of the stage, at row offset i * page_size (same strides as the stage, so
            # the 128B swizzle of the stage applies: TMA swizzles by smem address, the stage is 1024 B aligned)
            stage_layout = cute.composition(stage_layout,
                                            cute.make_layout((self.page_size, self.head_dim), stride=(1, self.tile_n)))
        box = (self.page_size, self.head_dim)
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), k_view, stage_layout, box)
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), v_view, stage_layout, box)
        k_rows, v_rows = (k_cache, v_cache) if cutlass.const_expr(self.row_gather) else (None, None)
        grid = num_ctas if cutlass.const_expr(line is not None) else work_indptr.shape[0] - 1
        self.kernel(
            q, qo_indptr, tma_atom_k, tma_k, tma_atom_v, tma_v, k_rows, v_rows, kv_indices, work_indptr, items,
            merge_indptr, merge_counters, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale,
            sQ_layout, sKV_layout, tiled_mma_qk, tiled_mma_pv, line,
        ).launch(grid=(grid, 1, 1), block=(self.num_threads, 1, 1), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(
        self,
        q: cute.Tensor,
        qo_indptr,  # multi-token decode: [batch + 1] int32; decode: None
        tma_atom_k: cute.CopyAtom,
        tma_k: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        tma_v: cute.Tensor,
        k_rows,  # page 1 (row gather): the caches themselves, [pages, 1, Hkv, D]; else None
        v_rows,
        kv_indices: cute.Tensor,
        work_indptr: cute.Tensor,
        items: cute.Tensor,
        merge_indptr: cute.Tensor,
        merge_counters: cute.Tensor,
        output: cute.Tensor,
        lse: cute.Tensor,
        partial_out: cute.Tensor,
        partial_lse: cute.Tensor,
        scale_log2: Float32,
        lse_out_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        line,  # line_schedule: (kv_indptr, kv_last_page_len, request_faults, unit_state, error_word, num_pages)
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # programmatic dependent launch (it may start while the planner runs): nothing global is read before this
        wait_for_previous_grid(self.releases_dependents)  # then the plan's loads, issued before the mbarrier setup
        row = cute.make_rmem_tensor((len(ITEM_FIELDS),), Int32)
        item_begin = Int32(0)
        item_end = Int32(0)
        guess = Int32(0)
        if cutlass.const_expr(not self.line_schedule):
            item_begin = work_indptr[cta]
            item_end = work_indptr[cta + 1]
            guess = guess_first_item(items, cta, ITEM_FIELDS, row)

        smem = SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sK = smem.allocate_tensor(self.dtype, sKV_layout.outer, byte_alignment=1024, swizzle=sKV_layout.inner)
        sV = smem.allocate_tensor(self.dtype, sKV_layout.outer, byte_alignment=1024, swizzle=sKV_layout.inner)
        mbar = smem.allocate_array(cutlass.Int64, 2 * self.stages, byte_alignment=8)
        exchange = smem.allocate_tensor(Float32, cute.make_layout(self.exchange_shape, stride=(self.exchange_shape[1], 1)),
                                        byte_alignment=16)
        arrival = smem.allocate_array(cutlass.Int32, 1, byte_alignment=4)  # fused merge: counter's old value
        if cutlass.const_expr(self.line_schedule):
            # every thread derives the CTA's stretch on a table over the K stages (free until the first load)
            items = start_line(line, sK.iterator, kv_indices, output, lse, tidx, self.num_threads, self.head_dim,
                               self.line_rules, self.line_requests)
            item_end = items.count

        if cutlass.const_expr(self.row_gather):
            # every producer lane's copies arrive on the full mbarrier (cp.async.mbarrier.arrive.noinc); the
            # consumers of PipelineCpAsync arrive from every thread, so the empty count is the warpgroup's
            pipe = pipeline.PipelineCpAsync.create(
                barrier_storage=mbar, num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * self.gather_warps),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_MMA_THREADS),
            )
        else:
            if warp_idx == PRODUCER_WARP:
                cpasync.prefetch_descriptor(tma_atom_k)
                cpasync.prefetch_descriptor(tma_atom_v)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar,
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                # a stage is consumed by one warpgroup: one arrival per warp of it
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_MMA_THREADS // 32),
                tx_count=2 * self.tile_bytes,
            )  # initialises the mbarriers (warp 0), fences and syncs the CTA

        if warp_idx >= PRODUCER_WARP:  # the producer warp, or with gather_warps 4 the producer warpgroup
            if cutlass.const_expr(self.row_gather):
                self.produce_rows(k_rows, v_rows, sK, sV, kv_indices, items, item_begin, item_end, guess, row, pipe,
                                  warp_idx - PRODUCER_WARP)
            elif cutlass.const_expr(self.pages_per_stage > 1):
                self.produce_pages(tma_atom_k, tma_k, tma_atom_v, tma_v, sK, sV, kv_indices, items, item_begin,
                                   item_end, guess, row, pipe)
            else:
                self.produce(tma_atom_k, tma_k, tma_atom_v, tma_v, sK, sV, kv_indices, items, item_begin, item_end,
                             guess, row, pipe)
        if warp_idx < PRODUCER_WARP:
            self.consume(q, qo_indptr, sQ, sK, sV, exchange, items, merge_indptr, merge_counters, arrival, output, lse,
                         partial_out, partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv, item_begin, item_end,
                         guess, row, pipe, tidx, line)

    # ----------------------------------------------------------------------------------- consumer
    @cute.jit
    def consume(self, q, qo_indptr, sQ, sK, sV, exchange, items, merge_indptr, merge_counters, arrival, output, lse,
                partial_out, partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv, item_begin, item_end,
                guess, row, pipe, tidx, line=None):
        M, N, D = self.tile_m, self.tile_n, self.head_dim
        neg_inf = -Float32.inf
        wg = tidx // NUM_MMA_THREADS  # warp-uniform
        wtid = tidx % NUM_MMA_THREADS  # both warpgroups compute the whole 64-row tile
        thr_qk = tiled_mma_qk.get_slice(wtid)
        thr_pv = tiled_mma_pv.get_slice(wtid)
        # V^T view (D, N, stages) for the MN-major B operand of P.V
        sVt = cute.composition(sV, cute.make_ordered_layout((D, N, self.stages), order=(1, 0, 2)))
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((M, N)))
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((M, N)), Float32)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((M, D)), Float32)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((M, N)))
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((M, D)))
        # Each thread holds 2 rows (r and r + 8 of its warp's 16); flat accumulator element i belongs
        # to row half (i // 2) % 2 in both S and O (wgmma C fragment: pairs of columns, 2 row halves).
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_scale = cute.make_rmem_tensor((2,), Float32)
        row_base = cute.make_rmem_tensor((2,), Float32)
        # Q in 16-byte vectors: ((1, Q_VEC), (rows, D / Q_VEC)); 128B swizzle keeps 16-byte chunks whole
        gQv = cute.zipped_divide(q, (1, 1, Q_VEC))
        sQv = cute.zipped_divide(sQ, (1, Q_VEC))
        q_vecs_per_row = D // Q_VEC

        # Live rows: the group's heads are packed rows 0..group-1, and each thread holds rows r and r + 8 of
        # its warp's 16 (row halves 0 and 1). Only warps with a real row run the softmax, and when the group
        # fits in 8 rows (every decode group of the family) only row half 0 of warp 0 does: the rest are
        # padding rows, never stored, whose P stays 0. The softmax of one warp is the per-tile critical
        # path of the small batches, so this halves it there.
        warp_live = (wtid // 32) * 16 < self.rows
        row_limit = cute.make_rmem_tensor((2,), Int32)  # multi-token: keys < row_limit[h] are visible to half h
        tOrP.fill(0.0)
        # The two warpgroups split the ring: warpgroup w consumes the stages of global tiles g = w, w + 2, ...
        state = pipeline.PipelineState(self.stages, wg, wg, Int32(0))
        first_tile = Int32(0)  # global index of the item's first tile
        for it in cutlass.range(item_begin, item_end, unroll=1):
            self.fetch_item(items, it, item_begin, guess, row)
            req = row[F.REQUEST]
            row_count = row[F.Q_ROW_COUNT]
            kv_start = row[F.KV_START]
            kv_end = row[F.KV_END]
            n_tiles = (cutlass.max(kv_end - kv_start, 0) + N - 1) // N
            first_head = row[F.KV_HEAD] * self.group + row[F.Q_ROW_START]
            if cutlass.const_expr(self.multi_token):
                # packed row r is token req_token + r // group (global row), head first_head + r % group
                # (tiles hold whole tokens: Q_ROW_START is a multiple of the group)
                first_head = row[F.KV_HEAD] * self.group
                req_token = qo_indptr[req] + row[F.Q_ROW_START] // self.group
                self.causal_limits(row_limit, tScS, row[F.Q_ROW_START], row_count, row[F.CAUSAL_OFFSET], kv_end)
                req = req_token

            # ---- Q: packed rows -> smem (both warpgroups are past the previous item's MMAs and exchange)
            cute.arch.barrier(barrier_id=BOTH_BARRIER_ID, number_of_threads=NUM_CONSUMER_THREADS)
            for j in cutlass.range_constexpr(M * q_vecs_per_row // NUM_CONSUMER_THREADS):
                e = tidx + j * NUM_CONSUMER_THREADS
                r = e // q_vecs_per_row
                cv = e % q_vecs_per_row
                src = r if r < row_count else row_count - 1
                if cutlass.const_expr(self.multi_token):
                    src_q = gQv[None, (req + src // self.group, first_head + src % self.group, cv)]
                    sQv[None, (r, cv)].store(src_q.load())
                else:
                    sQv[None, (r, cv)].store(gQv[None, (req, first_head + src, cv)].load())
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BOTH_BARRIER_ID, number_of_threads=NUM_CONSUMER_THREADS)

            row_max.fill(neg_inf)
            row_sum.fill(0.0)
            acc_O.fill(0.0)
            # this warpgroup's tiles of the item: local t = (wg - first_tile) mod 2, t + 2, ...
            t_first = (wg + first_tile) % 2  # same parity as wg - first_tile
            for t in cutlass.range(t_first, n_tiles, 2, unroll=1):
                tile_start = kv_start + t * N
                pipe.consumer_wait(state)
                if cutlass.const_expr(self.row_gather):
                    cute.arch.fence_view_async_shared()  # the producer's cp.async rows, seen by this warp's wgmmas
                stage = state.index
                wgmma_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, stage], True)
                if warp_live:
                    if cutlass.const_expr(self.multi_token):
                        self.softmax_tile(acc_S, acc_O, tOrP, tScS, tile_start, row_limit, scale_log2, row_max,
                                          row_sum, row_scale, row_base)
                    else:
                        self.softmax_tile(acc_S, acc_O, tOrP, tScS, tile_start, kv_end, scale_log2, row_max,
                                          row_sum, row_scale, row_base)
                if tile_start + N > kv_end:  # the item's last tile
                    self.zero_v_tail(sV, stage, tile_start, kv_end, wtid, wg)
                wgmma_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, stage], False)
                pipe.consumer_release(state)
                state.advance(NUM_CONSUMER_WG)
            # A partial last tile made its owner pass zero_v_tail's warpgroup barrier (pages > 1); the other warpgroup
            # passes its own once too. The GPU needs no such thing (bar.sync BOTH below orders the hand-over for every
            # warp), but racecheck orders two threads' accesses by how many barriers each has passed, so one warpgroup one
            # barrier ahead makes it report the hand-over as a race (tools/racecheck_probe.py --variant asymmetric).
            if cutlass.const_expr(self.page_size > 1):
                if n_tiles > 0 and n_tiles * N > kv_end - kv_start and (n_tiles - 1) % 2 != t_first:
                    warpgroup_barrier_sync(WG_BARRIER_ID, wg, NUM_MMA_THREADS, NUM_CONSUMER_WG)
            first_tile += n_tiles

            # ---- warpgroup 1 hands its (max, sum, O) to warpgroup 0, which merges and stores the item
            if wg == 1:
                if warp_live:
                    self.export_state(exchange, wtid, row_max, row_sum, acc_O)
            cute.arch.barrier(barrier_id=BOTH_BARRIER_ID, number_of_threads=NUM_CONSUMER_THREADS)
            if wg == 0:
                if warp_live:
                    self.merge_state(exchange, wtid, row_max, row_sum, acc_O)
                self.store_item(acc_O, tOcO, row_max, row_sum, row_scale, row_base, req, first_head, row_count,
                                row[F.PARTIAL_SLOT], output, lse, partial_out, partial_lse, lse_out_scale, wtid)
        if wg == 0:
            if cutlass.const_expr(self.line_schedule):
                end_line(items, line, merge_counters, arrival, partial_out, partial_lse, output, lse, lse_out_scale,
                         wtid, WG_BARRIER_ID, NUM_MMA_THREADS, self.head_dim)
            else:
                fold_completed_merges(items, item_begin, item_end, merge_indptr, merge_counters, arrival, self.group,
                                      partial_out, partial_lse, output, lse, lse_out_scale, wtid, WG_BARRIER_ID,
                                      NUM_MMA_THREADS, qo_indptr)

    @cute.jit
    def causal_limits(self, row_limit, tScS, row_start, row_count, causal_offset, kv_end):
        """Multi-token decode: ``row_limit[h]`` = one past the last key the thread's row of half h sees, the
        item's KV_END or its token's causal limit (token t sees keys <= t + CAUSAL_OFFSET), whichever is smaller.
        A padding row (>= row_count) takes the last real row's limit, so it stays finite like its Q row."""
        for h in cutlass.range_constexpr(2):
            r = cutlass.min(tScS[2 * h][0], row_count - 1)
            row_limit[h] = cutlass.min(kv_end, (row_start + r) // self.group + causal_offset + 1)

    @cute.jit
    def softmax_tile(self, acc_S, acc_O, tOrP, tScS, tile_start, kv_end, scale_log2, row_max, row_sum, row_scale,
                     row_base):
        """Scale, mask keys >= KV_END (multi-token decode: ``kv_end`` is the per-half ``row_limit``, the causal
        mask too), online softmax (base 2) of the live row halves; P -> tOrP, O rescaled."""
        neg_inf = -Float32.inf
        n_s = cute.size(acc_S)
        halves = (0,) if self.rows <= 8 else (0, 1)
        for i in cutlass.range_constexpr(n_s):
            if cutlass.const_expr((i // 2) % 2 in halves):
                key = tile_start + tScS[i][1]
                limit = kv_end
                if cutlass.const_expr(self.multi_token):
                    limit = kv_end[(i // 2) % 2]
                acc_S[i] = acc_S[i] * scale_log2 if key < limit else neg_inf
        for h in cutlass.range_constexpr(2):
            if cutlass.const_expr(h in halves):
                m_new = row_max[h]
                for i in cutlass.range_constexpr(n_s):
                    if cutlass.const_expr((i // 2) % 2 == h):
                        m_new = cute.arch.fmax(m_new, acc_S[i])
                m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=4)
                base = m_new if m_new != neg_inf else Float32(0.0)
                row_scale[h] = cute.math.exp2(row_max[h] - base, fastmath=True)
                row_base[h] = base
                row_max[h] = m_new
                row_sum[h] = row_sum[h] * row_scale[h]
        for i in cutlass.range_constexpr(n_s):
            if cutlass.const_expr((i // 2) % 2 in halves):
                p = cute.math.exp2(acc_S[i] - row_base[(i // 2) % 2], fastmath=True)
                row_sum[(i // 2) % 2] = row_sum[(i // 2) % 2] + p
                tOrP[i] = p.to(self.dtype)
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            if cutlass.const_expr((i // 2) % 2 in halves):
                acc_O[i] = acc_O[i] * row_scale[(i // 2) % 2]

    @cute.jit
    def zero_v_tail(self, sV, stage, tile_start, kv_end, wtid, wg):
        """Zero the last tile's V rows that may hold pool garbage (``common/kv_tail.py``) with 16-byte stores before
        the P V GEMM reads them. A decode item's ``kv_end`` stands in for the request's ``kv_len``: a split ending
        before it leaves rows of real (finite, masked) keys in ``[kv_end, kv_len)``, so zeroing from ``kv_end`` to
        the page's end covers the garbage past ``kv_len`` whichever item reads that page. Pages of one key have no
        tail (rows past ``kv_end`` are id -1 rows, zero-filled): nothing to zero, no barrier."""
        if cutlass.const_expr(self.page_size > 1):
            first, end = garbage_rows(tile_start, kv_end, kv_end, self.tile_n, self.page_size)
            zero_rows(sV[None, None, stage], first, end, wtid, NUM_MMA_THREADS, self.head_dim)
            cute.arch.fence_view_async_shared()
            warpgroup_barrier_sync(WG_BARRIER_ID, wg, NUM_MMA_THREADS, NUM_CONSUMER_WG)

    @cute.jit
    def export_state(self, exchange, wtid, row_max, row_sum, acc_O):
        """This thread's row maxima, partial row sums and O fragment -> its exchange row (live warps)."""
        for h in cutlass.range_constexpr(2):
            exchange[wtid, h] = row_max[h]
            exchange[wtid, 2 + h] = row_sum[h]
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            exchange[wtid, 4 + i] = acc_O[i]

    @cute.jit
    def merge_state(self, exchange, wtid, row_max, row_sum, acc_O):
        """Fold the other warpgroup's (max, sum, O) of the same fragment positions into this thread's."""
        neg_inf = -Float32.inf
        own = cute.make_rmem_tensor((2,), Float32)
        other = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            m_other = exchange[wtid, h]
            m_new = cute.arch.fmax(row_max[h], m_other)
            base = m_new if m_new != neg_inf else Float32(0.0)
            own[h] = cute.math.exp2(row_max[h] - base, fastmath=True)
            other[h] = cute.math.exp2(m_other - base, fastmath=True)
            row_sum[h] = row_sum[h] * own[h] + exchange[wtid, 2 + h] * other[h]
            row_max[h] = m_new
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            acc_O[i] = acc_O[i] * own[(i // 2) % 2] + exchange[wtid, 4 + i] * other[(i // 2) % 2]

    @cute.jit
    def store_item(self, acc_O, tOcO, row_max, row_sum, row_scale, row_base, req, first_head, row_count, slot,
                   output, lse, partial_out, partial_lse, lse_out_scale, wtid):
        """O / l and lse = m + log2(l) (a row that saw nothing: 0 and -inf) -> output/lse or the partial slot."""
        neg_inf = -Float32.inf
        n_o = cute.size(acc_O)
        for h in cutlass.range_constexpr(2):
            total = cute.arch.warp_reduction_sum(row_sum[h], threads_in_group=4)
            inv = Float32(0.0)
            row_lse = neg_inf
            if total > 0.0:
                inv = cute.arch.rcp_approx(total)
                row_lse = row_max[h] + cute.math.log2(total, fastmath=True)
            row_scale[h] = inv
            row_base[h] = row_lse
        if slot < 0:
            for i in cutlass.range_constexpr(n_o):
                r = tOcO[i][0]
                if r < row_count:
                    token, head = self.token_head(req, first_head, r)
                    output[token, head, tOcO[i][1]] = (acc_O[i] * row_scale[(i // 2) % 2]).to(self.dtype)
            if wtid % 4 == 0:
                for h in cutlass.range_constexpr(2):
                    r = tOcO[2 * h][0]
                    if r < row_count:
                        token, head = self.token_head(req, first_head, r)
                        lse[token, head] = row_base[h] * lse_out_scale
        else:
            for i in cutlass.range_constexpr(n_o):
                r = tOcO[i][0]
                if r < row_count:
                    partial_out[slot, r, tOcO[i][1]] = acc_O[i] * row_scale[(i // 2) % 2]
            if wtid % 4 == 0:
                for h in cutlass.range_constexpr(2):
                    r = tOcO[2 * h][0]
                    if r < row_count:
                        partial_lse[slot, r] = row_base[h]

    @cute.jit
    def token_head(self, req, first_head, r):
        """(output row, head) of packed row r: decode (req, first_head + r); multi-token decode, where ``req`` is
        the item's first token's global row, (req + r // group, first_head + r % group)."""
        token, head = req, first_head + r
        if cutlass.const_expr(self.multi_token):
            token, head = req + r // self.group, first_head + r % self.group
        return token, head


class GqaMultiTokenDecodeSm90(GqaDecodeSm90):
    """Multi-token (speculative) decode: the decode kernel with ``qo_indptr`` (its packed rows are q_len tokens'
    heads) and a per-row causal mask from CAUSAL_OFFSET; built for ``gqa_paged_multi_token_decode`` configs."""

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,  # [total_q, Hq, D] bf16
        k_cache: cute.Tensor,
        v_cache: cute.Tensor,
        qo_indptr: cute.Tensor,  # [batch + 1] int32
        kv_indices: cute.Tensor,
        work_indptr: cute.Tensor,
        items: cute.Tensor,
        merge_indptr: cute.Tensor,
        merge_counters: cute.Tensor,
        output: cute.Tensor,  # [total_q, Hq, D] bf16
        lse: cute.Tensor,  # [total_q, Hq] fp32
        partial_out: cute.Tensor,
        partial_lse: cute.Tensor,
        scale_log2: Float32,
        lse_out_scale: Float32,
        stream: cuda.CUstream,
    ):
        self.launch_kernel(q, k_cache, v_cache, qo_indptr, kv_indices, work_indptr, items, merge_indptr,
                           merge_counters, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream)


# --------------------------------------------------------------------------------------------- host
build, launch = gqa_decode_entry(GqaDecodeSm90, check_config)
multi_token_build, multi_token_launch = gqa_multi_token_decode_entry(GqaMultiTokenDecodeSm90, check_config)


def configs(arch: str, kind: str = KIND) -> list[PagedAttentionConfig]:
    """Of ``kind``: the definition's config (h20/kv4, d128, page 64), one family member (h32/kv8) and the small
    pages (h20/kv4: page 1, SGLang's default and FlashInfer-Bench's 19 page-1 GQA definitions; page 8: 8 boxes per
    stage; page 16, vLLM's FlashInfer default: 4 boxes per 64-key stage, decode only)."""
    if arch != ARCH:
        return []

    def decode(hq, hkv, ps):
        return default_paged_config(kind, arch=arch, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=128,
                                    head_dim_v=128, page_size=ps, causal=kind == MULTI_TOKEN_KIND)

    small = [decode(20, 4, 1), decode(20, 4, 8)] + ([decode(20, 4, 16)] if kind == KIND else [])
    return [decode(20, 4, 64), decode(32, 8, 64), *small]


def multi_token_configs(arch: str) -> list[PagedAttentionConfig]:
    return configs(arch, MULTI_TOKEN_KIND)


register_paged_kernel(KIND, ARCH, build=build, launch=launch, configs=configs,
                      check_config=check_config)
register_paged_kernel(MULTI_TOKEN_KIND, ARCH, build=multi_token_build, launch=multi_token_launch,
                      configs=multi_token_configs, check_config=check_config)

"""sm_90a causal GQA paged prefill, driven by the planner's work list (docs/kernel-contract.md) or by itself.

Grid: one persistent CTA per plan CTA slot (``work_indptr.shape[0] - 1``); CTA ``c`` runs items
``work_indptr[c] .. work_indptr[c+1]-1`` in order. An item is (request, KV head, up to
``tile_q_rows`` packed query rows, a key range ``[KV_START, KV_END)``). ``dynamic_schedule`` builds (entry
``call_dynamic``, the default call's route for batches with enough units): no plan; every CTA checks the batch's
index rules at its start, then its producer warp takes whole units (an unsplit item: request, q tile, KV head) from
an atomic counter and hands each to the consumers in its Q stage's slot; the consumers' end counts the CTA out, and
the last CTA clears the counter (``common/unit_schedule.py``; the producer side is ``gqa_prefill_producer.py``).

Warp roles (384 threads = 3 warpgroups):

* WG0, warp 0 -- producer (``setmaxnreg`` 24). Per item: TMA-loads the packed Q tile (one box over q
  viewed as ``((group, total_q), head_dim, kv_heads)``: the block ``q[t0:t0+tile_m//group, gh:gh+group]``,
  i.e. the first ``(tile_m // group) * group`` rows of the tile, whole tokens (a group that does not divide
  the tile, e.g. 5, leaves the last rows unloaded: stale, computed, never stored; the planner packs tiles of
  that many rows); rows past the request are loaded but never stored), then per ``kv_tile`` keys the K pages and the V
  pages (one TMA box per page of one KV head, page ids from ``kv_indices``; a page wholly past
  ``KV_END`` gets coordinate -1, which TMA zero-fills). Pages of 8+ keys: each lane loads the tile's <= 16 ids
  itself; pages 1, 2, 4 (32..128 boxes per tile): lane l loads ids l, l + 32, ... (coalesced,
  ``common/page_ids.py``) and each box gets its id by a shuffle; one elected lane issues a tile's boxes
  (``common/tma_issue.py``; pages 2..8 only with ``row_gather=False``). Pages 1..8 (``ROW_GATHER_PAGE_SIZES``,
  ``PagedAttentionConfig.row_gather``): no K/V boxes; each of WG0's four warps cp.asyncs a quarter of every
  tile's rows, 16 bytes each (``common/row_gather.gather_one_row_pages``), its page ids a tile ahead, into
  ``PipelineCpAsync`` stages that complete by ``noinc`` arrives; the consumers fence after every K / V wait.
  ``setmaxnreg`` 24: the release pays exactly for the consumers' 240 (``common/registers.py``). With boxes,
  warps 1-3 of WG0 exit at once.
* WG1, WG2 -- consumers (``setmaxnreg`` 240), 64 packed rows each. Per key tile: wgmma
  ``S = Q K^T`` (smem x smem), causal / sequence-end mask only on tiles that need it, online softmax
  in base 2 (``common/softmax.py``), P converted to bf16 in registers, wgmma ``O += P V``
  (registers x smem). On the last tile of an item that reads the request's last page, both consumer
  warpgroups zero its V rows past the request's keys in shared memory first (pool garbage, NaN in the
  tests; ``common/kv_tail.py``: every other row past ``KV_END`` is zero-filled or a real key), then meet
  at a named barrier.
* Epilogue (consumers): ``O / rowsum`` and ``lse = (max * scale_log2 + log2 sum)``; final items write
  bf16 ``output`` and ``lse * lse_out_scale`` with predicated stores (rows < Q_ROW_COUNT), split items
  write fp32 ``partial_out[slot]`` / base-2 ``partial_lse[slot]`` (``prefill_epilogue.py``, shared with the
  MLA kernel). The combine kernel merges those; with ``fused_merge`` (entry ``call_fused``) the kernel folds them
  itself after its item loop (``common/decode_merge.fold_completed_merges``: fence, named barrier ``_FOLD_BARRIER``
  over both consumer warpgroups, one acq_rel atomic per split item) and no combine launch follows: a device plan
  of prefill cannot know on the host whether it split anything, so without the fold it always launches the combine.

Pipelines (mbarriers, ``cutlass.pipeline.PipelineTmaAsync``): Q has 2 stages (released after the
item's last QK GEMM, so the next item's Q and first K/V tiles load during this item's tail and
epilogue), K and V have ``num_stages`` stages each; K and V of one key tile share a stage index.
head_dim 256 (``q_stages``): one Q stage, released after the item's main loop (so the next item's Q and
first K/V load under this item's epilogue; with ``smem_epilogue`` only after it), and 64-key tiles.

Consumer ping-pong (FA3): named barriers 2 and 3 give the two consumer warpgroups alternate GEMM
turns (wait on your own before issuing a GEMM, arrive on the other's after issuing the QK GEMM and
at the end of an item), so one warpgroup's softmax overlaps the other's tensor-core work.

Compile-time variants (``PagedAttentionConfig`` fields, off by default):

* ``intra_wg_overlap`` (FA3 ``IntraWGOverlap``): per item, S_0 and its softmax first; then for each
  further tile j one GEMM turn issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` back to back, the
  softmax of S_j runs while the P V GEMM is still in flight (``wait_group(1)``), and the last tile's
  P V GEMM closes the item. One scheduler turn per tile instead of two.
* ``smem_epilogue``: final bf16 output goes through shared memory (the item's Q stage) with 16-byte
  coalesced stores (``prefill_epilogue.py``); the Q stage is then released after the epilogue.

Shared memory: Q ``q_stages x tile_m x d``, K and V ``num_stages x kv_tile x d`` each, 128B-swizzled K-major
tiles (one page is the box ``page_size x d`` of a stage, at row ``i * page_size``: for pages 1, 2 and 4 a box
of fewer rows than the 8-row swizzle atom; legal because TMA swizzles by shared-memory address and the stage
is 1024 B aligned, and CuTe DSL builds the atom from the ``(page_size, d)`` slice of the stage layout; each box
is ``d / 64`` TMA copies of 64 columns, the 128B swizzle's width). head_dim 128, kv_tile 128: 64 + 128 KB;
head_dim 256, kv_tile 64: one 64 KB Q stage + 2 x 2 x 32 KB of K/V = 192 KB (pages 1..64: a page is one box
inside the key tile). Registers per consumer thread at head_dim 256: O 64 x 256 fp32 over 128 threads = 128, S
of a 64-key tile 32, bf16 P 16 (under the 240 of ``setmaxnreg``; ptxas: no spills with the default flags).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass import pipeline as cpipe
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ...config import PagedAttentionConfig, default_paged_config
from ...plan import ItemField as F
from .. import register_paged_kernel
from ..common.decode_merge import fold_completed_merges
from ..common.paged_launch import gqa_prefill_entry
from ..common.limits import page_box_reason, row_gather_reason, smem_reason, target_reason, uses_row_gather
from ..common.kv_tail import garbage_rows, zero_rows
from ..common.mask import apply_causal_seqend_mask, tile_needs_mask
from ..common.named_barrier import warpgroup_barrier_arrive, warpgroup_barrier_sync
from ..common.packed_q import q_box_stage_layout
from ..common.registers import register_split_reason
from ..common.unit_schedule import SLOT_FIELDS, SlotField, check_batch, dynamic_launch, finish_schedule, read_slot
from ..common.softmax import (acc_mn_view, acc_to_mma_a_view, make_softmax_state, rescale_rows,
                              softmax_finalize, softmax_reset, softmax_update, store_p_bf16)
from ..common.launch_chain import wait_for_previous_grid
from .gqa_prefill_producer import GqaPrefillProducer
from .prefill_epilogue import store_item_rows, store_output_rows, store_output_via_smem
from .wgmma import wgmma_gemm

KIND = "gqa_paged_prefill"
ARCH = "sm_90a"
NUM_STAGES = 2
# Pages below one 8-row swizzle atom: 16-byte cp.async rows from the four producer warps, not kv_tile / page_size
# page boxes a tile. H200, 8 x 992, one process (tools/sweep_many.py, session 10): rows against boxes at page
# 2 215.7 / 282.9 us, page 4 211.8 / 216.9, page 8 208.4 / 242.0; page 1 rows 219.5 (boxes were 484).
ROW_GATHER_PAGE_SIZES = (1, 2, 4, 8)
_SUPPORTED_HEAD_DIMS = (64, 128, 256)
#: key tile per head_dim; at 256 a 64-key tile keeps the consumers in registers (O alone is 64 x 256 fp32 per
#: warpgroup = 128 per thread) and one Q stage + 2 K/V stages in shared memory (64 + 128 KB)
_KV_TILES = {64: (64, 128), 128: (64, 128), 256: (64,)}
# setmaxnreg split of the 384 threads (launched at 168 each): the producer warpgroup's release pays exactly for the
# consumers' increase (a producer at 32 left the consumers 1024 registers short: they waited forever, H200)
PRODUCER_REGS, CONSUMER_REGS = 24, 240
_ZERO_V_BARRIER = 1  # named barrier id used by the two consumer warpgroups
_SCHED_BARRIER = 2  # ids 2, 3: consumer warpgroup w waits on 2 + w before issuing its GEMMs
_FOLD_BARRIER = 6  # fused_merge: both consumer warpgroups (ids 4, 5: prefill_epilogue's per-warpgroup barriers)
_FOLD_ARRIVAL_BYTES = 16  # fused_merge: the merge counter's old value, broadcast to the consumers
_ROW_SLOT_WORDS = 4  # dynamic_schedule row gathers: (request, KV head, key end) a hand-off, two hand-offs
_FINISH_BARRIER = 8  # dynamic_schedule: both consumer warpgroups done before the CTA counts itself out


#: ``PagedAttentionConfig.probe`` builds of this kernel: "cta_stamps" -- each CTA writes globaltimer_lo stamps (entry,
#: the wait's release, its consumers' end), its item count, its SM and each item's end to row ``slots - 1 - cta`` of
#: ``partial_lse`` viewed as int32, for plans whose partial slots leave those rows alone (``tools/cta_timeline.py``);
#: the outputs stay right
PROBES = ("cta_stamps",)
CTA_STAMPS = 5  # entry, release, consumers' end (ns, low 32 bits of globaltimer), items, SM id


def q_stages(head_dim: int) -> int:
    """Q stages: 2 (the next item's Q and first K/V load while the current item finishes), 1 at head_dim 256
    (a 128 x 256 bf16 Q stage is 64 KB; two would leave room for only one K/V stage)."""
    return 1 if head_dim == 256 else 2


def _num_threads(config: PagedAttentionConfig) -> int:
    """The producer warpgroup and one consumer warpgroup per 64 rows of the tile."""
    return 128 + 2 * config.tile_q_rows


def smem_bytes(config: PagedAttentionConfig, num_stages: int = NUM_STAGES) -> int:
    """Shared memory of one CTA: Q tile, K and V stages, mbarriers (plus alignment slack)."""
    tile = 2 * config.head_dim_qk
    qs = q_stages(config.head_dim_qk)
    return (qs * config.tile_q_rows * tile + 2 * num_stages * config.kv_tile * tile
            + 8 * (2 * qs + 4 * num_stages) + 3 * 1024 + (_FOLD_ARRIVAL_BYTES if config.fused_merge else 0)
            + (4 * (qs * SLOT_FIELDS + 2 * _ROW_SLOT_WORDS + 2 * _num_threads(config) // 32) + 48
               if config.dynamic_schedule else 0))


def check_config(config: PagedAttentionConfig) -> str | None:
    """None when this kernel can run ``config``, else a readable reason."""
    if (reason := target_reason(config, KIND, ARCH)) is not None:
        return reason
    if not config.causal:
        return "the sm_90a prefill kernel is built causal (the definition); causal=False is not built"
    if config.head_dim_qk not in _SUPPORTED_HEAD_DIMS or config.head_dim_v != config.head_dim_qk:
        return f"head_dim {config.head_dim_qk} is not built yet (supported: {_SUPPORTED_HEAD_DIMS})"
    if config.tile_q_rows != 128:
        return f"tile_q_rows={config.tile_q_rows}: the kernel runs two 64-row consumer warpgroups (128 rows)"
    kv_tiles = _KV_TILES[config.head_dim_qk]
    if config.kv_tile not in kv_tiles:
        return (f"kv_tile={config.kv_tile} must be one of {kv_tiles} at head_dim {config.head_dim_qk}"
                + (" (O is 128 fp32 registers per consumer thread; 2 K/V stages of 64 keys fill shared memory "
                   "next to the 64 KB Q tile)" if config.head_dim_qk == 256 else ""))
    if config.page_size > config.kv_tile:
        return (f"page_size={config.page_size} is not built at head_dim {config.head_dim_qk}: a page is one TMA "
                f"box inside a key tile and the tile holds {config.kv_tile} keys (use pages of 1..{config.kv_tile})")
    if config.group_size > config.tile_q_rows:
        return f"group size {config.group_size} exceeds the {config.tile_q_rows}-row tile (a tile packs whole tokens)"
    if (reason := page_box_reason(config)) is not None:
        return reason
    # the four producer warps gather a quarter of each key tile apiece (produce_rows)
    if (reason := row_gather_reason(config, ROW_GATHER_PAGE_SIZES, rows_per_warp=config.kv_tile // 4)) is not None:
        return reason
    if (reason := register_split_reason([(128, PRODUCER_REGS), (config.tile_q_rows * 2, CONSUMER_REGS)])) is not None:
        return reason
    if (reason := smem_reason(smem_bytes(config))) is not None:
        return reason
    if config.probe and config.probe not in PROBES:
        return f"probe={config.probe!r} must be one of {PROBES} for this kernel"
    if config.dynamic_schedule and (config.fused_merge or config.probe):
        return ("dynamic_schedule: the self-scheduling build splits nothing (no fused_merge) and stamps no plan's "
                f"items (no probe); got fused_merge={config.fused_merge}, probe={config.probe!r}")
    return None


class GqaPagedPrefillSm90(GqaPrefillProducer):
    """The kernel object: compile-time constants live on ``self``."""

    def __init__(self, config: PagedAttentionConfig):
        self.releases_dependents = config.early_dependents  # config.EARLY_DEPENDENTS says why
        reason = check_config(config)
        if reason is not None:
            raise ValueError(reason)
        self.num_qo_heads = config.num_qo_heads
        self.num_kv_heads = config.num_kv_heads
        self.group = config.group_size
        self.head_dim = config.head_dim_qk
        self.page_size = config.page_size
        self.tile_m = config.tile_q_rows
        self.q_rows = config.packed_rows_per_tile  # whole tokens: (tile_m // group) * group rows are loaded
        self.tile_n = config.kv_tile
        self.pages_per_tile = self.tile_n // self.page_size
        self.row_gather = uses_row_gather(config, ROW_GATHER_PAGE_SIZES)
        self.row_segments = self.row_gather and config.row_segments is not False  # policy (None): segments
        self.k_ahead = self.row_gather and bool(config.k_ahead)  # policy (None): K_t then V_t
        self.num_stages = NUM_STAGES
        self.q_stages = q_stages(self.head_dim)
        self.num_mma_wg = self.tile_m // 64
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = 128 + self.num_mma_threads
        self.dtype = cutlass.BFloat16
        self.intra_wg_overlap = config.intra_wg_overlap
        self.smem_epilogue = config.smem_epilogue
        self.fused_merge = config.fused_merge
        self.cta_stamps = config.probe == "cta_stamps"
        self.dynamic = config.dynamic_schedule
        self.late_claim = config.late_claim
        self.rank_major_units = config.rank_major_units

    def __repr__(self) -> str:  # shows in the kernel symbol
        return (f"GqaPagedPrefillSm90_H{self.num_qo_heads}_KV{self.num_kv_heads}_D{self.head_dim}"
                f"_P{self.page_size}_M{self.tile_m}_N{self.tile_n}"
                f"{'_OVL' if self.intra_wg_overlap else ''}{'_SEPI' if self.smem_epilogue else ''}"
                f"{'_RowSeg' if self.row_segments else ''}{'_KAhead' if self.k_ahead else ''}"
                f"{'_Fold' if self.fused_merge else ''}{'_CtaStamps' if self.cta_stamps else ''}"
                f"{'_Dyn' if self.dynamic else ''}{'_Late' if self.late_claim else ''}"
                f"{f'_Rank{self.rank_major_units}' if self.rank_major_units else ''}")

    # ------------------------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, qo_indptr: cute.Tensor,
                 kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor, items: cute.Tensor,
                 output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor,
                 scale_log2: Float32, lse_out_scale: Float32, stream: cuda.CUstream):
        """The entry the combine launch follows."""
        self.launch_kernel(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, work_indptr, items, None, None,
                           output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream)

    @cute.jit
    def call_fused(self, q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, qo_indptr: cute.Tensor,
                   kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor, items: cute.Tensor,
                   merge_indptr: cute.Tensor, merge_counters: cute.Tensor, output: cute.Tensor, lse: cute.Tensor,
                   partial_out: cute.Tensor, partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32,
                   stream: cuda.CUstream):
        """``fused_merge``: the merge table follows ``items``; the kernel folds its merges (no combine launch)."""
        self.launch_kernel(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, work_indptr, items, merge_indptr,
                           merge_counters, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream)

    @cute.jit
    def call_dynamic(self, q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, qo_indptr: cute.Tensor,
                     kv_indptr: cute.Tensor, kv_indices: cute.Tensor, kv_last_page_len: cute.Tensor,
                     request_faults: cute.Tensor, unit_state: cute.Tensor, error_word: cute.Tensor,
                     output: cute.Tensor, lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32,
                     num_pages: Int32, num_ctas: Int32, stream: cuda.CUstream):
        """``dynamic_schedule``: no plan, one launch. ``num_ctas`` CTAs check the batch's rules, then take units from
        ``unit_state``, checking each request's rules and page ids (of a pool of ``num_pages``) as they go
        (``common/unit_schedule.py``)."""
        self.launch_kernel(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, None, None, None, None, output, lse,
                           None, None, scale_log2, lse_out_scale, stream,
                           units=(kv_last_page_len, request_faults, unit_state, num_ctas, error_word, num_pages))

    @cute.jit
    def launch_kernel(self, q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, qo_indptr: cute.Tensor,
                      kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor, items: cute.Tensor,
                      merge_indptr, merge_counters, output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor,
                      partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32, stream: cuda.CUstream,
                      units=None):
        G, D, H = self.group, self.head_dim, self.num_qo_heads
        # packed Q: ((group, total_q), d, kv_heads); row (g, t) is token t, head kv_head * group + g
        m_q = cute.make_tensor(q.iterator, cute.make_layout(
            ((G, q.shape[0]), D, self.num_kv_heads), stride=((D, H * D), 1, G * D)))
        # K/V as (slot, d, kv_head, page): a page of one head is the TMA box
        m_k = cute.make_tensor(k_cache.iterator, cute.select(k_cache.layout, mode=[1, 3, 2, 0]))
        m_v = cute.make_tensor(v_cache.iterator, cute.select(v_cache.layout, mode=[1, 3, 2, 0]))

        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, D), self.dtype)
        s_q_layout = cute.tile_to_shape(atom, (self.tile_m, D, self.q_stages), (0, 1, 2))
        s_kv_layout = cute.tile_to_shape(atom, (self.tile_n, D, self.num_stages), (0, 1, 2))
        # one page = the first page_size rows of a stage (same strides as inside the stage)
        s_page_layout = cute.composition(
            cute.select(s_kv_layout, mode=[0, 1]),
            cute.make_layout((self.page_size, D), stride=(1, self.tile_n)))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(g2s, m_q, q_box_stage_layout(s_q_layout, self.q_rows, self.tile_m, D),
                                                        ((G, self.tile_m // G), D))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(g2s, m_k, s_page_layout, (self.page_size, D))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(g2s, m_v, s_page_layout, (self.page_size, D))

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, D), a_source=warpgroup.OperandSource.RMEM)

        k_rows, v_rows = (k_cache, v_cache) if cutlass.const_expr(self.row_gather) else (None, None)
        dynamic, num_ctas = dynamic_launch(units, work_indptr)  # (common/unit_schedule.py)
        self.kernel(
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, k_rows, v_rows,
            qo_indptr, kv_indptr, kv_indices, work_indptr, items, output, lse, partial_out, partial_lse,
            scale_log2, lse_out_scale, s_q_layout, s_kv_layout, s_page_layout, tiled_mma_qk, tiled_mma_pv,
            merge_indptr, merge_counters, **dynamic,
        ).launch(grid=(num_ctas, 1, 1), block=(self.num_threads, 1, 1), stream=stream, use_pdl=True,
                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_atom_q: cute.CopyAtom, tma_q: cute.Tensor, tma_atom_k: cute.CopyAtom, tma_k: cute.Tensor,
               tma_atom_v: cute.CopyAtom, tma_v: cute.Tensor, k_rows, v_rows, qo_indptr: cute.Tensor,
               kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor, items: cute.Tensor, output: cute.Tensor,
               lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor, scale_log2: Float32,
               lse_out_scale: Float32, s_q_layout: cute.ComposedLayout, s_kv_layout: cute.ComposedLayout,
               s_page_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               merge_indptr: cute.Tensor = None, merge_counters: cute.Tensor = None,
               kv_last_page_len: cute.Tensor = None, request_faults: cute.Tensor = None,
               unit_state: cute.Tensor = None, error_word: cute.Tensor = None, num_pages=None):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        entered = Int32(0)
        if cutlass.const_expr(self.cta_stamps):
            entered = cute.arch.globaltimer_lo()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)

        smem = SmemAllocator()
        s_q = smem.allocate_tensor(self.dtype, s_q_layout.outer, 1024, s_q_layout.inner)
        s_k = smem.allocate_tensor(self.dtype, s_kv_layout.outer, 1024, s_kv_layout.inner)
        s_v = smem.allocate_tensor(self.dtype, s_kv_layout.outer, 1024, s_kv_layout.inner)
        mbar_q = smem.allocate_array(Int64, 2 * self.q_stages, byte_alignment=8)
        mbar_k = smem.allocate_array(Int64, 2 * self.num_stages, byte_alignment=8)
        mbar_v = smem.allocate_array(Int64, 2 * self.num_stages, byte_alignment=8)
        arrival = None  # fused_merge: thread 0's merge arrival, broadcast to the consumers
        if cutlass.const_expr(merge_indptr is not None):
            arrival = smem.allocate_tensor(Int32, cute.make_layout((1,)), _FOLD_ARRIVAL_BYTES)
        source = None  # dynamic_schedule: the unit counter and the hand-off slots (unit_schedule.UnitSource)
        if cutlass.const_expr(self.dynamic):
            slots = smem.allocate_tensor(Int32, cute.make_layout((self.q_stages, SLOT_FIELDS), stride=(SLOT_FIELDS, 1)),
                                         16)
            row_slots = smem.allocate_tensor(Int32, cute.make_layout((2, _ROW_SLOT_WORDS), stride=(_ROW_SLOT_WORDS, 1)),
                                             16)
            rule_words = smem.allocate_tensor(Int32, cute.make_layout((2 * self.num_threads // 32,)), 16)

        producer = cpipe.CooperativeGroup(cpipe.Agent.Thread, 1)
        consumers = cpipe.CooperativeGroup(cpipe.Agent.Thread, self.num_mma_threads // 32)
        tile_bytes = self.tile_n * self.head_dim * 2
        pipe_q = cpipe.PipelineTmaAsync.create(
            barrier_storage=mbar_q, num_stages=self.q_stages, producer_group=producer, consumer_group=consumers,
            tx_count=self.q_rows * self.head_dim * 2, defer_sync=True)
        if cutlass.const_expr(self.row_gather):
            # page 1: the producer warpgroup's 128 threads cp.async the rows and arrive (noinc) on the full mbarrier;
            # PipelineCpAsync's consumers arrive from every thread
            row_producers = cpipe.CooperativeGroup(cpipe.Agent.Thread, 128)
            row_consumers = cpipe.CooperativeGroup(cpipe.Agent.Thread, self.num_mma_threads)
            pipe_k = cpipe.PipelineCpAsync.create(
                barrier_storage=mbar_k, num_stages=self.num_stages, producer_group=row_producers,
                consumer_group=row_consumers, defer_sync=True)
            pipe_v = cpipe.PipelineCpAsync.create(
                barrier_storage=mbar_v, num_stages=self.num_stages, producer_group=row_producers,
                consumer_group=row_consumers, defer_sync=True)
        else:
            pipe_k = cpipe.PipelineTmaAsync.create(
                barrier_storage=mbar_k, num_stages=self.num_stages, producer_group=producer,
                consumer_group=consumers, tx_count=tile_bytes, defer_sync=True)
            pipe_v = cpipe.PipelineTmaAsync.create(
                barrier_storage=mbar_v, num_stages=self.num_stages, producer_group=producer,
                consumer_group=consumers, tx_count=tile_bytes, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Launched with programmatic dependent launch (it may start while the device planner runs): nothing
        # global is read before this wait, which returns once the previous grid has finished and flushed.
        wait_for_previous_grid(self.releases_dependents)
        item_begin = Int32(0)
        item_end = Int32(0)
        if cutlass.const_expr(not self.dynamic):
            item_begin = work_indptr[cta]
            item_end = work_indptr[cta + 1]
        else:  # every thread: the batch's rules and units (a broken batch: this CTA's share of the rows, no unit)
            source = check_batch(tidx, cta, self.num_threads, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                 output, lse, slots, rule_words, request_faults, unit_state, error_word, num_pages,
                                 self.group, self.q_rows, self.num_kv_heads, self.head_dim, self.page_size,
                                 self.tile_n, row_slots=row_slots, rank_major_units=self.rank_major_units)
        if cutlass.const_expr(self.cta_stamps):
            if tidx == 0:
                self.stamp(partial_lse, cta, 0, entered)
                self.stamp(partial_lse, cta, 1, cute.arch.globaltimer_lo())
                self.stamp(partial_lse, cta, 3, item_end - item_begin)
                self.stamp(partial_lse, cta, 4, cute.arch.smid())
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if cutlass.const_expr(self.row_gather):
                self.produce_rows(warp_idx, tma_atom_q, tma_q, k_rows, v_rows, s_q, s_k, s_v, qo_indptr, kv_indptr,
                                  kv_indices, items, item_begin, item_end, pipe_q, pipe_k, pipe_v, source)
            elif warp_idx == 0:
                self.produce(tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, s_q, s_k, s_v,
                             qo_indptr, kv_indptr, kv_indices, items, item_begin, item_end, pipe_q, pipe_k, pipe_v,
                             source)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            split_items = self.consume(tidx - 128, s_q, s_k, s_v, qo_indptr, items, item_begin, item_end, output,
                                       lse, partial_out, partial_lse, scale_log2, lse_out_scale, tiled_mma_qk,
                                       tiled_mma_pv, pipe_q, pipe_k, pipe_v, source)
            if cutlass.const_expr(self.cta_stamps):
                if tidx == 128:
                    self.stamp(partial_lse, cta, 2, cute.arch.globaltimer_lo())
            if cutlass.const_expr(self.dynamic):  # every CTA, even of a batch without units: each took one from the
                # counter (past the end), so the last one must zero it for the next launch
                finish_schedule(unit_state, request_faults, qo_indptr, output, lse, tidx - 128, self.num_mma_threads,
                                self.head_dim, _FINISH_BARRIER, rule_words)
            if cutlass.const_expr(merge_indptr is not None):  # both consumer warpgroups wrote the partials
                # only a CTA that wrote partials walks its items again: a prefill CTA runs ~15-30 items, and the
                # walk's item loads at the tail of every CTA made plans without merges 2-9 us slower (session 16)
                if split_items > 0:
                    fold_completed_merges(items, item_begin, item_end, merge_indptr, merge_counters, arrival,
                                          self.group, partial_out, partial_lse, output, lse, lse_out_scale,
                                          tidx - 128, barrier_id=_FOLD_BARRIER, num_threads=self.num_mma_threads,
                                          qo_indptr=qo_indptr)

    @cute.jit
    def stamp(self, partial_lse: cute.Tensor, cta, slot, value):
        """``cta_stamps`` builds: ``value`` into word ``slot`` of the CTA's row of ``partial_lse`` (as int32), counted
        from the buffer's last row so that a plan's first partial slots stay free."""
        words = cute.recast_tensor(partial_lse, Int32)
        words[words.shape[0] - 1 - cta, slot] = Int32(value)

    @cute.jit
    def consume(self, ctid: Int32, s_q: cute.Tensor, s_k: cute.Tensor, s_v: cute.Tensor, qo_indptr: cute.Tensor,
                items: cute.Tensor, item_begin: Int32, item_end: Int32, output: cute.Tensor, lse: cute.Tensor,
                partial_out: cute.Tensor, partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32,
                tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, pipe_q, pipe_k, pipe_v, source=None):
        D = self.head_dim
        wg = cute.arch.make_warp_uniform(ctid // 128)
        thr_qk = tiled_mma_qk.get_slice(ctid)
        thr_pv = tiled_mma_pv.get_slice(ctid)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        # V^T view (d, keys, stage) for the second GEMM's B operand
        s_vt = cute.composition(s_v, cute.make_ordered_layout((D, self.tile_n, self.num_stages), order=(1, 0, 2)))

        t_sq = wg_qk.make_fragment_A(wg_qk.partition_A(s_q))
        t_sk = wg_qk.make_fragment_B(wg_qk.partition_B(s_k))
        t_op = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        t_ovt = wg_pv.make_fragment_B(wg_pv.partition_B(s_vt))
        acc_s = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_o = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((self.tile_m, D)), Float32)
        c_s = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        c_o = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, D)))

        row_max, row_sum = make_softmax_state(cute.size(acc_mn_view(acc_s), mode=[0]))
        q_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, self.q_stages)
        if wg == 0:  # warpgroup 0 issues first: pre-arrive on its own scheduler barrier
            cute.arch.barrier_arrive(barrier_id=_SCHED_BARRIER, number_of_threads=self.num_mma_threads)
        kv_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, self.num_stages)
        split_items = Int32(0)  # items whose partials this CTA wrote (the fused merge's fold runs only if any)
        tensors = (s_q, s_v, t_sq, t_sk, t_ovt, t_op, acc_s, acc_o, c_s, c_o, row_max, row_sum)
        if cutlass.const_expr(source is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                causal_offset = items[it, int(F.CAUSAL_OFFSET)]
                kv_len = items[it, int(F.KV_END)]  # causal: kv_len - q_len is CAUSAL_OFFSET; pages of 1 have no tail
                if cutlass.const_expr(self.page_size > 1):
                    req = items[it, int(F.REQUEST)]
                    kv_len = causal_offset + qo_indptr[req + 1] - qo_indptr[req]
                # read only after the main loop: fewer registers live across it
                late = lambda: (items[it, int(F.REQUEST)], items[it, int(F.KV_HEAD)],  # noqa: E731
                                items[it, int(F.Q_ROW_COUNT)], items[it, int(F.PARTIAL_SLOT)])
                q_state, kv_state, split = self.consume_item(
                    ctid, wg, tensors, qo_indptr, items[it, int(F.Q_ROW_START)], items[it, int(F.KV_START)],
                    items[it, int(F.KV_END)], causal_offset, kv_len, late, output, lse, partial_out, partial_lse,
                    scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, q_state, kv_state)
                split_items = split_items + split
                if cutlass.const_expr(self.cta_stamps):
                    # words CTA_STAMPS.. of the row: each item's end (warpgroup 0's stores issued), while the row lasts
                    if ctid == 0 and CTA_STAMPS + it - item_begin < partial_lse.shape[1]:
                        cta, _, _ = cute.arch.block_idx()
                        self.stamp(partial_lse, cta, CTA_STAMPS + it - item_begin, cute.arch.globaltimer_lo())
        else:
            # each unit's fields arrive in its Q stage's slot (gqa_prefill_producer); all are read before the Q stage
            # is released, since the producer rewrites the slot with the stage
            slots = source.slots
            pipe_q.consumer_wait(q_state)
            valid = read_slot(slots, q_state.index, int(SlotField.VALID))
            while valid != 0:
                stage = q_state.index
                field = lambda f: read_slot(slots, stage, int(f))  # noqa: E731
                fields = (field(SlotField.REQUEST), field(SlotField.KV_HEAD), field(SlotField.Q_ROW_COUNT), -1)
                q_state, kv_state, split = self.consume_item(
                    ctid, wg, tensors, qo_indptr, field(SlotField.Q_ROW_START), Int32(0), field(SlotField.KV_END),
                    field(SlotField.CAUSAL_OFFSET), field(SlotField.KV_LEN), lambda: fields, output, lse, partial_out,
                    partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, q_state,
                    kv_state)
                pipe_q.consumer_wait(q_state)
                valid = read_slot(slots, q_state.index, int(SlotField.VALID))
        return split_items

    @cute.jit
    def consume_item(self, ctid, wg, tensors, qo_indptr, r0, kv_start, kv_end, causal_offset, kv_len, late_fields,
                     output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv,
                     pipe_q, pipe_k, pipe_v, q_state, kv_state):
        """One item (or unit): its key tiles, then its epilogue. ``late_fields()`` gives ``(request, kv_head,
        q_row_count, partial_slot)``. Returns the Q and K/V pipeline states and 1 if it stored partials."""
        G, D = self.group, self.head_dim
        s_q, s_v, t_sq, t_sk, t_ovt, t_op, acc_s, acc_o, c_s, c_o, row_max, row_sum = tensors
        first_token = r0 // G
        softmax_reset(row_max, row_sum)
        acc_o.fill(0.0)
        pipe_q.consumer_wait(q_state)
        t_sq_cur = t_sq[None, None, None, q_state.index]
        num_tiles = cute.ceil_div(kv_end - kv_start, self.tile_n) if kv_end > kv_start else 0
        if cutlass.const_expr(self.intra_wg_overlap):
            kv_state = self.mainloop_overlap(
                ctid, wg, num_tiles, kv_start, kv_end, kv_len, r0, first_token, causal_offset, s_v, t_sq_cur,
                t_sk, t_ovt, t_op, acc_s, acc_o, c_s, row_max, row_sum, scale_log2, tiled_mma_qk, tiled_mma_pv,
                pipe_k, pipe_v, kv_state)
        else:
            self.sched_wait(wg)
            for t in cutlass.range(num_tiles, unroll=1):
                kv_base = kv_start + t * self.tile_n
                stage = kv_state.index
                self.wait_rows(pipe_k, kv_state)
                wgmma_gemm(tiled_mma_qk, acc_s, t_sq_cur, t_sk[None, None, None, stage], True, wait=False)
                self.sched_arrive(wg)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(kv_state)
                self.mask(acc_s, c_s, r0, kv_base, kv_end, first_token, causal_offset)
                row_scale = softmax_update(acc_s, row_max, row_sum, scale_log2)
                rescale_rows(acc_o, row_scale)
                t_op.store(acc_to_mma_a_view(acc_s).load().to(self.dtype))
                self.wait_rows(pipe_v, kv_state)
                if kv_base + self.tile_n > kv_end:
                    self.zero_v_garbage(s_v, stage, kv_base, kv_end, kv_len, ctid)
                self.sched_wait(wg)
                wgmma_gemm(tiled_mma_pv, acc_o, t_op, t_ovt[None, None, None, stage], False)
                pipe_v.consumer_release(kv_state)
                kv_state.advance()
        b, h, row_count, slot = late_fields()
        if cutlass.const_expr(not self.smem_epilogue):
            pipe_q.consumer_release(q_state)
        if cutlass.const_expr(not self.intra_wg_overlap):
            self.sched_arrive(wg)

        o_scale, row_lse = softmax_finalize(row_max, row_sum, scale_log2)
        rescale_rows(acc_o, o_scale)
        if cutlass.const_expr(self.smem_epilogue):
            if slot < 0:
                store_output_via_smem(acc_o, s_q[None, None, q_state.index], tiled_mma_pv, ctid, wg,
                                      qo_indptr[b] + first_token, h, row_count, output, G, D)
            cute.arch.fence_view_async_shared()  # generic-proxy accesses before the next TMA load
            pipe_q.consumer_release(q_state)
        q_state.advance()
        q_start = qo_indptr[b]
        split = Int32(0)
        if cutlass.const_expr(partial_out is None):  # self-scheduling: every unit is final
            store_output_rows(acc_o, c_o, row_lse, q_start, h, r0, row_count, output, lse, lse_out_scale, G,
                              write_output=not self.smem_epilogue)
        else:
            store_item_rows(acc_o, c_o, row_lse, slot, qo_indptr, b, h, r0, row_count, output, lse, lse_out_scale,
                            partial_out, partial_lse, G, write_output=not self.smem_epilogue, q_start=q_start)
            if slot >= 0:
                split = Int32(1)
        return q_state, kv_state, split

    @cute.jit
    def mainloop_overlap(self, ctid: Int32, wg: Int32, num_tiles: Int32, kv_start: Int32, kv_end: Int32,
                         kv_len: Int32, r0: Int32,
                         first_token: Int32, causal_offset: Int32, s_v: cute.Tensor, t_sq: cute.Tensor,
                         t_sk: cute.Tensor, t_ovt: cute.Tensor, t_op: cute.Tensor, acc_s: cute.Tensor,
                         acc_o: cute.Tensor, c_s: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                         scale_log2: Float32, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                         pipe_k, pipe_v, kv_state):
        """One item's key tiles with S_{j+1} issued before the softmax of tile j; returns the KV state."""
        if num_tiles > 0:
            # first half: S_0 and its softmax; acc_o is zero, so no rescale; P_0 waits in t_op
            self.wait_rows(pipe_k, kv_state)
            wgmma_gemm(tiled_mma_qk, acc_s, t_sq, t_sk[None, None, None, kv_state.index], True)
            pipe_k.consumer_release(kv_state)
            self.mask(acc_s, c_s, r0, kv_start, kv_end, first_token, causal_offset)
            softmax_update(acc_s, row_max, row_sum, scale_log2)
            store_p_bf16(acc_s, t_op)
            for t in cutlass.range(1, num_tiles, unroll=1):
                kv_base = kv_start + t * self.tile_n
                v_state = kv_state.clone()  # tile t - 1: its V feeds this turn's P V GEMM
                kv_state.advance()
                self.wait_rows(pipe_k, kv_state)
                self.sched_wait(wg)
                wgmma_gemm(tiled_mma_qk, acc_s, t_sq, t_sk[None, None, None, kv_state.index], True, wait=False)
                self.wait_rows(pipe_v, v_state)  # tiles before the last are whole: no V tail to zero
                wgmma_gemm(tiled_mma_pv, acc_o, t_op, t_ovt[None, None, None, v_state.index], False, wait=False)
                self.sched_arrive(wg)
                warpgroup.wait_group(1)  # S_t is ready; P_{t-1} V_{t-1} may still run
                pipe_k.consumer_release(kv_state)
                self.mask(acc_s, c_s, r0, kv_base, kv_end, first_token, causal_offset)
                row_scale = softmax_update(acc_s, row_max, row_sum, scale_log2)
                warpgroup.wait_group(0)  # acc_o and t_op are free again
                pipe_v.consumer_release(v_state)
                rescale_rows(acc_o, row_scale)
                store_p_bf16(acc_s, t_op)
            # last half: P V of the last tile (the only one that can end inside a page)
            last_base = kv_start + (num_tiles - 1) * self.tile_n
            self.wait_rows(pipe_v, kv_state)
            if last_base + self.tile_n > kv_end:
                self.zero_v_garbage(s_v, kv_state.index, last_base, kv_end, kv_len, ctid)
            wgmma_gemm(tiled_mma_pv, acc_o, t_op, t_ovt[None, None, None, kv_state.index], False)
            pipe_v.consumer_release(kv_state)
            kv_state.advance()
        return kv_state

    @cute.jit
    def wait_rows(self, pipe, state):
        """A K or V stage is full; page 1's cp.async rows (generic proxy) are then fenced for this warp's wgmmas."""
        pipe.consumer_wait(state)
        if cutlass.const_expr(self.row_gather):
            cute.arch.fence_view_async_shared()

    @cute.jit
    def mask(self, acc_s: cute.Tensor, c_s: cute.Tensor, r0: Int32, kv_base: Int32, kv_end: Int32,
             first_token: Int32, causal_offset: Int32):
        """Causal / sequence-end mask, only on key tiles that need it."""
        if tile_needs_mask(kv_base, self.tile_n, kv_end, first_token, causal_offset):
            apply_causal_seqend_mask(acc_s, c_s, r0, self.group, kv_base, kv_end, causal_offset)

    def sched_wait(self, wg: Int32):
        """Wait for this warpgroup's GEMM turn (FA3 ping-pong: one warpgroup's softmax hides the other's GEMMs)."""
        warpgroup_barrier_sync(_SCHED_BARRIER, wg, self.num_mma_threads, self.num_mma_wg)

    def sched_arrive(self, wg: Int32):
        """Hand the GEMM turn to the other consumer warpgroup."""
        warpgroup_barrier_arrive(_SCHED_BARRIER, 1 - wg, self.num_mma_threads, self.num_mma_wg)

    @cute.jit
    def zero_v_garbage(self, s_v: cute.Tensor, stage: Int32, kv_base: Int32, kv_end: Int32, kv_len: Int32,
                       ctid: Int32):
        """Zero the stage's V rows that may hold pool garbage (``common/kv_tail.py``: the request's last page past
        ``kv_len``, when this item reads it), visible to wgmma in both warpgroups. Item-uniform, so both
        warpgroups take the same branch to the named barrier."""
        if cutlass.const_expr(self.page_size > 1):
            first, end = garbage_rows(kv_base, kv_end, kv_len, self.tile_n, self.page_size)
            if end > first:
                zero_rows(s_v[None, None, stage], first, end, ctid, self.num_mma_threads, self.head_dim)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=_ZERO_V_BARRIER, number_of_threads=self.num_mma_threads)


# ----------------------------------------------------------------------------------- registration
build, launch = gqa_prefill_entry(GqaPagedPrefillSm90, check_config)


def configs(arch: str) -> list[PagedAttentionConfig]:
    """The definition's config plus family members that exercise other page and group sizes (group 5: the Q box
    fills 125 of the tile's 128 rows; page 1: 128 one-row boxes per K or V tile, ids one per lane) and head_dim
    256 (Qwen3-Next's h16/kv2 at page 64, Gemma's group 2 at page 16, page 1: 64 one-row boxes per 64-key tile),
    then the self-scheduling builds of pages 64 and 1."""
    if arch != ARCH:
        return []

    def cfg(heads, kv_heads, page_size, head_dim=128):
        return default_paged_config(KIND, arch=arch, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim_qk=head_dim,
                                    head_dim_v=head_dim, page_size=page_size, causal=True)

    planned = [cfg(32, 4, 64), cfg(32, 4, 16), cfg(32, 8, 64), cfg(20, 4, 64), cfg(32, 4, 1),
               cfg(16, 2, 64, 256), cfg(16, 8, 16, 256), cfg(16, 2, 1, 256)]
    # the default call's self-scheduling builds of the definition's layout: TMA page boxes and row gathers
    return planned + [dataclasses.replace(c, dynamic_schedule=True) for c in (planned[0], planned[4])]


register_paged_kernel(KIND, ARCH, build=build, launch=launch, configs=configs,
                      check_config=check_config)

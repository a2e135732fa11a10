"""sm_90a causal absorbed-MLA paged prefill (page sizes 1..128), driven by the plan (docs/kernel-contract.md).

Definition: 16 query heads share one latent KV row per key; ``s = sm_scale * (q_nope . ckv + q_pe . kpe)``
(576 wide), ``o = softmax(s) @ ckv`` (V = ckv, 512 wide). Packed rows: group = 16 heads, one KV head, so a
64-row tile is 4 query tokens x 16 heads and its Q is the contiguous block ``q_nope[t0:t0+4]`` (packed row
``p`` of request ``b`` is element row ``(qo_indptr[b] * 16 + p)`` of ``q_nope`` viewed as ``[*, 512]``).

Grid: one persistent CTA per plan CTA slot; CTA ``c`` runs items ``work_indptr[c] .. work_indptr[c+1]-1``.
``dynamic_schedule`` builds (entry ``call_dynamic``; the score_warpgroup splits only): no plan; every CTA checks the
batch's index rules and scans its share of the page ids (``unit_schedule.check_batch``), the load role takes whole
(request, q tile) units from an atomic counter and hands each to the consumers in a ring of unit entries
(``common/mla.load_units``), and the consumers' end counts the CTA out (``common/unit_schedule.py``).

Warp roles (384 threads = 3 warpgroups):

* WG0 -- producer (``setmaxnreg`` 40): the MLA load role shared with the sm_100a kernel (``common/mla.py``;
  row gathers in ``common/row_gather.py``). All 128 threads gather with ``cp.async`` 16-byte copies
  (``.cg``, L2 only). Per item, also one without keys (the consumers wait on Q for every item): the Q
  tile (64 packed rows x (512 nope + 64 pe); rows >= Q_ROW_COUNT are zero-filled, never read), then per
  ``kv_tile`` keys one smem stage holding the keys' ckv and kpe rows side by side (a ``kv_tile x 576``
  K tile). Row ids: the first ``kv_tile`` producer threads turn each key into a latent row
  (``page * page_size + key % page_size``, page ``kv_indices[kv_indptr[b] + key // page_size]``, an id
  outside ``[0, num_pages)`` becoming -1: never read) in a small double-buffered smem table, then a producer
  named barrier; keys >= KV_END are not loaded: their rows are zero-filled by ``cp.async`` with ``src-size`` 0
  (the pool holds NaN in rows no request owns, and V = ckv feeds the P V MMA). Every row is one unrolled,
  branch-free ``cp.async`` (``gather_rows_zero_fill``), and each producer thread's copies complete on the stage's
  full barrier by themselves (``cp.async.mbarrier.arrive.noinc``, ``PipelineCpAsync``, 128 arrivals): the thread
  goes on to the next tile at once, so both stages load at the same time (a thread waiting for its copies before
  arriving kept one tile in flight). The consumers ``fence.proxy.async.shared::cta`` after each K wait (the rows are
  generic-proxy writes, read by wgmma's async proxy). Q keeps the wait + fence + arrive (once per item).
  Pages of >= 8 keys (``uses_kv_boxes``; ``PagedAttentionConfig.row_gather=True`` keeps the rows): the K stages
  are TMA tile boxes instead (``common/mla.box_latent_tile``: 8-row boxes of 64 columns over the caches as
  rows, 1-row boxes for an item's partial last 8 keys, rows past its end and bad pages zero-filled as out of the
  map), 72 instructions a 64-key stage from one elected thread of warp 0, completing by bytes
  (``PipelineTmaAsync``, one arrival per consumer warp).
* WG1, WG2 -- consumers (``setmaxnreg`` 232). O ``[64 x 512]`` fp32 is split by V columns: WG ``w`` owns
  columns ``256 w .. 256 w + 255`` (128 fp32 registers per thread). Both warpgroups compute the same
  ``S = Q K^T`` (wgmma SS over K = 576, 36 k-steps of 16) for the whole 64 x kv_tile tile, so the softmax
  state is identical in both and P never goes through shared memory (the redundant QK GEMM costs as
  much tensor work as sharing P would cost in barriers; see "Possible next steps"). Causal /
  sequence-end mask only on tiles that need it (``common/mask.py``, group 16), online softmax in base 2
  (``common/softmax.py``), P to bf16 in registers, ``O_w += P V[:, w half]`` (wgmma RS) where V^T is an
  MN-major view of the stage's ckv columns (no copy). The stage is released once both PV GEMMs are done
  (consumer arrival count 256); Q is released after the item's last QK GEMM, so the next item's Q loads
  during this item's last softmax, PV GEMM and epilogue.
* Epilogue: ``O / rowsum`` and ``lse = max * scale_log2 + log2(sum)``. Final items store bf16 ``output``
  (each warpgroup its 256 columns; rows < Q_ROW_COUNT) and ``lse * lse_out_scale`` (WG1 only); split items
  store fp32 ``partial_out[slot]`` / base-2 ``partial_lse[slot]`` (``prefill_epilogue.py``, shared with the GQA
  kernel), and ``launch`` runs the combine. ``fused_merge`` (entry ``call_fused``, every consumer split; built,
  not run on a GPU yet): after their items both consumer warpgroups count each split item in its merge
  (``common/decode_merge.fold_completed_merges``: fence, named barrier ``_FOLD_BARRIER``, one acq_rel atomic) and
  the last CTA of a merge folds its slots, so no combine launch follows. ``eager_combine`` (same entry): the
  consumers only count the split items (``decode_merge.announce_partials``), every CTA releases the combine launch
  at its start, and the combine folds each merge as soon as its slots are in (``common/combine.py``).
  An item with no key (or rows that see none) writes 0 / ``-inf`` through the same path.

Shared memory (kv_tile 64, the default): Q 64 x 576 bf16 = 72 KiB, 2 stages x 64 x 576 bf16 = 144 KiB,
row-id table 2 x 64 x 4 B, 6 mbarriers: 216.6 KiB of the 227 KiB opt-in limit (plus 1 KiB alignment slack
counted in ``smem_bytes``). kv_tile 32 gives 4 stages of 36 KiB in the same budget. All tiles are 128B-
swizzled K-major (8 x 64 atoms), so Q and K feed wgmma directly and V^T is an MN-major view of K's first
512 columns.

``PagedAttentionConfig.share_scores`` builds the variant that computes S once (``mla_prefill_shared_s.py``:
S split by key halves between the warpgroups, the row max exchanged and P shared through smem); same
registration, rules and launcher, ``MlaPagedPrefillSharedSSm90`` in the kernel symbol.

Possible next steps (performance, not correctness): ping-pong or intra-warpgroup overlap of the QK GEMM
with the softmax; prefetching the next tile's row ids one tile ahead.
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

from ...config import PagedAttentionConfig
from ...plan import ItemField as F
from .. import register_paged_kernel
from ..common.decode_merge import announce_partials, fold_completed_merges
from ..common.limits import SMEM_LIMIT_BYTES, mla_definition_reason, smem_reason, target_reason
from ..common.mla import (BOX_ROWS, CKV_DIM, DEFINITION_PAGE_SIZES, KIND, KPE_DIM, QK_DIM, definition_config,
                          MlaEntries, fold_arrival_bytes, load_q_and_kv_tiles, load_units, mla_entry, mla_line_reason,
                          row_view)
from ..common.unit_schedule import (SLOT_FIELDS, UNIT_RING, check_batch, dynamic_launch, finish_schedule,
                                    ring_smem_bytes)
from ..common.tma_issue import make_row_box_atom, tma_descriptor_address
from ..common.mask import apply_causal_seqend_mask, tile_needs_mask
from ..common.registers import register_split_reason
from ..common.softmax import (acc_mn_view, make_softmax_state, rescale_rows, softmax_finalize, softmax_reset,
                              softmax_update, store_p_bf16)
from ..common.launch_chain import wait_for_previous_grid
from ..common.line_schedule import end_line, mla_line_rules, start_line
from .prefill_epilogue import store_item_rows
from .wgmma import wgmma_gemm

ARCH = "sm_90a"
MAX_STAGES = 4
PRODUCER_THREADS = 128
MMA_THREADS = 256  # two consumer warpgroups, split by V columns
NUM_THREADS = PRODUCER_THREADS + MMA_THREADS
PRODUCER_REGS = 40
MMA_REGS = 232
_IDS_BARRIER = 1  # named barrier of the producer warpgroup (row-id table)
_FOLD_BARRIER = 6  # fused_merge, line_schedule (its fold and count-out): both consumer warpgroups (2..5: the splits')
_FINISH_BARRIER = 7  # dynamic_schedule: both consumer warpgroups done before the CTA counts itself out
#: ``PagedAttentionConfig.probe`` values this kernel builds (measurement builds; wrong outputs by design)
PROBES = ("loads_only", "compute_only")


# --------------------------------------------------------------------------------------------- config
def _tile_bytes(rows: int) -> int:
    return rows * QK_DIM * 2


def swapped(config: PagedAttentionConfig) -> bool:
    """One query token per tile (``tile_q_rows`` = heads): the swapped-product decode kernel (``mla_decode.py``)."""
    return config.tile_q_rows < 64


def _exchange_bytes(config: PagedAttentionConfig) -> int:
    """The ``share_scores`` variant's row max / row sum exchange buffer, the swapped decode kernel's P^T and column
    buffers (0 for the default kernel)."""
    if swapped(config):
        from .mla_decode import exchange_bytes

        return exchange_bytes(config.tile_q_rows, config.share_scores, config.cluster_merge)
    if config.score_warpgroup:
        from .mla_prefill_score_wg import EXCHANGE_BYTES

        return EXCHANGE_BYTES
    if not config.share_scores:
        return 0
    from .mla_prefill_shared_s import EXCHANGE_BYTES

    return EXCHANGE_BYTES


def _stage_bytes(config: PagedAttentionConfig) -> int:
    """One K stage: ``kv_tile`` x 576 bf16, and after a short stage of the swapped decode kernel the pad its 64-row
    S^T view reads (``mla_decode.score_pad_bytes``)."""
    if swapped(config):
        from .mla_decode import score_pad_bytes

        return _tile_bytes(config.kv_tile) + score_pad_bytes(config.kv_tile)
    return _tile_bytes(config.kv_tile)


def _unit_bytes(config: PagedAttentionConfig) -> int:
    """``dynamic_schedule``: the unit ring and the batch rules' block reduction words; 0 otherwise."""
    return ring_smem_bytes(rule_threads=NUM_THREADS) if config.dynamic_schedule else 0


def num_stages(config: PagedAttentionConfig) -> int:
    """K stages that fit next to the Q tile, the row-id table, the mbarriers and the slack (<= MAX_STAGES)."""
    fixed = (_tile_bytes(config.tile_q_rows) + 2 * config.kv_tile * 4 + 8 * 2 * (1 + MAX_STAGES) + 1024
             + _exchange_bytes(config) + fold_arrival_bytes(config) + _unit_bytes(config))
    return max(0, min(MAX_STAGES, (SMEM_LIMIT_BYTES - fixed) // _stage_bytes(config)))


def uses_kv_boxes(config: PagedAttentionConfig) -> bool:
    """K stages by TMA tile boxes (pages of >= ``BOX_ROWS`` keys) or by cp.async rows: ``config.row_gather``, or
    (None) boxes wherever the pages allow them."""
    return config.page_size >= BOX_ROWS if config.row_gather is None else not config.row_gather


def smem_bytes(config: PagedAttentionConfig) -> int:
    """Shared memory one CTA allocates: Q, K stages, the row-id table, mbarriers, 1 KiB alignment slack (and the
    ``share_scores`` exchange buffer)."""
    stages = num_stages(config)
    return (_tile_bytes(config.tile_q_rows) + stages * _stage_bytes(config) + 2 * config.kv_tile * 4
            + 8 * 2 * (1 + stages) + 1024 + _exchange_bytes(config) + fold_arrival_bytes(config)
            + _unit_bytes(config))


def check_config(config: PagedAttentionConfig) -> str | None:
    """None when this kernel implements ``config``, else a readable reason (on top of ``can_implement``)."""
    if (reason := target_reason(config, KIND, ARCH)) is not None:
        return reason
    if (reason := mla_definition_reason(config, QK_DIM, CKV_DIM)) is not None:
        return reason
    if swapped(config):
        from .mla_decode import swapped_reason

        if (reason := swapped_reason(config)) is not None:
            return reason
    elif config.tile_q_rows != 64:
        return (f"tile_q_rows={config.tile_q_rows}: the kernel runs one 64-row M tile whose O (64 x 512) is "
                "split across two consumer warpgroups by V columns (or, with tile_q_rows = the head count, one "
                "token a tile: the swapped decode kernel)")
    if config.kv_tile not in (32, 64):
        return f"kv_tile={config.kv_tile} must be 32 or 64 (a 64 x kv_tile x 576 K stage, >= 2 stages in smem)"
    if config.tile_q_rows % config.group_size:
        return (f"group size {config.group_size} (heads) must divide tile_q_rows={config.tile_q_rows}: a tile "
                "packs whole tokens")
    if config.ctas_per_sm != 1:
        return f"ctas_per_sm={config.ctas_per_sm}: one CTA uses ~217 KiB of shared memory, so 1 per SM"
    if (reason := register_split_reason([(PRODUCER_THREADS, PRODUCER_REGS), (MMA_THREADS, MMA_REGS)])) is not None:
        return reason
    if num_stages(config) < 2:
        return f"fewer than 2 K stages fit in {SMEM_LIMIT_BYTES} bytes of shared memory"
    if uses_kv_boxes(config) and config.page_size < BOX_ROWS:
        return (f"row_gather=False at page_size={config.page_size}: the K stages' TMA boxes are {BOX_ROWS}-key "
                f"groups of one page (pages of >= {BOX_ROWS} keys)")
    if config.probe:
        if config.probe not in PROBES:
            return f"probe={config.probe!r} must be one of {PROBES}"
        if not config.score_warpgroup or uses_kv_boxes(config):
            return (f"probe={config.probe!r}: measurement builds of the score_warpgroup split with row gathers only "
                    "(a K stage by TMA boxes completes by bytes: it cannot be committed empty)")
    if config.cluster_merge and not swapped(config):
        return ("cluster_merge: the swapped MLA decode kernel's fold (one token a tile, tile_q_rows = the head count); "
                f"got tile_q_rows={config.tile_q_rows}")
    if config.smem_epilogue and not config.score_warpgroup:
        return ("smem_epilogue: of the sm_90a MLA kernels only the score_warpgroup split builds it (O staged in the "
                "item's last K stage)")
    if config.intra_wg_overlap and not config.score_warpgroup:
        return ("intra_wg_overlap: of the sm_90a MLA kernels only the score_warpgroup split builds it (its score "
                "warpgroup's PV GEMM in flight under the next tile's S GEMM)")
    if config.dynamic_schedule and (not config.score_warpgroup or swapped(config) or config.probe
                                    or config.fused_merge or config.eager_combine or config.cluster_merge):
        return ("dynamic_schedule: the self-scheduling MLA prefill is built on the score_warpgroup split and splits "
                "nothing (no fused_merge, eager_combine or cluster_merge, no probe, 64-row tiles); got "
                f"score_warpgroup={config.score_warpgroup}, tile_q_rows={config.tile_q_rows}, "
                f"fused_merge={config.fused_merge}, eager_combine={config.eager_combine}, "
                f"cluster_merge={config.cluster_merge}, probe={config.probe!r}")
    if config.line_schedule and (reason := line_schedule_reason(config)) is not None:
        return reason
    if config.score_warpgroup:
        from .mla_prefill_score_wg import score_wg_reason

        if (reason := score_wg_reason(config)) is not None:
            return reason
    elif config.share_scores and not swapped(config):  # the swapped kernel's share_scores: a split over K
        from .mla_prefill_shared_s import shared_s_reason

        if (reason := shared_s_reason(config)) is not None:
            return reason
    return smem_reason(smem_bytes(config))


def line_table_requests(config: PagedAttentionConfig) -> int:
    """The most requests the MLA line build's table holds (it aliases the K stages)."""
    from ..common.line_schedule import table_requests

    return table_requests(NUM_THREADS, num_stages(config) * config.kv_tile * QK_DIM * 2)


def line_schedule_reason(config: PagedAttentionConfig) -> str | None:
    """Why a ``line_schedule`` build of ``config`` is not made: the swapped one-token decode kernel only, folding its
    own merges (no cluster fold, eager combine, self-scheduling units or probe), its plan derivable per CTA."""
    if not swapped(config):
        return ("line_schedule: the MLA decode build (one query token a tile, tile_q_rows = the head count); got "
                f"tile_q_rows={config.tile_q_rows}")
    return mla_line_reason(config, line_table_requests(config))


# --------------------------------------------------------------------------------------------- kernel
class MlaPagedPrefillSm90(MlaEntries):
    """The kernel object: compile-time constants live on ``self``; the entries are ``MlaEntries``'."""

    def __init__(self, config: PagedAttentionConfig):
        # config.EARLY_DEPENDENTS says why; an eager combine must be dispatched while this grid runs
        self.releases_dependents = config.early_dependents or config.eager_combine
        self.eager_combine = config.eager_combine
        self.cluster_merge = config.cluster_merge
        self.cluster_flags = config.cluster_merge_flags
        reason = check_config(config)
        if reason is not None:
            raise ValueError(reason)
        self.num_heads = config.num_qo_heads
        self.group = config.group_size
        self.tile_m = config.tile_q_rows
        self.tile_n = config.kv_tile
        self.num_stages = num_stages(config)
        self.kv_boxes = uses_kv_boxes(config)
        self.page_boxes = config.page_boxes and self.kv_boxes  # row gathers (row_gather=True) ignore it
        self.probe = config.probe
        self.row_segments = config.row_segments is not False  # the MLA policy: segments
        self.dynamic = config.dynamic_schedule
        self.late_claim = config.late_claim
        self.rank_major_units = config.rank_major_units
        self.line = config.line_schedule  # compile time: every other build's code is unchanged
        if config.line_schedule:
            self.line_rules = mla_line_rules(config)
            self.line_requests = line_table_requests(config)
        self.page_size = config.page_size
        self.early_page_ids = config.early_page_ids is not False
        self.early_first_stage = config.early_first_stage is not False
        self.dtype = cutlass.BFloat16

    def __repr__(self) -> str:  # shows in the kernel symbol
        return (f"MlaPagedPrefillSm90_H{self.num_heads}_M{self.tile_m}_N{self.tile_n}_S{self.num_stages}"
                + ("" if self.row_segments else "_ChunkColumns") + ("_Dyn" if self.dynamic else "")
                + ("_Late" if self.late_claim else "")
                + (f"_Rank{self.rank_major_units}" if self.rank_major_units else ""))

    # ------------------------------------------------------------------------------- host side
    def smem_layouts(self):
        """``(Q tile, K stages)``: 128B-swizzled row-major atoms of the 576-wide rows (every variant's, traced on
        the host side)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, QK_DIM), self.dtype)
        return (cute.tile_to_shape(atom, (self.tile_m, QK_DIM), (0, 1)),
                cute.tile_to_shape(atom, (self.tile_n, QK_DIM, self.num_stages), (0, 1, 2)))

    def kv_box_atoms(self, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor, s_k_layout) -> tuple:
        """``(ckv 8-row, ckv 1-row, kpe 8-row, kpe 1-row)`` TMA atoms over the caches as latent rows, boxes where the
        K stage layout puts them (``common/mla.box_latent_tile`` issues them raw). Built for every config (the
        kernel's parameters do not depend on the page size); used where ``kv_boxes``."""
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        ckv_rows, kpe_rows = row_view(ckv_cache, CKV_DIM), row_view(kpe_cache, KPE_DIM)
        return tuple(make_row_box_atom(g2s, rows, s_k_layout, box_rows)[0]
                     for rows in (ckv_rows, kpe_rows) for box_rows in (BOX_ROWS, 1))

    def page_box_atoms(self, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor, s_k_layout) -> dict:
        """``page_boxes``: the ``(ckv, kpe)`` kv_tile-row TMA atoms of a whole-page stage, as the kernel's keyword
        arguments (none otherwise, so other builds keep their parameters)."""
        if not self.page_boxes:
            return {}
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        ckv_rows, kpe_rows = row_view(ckv_cache, CKV_DIM), row_view(kpe_cache, KPE_DIM)
        return dict(box_ckv_page=make_row_box_atom(g2s, ckv_rows, s_k_layout, self.tile_n)[0],
                    box_kpe_page=make_row_box_atom(g2s, kpe_rows, s_k_layout, self.tile_n)[0])

    @cute.jit
    def launch_kernel(self, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
                      qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor,
                      work_indptr: cute.Tensor, items: cute.Tensor, merge_indptr, merge_counters,
                      output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor,
                      scale_log2: Float32, lse_out_scale: Float32, stream: cuda.CUstream, units=None):
        s_q_layout, s_k_layout = self.smem_layouts()
        tiled_mma_qk, tiled_mma_pv = self.tiled_mmas()
        dynamic, num_ctas = dynamic_launch(units, work_indptr)  # (common/unit_schedule.py)
        self.kernel(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, work_indptr, items,
                    output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, s_q_layout, s_k_layout,
                    tiled_mma_qk, tiled_mma_pv, *self.kv_box_atoms(ckv_cache, kpe_cache, s_k_layout),
                    merge_indptr, merge_counters, **self.page_box_atoms(ckv_cache, kpe_cache, s_k_layout), **dynamic,
                    ).launch(**self.grid(num_ctas), block=(NUM_THREADS, 1, 1), stream=stream,
                             use_pdl=True, min_blocks_per_mp=1)

    def grid(self, num_ctas) -> dict:
        """The launch's grid: one CTA a plan slot; with ``cluster_merge`` whole clusters of that many CTAs (the plan
        keeps its items below ``(num_ctas // k) * k``: ``plan_clusters.py``)."""
        if self.cluster_merge:
            k = self.cluster_merge
            return dict(grid=(num_ctas // k * k, 1, 1), cluster=(k, 1, 1))
        return dict(grid=(num_ctas, 1, 1))

    def allocate_k_stages(self, smem, s_k_layout):
        """The K stages' ring in shared memory (the swapped decode kernel's short stages add a pad after each)."""
        return smem.allocate_tensor(self.dtype, s_k_layout.outer, 1024, s_k_layout.inner)

    # The variants' hook (with allocate_exchange and consume_items below): how the consumers' MMAs tile the work.
    def tiled_mmas(self) -> tuple:
        """``(S = Q K^T, O = P V)`` tiled MMAs: both warpgroups compute all of S (one warpgroup's 64 x kv_tile
        tiling); O split by V columns with P from registers."""
        return self.qk_one_warpgroup(), self.pv_by_columns(p_in_registers=True)

    def qk_one_warpgroup(self):
        """S = Q K^T as one warpgroup's 64 x kv_tile MMA (K-major Q and K from the stages)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.tile_n))

    def pv_by_columns(self, p_in_registers: bool):
        """O = P V: the consumer warpgroups side by side along N (V columns), 64 x 256 each; V^T MN-major from the
        stage, P from registers or (``p_in_registers`` False) from shared memory."""
        wgs = MMA_THREADS // 128
        source = dict(a_source=warpgroup.OperandSource.RMEM) if p_in_registers else {}
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, wgs, 1), tiler_mn=(64, CKV_DIM // wgs), **source)

    # ------------------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
               qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor,
               items: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor,
               partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32,
               s_q_layout: cute.ComposedLayout, s_k_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, box_ckv8: cute.CopyAtom, box_ckv1: cute.CopyAtom,
               box_kpe8: cute.CopyAtom, box_kpe1: cute.CopyAtom, merge_indptr: cute.Tensor = None,
               merge_counters: cute.Tensor = None, box_ckv_page: cute.CopyAtom = None,
               box_kpe_page: cute.CopyAtom = None, kv_last_page_len: cute.Tensor = None,
               request_faults: cute.Tensor = None, unit_state: cute.Tensor = None, error_word: cute.Tensor = None,
               num_pages=None):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = SmemAllocator()
        s_q = smem.allocate_tensor(self.dtype, s_q_layout.outer, 1024, s_q_layout.inner)
        s_k = self.allocate_k_stages(smem, s_k_layout)
        s_ids = smem.allocate_tensor(Int32, cute.make_layout((self.tile_n, 2)), 16)
        s_red = self.allocate_exchange(smem)
        mbar_q = smem.allocate_array(Int64, 2, byte_alignment=8)
        mbar_k = smem.allocate_array(Int64, 2 * self.num_stages, byte_alignment=8)
        arrival = None  # fused_merge: thread 0's merge arrival, broadcast to the consumers
        if cutlass.const_expr((merge_indptr is not None and not self.eager_combine and not self.cluster_flags)
                              or self.line):
            arrival = smem.allocate_tensor(Int32, cute.make_layout((1,)), 16)
        if cutlass.const_expr(self.dynamic):  # the unit ring (common/mla.load_units), the rules' reduction words
            ring = smem.allocate_tensor(Int32, cute.make_layout((UNIT_RING, SLOT_FIELDS), stride=(SLOT_FIELDS, 1)), 16)
            rule_words = smem.allocate_tensor(Int32, cute.make_layout((2 * NUM_THREADS // 32,)), 16)

        producers = cpipe.CooperativeGroup(cpipe.Agent.Thread, PRODUCER_THREADS)
        consumers = cpipe.CooperativeGroup(cpipe.Agent.Thread, MMA_THREADS)
        pipe_q = cpipe.PipelineAsync.create(barrier_storage=mbar_q, num_stages=1, producer_group=producers,
                                            consumer_group=consumers, defer_sync=True)
        if cutlass.const_expr(self.kv_boxes):  # TMA boxes from one thread, complete by bytes; one arrival a warp
            pipe_k = cpipe.PipelineTmaAsync.create(
                barrier_storage=mbar_k, num_stages=self.num_stages,
                producer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, 1),
                consumer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, MMA_THREADS // 32),
                tx_count=self.tile_n * QK_DIM * 2, defer_sync=True)
        else:  # K stages complete by themselves (cp.async.mbarrier.arrive.noinc per producer thread): two in flight
            pipe_k = cpipe.PipelineCpAsync.create(barrier_storage=mbar_k, num_stages=self.num_stages,
                                                  producer_group=producers, consumer_group=consumers,
                                                  defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Launched with programmatic dependent launch (it may start while the device planner runs): nothing
        # global is read before this wait, which returns once the previous grid has finished and flushed.
        wait_for_previous_grid(self.releases_dependents)
        item_begin = Int32(0)
        item_end = Int32(0)
        source = None  # dynamic_schedule: the unit counter and the ring (unit_schedule.UnitSource)
        line = (kv_indptr, kv_last_page_len, request_faults, unit_state, error_word, num_pages)
        if cutlass.const_expr(self.line):  # every thread derives the CTA's stretch on a table over the K stages
            items = start_line(line, s_k.iterator, kv_indices, output, lse, tidx, NUM_THREADS, CKV_DIM,
                               self.line_rules, self.line_requests)
            item_end = items.count
        elif cutlass.const_expr(not self.dynamic):
            item_begin = work_indptr[cta]
            item_end = work_indptr[cta + 1]
        else:
            source = check_batch(tidx, cta, NUM_THREADS, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output,
                                 lse, ring, rule_words, request_faults, unit_state, error_word, num_pages, self.group,
                                 self.tile_m, 1, CKV_DIM, self.page_size, self.tile_n,
                                 rank_major_units=self.rank_major_units)
        if warp_idx < PRODUCER_THREADS // 32:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            kv_boxes = None
            if cutlass.const_expr(self.kv_boxes):
                if warp_idx == 0:
                    for atom in (box_ckv8, box_ckv1, box_kpe8, box_kpe1):
                        cpasync.prefetch_descriptor(atom)
                kv_boxes = ((tma_descriptor_address(box_ckv8), tma_descriptor_address(box_ckv1)),
                            (tma_descriptor_address(box_kpe8), tma_descriptor_address(box_kpe1)))
                if cutlass.const_expr(self.page_boxes):  # a third map each: whole-page stages
                    if warp_idx == 0:
                        cpasync.prefetch_descriptor(box_ckv_page)
                        cpasync.prefetch_descriptor(box_kpe_page)
                    kv_boxes = ((kv_boxes[0][0], kv_boxes[0][1], tma_descriptor_address(box_ckv_page)),
                                (kv_boxes[1][0], kv_boxes[1][1], tma_descriptor_address(box_kpe_page)))
            if cutlass.const_expr(self.dynamic):
                load_units(tidx, q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, s_q, s_k,
                           s_ids, pipe_q, pipe_k, cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, 1),
                           cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, self.num_stages), source,
                           group=self.group, num_threads=PRODUCER_THREADS, ids_barrier=_IDS_BARRIER,
                           page_size=self.page_size, kv_boxes=kv_boxes, row_segments=self.row_segments,
                           late_claim=self.late_claim)
            else:
                load_q_and_kv_tiles(tidx, q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices,
                                    items, item_begin, item_end, s_q, s_k, s_ids, pipe_q, pipe_k,
                                    cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, 1),
                                    cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, self.num_stages),
                                    group=self.group, num_threads=PRODUCER_THREADS, ids_barrier=_IDS_BARRIER,
                                    q_for_keyless_items=True, async_kv=True, kv_boxes=kv_boxes,
                                    skip_kv_copies=self.probe == "compute_only",
                                    row_segments=self.row_segments, early_page_ids=self.early_page_ids,
                                    early_first_stage=self.early_first_stage)
            if cutlass.const_expr(self.cluster_flags):  # after its last load: the check, the flags, the barriers
                self.fold_checked(tidx, s_red, None, qo_indptr, work_indptr, items, item_begin, item_end, output, lse,
                                  lse_out_scale, merge_indptr, merge_counters)
        else:
            cute.arch.setmaxregister_increase(MMA_REGS)
            consumer_red = s_red
            if cutlass.const_expr(self.cluster_flags):  # does this CTA's cluster hold one whole merge? (mla_decode.py)
                consumer_red = self.with_cluster_check(s_red, cta, work_indptr, items, merge_indptr)
            if cutlass.const_expr(self.dynamic):
                self.consume_items(tidx - PRODUCER_THREADS, s_q, s_k, consumer_red, qo_indptr, items, item_begin,
                                   item_end, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale,
                                   tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, source)
                # every CTA, even of a batch without units: each took one index from the counter, so the last one
                # to count itself out must zero it for the next launch
                finish_schedule(unit_state, request_faults, qo_indptr, output, lse, tidx - PRODUCER_THREADS,
                                MMA_THREADS, CKV_DIM, _FINISH_BARRIER, rule_words)
            else:
                self.consume_items(tidx - PRODUCER_THREADS, s_q, s_k, consumer_red, qo_indptr, items, item_begin,
                                   item_end, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale,
                                   tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k)
            if cutlass.const_expr(self.line):  # both consumer warpgroups wrote the partials and outputs
                end_line(items, line, merge_counters, arrival, partial_out, partial_lse, output, lse, lse_out_scale,
                         tidx - PRODUCER_THREADS, _FOLD_BARRIER, MMA_THREADS, CKV_DIM, qo_indptr=qo_indptr, wide=True)
            elif cutlass.const_expr(self.eager_combine):  # both consumer warpgroups wrote the partials
                announce_partials(items, item_begin, item_end, merge_counters, tidx - PRODUCER_THREADS,
                                  barrier_id=_FOLD_BARRIER, num_threads=MMA_THREADS)
            elif cutlass.const_expr(merge_indptr is not None and not self.cluster_flags):  # both wrote the partials
                fold_completed_merges(items, item_begin, item_end, merge_indptr, merge_counters, arrival, self.group,
                                      partial_out, partial_lse, output, lse, lse_out_scale, tidx - PRODUCER_THREADS,
                                      barrier_id=_FOLD_BARRIER, num_threads=MMA_THREADS, qo_indptr=qo_indptr,
                                      wide=True)
            if cutlass.const_expr(self.cluster_flags):  # the check the consumers made before their first tile
                self.fold_checked(tidx, consumer_red, consumer_red[3][2], qo_indptr, work_indptr, items, item_begin,
                                  item_end, output, lse, lse_out_scale, merge_indptr, merge_counters)
        if cutlass.const_expr(self.cluster_merge > 0 and not self.cluster_flags):  # every thread: the cluster folds
            self.fold_split_request(tidx, s_red, qo_indptr, items, item_begin, item_end, output, lse, lse_out_scale)

    # The two hooks the share_scores kernel (mla_prefill_shared_s.py) overrides; the rest of the kernel is shared.
    def allocate_exchange(self, smem):
        """Shared memory the consumer warpgroups exchange row statistics through (none: each computes all of S)."""
        return None

    def consume_items(self, ctid, s_q, s_k, s_red, qo_indptr, items, item_begin, item_end, output, lse, partial_out,
                      partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k):
        self.consume(ctid, s_q, s_k, qo_indptr, items, item_begin, item_end, output, lse, partial_out, partial_lse,
                     scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k)

    # ------------------------------------------------------------------------------- consumers
    @cute.jit
    def consume(self, ctid: Int32, s_q: cute.Tensor, s_k: cute.Tensor, qo_indptr: cute.Tensor, items: cute.Tensor,
                item_begin: Int32, item_end: Int32, output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor,
                partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32, tiled_mma_qk: cute.TiledMma,
                tiled_mma_pv: cute.TiledMma, pipe_q, pipe_k):
        G = self.group
        wg = cute.arch.make_warp_uniform(ctid // 128)
        thr_qk = tiled_mma_qk.get_slice(ctid % 128)
        wg_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(ctid)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        # V^T: (ckv column, key, stage) over the K stages' first 512 columns (MN-major B operand)
        s_vt = cute.composition(s_k, cute.make_layout((CKV_DIM, self.tile_n, self.num_stages),
                                                      stride=(self.tile_n, 1, self.tile_n * QK_DIM)))

        t_sq = wg_qk.make_fragment_A(wg_qk.partition_A(s_q))
        t_sk = wg_qk.make_fragment_B(wg_qk.partition_B(s_k))
        t_op = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        t_ovt = wg_pv.make_fragment_B(wg_pv.partition_B(s_vt))
        acc_s = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_o = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((self.tile_m, CKV_DIM)), Float32)
        c_s = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        c_o = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, CKV_DIM)))

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
                row_scale = softmax_update(acc_s, row_max, row_sum, scale_log2)
                rescale_rows(acc_o, row_scale)
                store_p_bf16(acc_s, t_op)
                wgmma_gemm(tiled_mma_pv, acc_o, t_op, t_ovt[None, None, None, stage], False)
                pipe_k.consumer_release(k_state)
                k_state.advance()
            if num_tiles == 0:
                pipe_q.consumer_release(q_state)
            q_state.advance()

            # read only now: fewer registers live across the main loop
            b = items[it, int(F.REQUEST)]
            row_count = items[it, int(F.Q_ROW_COUNT)]
            slot = items[it, int(F.PARTIAL_SLOT)]
            o_scale, row_lse = softmax_finalize(row_max, row_sum, scale_log2)
            rescale_rows(acc_o, o_scale)
            # one KV head: packed row p is head p % G of token p // G
            store_item_rows(acc_o, c_o, row_lse, slot, qo_indptr, b, 0, r0, row_count, output, lse, lse_out_scale,
                            partial_out, partial_lse, G)


# ----------------------------------------------------------------------------------- registration
def _kernel_for(config: PagedAttentionConfig):
    """The kernel object of ``config``: the default kernel, the S-computed-once variant (``share_scores``), or the
    swapped-product decode kernel (one token a tile)."""
    if swapped(config):
        from .mla_decode import MlaPagedDecodeSwappedSm90

        return MlaPagedDecodeSwappedSm90(config)
    if config.score_warpgroup:
        from .mla_prefill_score_wg import MlaPagedPrefillScoreWgSm90

        return MlaPagedPrefillScoreWgSm90(config)
    if config.share_scores:
        from .mla_prefill_shared_s import MlaPagedPrefillSharedSSm90

        return MlaPagedPrefillSharedSSm90(config)
    return MlaPagedPrefillSm90(config)


build, launch = mla_entry(_kernel_for, check_config)


def configs(arch: str) -> list[PagedAttentionConfig]:
    """The definitions' configs (``mla_paged_prefill_causal_h16_ckv512_kpe64_ps1`` and ``_ps64``), then the same two
    with each other consumer split (the variants the default is A/B'd against), then the MLA decode definitions'
    one-token configs (h16 at pages 1 and 64, h8 at page 1: what ``cute_attn.mla_paged_decode`` launches) and their
    device plans' builds (clusters of 2 checked at run time: ``ops/mla_decode.device_cluster_config``), so
    compile_all builds them all."""
    if arch != ARCH:
        return []
    from ...config import default_paged_config
    from ...ops.mla_decode import ONE_TOKEN_SPEC, device_cluster_config
    from ...ops.mla_prefill import CONSUMER_KNOBS, SM90_CONSUMER_SPLITS, SM90_LONG_ITEM_CONSUMERS

    definitions = [definition_config(arch, ps) for ps in DEFINITION_PAGE_SIZES]
    variants = [dataclasses.replace(c, **{**CONSUMER_KNOBS, **knobs})
                for knobs in SM90_CONSUMER_SPLITS.values() for c in definitions]
    decode = [default_paged_config(KIND, arch=arch, num_qo_heads=heads, num_kv_heads=1, head_dim_qk=QK_DIM,
                                   head_dim_v=CKV_DIM, page_size=ps, causal=True, spec=ONE_TOKEN_SPEC)
              for heads, ps in ((16, 1), (16, 64), (8, 1))]
    device_planned = [c for c in map(device_cluster_config, decode) if c not in decode]
    # the default call's self-scheduling builds: both definitions with the default split, page 1 with the long-item one
    long_split = {**CONSUMER_KNOBS, **SM90_CONSUMER_SPLITS[SM90_LONG_ITEM_CONSUMERS]}
    dynamic = [dataclasses.replace(c, dynamic_schedule=True) for c in definitions] + [
        dataclasses.replace(definitions[0], dynamic_schedule=True, **long_split)]
    return definitions + [c for c in variants + decode + device_planned + dynamic if c not in definitions]


register_paged_kernel(KIND, ARCH, build=build, launch=launch, configs=configs,
                      check_config=check_config)

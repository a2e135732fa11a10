"""sm_100a causal absorbed-MLA paged prefill (page sizes 1..128), driven by the plan (docs/kernel-contract.md).

The Blackwell twin of ``kernels/sm90/mla_prefill.py``: same grid, item loop, gathers, masking and outputs;
the MMAs are ``tcgen05.mma`` issued by one warp with S and O in tensor memory (TMEM). Compiled and
inspected only (no Blackwell GPU in this project): it has never run.

Definition: 16 query heads share one latent KV row per key; ``s = sm_scale * (q_nope . ckv + q_pe . kpe)``
(576 wide), ``o = softmax(s) @ ckv`` (V = ckv, 512 wide). A 64-row tile is 4 query tokens x 16 heads.

``line_schedule`` builds (entry ``call_line``, the sm_90a swapped decode kernel's twin; one query token a request, the
MLA decode entry's one-token batches): no plan; before the roles split every thread derives the CTA's stretch of the
device plan's cost line on a table over the K stages (``common/line_schedule.start_line``), every role reads item
``it`` as ``items[it, field]`` from it, and the correction warpgroup folds the CTA's (at most two) split items and
counts the CTA out (``end_line``, the wide fold of 512-column rows). The default call on sm_100a stays on the device
planner until it has run.

``dynamic_schedule`` builds (entry ``call_dynamic``, the sm_90a builds' twin): no plan; every CTA checks the batch's
index rules and scans its share of the page ids (``unit_schedule.check_batch``; the reduction words borrow the vector
ring), the load warpgroup takes whole (request, q tile) units from an atomic counter (``common/mla.load_units``) and
sends each to the MMA warp and the softmax and correction warpgroups through a unit pipeline over a ring of
shared-memory entries, and the correction warpgroup counts the CTA out (``common/unit_schedule.py``). The default call
on sm_100a stays on the device planner (``ops/mla_prefill.DYNAMIC_SCHEDULE_ARCHS``) until this kernel has run.

The TMEM problem. O is 64 rows x 512 fp32. A 128-row MMA would put O in 512 columns (all of TMEM) and
leave nothing for S. So O is computed *transposed*: ``O^T = V^T P^T`` as four ``M = 128`` (V columns)
x ``N = 64`` (query rows) x ``K = kv_tile`` MMAs, one per 128-column chunk of V: every TMEM lane is a V
column, every TMEM column a query row, 4 x 64 = 256 columns for all of O. ``A = V^T`` is an MN-major view
of the K stage's ckv part (the same bytes as the K-major K operand: key rows of 128 B per 64-column
chunk), ``B = P`` is a K-major 64 x 64 bf16 tile in shared memory written by the softmax warps.
``S = Q K^T`` is an ``M = 64`` MMA (PTX data-path layout F: packed row ``r`` in TMEM lane
``32 (r // 16) + r % 16``, key = column), so softmax warp ``w`` finds rows ``16 w .. 16 w + 15`` in its
lanes 0-15 (lanes 16-31 read unused TMEM and only join the warp-collective loads and the barriers).

TMEM (512 columns allocated, 384 used):
``[0, 256)`` O^T: chunk ``c`` (V columns ``128 c .. 128 c + 127``, lane = V column % 128) in columns
``[64 c, 64 c + 64)``, column = packed query row; ``[256, 320)`` S stage 0; ``[320, 384)`` S stage 1
(64 fp32 key columns each, lanes 0-15 of every 32-lane slab).

Warp roles (512 threads, 16 warps; ``setmaxnreg`` 152 softmax / 232 correction / 64 load and MMA warpgroups;
warps 13-15 idle, so that every role is whole warpgroups):

* warps 0-3 softmax: ``tcgen05.ld 32x32b.x64`` of the S stage, causal / sequence-end mask on tiles that
  need it (token ``t = row // 16`` sees key ``j`` iff ``j < KV_END`` and ``j <= t + CAUSAL_OFFSET``),
  online softmax in base 2 on raw scores (``p = exp2(s * scale_log2 - max * scale_log2)``, max 0 while
  it is -inf), P -> bf16 -> the swizzled P tile in smem (``fence.proxy.async``), row scale (tile >= 1)
  and finally (row_sum, row_max) -> correction through a small smem vector ring.
* warps 4-7 correction + epilogue, thread ``i`` = TMEM lane ``i`` = V column ``128 c + i`` of chunk ``c``:
  after PV(j-1) lands, ``O^T[:, row] *= scale_j[row]`` (all 64 row scales broadcast from smem; skipped
  when every scale is 1); after the last PV, ``O / row_sum`` and predicated stores of rows
  ``< Q_ROW_COUNT`` (bf16 ``output`` / fp32 ``partial_out[slot]``: a warp writes 32 consecutive columns of
  one row per store), ``lse * lse_out_scale`` / base-2 ``partial_lse`` by threads 0..63 (one row each).
  An item with no key writes 0 / -inf. Warp 4 allocates / frees TMEM. ``fused_merge`` (entry ``call_fused``):
  then these warps count their split items and the last CTA of a merge folds it (``common/decode_merge.py``,
  named barrier ``_BAR_FOLD``), so no combine launch follows.
* warps 8-11 load (128 threads): the MLA load role shared with the sm_90a producer (``common/mla.py``;
  row gathers in ``common/row_gather.py``). Per item with keys (the MMA warp reads Q only for those) the
  Q tile (rows >= Q_ROW_COUNT zero-filled) with 16-byte ``cp.async``; per key tile the latent row ids
  (``common/mla.py``: page size 1..128, page ids range-checked) into a double-buffered smem table, then the keys' ckv and kpe rows
  side by side into one ``kv_tile x 576`` stage by TMA ``tile::gather4`` (``common/mla.gather4_latent_tile``: one
  elected thread, four row ids an instruction, 16 x 9 boxes of 64 columns a stage, over 2-D tensor maps of the
  caches as latent rows), completing on the stage's mbarrier by bytes; keys >= KV_END get id -1, which TMA
  zero-fills as out of the map (the pool holds NaN in rows no request owns and V = ckv feeds the PV MMA). Q's
  rows: each thread ``cp.async.wait_group 0``, ``fence.proxy.async.shared::cta``, arrive.
* warp 12 MMA: ``S_j = Q K_j^T`` (36 k-blocks of 16), ``O^T (+)= V_j^T P_j^T`` (4 chunks x 4 k-blocks),
  order S0, S1, PV0, S2, PV1, ..., PV(n-1); ``tcgen05.commit`` releases Q after the item's last S, a K
  stage after its PV, P after the PV that read it.

Shared memory (``smem_bytes``, kv_tile 64): Q 64 x 576 bf16 = 72 KiB, 2 K stages x 72 KiB, P 8 KiB,
row-id table 512 B, vector ring 1 KiB, mbarriers, TMEM address, 1 KiB alignment slack: 226.6 KiB of
227 KiB. (Two stages only: the 72 KiB stage is the 576-wide K row; V is a view of it.)

Pipelines (``cutlass.pipeline``), in consumption order:
``q`` (AsyncUmma, 1): load -> MMA, released after the item's last S MMA.
``kv`` (TmaUmma, 2): load (gather4 bytes) -> MMA; waited before S_j, released after PV_j (V is the same stage).
``s`` (UmmaAsync, 2): MMA -> softmax, released once S_j is in registers.
``p`` (AsyncUmma, 1): softmax -> MMA, "P_j in smem"; released by the PV commit.
``o`` (UmmaAsync, 1): MMA -> correction, "PV_j landed"; released once O is rescaled / read out.
``c`` (Async, 2): softmax -> correction, row scales then the final (row_sum, row_max).
Hand-offs of tcgen05 work across threads are bracketed by ``tcgen05.fence::before_thread_sync`` /
``after_thread_sync``; TMEM loads/stores complete (``tcgen05.wait::ld/st``) before they are announced.
Shared with the GQA twin: the mbarrier storage and the s/p/o/c pipelines (``prefill_setup.py``), TMEM
ownership and those fences (``tmem.py``), the softmax-role steps (per-item header, S load, row-per-thread
online softmax, vector ring: ``softmax_rows.py``).

Possible next steps (performance): 128-row tiles (2 x 64 rows) so S uses all TMEM lanes and the
softmax all threads; S/P in TMEM with O^T; a third K stage with kv_tile 32; Q by gather4 too.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64
from cutlass import pipeline as cpipe
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator

from ...config import PagedAttentionConfig
from ...plan import ItemField as F
from .. import register_paged_kernel
from ..common.decode_merge import fold_completed_merges
from ..common.limits import TMEM_COLUMNS, mla_definition_reason, row_gather_choice_reason, smem_reason, target_reason
from ..common.mla import (CKV_DIM, DEFINITION_PAGE_SIZES, KIND, KPE_DIM, QK_DIM, definition_config,
                          MlaEntries, fold_arrival_bytes, load_q_and_kv_tiles, load_units, mla_entry, mla_line_reason,
                          row_view)
from ..common.unit_schedule import (SLOT_FIELDS, UNIT_RING, check_batch, dynamic_launch, finish_schedule,
                                    first_ring_unit, ring_smem_bytes, take_held_unit, wait_ring_unit)
from ..common.tma_issue import make_gather4_atom, tma_descriptor_address
from ..common.launch_chain import wait_for_previous_grid
from ..common.line_schedule import end_line, mla_line_rules, start_line, table_requests
from .prefill_setup import PrefillBarriers
from .softmax_rows import (NEG_INF, begin_softmax_item, begin_softmax_unit, load_s_row, num_key_tiles,
                           online_softmax_row, send_row_values)
from .tmem import fence_after_sync, fence_before_sync

ARCH = "sm_100a"
Q_STAGES = 1
KV_STAGES = 2
S_STAGES = 2
P_STAGES = 1  # one P tile in shared memory
C_STAGES = 2
PV_M = 128  # V columns per PV MMA (one O^T chunk)
O_COL = 0
LOAD_THREADS = 128  # one warpgroup runs the shared MLA load role
_WARP_SOFTMAX = 0  # warps 0-3
_WARP_CORRECTION = 4  # warps 4-7
_WARP_LOAD = 8  # warps 8-11
_WARP_MMA = 12
NUM_THREADS = 16 * 32  # warps 13-15 idle: setmaxnreg works on whole warpgroups
# registers per thread by warpgroup (128 x (152 + 232 + 64 + 64) = 64 Ki): softmax, correction, load, MMA;
# ptxas (13.0, PTX re-versioned) reports 12 B of spill stores; 168 / 216 spilled ~170 B (correction epilogue); the
# line build 88 B (its stretch, derived at 128 registers before the split, reloaded once at each role's entry)
_REGS_SOFTMAX, _REGS_CORRECTION, _REGS_OTHER = 152, 232, 64
_BAR_IDS = 1  # the load warps' row-id table barrier
_BAR_TMEM_ALLOC = 2
_BAR_TMEM_FREE = 3
_BAR_FOLD = 4  # fused_merge, line_schedule: the correction warpgroup's merge fold (and the line build's count-out)
_BAR_FINISH = 5  # dynamic_schedule: the correction warpgroup's stores done before the CTA counts itself out
#: dynamic_schedule: the roles reading each unit from the ring (MMA warp, softmax and correction warpgroups)
_UNIT_READERS = 32 + 128 + 128
_VEC = 8  # bf16 per 16-byte shared store of P


# --------------------------------------------------------------------------------------------- config
def tmem_columns(config: PagedAttentionConfig) -> int:
    """TMEM columns used: O^T (one column per query row per 128-column V chunk) and two fp32 S stages."""
    return CKV_DIM // PV_M * config.tile_q_rows + S_STAGES * config.kv_tile


def smem_bytes(config: PagedAttentionConfig) -> int:
    """Shared memory of one CTA: Q, K stages, P, row ids, vector ring, mbarriers, TMEM address, slack."""
    m, n = config.tile_q_rows, config.kv_tile
    barriers = PrefillBarriers.smem_bytes(Q_STAGES, KV_STAGES, S_STAGES, P_STAGES, C_STAGES)
    return (m * QK_DIM * 2 + KV_STAGES * n * QK_DIM * 2 + m * n * 2 + 2 * n * 4 + m * 2 * C_STAGES * 4
            + barriers + 1024 + fold_arrival_bytes(config) + _unit_bytes(config))


def _unit_bytes(config: PagedAttentionConfig) -> int:
    """``dynamic_schedule``: the unit pipeline's ring and mbarriers; 0 otherwise. The batch rules' reduction words and
    the count-out word borrow the vector ring, idle before the first unit is sent and after the last row values were
    read (the kernel is 148 bytes under the limit without them)."""
    return ring_smem_bytes(pipeline=True) if config.dynamic_schedule else 0


def line_table_requests(config: PagedAttentionConfig) -> int:
    """The most requests the line build's table holds (it aliases the K stages)."""
    return table_requests(NUM_THREADS, KV_STAGES * config.kv_tile * QK_DIM * 2)


def check_config(config: PagedAttentionConfig) -> str | None:
    """None when this kernel can build ``config``, else a readable reason."""
    if (reason := target_reason(config, KIND, ARCH)) is not None:
        return reason
    if (reason := mla_definition_reason(config, QK_DIM, CKV_DIM) or row_gather_choice_reason(config)) is not None:
        return reason
    if config.share_scores or config.score_warpgroup:
        knob = "share_scores" if config.share_scores else "score_warpgroup"
        return f"{knob} is an sm_90a variant (this kernel's one MMA warp computes S once already)"
    if config.tile_q_rows != 64:
        return (f"tile_q_rows={config.tile_q_rows} must be 64: S = Q K^T is one M=64 tcgen05 MMA and O^T keeps "
                "one TMEM column per query row (4 x 64 columns)")
    if config.kv_tile != 64:
        return (f"kv_tile={config.kv_tile} must be 64: one 128-byte swizzle row of P per query row, and two "
                "64 x 576 K stages fill shared memory")
    if config.tile_q_rows % config.group_size:
        return (f"group size {config.group_size} (heads) must divide tile_q_rows={config.tile_q_rows}: a tile "
                "packs whole tokens")
    if config.ctas_per_sm != 1:
        return f"ctas_per_sm={config.ctas_per_sm}: one CTA uses ~227 KiB of shared memory and all of TMEM"
    if config.dynamic_schedule and config.fused_merge:
        return "dynamic_schedule: the self-scheduling build splits nothing, so it has no merges to fold (fused_merge)"
    # line_schedule takes one query token a request (the MLA decode entry's one-token batches, ONE_TOKEN_SPEC): on
    # sm_100a that config is the prefill definition's (64-row tile), so the rule is the host's, which routes no call
    # here yet (ops/mla_decode.line_schedule: sm_90a only)
    if config.line_schedule and (reason := mla_line_reason(config, line_table_requests(config))) is not None:
        return reason
    if (reason := smem_reason(smem_bytes(config))) is not None:
        return reason
    if tmem_columns(config) > TMEM_COLUMNS:
        return f"needs {tmem_columns(config)} TMEM columns, more than {TMEM_COLUMNS}"
    return None


# --------------------------------------------------------------------------------------------- kernel
class MlaPagedPrefillSm100(MlaEntries):
    """The kernel object: compile-time constants live on ``self``; the entries are ``MlaEntries``'."""

    def __init__(self, config: PagedAttentionConfig):
        self.releases_dependents = config.early_dependents  # config.EARLY_DEPENDENTS says why
        reason = check_config(config)
        if reason is not None:
            raise ValueError(reason)
        self.num_heads = config.num_qo_heads
        self.group = config.group_size
        self.tile_m = config.tile_q_rows
        self.tile_n = config.kv_tile
        self.dtype = cutlass.BFloat16
        self.s_col = O_COL + CKV_DIM // PV_M * self.tile_m
        self.o_chunks = CKV_DIM // PV_M
        self.o_piece = 32  # O^T columns (query rows) per tcgen05.ld/st in the correction role
        self.dynamic = config.dynamic_schedule
        self.late_claim = config.late_claim
        self.rank_major_units = config.rank_major_units
        self.page_size = config.page_size
        self.early_page_ids = config.early_page_ids is not False
        self.line = config.line_schedule  # compile time: every other build's code is unchanged
        if config.line_schedule:
            self.line_rules = mla_line_rules(config)
            self.line_requests = line_table_requests(config)

    def __repr__(self) -> str:  # shows in the kernel symbol
        return (f"MlaPagedPrefillSm100_H{self.num_heads}_M{self.tile_m}_N{self.tile_n}_S{KV_STAGES}"
                + ("_Dyn" if self.dynamic else "") + ("_Late" if self.late_claim else "")
                + (f"_Rank{self.rank_major_units}" if self.rank_major_units else "")
                + ("_Line" if self.line else ""))

    # ------------------------------------------------------------------------------- host side
    @cute.jit
    def launch_kernel(self, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
                      qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor,
                      work_indptr: cute.Tensor, items: cute.Tensor, merge_indptr, merge_counters,
                      output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor,
                      scale_log2: Float32, lse_out_scale: Float32, stream: cuda.CUstream, units=None):
        M, N = self.tile_m, self.tile_n
        one = tcgen05.CtaGroup.ONE
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, one, (M, N))
        # O^T = V^T P^T: A = V^T (V column x key, MN-major), B = P (query row x key, K-major)
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.MN, OperandMajorMode.K, Float32, one, (PV_M, M))
        s_q_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, (M, N, QK_DIM), self.dtype, 1)
        s_k_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, (M, N, QK_DIM), self.dtype, KV_STAGES)
        s_vt_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, (PV_M, M, N), self.dtype, 1)
        s_p_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, (PV_M, M, N), self.dtype, 1)
        # (rows, columns[, stage]) views of the same bytes for the loads and the P stores: row r at 128 B * r
        # inside each 64-column chunk, chunks rows * 128 B apart (V^T's MN-major chunk of 128 columns is two
        # such 64-column chunks of one stage: 2 * N * 64 elements)
        atom = sm100_utils.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, self.dtype)
        s_q_rows = cute.tile_to_shape(atom, (M, QK_DIM), (0, 1))
        s_kv_rows = cute.tile_to_shape(atom, (N, QK_DIM, KV_STAGES), (0, 1, 2))
        s_p_rows = cute.tile_to_shape(atom, (M, N), (0, 1))
        # K stages by TMA gather4: the caches as latent rows, a box of one row x 64 columns (the stage's 128-byte
        # row of one 64-column block, swizzled by address); the descriptors only, the loads are raw gather4
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_ckv, _ = make_gather4_atom(g2s, row_view(ckv_cache, CKV_DIM), s_kv_rows)
        tma_atom_kpe, _ = make_gather4_atom(g2s, row_view(kpe_cache, KPE_DIM), s_kv_rows)

        dynamic, num_ctas = dynamic_launch(units, work_indptr)  # (common/unit_schedule.py)
        self.kernel(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, work_indptr, items,
                    output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, tiled_mma_qk, tiled_mma_pv,
                    s_q_layout, s_k_layout, s_vt_layout, s_p_layout, s_q_rows, s_kv_rows, s_p_rows, tma_atom_ckv,
                    tma_atom_kpe, merge_indptr, merge_counters, **dynamic,
                    ).launch(grid=(num_ctas, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, use_pdl=True,
                             min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, q_nope: cute.Tensor, q_pe: cute.Tensor, ckv_cache: cute.Tensor, kpe_cache: cute.Tensor,
               qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor,
               items: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor,
               partial_lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, s_q_layout: cute.ComposedLayout, s_k_layout: cute.ComposedLayout,
               s_vt_layout: cute.ComposedLayout, s_p_layout: cute.ComposedLayout, s_q_rows: cute.ComposedLayout,
               s_kv_rows: cute.ComposedLayout, s_p_rows: cute.ComposedLayout, tma_atom_ckv: cute.CopyAtom,
               tma_atom_kpe: cute.CopyAtom, merge_indptr: cute.Tensor = None, merge_counters: cute.Tensor = None,
               kv_last_page_len: cute.Tensor = None, request_faults: cute.Tensor = None,
               unit_state: cute.Tensor = None, error_word: cute.Tensor = None, num_pages=None):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = SmemAllocator()
        q_buf = smem.allocate_tensor(self.dtype, s_q_rows.outer, 1024, s_q_rows.inner)
        kv_buf = smem.allocate_tensor(self.dtype, s_kv_rows.outer, 1024, s_kv_rows.inner)
        p_buf = smem.allocate_tensor(self.dtype, s_p_rows.outer, 1024, s_p_rows.inner)
        s_ids = smem.allocate_tensor(Int32, cute.make_layout((self.tile_n, 2)), 16)
        s_vec = smem.allocate_tensor(Float32, cute.make_layout((self.tile_m, 2, C_STAGES)), 16)
        barriers = PrefillBarriers(smem, Q_STAGES, KV_STAGES, S_STAGES, P_STAGES, C_STAGES)
        arrival = None  # fused_merge, line_schedule: one merge arrival, broadcast to the correction warpgroup
        if cutlass.const_expr(merge_indptr is not None or self.line):
            arrival = smem.allocate_tensor(Int32, cute.make_layout((1,)), 16)
        pipe_u = None  # dynamic_schedule: the unit pipeline, load warpgroup -> the other roles
        ring = None
        if cutlass.const_expr(self.dynamic):
            ring = smem.allocate_tensor(Int32, cute.make_layout((UNIT_RING, SLOT_FIELDS), stride=(SLOT_FIELDS, 1)), 16)
            # the vector ring's first words: idle before the first unit is sent (the load warpgroup's rules) and after
            # the softmax warps' last send has been read (finish_schedule's count)
            rule_words = cute.make_tensor(cute.recast_ptr(s_vec.iterator, dtype=Int32),
                                          cute.make_layout((2 * NUM_THREADS // 32,)))
            mbar_u = smem.allocate_array(Int64, 2 * UNIT_RING, byte_alignment=8)
            pipe_u = cpipe.PipelineAsync.create(
                barrier_storage=mbar_u, num_stages=UNIT_RING,
                producer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, 1),
                consumer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, _UNIT_READERS), defer_sync=True)

        # q: cp.async by the whole load warpgroup (each thread arrives); kv: TMA gather4 from one thread, complete
        # by bytes; both consumed by the MMA thread
        thread = cpipe.CooperativeGroup(cpipe.Agent.Thread, 1)
        loaders = cpipe.CooperativeGroup(cpipe.Agent.Thread, LOAD_THREADS)
        pipe_q = cpipe.PipelineAsyncUmma.create(num_stages=Q_STAGES, producer_group=loaders, consumer_group=thread,
                                                barrier_storage=barriers.q, defer_sync=True)
        pipe_kv = cpipe.PipelineTmaUmma.create(num_stages=KV_STAGES, producer_group=thread, consumer_group=thread,
                                               tx_count=self.tile_n * QK_DIM * 2, barrier_storage=barriers.kv,
                                               defer_sync=True)
        pipe_s, pipe_p, pipe_o, pipe_c, tmem = barriers.create_role_pipelines(_BAR_TMEM_ALLOC, _BAR_TMEM_FREE,
                                                                               _WARP_CORRECTION)

        producer, consumer = cpipe.PipelineUserType.Producer, cpipe.PipelineUserType.Consumer
        # Launched with programmatic dependent launch (it may start while the device planner runs): nothing
        # global is read before this wait, which returns once the previous grid has finished and flushed.
        wait_for_previous_grid(self.releases_dependents)
        item_begin = Int32(0)
        item_end = Int32(0)
        units = {}  # dynamic_schedule: the ring the roles read their units from (each makes its own pipeline state)
        line = (kv_indptr, kv_last_page_len, request_faults, unit_state, error_word, num_pages)
        if cutlass.const_expr(self.line):  # every thread derives the CTA's stretch on a table over the K stages
            items = start_line(line, kv_buf.iterator, kv_indices, output, lse, tidx, NUM_THREADS, CKV_DIM,
                               self.line_rules, self.line_requests)
            item_end = items.count
        elif cutlass.const_expr(not self.dynamic):
            item_begin = work_indptr[cta]
            item_end = work_indptr[cta + 1]
        else:
            units = dict(ring=ring, pipe_u=pipe_u)
        if warp_idx < _WARP_CORRECTION:
            cute.arch.setmaxregister_increase(_REGS_SOFTMAX)
            self.softmax_role(tmem, p_buf, s_vec, items, item_begin, item_end, scale_log2, pipe_s, pipe_p, pipe_c,
                              cpipe.make_pipeline_state(consumer, S_STAGES),
                              cpipe.make_pipeline_state(producer, P_STAGES),
                              cpipe.make_pipeline_state(producer, C_STAGES), tidx, **units)
            tmem.release()
        elif warp_idx < _WARP_LOAD:
            cute.arch.setmaxregister_increase(_REGS_CORRECTION)
            tmem.allocate()
            self.correction_role(tmem, s_vec, items, item_begin, item_end, qo_indptr, output, lse, partial_out,
                                 partial_lse, scale_log2, lse_out_scale, pipe_o, pipe_c,
                                 cpipe.make_pipeline_state(consumer, 1), cpipe.make_pipeline_state(consumer, C_STAGES),
                                 tidx - 32 * _WARP_CORRECTION, **units)
            if cutlass.const_expr(self.dynamic):  # every CTA, even of a batch without units (it took one index)
                finish_schedule(unit_state, request_faults, qo_indptr, output, lse, tidx - 32 * _WARP_CORRECTION, 128,
                                CKV_DIM, _BAR_FINISH, rule_words)
            tmem.free()  # once the softmax and MMA warps are done with TMEM
            if cutlass.const_expr(self.line):  # the correction warpgroup wrote every partial and output
                end_line(items, line, merge_counters, arrival, partial_out, partial_lse, output, lse, lse_out_scale,
                         tidx - 32 * _WARP_CORRECTION, _BAR_FOLD, 128, CKV_DIM, qo_indptr=qo_indptr, wide=True)
            elif cutlass.const_expr(merge_indptr is not None):  # the correction warpgroup wrote every partial
                fold_completed_merges(items, item_begin, item_end, merge_indptr, merge_counters, arrival, self.group,
                                      partial_out, partial_lse, output, lse, lse_out_scale,
                                      tidx - 32 * _WARP_CORRECTION, barrier_id=_BAR_FOLD, num_threads=128,
                                      qo_indptr=qo_indptr, wide=True)
        elif warp_idx < _WARP_MMA:
            cute.arch.setmaxregister_decrease(_REGS_OTHER)
            if warp_idx == _WARP_LOAD:
                cpasync.prefetch_descriptor(tma_atom_ckv)
                cpasync.prefetch_descriptor(tma_atom_kpe)
            gather4 = (tma_descriptor_address(tma_atom_ckv), tma_descriptor_address(tma_atom_kpe))
            if cutlass.const_expr(self.dynamic):
                # the batch's rules and page-id scan by the load warpgroup alone, the one role that needs the batch's
                # units: at the kernel's start, before the roles split, all 512 threads' 128 registers spilled ~160
                # bytes over the rules' loop (ptxas); the other roles learn everything from the ring
                source = check_batch(tidx - 32 * _WARP_LOAD, cta, LOAD_THREADS, qo_indptr, kv_indptr, kv_indices,
                                     kv_last_page_len, output, lse, ring, rule_words, request_faults, unit_state,
                                     error_word, num_pages, self.group, self.tile_m, 1, CKV_DIM, self.page_size,
                                     self.tile_n, barrier_id=_BAR_IDS, rank_major_units=self.rank_major_units)
                load_units(tidx - 32 * _WARP_LOAD, q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr,
                           kv_indices, q_buf, kv_buf, s_ids, pipe_q, pipe_kv,
                           cpipe.make_pipeline_state(producer, Q_STAGES),
                           cpipe.make_pipeline_state(producer, KV_STAGES), source, group=self.group,
                           num_threads=LOAD_THREADS, ids_barrier=_BAR_IDS, page_size=self.page_size,
                           q_for_keyless_items=False, kv_gather4=gather4, pipe_u=pipe_u, late_claim=self.late_claim)
            else:
                load_q_and_kv_tiles(tidx - 32 * _WARP_LOAD, q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr,
                                    kv_indices, items, item_begin, item_end, q_buf, kv_buf, s_ids, pipe_q, pipe_kv,
                                    cpipe.make_pipeline_state(producer, Q_STAGES),
                                    cpipe.make_pipeline_state(producer, KV_STAGES),
                                    group=self.group, num_threads=LOAD_THREADS, ids_barrier=_BAR_IDS,
                                    q_for_keyless_items=False, kv_gather4=gather4,
                                    early_page_ids=self.early_page_ids)
        else:
            cute.arch.setmaxregister_decrease(_REGS_OTHER)
        if warp_idx == _WARP_MMA:
            kv_ptr = cute.recast_ptr(kv_buf.iterator, s_k_layout.inner, dtype=self.dtype)
            s_q = cute.make_tensor(cute.recast_ptr(q_buf.iterator, s_q_layout.inner, dtype=self.dtype),
                                   s_q_layout.outer)
            s_k = cute.make_tensor(kv_ptr, s_k_layout.outer)
            # V^T of every (128-column chunk, stage): the chunk's MMA layout plus chunk and stage modes
            vt = s_vt_layout.outer
            s_vt = cute.make_tensor(kv_ptr, cute.make_layout(
                (*vt.shape[:3], self.o_chunks, KV_STAGES),
                stride=(*vt.stride[:3], PV_M * self.tile_n, self.tile_n * QK_DIM)))
            s_p = cute.make_tensor(cute.recast_ptr(p_buf.iterator, s_p_layout.inner, dtype=self.dtype),
                                   s_p_layout.outer)
            self.mma_role(tiled_mma_qk, tiled_mma_pv, s_q, s_k, s_vt, s_p, tmem, items, item_begin, item_end,
                          pipe_q, pipe_kv, pipe_s, pipe_p, pipe_o, cpipe.make_pipeline_state(consumer, Q_STAGES),
                          cpipe.make_pipeline_state(consumer, KV_STAGES),
                          cpipe.make_pipeline_state(consumer, KV_STAGES),
                          cpipe.make_pipeline_state(producer, S_STAGES), cpipe.make_pipeline_state(consumer, P_STAGES),
                          cpipe.make_pipeline_state(producer, 1), **units)
            tmem.release()

    # ------------------------------------------------------------------------------- TMEM views
    @cute.jit
    def lane_view(self, tmem_ptr: cute.Pointer, col: int, width: int) -> cute.Tensor:
        """A (128 lanes, width columns) fp32 view of TMEM at column ``col`` (lane stride 1 << 16)."""
        return cute.make_tensor(tmem_ptr + col, cute.make_layout((128, width), stride=(1 << 16, 1)))

    # ------------------------------------------------------------------------------- mma
    @cute.jit
    def mma_role(self, tiled_mma_qk, tiled_mma_pv, s_q, s_k, s_vt, s_p, tmem, items, item_begin: Int32,
                 item_end: Int32, pipe_q, pipe_kv, pipe_s, pipe_p, pipe_o, q_state, kv_state, kv_pv_state, s_state,
                 p_state, o_state, ring=None, pipe_u=None):
        M, N = self.tile_m, self.tile_n
        tmem_ptr = tmem.base()
        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        s_frag = thr_qk.make_fragment_C(thr_qk.partition_shape_C((M, N)))
        o_frag = thr_pv.make_fragment_C(thr_pv.partition_shape_C((PV_M, M)))
        t_s = cute.make_tensor(tmem_ptr + self.s_col, s_frag.layout)
        t_o = cute.make_tensor(tmem_ptr + O_COL, o_frag.layout)
        t_rq = thr_qk.make_fragment_A(s_q)
        t_rk = thr_qk.make_fragment_B(s_k)
        t_rvt = thr_pv.make_fragment_A(s_vt)
        t_rp = thr_pv.make_fragment_B(s_p)
        mma = (tiled_mma_qk, tiled_mma_pv, t_rq, t_rk, t_rvt, t_rp, t_s, t_o)
        pipes = (pipe_q, pipe_kv, pipe_s, pipe_p, pipe_o)
        if cutlass.const_expr(ring is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                q_state, kv_state, kv_pv_state, s_state, p_state, o_state = self._mma_item(
                    mma, pipes, (q_state, kv_state, kv_pv_state, s_state, p_state, o_state),
                    num_key_tiles(items[it, int(F.KV_START)], items[it, int(F.KV_END)], N))
        else:
            u_state, valid = first_ring_unit(pipe_u, ring)
            while valid != 0:
                _, _, _, _, kv_end, _, _ = take_held_unit(pipe_u, u_state, ring)
                q_state, kv_state, kv_pv_state, s_state, p_state, o_state = self._mma_item(
                    mma, pipes, (q_state, kv_state, kv_pv_state, s_state, p_state, o_state),
                    num_key_tiles(Int32(0), kv_end, N))
                valid = wait_ring_unit(pipe_u, u_state, ring)

    @cute.jit
    def _mma_item(self, mma, pipes, states, n: Int32):
        """One item's ``n`` key tiles: S0, S1, PV0, S2, PV1, ..., PV(n-1); Q released after the last S. Returns the
        pipeline states."""
        tiled_mma_qk, tiled_mma_pv, t_rq, t_rk, t_rvt, t_rp, t_s, t_o = mma
        pipe_q, pipe_kv, pipe_s, pipe_p, pipe_o = pipes
        q_state, kv_state, kv_pv_state, s_state, p_state, o_state = states
        if n > 0:
            pipe_q.consumer_wait(q_state)
            kv_state, s_state = self._mma_qk(tiled_mma_qk, t_rq, t_rk, t_s, pipe_kv, pipe_s, kv_state, s_state)
            for j in cutlass.range(1, n, unroll=1):
                kv_state, s_state = self._mma_qk(tiled_mma_qk, t_rq, t_rk, t_s, pipe_kv, pipe_s, kv_state,
                                                 s_state)
                if j == n - 1:  # the item's last read of Q: the next item's Q may load now
                    pipe_q.consumer_release(q_state)
                kv_pv_state, p_state, o_state = self._mma_pv(tiled_mma_pv, t_rvt, t_rp, t_o, j > 1, pipe_kv,
                                                             pipe_p, pipe_o, kv_pv_state, p_state, o_state)
            if n == 1:
                pipe_q.consumer_release(q_state)
            kv_pv_state, p_state, o_state = self._mma_pv(tiled_mma_pv, t_rvt, t_rp, t_o, n > 1, pipe_kv, pipe_p,
                                                         pipe_o, kv_pv_state, p_state, o_state)
            q_state.advance()
        return q_state, kv_state, kv_pv_state, s_state, p_state, o_state

    @cute.jit
    def _mma_qk(self, tiled_mma, t_rq, t_rk, t_s, pipe_kv, pipe_s, kv_state, s_state):
        """S_j = Q K_j^T into S stage ``s_state.index`` (the K stage stays held until PV_j)."""
        pipe_kv.consumer_wait(kv_state)
        pipe_s.producer_acquire(s_state)
        fence_after_sync()
        acc = cute.make_tensor(t_s.iterator + s_state.index * self.tile_n, t_s.layout)
        mma = cute.make_mma_atom(tiled_mma.op)  # a local atom: its ACCUMULATE field never escapes this call
        for k in cutlass.range_constexpr(cute.size(t_rq, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(mma, acc, t_rq[None, None, k, 0], t_rk[None, None, k, kv_state.index], acc)
        pipe_s.producer_commit(s_state)
        s_state.advance()
        kv_state.advance()
        return kv_state, s_state

    @cute.jit
    def _mma_pv(self, tiled_mma, t_rvt, t_rp, t_o, accumulate, pipe_kv, pipe_p, pipe_o, kv_state, p_state,
                o_state):
        """O^T (+)= V_j^T P_j^T, chunk by chunk; then release the K stage and P, and announce O."""
        pipe_o.producer_acquire(o_state)  # the correction role is done with O (rescaled, or read out)
        pipe_p.consumer_wait(p_state)
        fence_after_sync()
        mma = cute.make_mma_atom(tiled_mma.op)
        for c in cutlass.range_constexpr(self.o_chunks):
            acc = cute.make_tensor(t_o.iterator + c * self.tile_m, t_o.layout)  # O^T chunk c
            for k in cutlass.range_constexpr(cute.size(t_rp, mode=[2])):
                mma.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)
                cute.gemm(mma, acc, t_rvt[None, None, k, c, kv_state.index], t_rp[None, None, k, 0], acc)
        pipe_p.consumer_release(p_state)
        p_state.advance()
        pipe_kv.consumer_release(kv_state)
        kv_state.advance()
        pipe_o.producer_commit(o_state)
        o_state.advance()
        return kv_state, p_state, o_state

    # ------------------------------------------------------------------------------- softmax
    @cute.jit
    def softmax_role(self, tmem, p_buf, s_vec, items, item_begin: Int32, item_end: Int32, scale_log2: Float32,
                     pipe_s, pipe_p, pipe_c, s_state, p_state, c_state, tid: Int32, ring=None, pipe_u=None):
        G, N = self.group, self.tile_n
        tmem_ptr = tmem.base()
        t_s = self.lane_view(tmem_ptr, self.s_col, N)
        c_s = cute.make_identity_tensor((128, N))
        tiled_ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(N)), Float32), t_s)
        thr_ld = tiled_ld.get_slice(tid)
        t_ld_s = thr_ld.partition_S(t_s)
        t_ld_c = thr_ld.partition_D(c_s)
        r_s = cute.make_rmem_tensor(t_ld_c.shape, Float32)
        r_p = cute.make_rmem_tensor((N,), self.dtype)
        r_p_chunks = cute.flat_divide(r_p, (_VEC,))  # (vec, chunk)
        s_p_chunks = cute.flat_divide(p_buf, (1, _VEC))  # (1, vec, row, chunk)
        # M=64 data-path layout: packed row 16 w + l lives in lane 32 w + l (l < 16) of warp w
        lane = tid % 32
        valid = lane < 16
        row = (tid // 32) * 16 + lane % 16

        tensors = (tiled_ld, t_ld_s, t_ld_c, r_s, r_p, r_p_chunks, s_p_chunks, s_vec, valid, row)
        pipes = (pipe_s, pipe_p, pipe_c)
        if cutlass.const_expr(ring is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                s_state, p_state, c_state = self._softmax_item(
                    tensors, pipes, (s_state, p_state, c_state), begin_softmax_item(items, it, row, G, N), scale_log2)
        else:
            u_state, live = first_ring_unit(pipe_u, ring)
            while live != 0:
                _, _, r0, _, kv_end, offset, _ = take_held_unit(pipe_u, u_state, ring)
                s_state, p_state, c_state = self._softmax_item(
                    tensors, pipes, (s_state, p_state, c_state),
                    begin_softmax_unit(r0, Int32(0), kv_end, offset, row, G, N), scale_log2)
                live = wait_ring_unit(pipe_u, u_state, ring)

    @cute.jit
    def _softmax_item(self, tensors, pipes, states, header, scale_log2: Float32):
        """One item's S rows -> P tiles in smem, row scales and the final (row_sum, row_max) (``header``:
        ``begin_softmax_item``'s). Returns the S, P and C states."""
        N = self.tile_n
        tiled_ld, t_ld_s, t_ld_c, r_s, r_p, r_p_chunks, s_p_chunks, s_vec, valid, row = tensors
        pipe_s, pipe_p, pipe_c = pipes
        s_state, p_state, c_state = states
        kv_start, kv_end, causal_offset, n, first_token, token, row_max, row_sum = header
        for j in cutlass.range(n, unroll=1):
            kv_base = kv_start + j * N
            load_s_row(tiled_ld, t_ld_s, r_s, N, pipe_s, s_state)
            fence_before_sync()
            pipe_s.consumer_release(s_state)  # S_j is in registers: the stage may take S_{j+2}
            s_state.advance()
            row_max, row_sum, scale = online_softmax_row(r_s, t_ld_c, kv_base, kv_end, first_token, token,
                                                         causal_offset, row_max, row_sum, scale_log2, N)
            r_p.store(r_s.load().to(self.dtype))
            pipe_p.producer_acquire(p_state)  # PV_{j-1} has read the previous P
            if valid:
                for c in cutlass.range_constexpr(N // _VEC):
                    cute.autovec_copy(r_p_chunks[None, c], s_p_chunks[0, None, row, c])
            cute.arch.fence_proxy("async.shared", space="cta")  # generic stores -> tcgen05 (async proxy)
            pipe_p.producer_commit(p_state)
            p_state.advance()
            if j > 0:  # O holds P(<j) V: the correction role rescales it before PV_j
                send_row_values(pipe_c, c_state, s_vec, row, (scale,), owns_row=valid)
                c_state.advance()
        if n > 0:
            send_row_values(pipe_c, c_state, s_vec, row, (row_sum, row_max), owns_row=valid)
            c_state.advance()
        return s_state, p_state, c_state

    # ------------------------------------------------------------------------------- correction
    @cute.jit
    def correction_role(self, tmem, s_vec, items, item_begin: Int32, item_end: Int32, qo_indptr, output, lse,
                        partial_out, partial_lse, scale_log2: Float32, lse_out_scale: Float32, pipe_o, pipe_c,
                        o_state, c_state, tid: Int32, ring=None, pipe_u=None):
        """Per item (or unit, from the unit pipeline): O's rescales, then the epilogue (:meth:`_correction_item`)."""
        N, M, C = self.tile_n, self.tile_m, self.o_piece
        tmem_ptr = tmem.base()
        # O^T in pieces of C query-row columns: 32x32b.xC loads/stores, thread = lane = V column % 128
        t_o = self.lane_view(tmem_ptr, O_COL, C)
        c_o = cute.make_identity_tensor((128, C))
        tiled_ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(C)), Float32), t_o)
        tiled_st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(C)), Float32), t_o)
        t_ld_o = tiled_ld.get_slice(tid).partition_S(t_o)
        t_st_o = tiled_st.get_slice(tid).partition_D(t_o)
        r_o = cute.make_rmem_tensor(tiled_ld.get_slice(tid).partition_D(c_o).shape, Float32)
        r_scale = cute.make_rmem_tensor(M, Float32)  # one factor per query row (= O^T column)

        tensors = (tiled_ld, tiled_st, t_ld_o, t_st_o, r_o, r_scale, s_vec, tid)
        outputs = (qo_indptr, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale)
        if cutlass.const_expr(ring is None):
            for it in cutlass.range(item_begin, item_end, unroll=1):
                o_state, c_state = self._correction_item(
                    tensors, outputs, pipe_o, pipe_c, o_state, c_state, items[it, int(F.REQUEST)],
                    items[it, int(F.Q_ROW_START)], items[it, int(F.Q_ROW_COUNT)], items[it, int(F.PARTIAL_SLOT)],
                    num_key_tiles(items[it, int(F.KV_START)], items[it, int(F.KV_END)], N))
        else:
            u_state, valid = first_ring_unit(pipe_u, ring)
            while valid != 0:
                b, _, r0, rows, kv_end, _, _ = take_held_unit(pipe_u, u_state, ring)
                # partial slot -1 as a Python int: a unit is never split, so only the final stores are traced
                o_state, c_state = self._correction_item(tensors, outputs, pipe_o, pipe_c, o_state, c_state, b, r0,
                                                         rows, -1, num_key_tiles(Int32(0), kv_end, N))
                valid = wait_ring_unit(pipe_u, u_state, ring)

    @cute.jit
    def _correction_item(self, tensors, outputs, pipe_o, pipe_c, o_state, c_state, b: Int32, r0: Int32,
                         row_count: Int32, slot, n: Int32):
        """One item's O^T rescales after each PV but the last, then its rows: bf16 ``output`` and lse, or a split
        item's fp32 partials (0 / -inf for an item without keys). Returns the O and C states."""
        G, M, C = self.group, self.tile_m, self.o_piece
        tiled_ld, tiled_st, t_ld_o, t_st_o, r_o, r_scale, s_vec, tid = tensors
        qo_indptr, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale = outputs
        for j in cutlass.range(1, n, unroll=1):
            pipe_c.consumer_wait(c_state)
            off = Float32(0.0)
            for r in cutlass.range_constexpr(M):
                r_scale[r] = s_vec[r, 0, c_state.index]
                off = cute.arch.fmax(off, cute.arch.fmax(r_scale[r] - 1.0, 1.0 - r_scale[r]))
            pipe_c.consumer_release(c_state)
            c_state.advance()
            pipe_o.consumer_wait(o_state)  # PV_{j-1} has landed in O
            fence_after_sync()
            if off != Float32(0.0):  # the same smem values in every thread: warp-uniform
                for c in cutlass.range_constexpr(self.o_chunks * M // C):
                    cute.copy(tiled_ld, cute.make_tensor(t_ld_o.iterator + c * C, t_ld_o.layout), r_o)
                    cute.arch.fence_view_async_tmem_load()
                    for i in cutlass.range_constexpr(C):
                        r_o[i] = r_o[i] * r_scale[(c * C + i) % M]
                    cute.copy(tiled_st, r_o, cute.make_tensor(t_st_o.iterator + c * C, t_st_o.layout))
                cute.arch.fence_view_async_tmem_store()
            fence_before_sync()
            pipe_o.consumer_release(o_state)
            o_state.advance()
        # epilogue: r_scale = 1 / row_sum (0 for a row that saw no key); own row's lse (threads < M)
        r_scale.fill(0.0)
        row_lse = NEG_INF
        if n > 0:
            pipe_c.consumer_wait(c_state)
            for r in cutlass.range_constexpr(M):
                s = s_vec[r, 0, c_state.index]
                r_scale[r] = Float32(0.0) if s == Float32(0.0) else cute.arch.rcp_approx(s)
            if tid < M:
                s = s_vec[tid, 0, c_state.index]
                if s != Float32(0.0):
                    row_lse = s_vec[tid, 1, c_state.index] * scale_log2 + cute.math.log2(s, fastmath=True)
            pipe_c.consumer_release(c_state)
            c_state.advance()
            pipe_o.consumer_wait(o_state)  # the last PV has landed
            fence_after_sync()
        q_start = qo_indptr[b]
        for c in cutlass.range_constexpr(self.o_chunks * M // C):
            if n > 0:  # tcgen05.ld is warp-collective: every lane loads, only real rows store
                cute.copy(tiled_ld, cute.make_tensor(t_ld_o.iterator + c * C, t_ld_o.layout), r_o)
                cute.arch.fence_view_async_tmem_load()
            else:
                r_o.fill(0.0)
            col = (c * C // M) * PV_M + tid  # V column
            for i in cutlass.range_constexpr(C):
                r = (c * C + i) % M  # query row (compile time)
                if r < row_count:
                    val = r_o[i] * r_scale[r]
                    if cutlass.const_expr(partial_out is None):  # self-scheduling builds: every unit is final
                        output[q_start + (r0 + r) // G, (r0 + r) % G, col] = val.to(self.dtype)
                    else:
                        if slot < 0:
                            output[q_start + (r0 + r) // G, (r0 + r) % G, col] = val.to(self.dtype)
                        else:
                            partial_out[slot, r, col] = val
        if n > 0:
            fence_before_sync()
            pipe_o.consumer_release(o_state)  # O may now be overwritten by the next item's PV
            o_state.advance()
        if tid < row_count:
            if cutlass.const_expr(partial_out is None):
                lse[q_start + (r0 + tid) // G, (r0 + tid) % G] = row_lse * lse_out_scale
            else:
                if slot < 0:
                    lse[q_start + (r0 + tid) // G, (r0 + tid) % G] = row_lse * lse_out_scale
                else:
                    partial_lse[slot, tid] = row_lse
        return o_state, c_state


# ----------------------------------------------------------------------------------- registration
build, launch = mla_entry(MlaPagedPrefillSm100, check_config)


def configs(arch: str) -> list[PagedAttentionConfig]:
    """The definitions' configs (``mla_paged_prefill_causal_h16_ckv512_kpe64_ps1`` and ``_ps64``), then their
    self-scheduling builds (``dynamic_schedule``: the sm_90a builds' twins)."""
    if arch != ARCH:
        return []
    definitions = [definition_config(arch, ps) for ps in DEFINITION_PAGE_SIZES]
    return definitions + [dataclasses.replace(c, dynamic_schedule=True) for c in definitions]


register_paged_kernel(KIND, ARCH, build=build, launch=launch, configs=configs,
                      check_config=check_config)

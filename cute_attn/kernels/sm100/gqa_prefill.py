"""sm_100a causal GQA paged prefill, driven by the planner's work list (docs/kernel-contract.md).

The Blackwell twin of ``kernels/sm90/gqa_prefill.py``: same grid, items, Q/K/V TMA boxes, masking and
outputs; the MMAs are ``tcgen05.mma`` issued by one warp with S, P and O in tensor memory (TMEM).
Compiled and inspected only (no Blackwell GPU in this project): it has never run.

Grid: one persistent CTA per plan CTA slot (``work_indptr.shape[0] - 1``); CTA ``c`` runs items
``work_indptr[c] .. work_indptr[c+1]-1`` in order. ``dynamic_schedule`` builds (entry ``call_dynamic``, the sm_90a
builds' twin): no plan; every CTA checks the batch's index rules and scans its share of the page ids at its start
(``unit_schedule.check_batch``), the load warp takes whole units from an atomic counter and sends each to the MMA,
softmax and correction warps through a unit pipeline over a ring of shared-memory entries (``prefill_roles.py``),
and the correction warps count the CTA out (``common/unit_schedule.py``). The default call on sm_100a stays on the device
planner (``ops/gqa_prefill.DYNAMIC_SCHEDULE_ARCHS``) until this kernel has run on a Blackwell GPU.

Role bodies: ``prefill_roles.py``; shared with the MLA twin: mbarrier storage and the s/p/o/c pipelines
(``prefill_setup.py``), TMEM ownership and tcgen05 hand-off fences (``tmem.py``), softmax-role steps
(``softmax_rows.py``).

Warp roles (384 threads, 12 warps):

* warps 0-3 softmax (``setmaxnreg`` 240): thread ``i`` owns packed row ``i``. Per key tile:
  ``tcgen05.ld 32x32b.x32`` of its S row, causal / sequence-end mask only on tiles that need it (token
  ``t = row // group`` sees key ``j`` iff ``j < KV_END`` and ``j <= t + CAUSAL_OFFSET``), online
  softmax in base 2 on raw scores (``p = exp2(s * scale_log2 - max * scale_log2)``, max 0 while it is
  -inf), P -> bf16 -> ``tcgen05.st`` into the S stage's TMEM, row scale -> correction.
* warps 4-7 correction + epilogue (``setmaxnreg`` 112), one row per thread: after PV(j-1) lands,
  ``O *= scale_j`` in TMEM (skipped when the whole warp's scale is 1); after the last PV,
  ``O / row_sum``, predicated stores of rows ``< Q_ROW_COUNT`` (bf16 ``output`` and
  ``lse * lse_out_scale``, or fp32 ``partial_out[slot]`` and base-2 ``partial_lse[slot]``); a row
  that saw no key (or an item with no key) writes 0 and -inf. Warp 4 allocates / frees TMEM.
* warp 8 MMA: ``S = Q K^T`` (smem x smem, 128x128x16 atoms), ``O (+)= P V`` (P from TMEM, V smem).
  Before the last PV of an item that reads the request's last page it zeroes that page's V rows past the
  request's keys in smem (pool garbage, NaN in the tests, and 0 * NaN = NaN inside the MMA;
  ``common/kv_tail.py``), then ``fence.proxy.async``.
* warp 9 TMA load: the packed Q tile (one box over q viewed as ``((group, total_q), d, kv_heads)``:
  the block ``q[t0:t0+128/group, gh:gh+group]``; rows past the request are loaded, never stored);
  per key tile one box per page of one KV head (page id from ``kv_indices`` via ``kv_indptr``; a page
  wholly past ``KV_END`` gets coordinate -1, which TMA zero-fills). Pages 1, 2, 4 (32..128 boxes per
  tile, fewer rows than a swizzle atom: TMA swizzles by address, the stage is 1024 B aligned): the ids are
  loaded one per lane (``common/page_ids.py``) and shuffled to the issuing lane, which issues the tile's boxes
  (``common/tma_issue.py``). Page 1: TMA ``tile::gather4`` over the caches as 2-D rows of pages
  (``[num_pages, Hkv * d]`` with the page stride, whatever it is: pages are compact), four pages an
  instruction: 32 instructions a 128-key tile at d 128, where one-row boxes took 256. Warps 10-11 idle. Warps 8-11
  run at ``setmaxnreg`` 64 (112 at head_dim 256: the MMA warp issues 16 QK k-blocks per tile and spilled at
  64). (240/112/64: the softmax row of 128 fp32 scores + 64 packed P words needs ~230 registers; ptxas 13.0
  reports no spills beyond an 8-byte local array.)

TMEM (512 columns allocated, 384 used; lane = packed row):
``[0, 128)`` S stage 0, ``[128, 256)`` S stage 1, ``[256, 384)`` O (fp32). P(j) (bf16 pairs, 64
columns) overwrites columns ``[64, 128)`` of its own S stage once the softmax has read S(j).
head_dim 256 (``kv_tile`` 64): ``[0, 64)`` and ``[64, 128)`` S stages (P in their upper 32 columns),
``[128, 384)`` O: 384 columns again.

Shared memory (``smem_bytes``): Q 2 stages x 32 KB, K/V ring 4 stages x 32 KB (a stage holds one K
or one V tile, 128B-swizzled: K-major for K, MN-major for V, the same bytes per page), mbarriers,
the softmax -> correction vector ring (2 x 128 x 2 fp32) and the TMEM address: 197 KB with slack.
head_dim 256: Q 1 stage x 64 KB (128 x 256 bf16), the ring 4 stages x 32 KB (64 keys x 256): also 197 KB;
pages 1..64 (a page is one box inside the 64-key tile). With one Q stage the MMA warp frees Q right after the
item's last QK GEMM, so the next item's Q loads under the last PV.

Pipelines (mbarriers, ``cutlass.pipeline``), in consumption order:
``q`` (TmaUmma, 2 stages): load -> MMA, released after an item's last QK GEMM.
``kv`` (TmaUmma, 4 stages): load -> MMA, order K0, K1, V0, K2, V1, ..., V(n-1).
``s`` (UmmaAsync, 2 stages): MMA -> softmax, "S(j) in TMEM"; released with P(j).
``p`` (AsyncUmma, 2 stages): softmax -> MMA, "P(j) in TMEM"; released by the PV commit.
``o`` (UmmaAsync, 1 stage): MMA -> correction, "PV(j) landed"; released once O is rescaled / read.
``c`` (Async, 2 stages): softmax -> correction, row scales then the final (row_sum, row_max).
Hand-offs that order tcgen05 work across threads are bracketed by ``tcgen05.fence::before_thread_sync``
(before the arrive) and ``tcgen05.fence::after_thread_sync`` (after the wait); TMEM loads/stores are
completed with ``tcgen05.wait::ld`` / ``wait::st`` before their registers are used or announced.
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

from ...config import PagedAttentionConfig, default_paged_config
from .. import register_paged_kernel
from ..common.paged_launch import gqa_prefill_entry
from ..common.limits import TMEM_COLUMNS, page_box_reason, row_gather_choice_reason, smem_reason, target_reason
from ..common.packed_q import q_box_stage_layout
from ..common.tma_issue import GATHER4_PAGE_SIZES, make_gather4_atom, pages_as_rows
from ..common.launch_chain import wait_for_previous_grid
from ..common.unit_schedule import (SLOT_FIELDS, UNIT_RING, check_batch, dynamic_launch, finish_schedule,
                                    ring_smem_bytes)
from .prefill_roles import PrefillRoles
from .prefill_setup import PrefillBarriers

KIND = "gqa_paged_prefill"
ARCH = "sm_100a"
Q_STAGES = 2  # head_dim 128; 1 at head_dim 256 (stages(): a 128 x 256 bf16 Q stage is 64 KB)
KV_STAGES = 4
C_STAGES = 2
S_STAGES = 2
P_STAGES = S_STAGES  # P(j) lives in S(j)'s TMEM stage
_WARP_SOFTMAX = 0  # warps 0-3
_WARP_CORRECTION = 4  # warps 4-7
_WARP_MMA = 8
_WARP_LOAD = 9
NUM_THREADS = 12 * 32
_REGS_SOFTMAX, _REGS_CORRECTION, _REGS_OTHER = 240, 112, 64
#: head_dim 256: the MMA warp's 16 QK k-blocks need more than 64 registers (ptxas spilled 28 B stores / 220 B loads
#: at 64, none at 112); 240 + 112 + 112 warpgroup registers still fit the 168 x 384 the launch allots
_REGS_OTHER_D256 = 112
_BAR_TMEM_ALLOC = 1
_BAR_TMEM_FREE = 2
_BAR_FINISH = 3  # dynamic_schedule: the correction warps' stores done before the CTA counts itself out
#: dynamic_schedule: the roles reading each unit from the ring (MMA warp, softmax and correction warps)
_UNIT_READERS = 32 + 128 + 128


#: the key tile per head_dim: at 256 a 64-key tile keeps one Q stage + 4 K/V stages in 192 KB of shared memory
#: (a 128-key ring would hold 2 stages) and S + O in 2 x 64 + 256 = 384 TMEM columns
_KV_TILE = {128: 128, 256: 64}


def stages(head_dim: int) -> tuple[int, int]:
    """(Q stages, K/V ring stages): 2 and 4 at head_dim 128, 1 and 4 at 256."""
    return (1 if head_dim == 256 else Q_STAGES), KV_STAGES


def tmem_columns(config: PagedAttentionConfig) -> int:
    """TMEM columns used: two fp32 S stages of ``kv_tile`` columns and the fp32 O accumulator."""
    return S_STAGES * config.kv_tile + config.head_dim_v


def smem_bytes(config: PagedAttentionConfig) -> int:
    """Shared memory of one CTA: Q stages, K/V ring, mbarriers, vector ring, TMEM address (+ alignment)."""
    tile = 2 * config.head_dim_qk
    q_stages, kv_stages = stages(config.head_dim_qk)
    barriers = PrefillBarriers.smem_bytes(q_stages, kv_stages, S_STAGES, P_STAGES, C_STAGES)
    return (q_stages * config.tile_q_rows * tile + kv_stages * config.kv_tile * tile + barriers
            + 4 * config.tile_q_rows * 2 * C_STAGES + 3 * 1024 + _unit_bytes(config))


def _unit_bytes(config: PagedAttentionConfig) -> int:
    """``dynamic_schedule``: the unit pipeline's ring and mbarriers, the batch rules' reduction words; 0 otherwise."""
    return ring_smem_bytes(rule_threads=NUM_THREADS, pipeline=True) if config.dynamic_schedule else 0


def check_config(config: PagedAttentionConfig) -> str | None:
    """None when this kernel can build ``config``, else a readable reason."""
    if (reason := target_reason(config, KIND, ARCH) or row_gather_choice_reason(config)) is not None:
        return reason
    if not config.causal:
        return "the sm_100a prefill kernel is built causal (the definition); causal=False is not built"
    if config.head_dim_qk not in _KV_TILE or config.head_dim_v != config.head_dim_qk:
        return f"head_dim {config.head_dim_qk} is not built yet on sm_100a (supported: {tuple(_KV_TILE)})"
    if config.head_dim_qk == 128 and (config.tile_q_rows != 128 or config.kv_tile != 128):
        return ("tile_q_rows and kv_tile must be 128: one 128-lane TMEM tile per item, one 128x128 tcgen05 "
                f"S tile per key step (got {config.tile_q_rows}, {config.kv_tile})")
    if config.head_dim_qk == 256 and (config.tile_q_rows != 128 or config.kv_tile != 64):
        return ("at head_dim 256 tile_q_rows must be 128 and kv_tile 64: one 128-lane TMEM tile per item, one "
                "128x64 tcgen05 S tile per key step; one 64 KB Q stage and a 4-stage ring of 32 KB K/V tiles fill "
                f"shared memory (got {config.tile_q_rows}, {config.kv_tile})")
    if config.page_size > config.kv_tile:
        return (f"page_size={config.page_size} is not built at head_dim {config.head_dim_qk}: a page is one TMA "
                f"box inside a key tile and the tile holds {config.kv_tile} keys (use pages of 1..{config.kv_tile})")
    if config.group_size > config.tile_q_rows:
        return f"group size {config.group_size} exceeds the {config.tile_q_rows}-row tile (a tile packs whole tokens)"
    if (reason := page_box_reason(config)) is not None:
        return reason
    if (reason := smem_reason(smem_bytes(config))) is not None:
        return reason
    if tmem_columns(config) > TMEM_COLUMNS:
        return f"needs {tmem_columns(config)} TMEM columns, more than {TMEM_COLUMNS}"
    return None


class GqaPagedPrefillSm100(PrefillRoles):
    """The kernel object: compile-time constants live on ``self``; role bodies in ``PrefillRoles``."""

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
        self.gather4 = self.page_size in GATHER4_PAGE_SIZES  # one-key pages: tile::gather4, four an instruction
        self.q_stages, self.kv_stages = stages(self.head_dim)
        self.regs_other = _REGS_OTHER_D256 if self.head_dim == 256 else _REGS_OTHER
        self.dtype = cutlass.BFloat16
        self.p_col = self.tile_n // 2  # P(j) in the upper half of its S stage
        self.o_col = S_STAGES * self.tile_n
        self.epi_cols = 32  # O columns per tcgen05.ld in the correction role
        self.dynamic = config.dynamic_schedule
        self.late_claim = config.late_claim
        self.rank_major_units = config.rank_major_units

    def __repr__(self) -> str:  # shows in the kernel symbol
        return (f"GqaPagedPrefillSm100_H{self.num_qo_heads}_KV{self.num_kv_heads}_D{self.head_dim}"
                f"_P{self.page_size}_M{self.tile_m}_N{self.tile_n}" + ("_Dyn" if self.dynamic else "")
                + ("_Late" if self.late_claim else "")
                + (f"_Rank{self.rank_major_units}" if self.rank_major_units else ""))

    # ------------------------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, qo_indptr: cute.Tensor,
                 kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr: cute.Tensor, items: cute.Tensor,
                 output: cute.Tensor, lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor,
                 scale_log2: Float32, lse_out_scale: Float32, stream: cuda.CUstream):
        self.launch_kernel(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, work_indptr, items, output, lse,
                           partial_out, partial_lse, scale_log2, lse_out_scale, stream)

    @cute.jit
    def call_dynamic(self, q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, qo_indptr: cute.Tensor,
                     kv_indptr: cute.Tensor, kv_indices: cute.Tensor, kv_last_page_len: cute.Tensor,
                     request_faults: cute.Tensor, unit_state: cute.Tensor, error_word: cute.Tensor,
                     output: cute.Tensor, lse: cute.Tensor, scale_log2: Float32, lse_out_scale: Float32,
                     num_pages: Int32, num_ctas: Int32, stream: cuda.CUstream):
        """``dynamic_schedule``: no plan, one launch; the sm_90a build's contract (``common/unit_schedule.py``)."""
        self.launch_kernel(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, None, None, output, lse, None,
                           None, scale_log2, lse_out_scale, stream,
                           units=(kv_last_page_len, request_faults, unit_state, num_ctas, error_word, num_pages))

    @cute.jit
    def launch_kernel(self, q: cute.Tensor, k_cache: cute.Tensor, v_cache: cute.Tensor, qo_indptr: cute.Tensor,
                      kv_indptr: cute.Tensor, kv_indices: cute.Tensor, work_indptr, items, output: cute.Tensor,
                      lse: cute.Tensor, partial_out, partial_lse, scale_log2: Float32, lse_out_scale: Float32,
                      stream: cuda.CUstream, units=None):
        G, D, H, M, N = self.group, self.head_dim, self.num_qo_heads, self.tile_m, self.tile_n
        # packed Q: ((group, total_q), d, kv_heads); row (g, t) is token t, head kv_head * group + g
        m_q = cute.make_tensor(q.iterator, cute.make_layout(
            ((G, q.shape[0]), D, self.num_kv_heads), stride=((D, H * D), 1, G * D)))
        # K/V as (slot, d, kv_head, page): a page of one head is the TMA box
        m_k = cute.make_tensor(k_cache.iterator, cute.select(k_cache.layout, mode=[1, 3, 2, 0]))
        m_v = cute.make_tensor(v_cache.iterator, cute.select(v_cache.layout, mode=[1, 3, 2, 0]))

        major_k, major_mn = OperandMajorMode.K, OperandMajorMode.MN
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major_k, major_k, Float32, tcgen05.CtaGroup.ONE, (M, N))
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major_k, major_mn, Float32, tcgen05.CtaGroup.ONE, (M, D),
            tcgen05.OperandSource.TMEM)
        # MMA views of the smem buffers (Q: A operand; K: B K-major; V: B MN-major; P: A in TMEM)
        s_q_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, (M, N, D), self.dtype, self.q_stages)
        s_k_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, (M, N, D), self.dtype, self.kv_stages)
        s_v_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, (M, D, N), self.dtype, self.kv_stages)
        p_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, (M, D, N), self.dtype, 1)
        # (rows, d, stage) views of the same bytes for TMA and V zeroing: row r at 128 B * r inside each
        # 64-column chunk, chunks tile_rows * 128 B apart (K rows = keys; V's MN-major layout puts key k
        # at the same place), so one page is the box of rows [i * page, (i + 1) * page) of a stage.
        atom = sm100_utils.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, self.dtype)
        s_q_rows = cute.tile_to_shape(atom, (M, D, self.q_stages), (0, 1, 2))
        s_kv_rows = cute.tile_to_shape(atom, (N, D, self.kv_stages), (0, 1, 2))
        s_page_layout = cute.composition(
            cute.select(s_kv_rows, mode=[0, 1]), cute.make_layout((self.page_size, D), stride=(1, N)))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            g2s, m_q, q_box_stage_layout(s_q_rows, self.q_rows, M, D), ((G, M // G), D))
        if cutlass.const_expr(self.gather4):
            # page 1: the caches as rows of pages, a box of one row x 64 columns, for raw gather4 (tma_issue.py)
            tma_atom_k, tma_k = make_gather4_atom(g2s, pages_as_rows(k_cache), s_kv_rows)
            tma_atom_v, tma_v = make_gather4_atom(g2s, pages_as_rows(v_cache), s_kv_rows)
        else:
            tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(g2s, m_k, s_page_layout, (self.page_size, D))
            tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(g2s, m_v, s_page_layout, (self.page_size, D))

        dynamic, num_ctas = dynamic_launch(units, work_indptr)  # (common/unit_schedule.py)
        self.kernel(
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, qo_indptr, kv_indptr, kv_indices,
            work_indptr, items, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale,
            tiled_mma_qk, tiled_mma_pv, s_q_layout, s_k_layout, s_v_layout, p_layout, s_q_rows, s_kv_rows, **dynamic,
        ).launch(grid=(num_ctas, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, use_pdl=True,
                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_atom_q: cute.CopyAtom, tma_q: cute.Tensor, tma_atom_k: cute.CopyAtom, tma_k: cute.Tensor,
               tma_atom_v: cute.CopyAtom, tma_v: cute.Tensor, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor,
               kv_indices: cute.Tensor, work_indptr: cute.Tensor, items: cute.Tensor, output: cute.Tensor,
               lse: cute.Tensor, partial_out: cute.Tensor, partial_lse: cute.Tensor, scale_log2: Float32,
               lse_out_scale: Float32, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               s_q_layout: cute.ComposedLayout, s_k_layout: cute.ComposedLayout, s_v_layout: cute.ComposedLayout,
               p_layout: cute.ComposedLayout, s_q_rows: cute.ComposedLayout, s_kv_rows: cute.ComposedLayout,
               kv_last_page_len: cute.Tensor = None, request_faults: cute.Tensor = None,
               unit_state: cute.Tensor = None, error_word: cute.Tensor = None, num_pages=None):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == _WARP_LOAD:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)

        smem = SmemAllocator()
        q_buf = smem.allocate_tensor(self.dtype, s_q_rows.outer, 1024, s_q_rows.inner)
        kv_buf = smem.allocate_tensor(self.dtype, s_kv_rows.outer, 1024, s_kv_rows.inner)
        s_vec = smem.allocate_tensor(Float32, cute.make_layout((self.tile_m, 2, C_STAGES)), 16)
        barriers = PrefillBarriers(smem, self.q_stages, self.kv_stages, S_STAGES, P_STAGES, C_STAGES)
        pipe_u = None  # dynamic_schedule: the unit pipeline, load warp -> the other roles (prefill_roles.py)
        if cutlass.const_expr(self.dynamic):
            ring = smem.allocate_tensor(Int32, cute.make_layout((UNIT_RING, SLOT_FIELDS), stride=(SLOT_FIELDS, 1)), 16)
            rule_words = smem.allocate_tensor(Int32, cute.make_layout((2 * NUM_THREADS // 32,)), 16)
            mbar_u = smem.allocate_array(Int64, 2 * UNIT_RING, byte_alignment=8)
            pipe_u = cpipe.PipelineAsync.create(
                barrier_storage=mbar_u, num_stages=UNIT_RING,
                producer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, 1),
                consumer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, _UNIT_READERS), defer_sync=True)
        # MMA views of the same buffers
        s_q = cute.make_tensor(cute.recast_ptr(q_buf.iterator, s_q_layout.inner, dtype=self.dtype), s_q_layout.outer)
        kv_ptr = cute.recast_ptr(kv_buf.iterator, s_k_layout.inner, dtype=self.dtype)
        s_k = cute.make_tensor(kv_ptr, s_k_layout.outer)
        s_v = cute.make_tensor(kv_ptr, s_v_layout.outer)

        # q and kv: TMA (load warp) -> MMA warp, one arrival per phase on each side
        thread = cpipe.CooperativeGroup(cpipe.Agent.Thread, 1)
        tile_bytes = self.tile_n * self.head_dim * 2
        pipe_q = cpipe.PipelineTmaUmma.create(num_stages=self.q_stages, producer_group=thread, consumer_group=thread,
                                              tx_count=self.q_rows * self.head_dim * 2, barrier_storage=barriers.q,
                                              defer_sync=True)
        pipe_kv = cpipe.PipelineTmaUmma.create(num_stages=self.kv_stages, producer_group=thread, consumer_group=thread,
                                               tx_count=tile_bytes, barrier_storage=barriers.kv, defer_sync=True)
        pipe_s, pipe_p, pipe_o, pipe_c, tmem = barriers.create_role_pipelines(_BAR_TMEM_ALLOC, _BAR_TMEM_FREE,
                                                                               _WARP_CORRECTION)

        producer, consumer = cpipe.PipelineUserType.Producer, cpipe.PipelineUserType.Consumer
        # Launched with programmatic dependent launch (it may start while the device planner runs): nothing
        # global is read before this wait, which returns once the previous grid has finished and flushed.
        wait_for_previous_grid(self.releases_dependents)
        item_begin = Int32(0)
        item_end = Int32(0)
        source = None  # dynamic_schedule: the counter, the marks and the ring (unit_schedule.UnitSource)
        units = {}  # dynamic_schedule: the unit source and pipeline (each role makes its own pipeline state)
        if cutlass.const_expr(not self.dynamic):
            item_begin = work_indptr[cta]
            item_end = work_indptr[cta + 1]
        else:
            source = check_batch(tidx, cta, NUM_THREADS, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output,
                                 lse, ring, rule_words, request_faults, unit_state, error_word, num_pages, self.group,
                                 self.q_rows, self.num_kv_heads, self.head_dim, self.page_size, self.tile_n,
                                 rank_major_units=self.rank_major_units)
            units = dict(source=source, pipe_u=pipe_u)
        if warp_idx < _WARP_CORRECTION:
            cute.arch.setmaxregister_increase(_REGS_SOFTMAX)
            self.softmax_role(tiled_mma_qk, tiled_mma_pv, tmem, s_vec, items, item_begin, item_end, scale_log2,
                              pipe_s, pipe_p, pipe_c, cpipe.make_pipeline_state(consumer, S_STAGES),
                              cpipe.make_pipeline_state(producer, S_STAGES),
                              cpipe.make_pipeline_state(producer, C_STAGES), tidx, **units)
            tmem.release()
        elif warp_idx < _WARP_MMA:
            cute.arch.setmaxregister_decrease(_REGS_CORRECTION)
            tmem.allocate()
            self.correction_role(tiled_mma_qk, tiled_mma_pv, tmem, s_vec, items, item_begin, item_end, qo_indptr,
                                 output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, pipe_o, pipe_c,
                                 cpipe.make_pipeline_state(consumer, 1),
                                 cpipe.make_pipeline_state(consumer, C_STAGES), tidx - 128, **units)
            if cutlass.const_expr(self.dynamic):  # every CTA, even of a batch without units (it took one index)
                finish_schedule(unit_state, request_faults, qo_indptr, output, lse, tidx - 128, 128, self.head_dim,
                                _BAR_FINISH, rule_words)
            tmem.free()  # once the softmax and MMA warps are done with TMEM
        else:
            cute.arch.setmaxregister_decrease(self.regs_other)
            if warp_idx == _WARP_MMA:
                self.mma_role(tiled_mma_qk, tiled_mma_pv, s_q, s_k, s_v, kv_buf, tmem, items, qo_indptr, item_begin,
                              item_end, pipe_q, pipe_kv, pipe_s, pipe_p, pipe_o,
                              cpipe.make_pipeline_state(consumer, self.q_stages),
                              cpipe.make_pipeline_state(consumer, self.kv_stages),
                              cpipe.make_pipeline_state(producer, S_STAGES),
                              cpipe.make_pipeline_state(consumer, S_STAGES),
                              cpipe.make_pipeline_state(producer, 1), **units)
                tmem.release()
            elif warp_idx == _WARP_LOAD:
                self.load_role(tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, q_buf, kv_buf,
                               qo_indptr, kv_indptr, kv_indices, items, item_begin, item_end, pipe_q, pipe_kv,
                               cpipe.make_pipeline_state(producer, self.q_stages),
                               cpipe.make_pipeline_state(producer, self.kv_stages), **units)

    @cute.jit
    def tmem_tensors(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tmem_ptr: cute.Pointer):
        """S stage 0, O (fp32 accumulator views) and the layout of P as the PV MMA's TMEM A operand."""
        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        s_frag = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.tile_m, self.tile_n)))
        o_frag = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.head_dim)))
        t_s = cute.make_tensor(tmem_ptr, s_frag.layout)
        t_o = cute.make_tensor(tmem_ptr + self.o_col, o_frag.layout)
        p_tmem_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, (self.tile_m, self.head_dim, self.tile_n),
                                                       self.dtype, 1)
        t_p = thr_pv.make_fragment_A(cute.make_tensor(tmem_ptr, p_tmem_layout.outer))[None, None, None, 0]
        return t_s, t_o, t_p.layout


# ----------------------------------------------------------------------------------- registration
build, launch = gqa_prefill_entry(GqaPagedPrefillSm100, check_config)


def configs(arch: str) -> list[PagedAttentionConfig]:
    """The definition's config (gqa_paged_prefill_causal_h32_kv4_d128_ps64), group 5 (h20/kv4: the Q box fills
    125 of the tile's 128 rows) and page 1 (h32/kv4: 128 one-row boxes per K or V tile); head_dim 256 (64-key
    tiles): Qwen3-Next's h16/kv2 at page 64, Gemma's group 2 at page 16, and page 1; then the self-scheduling
    builds of the definition's layout at pages 64 and 1 (``dynamic_schedule``: the sm_90a builds' twins)."""
    if arch != ARCH:
        return []
    planned = [default_paged_config(KIND, arch=arch, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d,
                                    head_dim_v=d, page_size=page, causal=True)
               for hq, hkv, page, d in ((32, 4, 64, 128), (20, 4, 64, 128), (32, 4, 1, 128),
                                        (16, 2, 64, 256), (16, 8, 16, 256), (16, 2, 1, 256))]
    return planned + [dataclasses.replace(c, dynamic_schedule=True) for c in (planned[0], planned[2])]


register_paged_kernel(KIND, ARCH, build=build, launch=launch, configs=configs,
                      check_config=check_config)

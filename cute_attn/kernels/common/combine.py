"""LSE combine: fold split-KV partials into the final output (shared by every kernel and both arches).

Roles / pipeline: grid ``(max_merges, row_blocks, dim_blocks)`` (fixed by the plan capacity, so a CUDA
graph replays any plan that fits; merges past ``num_merges`` have no slots and exit), 4 warps per CTA, one
(packed row, 128-column chunk of the head dimension) per warp at a time: a 512-wide MLA row is four warps'
work, not one's (one warp folding 64 slots x 512 fp32 of a batch-1 MLA decode was latency-bound). A warp
spreads the row's partial LSEs over its lanes and reduces them with shuffles to the merged base-2 LSE
``L = m + log2(sum 2^(lse_i - m))``; then, 32 slots at a time, each lane turns its slot's LSE into the weight
``2^(lse_i - L)`` and the warp walks the slots taking each weight by a shuffle (no load between a slot's weight and
its row, so the rows' loads overlap), each lane accumulating 4 consecutive columns of the chunk with one 16-byte
load per slot (``o = sum_i w_i * partial_out[slot_i, row, :]``; a slot whose LSE is ``-inf`` saw no key and adds
nothing, whatever its row holds). The chunk is stored as bf16, and lane 0 of chunk 0 writes ``lse = L *
lse_out_scale``. A row whose partials are all ``-inf`` (it saw no key) gets 0 and ``-inf``. Launched with
programmatic dependent launch: its launch overlaps the attention kernel's tail, and it waits for that grid
(``griddepcontrol.wait``) before its first global read. ``early_rows`` (``COMBINE_EARLY_ROWS``): a row's first
slots' partials are loaded with its LSEs, before the reduction (one L2 round trip fewer for merges of <= 8 slots).

``eager`` (``PagedAttentionConfig.eager_combine``, entry ``call_eager``: ``merge_counters`` after ``merges``): the
attention kernel releases this launch at its start and counts each split item in its merge
(``decode_merge.announce_partials``: release after the partial stores), so no ``griddepcontrol.wait`` comes first:
thread 0 of a CTA polls the merge's counter (``ld.acquire.gpu``) until every slot is in, and the CTA folds it while
other attention CTAs still run, on the SMs their finished neighbours left. After the fold each CTA counts itself in
the same counter; the last of the merge's ``row_blocks x dim_blocks`` CTAs sets it back to 0 (clean for the next
launch or graph replay). The CTA waits for the attention grid at its end, so this grid's completion still implies
that grid's. No deadlock: the launch is dispatched only once every attention CTA has started (each releases it
after its own start), so every slot's writer is resident. A poll gives up after ``MAX_POLLS`` (a plan whose slots
never all arrive is a planner bug; the fold then reads whatever is there rather than hang the stream).

``skip_flagged`` (``PagedAttentionConfig.cluster_merge_flags``, entry ``call_eager``): after its wait the combine
reads ``merge_counters[m]``, the attention kernel's flag for merge ``m`` (written for every merge, every launch: 1
where a thread-block cluster folded it in shared memory, 0 where its slots went to global partials), and skips the
flagged merges.

Packed row ``r`` of (request ``b``, KV head ``h``) is token ``TOKEN_START + r // group`` and query head
``h * group + r % group`` (``docs/kernel-contract.md``).

Memory-light by design: partials are small (only split items write them) and read once. ``bf16_partials``
(``PagedAttentionConfig.bf16_partials``): the rows are bf16 (8-byte loads, widened in registers; the sums stay fp32),
the LSEs fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ...compile import compile_kernel, register_kernel
from ...config import KernelConfig, PagedAttentionConfig
from ...plan import MergeField

WARP = 32
WARPS_PER_CTA = 4  # one (packed row, column chunk) per warp at a time
LANE_COLUMNS = 4  # consecutive fp32 columns per lane: one 16-byte load per slot
SLOTS_IN_FLIGHT = 8  # slot rows a warp loads before it accumulates any (8 x 512 B in flight per warp)
ROWS_PER_MERGE_PASS = 16  # rows of one merge handled concurrently (CTAs per merge x warps)
#: CTAs of a combine launch (``CombineConfig.max_ctas``): 0 launches one CTA per merge slot of the capacity (x row and
#: column blocks), so a plan with few or no merges still launches them all (GQA prefill 8 x 992: 2112 CTAs, the MLA
#: seed 8288, each waiting on the attention grid and exiting); > 0 caps the grid near one resident wave (1056: 8 an SM)
#: and each CTA walks merges ``m, m + grid, ...`` until the first without slots. Why: a device plan's merges are
#: unknown on the host, so every device-planned call launches the combine. Measured (session 17, H200, one process,
#: ``tools/ab_policy.py combine_grid``, ``docs/perf/h200-combine-grid.json``): the MLA seed's default call 51.9 ->
#: 47.7 us, MLA 1 / 1028 60.8 -> 59.1, GQA prefill 16 x 992 device-planned 367.2 -> 363.3; plans with real merges
#: within +-1 us
COMBINE_MAX_CTAS = 1056
#: ``CombineConfig.early_rows`` of the API's combine launches: a row's first ``SLOTS_IN_FLIGHT`` slots' partials are
#: loaded with its LSEs, before the reduction that gives their weights, so a merge of up to 8 slots costs one L2
#: round trip after the plan instead of two. Why: the combine is a fixed ~4 us of every call with merges (MLA decode
#: page 64, session 18: 3.8 of 34.5 us at 16 x 4096, where fa3 takes 34.3 in all). H200, session 19
#: (``tools/ab_policy.py combine_early_rows``, one process; GPU tests 35 passed, memcheck/racecheck clean): MLA decode
#: 16 x 4096 planned 34.5 -> 34.2 us (page 64), 35.2 -> 34.8 (page 1); GQA prefill rows within +-1 us (noise)
COMBINE_EARLY_ROWS = True
MAX_POLLS = 1 << 22  # eager: ~2-4 s of ~0.5-1 us L2 round trips before a poll gives up (never reached by a valid plan)


@dataclass(frozen=True)
class CombineConfig(KernelConfig):
    """Compile-time shape of the partial buffers and the output heads."""

    kernel_name: ClassVar[str] = "lse_combine"

    tile_q_rows: int = 128
    head_dim_v: int = 128
    num_qo_heads: int = 32
    group_size: int = 8
    max_ctas: int = 0  # see COMBINE_MAX_CTAS
    early_rows: bool = False  # see COMBINE_EARLY_ROWS
    eager: bool = False  # PagedAttentionConfig.eager_combine: each merge folded once its slots are in (module doc)
    bf16_partials: bool = False  # PagedAttentionConfig.bf16_partials: the partial rows are bf16 (LSEs stay fp32)
    #: PagedAttentionConfig.cluster_merge_flags: ``merge_counters`` after ``merges`` holds the attention kernel's flag
    #: per merge, nonzero where its cluster folded the merge already: those merges are skipped
    skip_flagged: bool = False

    @staticmethod
    def for_paged(config: PagedAttentionConfig) -> "CombineConfig":
        return CombineConfig(arch=config.arch, tile_q_rows=config.tile_q_rows, head_dim_v=config.head_dim_v,
                             num_qo_heads=config.num_qo_heads, group_size=config.group_size,
                             max_ctas=COMBINE_MAX_CTAS, early_rows=COMBINE_EARLY_ROWS, eager=config.eager_combine,
                             bf16_partials=config.bf16_partials, skip_flagged=config.cluster_merge_flags)

    def can_implement(self) -> str | None:
        if (reason := super().can_implement()) is not None:
            return reason
        if self.head_dim_v % (WARP * 2):
            return f"head_dim_v={self.head_dim_v} must be a multiple of {WARP * 2} (a warp spans a column chunk)"
        if self.group_size < 1 or self.num_qo_heads % self.group_size:
            return f"num_qo_heads={self.num_qo_heads} must be a multiple of group_size={self.group_size}"
        if self.max_ctas < 0:
            return f"max_ctas={self.max_ctas} must be >= 0 (0: one CTA per merge slot)"
        if self.skip_flagged and self.eager:
            return "skip_flagged and eager both read merge_counters, as flags and as arrival counts: one at most"
        return None


@contextlib.contextmanager
def combine_early_rows_policy(enabled: bool):
    """Inside the block every combine launch is built with ``early_rows=enabled`` (A/Bs, GPU tests, sanitizer)."""
    from ...ops import policy

    with policy(globals(), COMBINE_EARLY_ROWS=bool(enabled)):
        yield


@contextlib.contextmanager
def combine_grid_policy(max_ctas: int):
    """Inside the block every combine launch is built with ``max_ctas`` (A/Bs, the GPU tier's combine cases)."""
    from ...ops import policy  # the spec policies' save / clear caches / restore

    with policy(globals(), COMBINE_MAX_CTAS=int(max_ctas)):
        yield


class LseCombine:
    def __init__(self, config: CombineConfig) -> None:
        self.config = config
        self.group = config.group_size
        # a warp folds a chunk of 32 lanes x 4 columns (x 2 at head_dim 64)
        self.dims_per_lane = min(LANE_COLUMNS, config.head_dim_v // WARP)
        self.chunk = WARP * self.dims_per_lane
        self.dim_blocks = config.head_dim_v // self.chunk
        # enough CTAs per merge that short merges (decode: 5 rows) spread over warps, few enough that
        # a 128-row merge loops instead of launching idle CTAs
        self.row_blocks = max(1, min(config.tile_q_rows, ROWS_PER_MERGE_PASS) // WARPS_PER_CTA)
        # capped grid: CTAs along the merges (each walks merges a grid apart), 0: one per merge slot
        self.merge_ctas = max(1, config.max_ctas // (self.row_blocks * self.dim_blocks)) if config.max_ctas else 0

    def __repr__(self) -> str:
        c = self.config
        return (f"LseCombine_R{c.tile_q_rows}_D{c.head_dim_v}_H{c.num_qo_heads}_G{c.group_size}"
                f"{f'_C{self.merge_ctas}' if self.merge_ctas else ''}{'_EarlyRows' if c.early_rows else ''}"
                f"{'_Eager' if c.eager else ''}{'_Bf16Partials' if c.bf16_partials else ''}"
                f"{'_SkipFlagged' if c.skip_flagged else ''}")

    @cute.jit
    def __call__(
        self,
        partial_out: cute.Tensor,  # [slots, tile_q_rows, head_dim_v] fp32 (bf16: bf16_partials)
        partial_lse: cute.Tensor,  # [slots, tile_q_rows] fp32
        merge_indptr: cute.Tensor,  # [max_merges + 1] int32
        merges: cute.Tensor,  # [max_merges, len(MergeField)] int32
        output: cute.Tensor,  # [total_q, num_qo_heads, head_dim_v] bf16
        lse: cute.Tensor,  # [total_q, num_qo_heads] fp32
        lse_out_scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        self.launch(partial_out, partial_lse, merge_indptr, merges, None, output, lse, lse_out_scale, stream)

    @cute.jit
    def call_eager(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, merge_indptr: cute.Tensor,
                   merges: cute.Tensor, merge_counters: cute.Tensor, output: cute.Tensor, lse: cute.Tensor,
                   lse_out_scale: cutlass.Float32, stream: cuda.CUstream):
        """``eager``: ``merge_counters`` (int32 ``[max(max_merges, 1)]``, the plan's, zero between launches) after
        ``merges``; ``skip_flagged``: the same tensor, the attention kernel's cluster-fold flags."""
        self.launch(partial_out, partial_lse, merge_indptr, merges, merge_counters, output, lse, lse_out_scale,
                    stream)

    @cute.jit
    def launch(self, partial_out, partial_lse, merge_indptr, merges, merge_counters, output, lse,
               lse_out_scale: cutlass.Float32, stream: cuda.CUstream):
        grid_merges = merges.shape[0]
        if cutlass.const_expr(self.merge_ctas > 0):
            grid_merges = cutlass.min(merges.shape[0], self.merge_ctas)
        self.kernel(partial_out, partial_lse, merge_indptr, merges, output, lse, lse_out_scale,
                    merge_counters).launch(
            grid=(grid_merges, self.row_blocks, self.dim_blocks), block=(WARPS_PER_CTA * WARP, 1, 1),
            stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, partial_out, partial_lse, merge_indptr, merges, output, lse, lse_out_scale: cutlass.Float32,
               merge_counters: cute.Tensor = None):
        tidx, _, _ = cute.arch.thread_idx()
        m, row_block, dim_block = cute.arch.block_idx()
        eager = merge_counters is not None and not self.config.skip_flagged
        if cutlass.const_expr(not eager):
            # launched with programmatic dependent launch behind the attention kernel (its launch overlaps that
            # kernel's tail): nothing global is read before this wait, which returns once that grid has finished
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.merge_ctas == 0):
            if cutlass.const_expr(eager):
                if has_slots(merge_indptr, merges.shape[0], m, coherent=True) != 0:
                    self.eager_fold(m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges,
                                    merge_counters, output, lse, lse_out_scale)
            else:
                self.fold_unflagged(m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges,
                                    merge_counters, output, lse, lse_out_scale)
        else:
            # the plan's merges are a prefix of the capacity: walk them a grid apart until the first without slots
            step, _, _ = cute.arch.grid_dim()
            live = has_slots(merge_indptr, merges.shape[0], m, coherent=eager)
            while live != 0:
                if cutlass.const_expr(eager):
                    self.eager_fold(m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges,
                                    merge_counters, output, lse, lse_out_scale)
                else:
                    self.fold_unflagged(m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges,
                                        merge_counters, output, lse, lse_out_scale)
                m = m + step
                live = has_slots(merge_indptr, merges.shape[0], m, coherent=eager)
        if cutlass.const_expr(eager):
            # this grid ends after the attention grid: whatever follows in the stream sees both finished
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def fold_unflagged(self, m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges,
                       merge_counters, output, lse, lse_out_scale: cutlass.Float32):
        """:meth:`fold`, except (``skip_flagged``) a merge the attention kernel's cluster folded already."""
        if cutlass.const_expr(self.config.skip_flagged):
            if merge_counters[m] == 0:
                self.fold(m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges, output, lse,
                          lse_out_scale)
        else:
            self.fold(m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges, output, lse,
                      lse_out_scale)

    @cute.jit
    def eager_fold(self, m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges,
                   merge_counters, output, lse, lse_out_scale: cutlass.Float32):
        """``eager``: wait until merge ``m``'s slots are all announced, fold this CTA's part, count the CTA out."""
        counter = (merge_counters.iterator + m).llvm_ptr
        slots = coherent_load(merge_indptr, m + 1) - coherent_load(merge_indptr, m)
        if tidx == 0:
            missing = slots - cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
            polls = Int32(0)
            while missing > 0:
                missing = slots - cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
                polls = polls + 1
                if polls >= MAX_POLLS:
                    missing = Int32(0)
        cute.arch.sync_threads()
        cute.arch.fence_acq_rel_gpu()  # thread 0's acquire, taken by every thread past the barrier
        self.fold(m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges, output, lse,
                  lse_out_scale)
        cute.arch.sync_threads()  # the CTA's polls and reads of this merge are done
        if tidx == 0:
            ctas = self.row_blocks * self.dim_blocks
            if cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu") == slots + ctas - 1:
                cute.arch.store(counter, Int32(0), sem="relaxed", scope="gpu")

    @cute.jit
    def fold(self, m, row_block, dim_block, tidx, partial_out, partial_lse, merge_indptr, merges, output, lse,
             lse_out_scale: cutlass.Float32):
        """Merge ``m``'s rows of this CTA's row and column block."""
        lane = tidx % WARP
        warp = tidx // WARP
        slot_begin = merge_indptr[m]
        slot_end = merge_indptr[m + 1]
        kv_head = merges[m, MergeField.KV_HEAD]
        row_start = merges[m, MergeField.Q_ROW_START]
        row_count = merges[m, MergeField.Q_ROW_COUNT]
        token_start = merges[m, MergeField.TOKEN_START]
        if slot_end <= slot_begin:
            row_count = 0
        neg_inf = -cutlass.Float32.inf
        vec = self.dims_per_lane
        col0 = dim_block * self.chunk + lane * vec  # this lane's first column
        acc = cute.make_rmem_tensor((vec,), cutlass.Float32)
        parts = cute.make_rmem_tensor((vec, SLOTS_IN_FLIGHT), cutlass.Float32)
        weights = cute.make_rmem_tensor((SLOTS_IN_FLIGHT,), cutlass.Float32)
        row_stride = self.row_blocks * WARPS_PER_CTA
        for r in range(row_block * WARPS_PER_CTA + warp, row_count, row_stride):
            if cutlass.const_expr(self.config.early_rows):  # the first slots' rows go out with the LSE loads
                self.load_rows(partial_out, parts, slot_begin, 0, cutlass.min(WARP, slot_end - slot_begin), r, col0)
            # the row's partial LSEs, spread over the lanes, reduced with shuffles
            lane_max = neg_inf
            for s in range(slot_begin + lane, slot_end, WARP):
                lane_max = cute.arch.fmax(lane_max, partial_lse[s, r])
            row_max = cute.arch.warp_reduction_max(lane_max)
            safe_max = row_max if row_max != neg_inf else cutlass.Float32(0.0)
            lane_sum = cutlass.Float32(0.0)
            for s in range(slot_begin + lane, slot_end, WARP):
                lane_sum = lane_sum + cute.math.exp2(partial_lse[s, r] - safe_max, fastmath=True)
            total = cute.arch.warp_reduction(lane_sum, lambda a, b: a + b)
            merged_lse = neg_inf
            if total > 0.0:
                merged_lse = safe_max + cute.math.log2(total, fastmath=True)
            acc.fill(0.0)
            for g in range(slot_begin, slot_end, WARP):
                # lane j holds slot g + j's weight; 0 for a slot that saw no key (its row may hold anything)
                lane_weight = cutlass.Float32(0.0)
                if g + lane < slot_end:
                    lane_lse = partial_lse[g + lane, r]
                    if lane_lse != neg_inf:
                        lane_weight = cute.math.exp2(lane_lse - merged_lse, fastmath=True)
                n = cutlass.min(WARP, slot_end - g)
                for j0 in range(0, n, SLOTS_IN_FLIGHT):
                    # all the group's rows are loaded before any is used: their latencies overlap
                    if cutlass.const_expr(self.config.early_rows):
                        for u in cutlass.range_constexpr(SLOTS_IN_FLIGHT):
                            weights[u] = cute.arch.shuffle_sync(lane_weight, cutlass.min(j0 + u, n - 1))
                            if j0 + u >= n:
                                weights[u] = cutlass.Float32(0.0)
                        if (g - slot_begin) + j0 > 0:  # the first batch came with the LSEs
                            self.load_rows(partial_out, parts, g, j0, n, r, col0)
                    else:  # the build the GPU tier ran: each slot's weight and load interleaved (load_rows' loads)
                        for u in cutlass.range_constexpr(SLOTS_IN_FLIGHT):
                            j = cutlass.min(j0 + u, n - 1)  # past the last slot: reread it, with weight 0
                            weights[u] = cute.arch.shuffle_sync(lane_weight, j)
                            if j0 + u >= n:
                                weights[u] = cutlass.Float32(0.0)
                            self.load_slot_row(partial_out, parts, u, g + j, r, col0)
                    for u in cutlass.range_constexpr(SLOTS_IN_FLIGHT):
                        for i in cutlass.range_constexpr(vec):
                            term = weights[u] * parts[i, u]
                            acc[i] = acc[i] + (term if weights[u] > 0.0 else cutlass.Float32(0.0))
            packed = row_start + r
            token = token_start + packed // self.group
            head = kv_head * self.group + packed % self.group
            for i in cutlass.range_constexpr(vec):
                output[token, head, col0 + i] = acc[i].to(cutlass.BFloat16)
            if dim_block == 0:
                if lane == 0:
                    lse[token, head] = merged_lse * lse_out_scale

    @cute.jit
    def load_rows(self, partial_out, parts, g, j0, n, r, col0):
        """Slots ``g + j0 .. g + j0 + SLOTS_IN_FLIGHT - 1`` (clamped to ``g + n - 1``) of row ``r``: this lane's 16
        bytes of each into ``parts``, every load issued before any is used."""
        for u in cutlass.range_constexpr(SLOTS_IN_FLIGHT):
            self.load_slot_row(partial_out, parts, u, g + cutlass.min(j0 + u, n - 1), r, col0)

    @cute.jit
    def load_slot_row(self, partial_out, parts, u, slot, r, col0):
        """This lane's ``dims_per_lane`` columns of ``partial_out[slot, r]`` into ``parts[:, u]`` (fp32): one 16-byte
        load of fp32 partials, or one 8-byte load of bf16 ones widened in registers."""
        vec = self.dims_per_lane
        dtype = cutlass.BFloat16 if cutlass.const_expr(self.config.bf16_partials) else cutlass.Float32
        size = 2 if cutlass.const_expr(self.config.bf16_partials) else 4
        offset = (cutlass.Int64(slot) * partial_out.stride[0] + r * partial_out.stride[1] + col0) * size
        src = cute.make_tensor(cute.make_ptr(dtype, partial_out.iterator.toint() + offset, cute.AddressSpace.gmem,
                                             assumed_align=size * vec), cute.make_layout(vec))
        if cutlass.const_expr(self.config.bf16_partials):
            narrow = cute.make_rmem_tensor((vec,), dtype)
            cute.autovec_copy(src, narrow)
            parts[None, u].store(narrow.load().to(cutlass.Float32))
        else:
            cute.autovec_copy(src, parts[None, u])


@cute.jit
def coherent_load(tensor: cute.Tensor, i) -> Int32:
    """``tensor[i]`` (int32) read at GPU scope (``ld.relaxed.gpu``: never a stale L1 line): an eager combine reads the
    plan before any wait on the grid that follows the planner."""
    return cute.arch.load((tensor.iterator + i).llvm_ptr, Int32, sem="relaxed", scope="gpu")


@cute.jit
def has_slots(merge_indptr: cute.Tensor, max_merges, m, coherent: cutlass.Constexpr[bool] = False) -> Int32:
    """1 when merge ``m`` exists in the capacity and has partial slots (the plan's merges are a prefix), else 0."""
    live = Int32(0)
    if m < max_merges:
        if cutlass.const_expr(coherent):
            if coherent_load(merge_indptr, m + 1) > coherent_load(merge_indptr, m):
                live = Int32(1)
        elif merge_indptr[m + 1] > merge_indptr[m]:
            live = Int32(1)
    return live


def build(config: CombineConfig) -> tuple[Any, tuple[Any, ...]]:
    slots = cute.sym_int(symbol="slots")
    num_merges = cute.sym_int(symbol="max_merges")
    merge_ptr_len = cute.sym_int(symbol="max_merges_plus_1")
    total_q = cute.sym_int(symbol="total_q")
    rows, dv, hq = config.tile_q_rows, config.head_dim_v, config.num_qo_heads
    fake = cute.runtime.make_fake_compact_tensor
    args = (
        fake(cutlass.BFloat16 if config.bf16_partials else cutlass.Float32, (slots, rows, dv), stride_order=(2, 1, 0),
             assumed_align=16),
        fake(cutlass.Float32, (slots, rows), stride_order=(1, 0), assumed_align=16),
        fake(cutlass.Int32, (merge_ptr_len,)),
        fake(cutlass.Int32, (num_merges, len(MergeField)), stride_order=(1, 0)),
        *((fake(cutlass.Int32, (cute.sym_int(symbol="merge_counters"),)),) if config.eager or config.skip_flagged
          else ()),
        fake(cutlass.BFloat16, (total_q, hq, dv), stride_order=(2, 1, 0), assumed_align=16),
        fake(cutlass.Float32, (total_q, hq), stride_order=(1, 0)),
        cutlass.Float32(1.0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    combine = LseCombine(config)
    return (combine.call_eager if config.eager or config.skip_flagged else combine), args


def default_configs(arch: str) -> list[CombineConfig]:
    """The combine steps of the three definitions' default tile geometry (and of head_dim 256 GQA prefill), with the
    grid and row loads the API builds (``COMBINE_MAX_CTAS``, ``COMBINE_EARLY_ROWS``)."""
    def config(tile_q_rows, head_dim_v, num_qo_heads, group_size, skip_flagged=False):
        return CombineConfig(arch=arch, tile_q_rows=tile_q_rows, head_dim_v=head_dim_v, num_qo_heads=num_qo_heads,
                             group_size=group_size, max_ctas=COMBINE_MAX_CTAS, early_rows=COMBINE_EARLY_ROWS,
                             skip_flagged=skip_flagged)

    return [
        config(128, 128, 32, 8),
        config(64, 128, 20, 5),
        config(64, 512, 16, 16),
        # MLA decode, one token a tile (the swapped sm_90a kernel): h16 and h8
        config(16, 512, 16, 16),
        config(8, 512, 8, 8),
        config(128, 256, 16, 8),  # prefill d256
        # sm_90a: behind the MLA decode device plans' clusters of 2 (cluster_merge_flags), skipping what they folded
        *([config(16, 512, 16, 16, skip_flagged=True), config(8, 512, 8, 8, skip_flagged=True)]
          if arch == "sm_90a" else []),
    ]


register_kernel(CombineConfig, build, configs=default_configs)


def launch_combine(device_plan, output, lse, lse_out_scale: float, partial_out=None, partial_lse=None) -> None:
    """Fold the partial slots (this stream's scratch of ``device_plan`` unless given) into ``output``/``lse``
    (no-op when the plan has no merges)."""
    if not device_plan.may_merge:
        return
    merge_counters = device_plan.scratch()[2]
    if partial_out is None:
        partial_out, partial_lse, _ = device_plan.scratch()
    fn = compile_kernel(CombineConfig.for_paged(device_plan.config))
    fn(*combine_arguments(device_plan, output, lse, lse_out_scale, partial_out, partial_lse, merge_counters))


def combine_arguments(device_plan, output, lse, lse_out_scale: float, partial_out, partial_lse,
                      merge_counters=None) -> tuple:
    """The combine kernel's arguments in its order (stream excluded): alone or as a launch chain's last stage
    (``merge_counters``, this stream's, only for an ``eager_combine`` or ``cluster_merge_flags`` config's combine)."""
    config = device_plan.config
    counters = (merge_counters,) if config.eager_combine or config.cluster_merge_flags else ()
    return (partial_out, partial_lse, device_plan.merge_indptr, device_plan.merges, *counters, output, lse,
            float(lse_out_scale))

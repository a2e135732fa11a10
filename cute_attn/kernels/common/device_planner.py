"""Device planner: index tensors -> the work lists the attention kernels consume, in one launch, no host sync.

The algorithm is :mod:`cute_attn.plan_partition`'s (its numpy twin and oracle: cuts of the cost line, so
every step is a prefix sum or a binary search); this kernel also checks the index values, so a new batch
costs launches only and stays safe with ``check_indices=False``.

Roles / phases (``writers`` + :func:`scan_ctas` CTAs x 512 threads, arch-neutral SIMT code: the same source for
sm_90a and sm_100a)
    every CTA   ``griddepcontrol.launch_dependents`` first: the attention kernel is launched with programmatic
                dependent launch, so its CTAs start their prologue while this grid runs and wait
                (``griddepcontrol.wait``) only before their first global read.
    CTAs w..    *page scan* (``planner_scan.py``), beside the planning: a grid-stride pass over ``kv_indices``
                (prefetched to L2, 8 ids in flight per thread), checking ``[0 : min(kv_indptr[batch], len)]``; a
                page id outside ``[0, num_pages)`` marks its request (binary search of ``kv_indptr``) in
                ``request_faults`` and the device error word. Each scan CTA then counts itself in ``arrivals``
                (acq_rel); how the marks reach the lists, with no CTA waiting on another, is ``planner_scan.py``'s
                docstring.
                The planning CTA keeps ``requests``, ``q_tiles`` and the cost line in shared memory when the
                batch fits (``SMEM_REQUESTS`` requests, ``SMEM_Q_TILES`` q tiles; one code path, instantiated
                twice), so its phases hand each other data at shared-memory latency; larger batches use the
                global scratch of the same names.
    CTAs 0..w-1 *row writers* (w = 1 unless a ``row_writers`` build, off by default, launches more:
                :func:`launch_writers`): each makes the same plan and writes its share of the item rows
                (``planner_lists.row_share``); CTA 0 alone writes the rest (``work_indptr``, merges, empty plans).
                Each is counted in ``arrivals`` (``planner_scan.py``). H200, session 30: off (default call <= 2 us).
    CTA 0       *rules*: ``qo_indptr``/``kv_indptr`` start at 0, never decrease, end at ``total_q`` / at most
                ``len(kv_indices)``; ``kv_last_page_len`` in ``1..page_size`` (``0..page_size`` without pages).
                A broken indptr faults the whole batch: no items, and this CTA writes output 0 / lse ``-inf``
                for every row. A broken request gets its tiles with no keys (a page-id fault: its items only; the
                attention kernel writes 0 / ``-inf`` for its rows and reads none of its pages).
                *q tiles*: per request ``ceil(q_len * group / rows_per_tile)`` tiles (block prefix sum), per q
                tile its request (binary search), rows, causal key end and cost; the cost line's prefix sum
                (int64) into ``q_tile_start``.
                *deal first* (``deal_first``, ``planner_deal_first.py``; GQA prefill by default): where the
                longest tile is within ``W + W / 8``, the sorted deal below is made before any cut, and kept with
                none made when its busiest CTA is too (the cuts, their vote and the partial slots' scan are
                skipped); otherwise the cuts follow and decide against it as below (``plan_partition.deals_first``).
                *cuts* (``planner_cuts.py``): one thread per CTA edge finds its tile (binary search) and key,
                snapping near edges;
                the same thread also finds the edge's nearer tile boundary, and when those whole-tile cuts
                leave no CTA above ``W + W / 2**WHOLE_TILE_SHIFT`` (one vote) they replace the split cuts.
                *sorted deal* (``sorted_deal``, causal kinds, when the cuts split or their whole tiles leave a
                CTA above ``W + W / 2**DEAL_WHOLE_SHIFT``): each CTA's cut load, the
                longest tile; when a deal can win, a bitonic sort of the q tiles' (cost, index) keys held in
                registers (a shuffle a stage under a warp's stride, a shared-memory exchange above), each CTA's
                serpentine load over its laps, and the deal replaces the cuts when its busiest CTA is no worse
                (``plan_partition``'s rule; ``sorted_deal.py``). *line deal* (``line_deal``, decode: pages 1-2
                and from 8 KV heads by default): the same deal over the line order, unsorted, when no worse than
                the cuts.
                *lists*: merges (runs of cuts inside one tile; block prefix sums give merge ids and partial slot
                bases), ``work_indptr`` (prefix sum of items per CTA), ``merge_indptr``/``merges``, then each
                thread builds ``ITEMS_PER_THREAD`` items' 10 fields in shared memory a pass (their CTA searches side
                by side) and thread 0 stores the pass as one bulk copy (``cp.async.bulk``, double-buffered stage).
                A plan larger than the buffers is a capacity fault.

Device error word (int32 ``[4]``, cleared by :func:`cute_attn.device_errors.raise_on_device_error`):
``[0]`` OR of the fault bits (``device_errors.Fault``), ``[1]`` the lowest faulting request (init INT32_MAX),
``[2]``/``[3]`` one bad page id and its kv_indices position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...compile import register_kernel
from ...config import KernelConfig
from ...plan import DEAL_MAX_Q_TILES_CHOICES, RANK_DEAL_MAX_Q_TILES_CHOICES, ItemField, MergeField, PlanConfig
from ...plan_partition import min_width
from .planner_collectives import NUM_THREADS, NUM_WARPS, block_any, block_any_pair, block_exclusive_sum, div_nonneg
from .planner_lists import write_lists
from .planner_q_tiles import q_tile_pairs, q_tile_singles
from .planner_scan import FAULT_PAGE_ID, MAX_SCAN_CTAS, scan_ctas  # noqa: F401 (the planner's public names)
from .planner_scan import (L2_LINE_INT32, ONE_WRITER, SEVERAL_WRITERS, arrivals_seen, planning_cta_ends,
                           scan_and_arrive, scan_verdict)
from .planner_scan import record_fault as _record
from .index_rules import (FAULT_CAPACITY, FAULT_KV_INDPTR, FAULT_LAST_PAGE_LEN, FAULT_QO_INDPTR,  # noqa: F401 (public)
                          empty_rows, request_rule_faults)
from .planner_cuts import cut_line
from .planner_deal_first import deal_first, deal_first_one_site
from .sorted_deal import deal_slots, sorted_deal

MAX_CTAS = NUM_THREADS - 1  # one thread per CTA edge (num_ctas + 1 of them)
# The planning CTA keeps its per-request and per-q-tile arrays in shared memory when the batch fits (the
# common case): every phase then reads what the previous one wrote at ~30 cycles instead of an L2 round trip
# (~0.3 us), and the binary searches cost ~30 cycles a step. Larger batches use the global scratch.
SMEM_REQUESTS = 1024
SMEM_Q_TILES = 2048
#: item rows a thread builds per pass of the lists phase (their CTA searches side by side); a pass's rows go out as
#: one bulk copy from one of two stage buffers (2 x NUM_THREADS x ITEMS_PER_THREAD rows of 40 bytes: 80 KB at 2; the
#: planning CTA's shared memory ~183 KB in all, ~199 KB with the 2048-key sort). ``items_per_thread`` overrides it
ITEMS_PER_THREAD = 2
#: the q-tile phase's build for every planner (``DevicePlannerConfig.q_tiles_per_pass``): 1 until the per-launch
#: choice (0) has run on a GPU; :func:`q_tile_pass_policy` sets it inside a block (GPU tests, A/Bs)
Q_TILES_PER_PASS = 1
#: every planner built with ``late_scan`` / ``scan_delay_ns`` (test builds; :func:`late_scan_policy` sets them)
LATE_SCAN = False
SCAN_DELAY_NS = 0
#: every deal-first planner built with the deal's code at one call site (``planner_deal_first.deal_first_one_site``)
#: instead of two (A/B builds; :func:`deal_one_site_policy` sets it). H200, 200 runs: the MLA seed's default call
#: 47.3 -> 46.8 us (session 25), GQA prefill 8 x 992's 169.1 -> 170.8 (session 26, its kind): off
DEAL_ONE_SITE = False
#: planners built with ``lap_lists`` (a dealt plan's rows in one pass by (lap, CTA) slots): None follows
#: ``deal_first``, so the GQA prefill planners, whose kept deals are dealt plans; True / False: every planner (A/Bs,
#: GPU tests; :func:`lap_lists_policy` sets it). H200, session 26 (``tools/ab_policy.py lap_lists``, 200 runs): GQA
#: prefill 8 x 992 default call 170.0 -> 169.5 us at h32/kv4, 114.3 -> 113.8 at h20/kv4; the MLA seed 45.9 -> 46.8
#: (MLA's default call moves ~1 us with any change of its planner's build: session 25), so it follows deal_first
LAP_LISTS: bool | None = None
#: the most row writers a build launches (``DevicePlannerConfig.row_writers``; ``planner_scan.ArrivalWord`` has a
#: late bit for each) and the rows a writer is given at least (:func:`launch_writers`)
MAX_ROW_WRITERS = 8
ROWS_PER_WRITER = 1024
#: every planner's ``row_writers`` (:func:`row_writers_policy` sets it with ROWS_PER_WRITER). 1: off (H200, session
#: 30, ``ab_policy.py row_writers``: GQA prefill default call 8 / 16 / 32 x 992 157.8 -> 161.7, 298.7 -> 297.5, ...)
ROW_WRITERS = 1
#: every sorting planner's ``count_sort`` (``count_sort.py``; ``count_sort_policy`` sets it): built in session 30, not run
COUNT_SORT = False
TRACE_STAMPS = 27  # trace_phases: stamps at the tail of q_tile_start (tools/planner_trace.py): phases 0-15, ...
TRACE_WRITER_ENDS = 16  # ... each row writer's end (globaltimer; builds with several), then the CTA's end and span
Q_TILE_FIELDS = 4  # request, row start, row count, key end
# first q tile, keys, query tokens, fault bits, first page, first token: the lists phase reads a request's page and
# token starts here, not from global per item (no faster on the H200: docs/perf-history.md session 7)
REQUEST_FIELDS = 6
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class DevicePlannerConfig(KernelConfig):
    """The plan rules baked into one planner build; batch, lengths, CTA count and capacities are runtime."""

    kernel_name: ClassVar[str] = "device_planner"

    num_kv_heads: int = 4
    group_size: int = 5
    rows_per_tile: int = 64  # packed rows per tile (whole tokens)
    kv_tile: int = 64
    page_size: int = 64
    causal: bool = False
    has_qo_indptr: bool = False  # decode: one query per request (token b), no qo_indptr
    item_overhead_keys: int = 128
    min_chunk_keys: int = 0
    allow_split: bool = True
    zigzag: bool = False  # PlanConfig.zigzag: a causal request's q tiles short, long, short... on the line
    sorted_deal: bool = False  # PlanConfig.sorted_deal: longest-first q tiles dealt serpentine when cuts split
    line_deal: bool = False  # PlanConfig.line_deal: whole tiles dealt serpentine in line order when no worse
    even_pieces: bool = False  # PlanConfig.even_pieces: equal one-tile requests cut in even pieces
    max_slack_keys: int = 0  # PlanConfig.max_slack_keys: the snap and whole-tile slacks capped (0: none)
    deal_whole_cuts: bool = False  # PlanConfig.deal_whole_cuts: whole-tile cuts dealt within 1/16 of their busiest
    deal_max_q_tiles: int = DEAL_MAX_Q_TILES_CHOICES[0]  # PlanConfig.deal_max_q_tiles: the sort's keys (16 / 32 KiB)
    rank_deal_max_q_tiles: int = 0  # PlanConfig.rank_deal_max_q_tiles: ranked deals past the sort (rank_sort.py)
    deal_first: bool = False  # PlanConfig.deal_first: the sorted deal before the cuts, kept near the mean with none
    #: an A/B build of ``deal_first`` with the deal's code at one call site (``planner_deal_first.py``); for_plan
    #: takes DEAL_ONE_SITE
    deal_one_site: bool = False
    #: a dealt plan's rows in one pass by (lap, CTA) slots, no CTA search (``planner_lists.build_dealt_rows``);
    #: for_plan takes LAP_LISTS (None: deal_first)
    lap_lists: bool = False
    lap_turn: bool = False  # PlanConfig.lap_turn: each lap's CTA order rotated (sorted_deal.turned_deal_loads)
    #: the most planning CTAs (row writers) a launch of this build may have; for_plan takes ROW_WRITERS
    row_writers: int = 1
    #: few-valued deal keys ranked by counting (``count_sort.py``) instead of the bitonic sort; for_plan takes COUNT_SORT
    count_sort: bool = False
    num_qo_heads: int = 20
    head_dim_v: int = 128
    #: a development build: CTA 0 stamps its phases in the last TRACE_STAMPS entries of ``q_tile_start``
    trace_phases: bool = False
    #: item rows a thread builds per pass of the lists phase (1 or 2; see ITEMS_PER_THREAD)
    items_per_thread: int = 0  # 0: ITEMS_PER_THREAD
    #: q tiles a thread builds per pass of the q-tile phase: 1, 2 (``planner_q_tiles.q_tile_pairs``: faster past 512
    #: q tiles, slower below; both measured) or 0 (per launch: pairs past one pass of NUM_THREADS tiles; built in
    #: session 17, not run yet). ``for_plan`` takes Q_TILES_PER_PASS
    q_tiles_per_pass: int = 1
    #: a test build: the planning CTA takes the late way (``planner_scan.py``) even when every scan CTA has arrived,
    #: so the last CTA to arrive empties the faulted requests' items in place
    late_scan: bool = False
    #: a test build: each scan CTA waits this long (globaltimer) before it counts itself, so with ``late_scan`` the
    #: last CTA to arrive is a scan CTA, which then empties the faulted items the planning CTA wrote
    scan_delay_ns: int = 0

    @staticmethod
    def for_plan(plan_config: PlanConfig, *, arch: str, has_qo_indptr: bool, head_dim_v: int) -> "DevicePlannerConfig":
        return DevicePlannerConfig(
            arch=arch, num_kv_heads=plan_config.num_kv_heads, group_size=plan_config.group_size,
            rows_per_tile=plan_config.tile_q_rows, kv_tile=plan_config.kv_tile, page_size=plan_config.page_size,
            causal=plan_config.causal, has_qo_indptr=has_qo_indptr, item_overhead_keys=plan_config.item_overhead_keys,
            min_chunk_keys=plan_config.min_chunk_keys, allow_split=plan_config.allow_split,
            zigzag=plan_config.zigzag, sorted_deal=plan_config.sorted_deal, line_deal=plan_config.line_deal,
            even_pieces=plan_config.even_pieces, max_slack_keys=plan_config.max_slack_keys, num_qo_heads=plan_config.num_qo_heads,
            head_dim_v=head_dim_v, q_tiles_per_pass=Q_TILES_PER_PASS, deal_whole_cuts=plan_config.deal_whole_cuts,
            late_scan=LATE_SCAN, scan_delay_ns=SCAN_DELAY_NS,
            deal_max_q_tiles=plan_config.deal_max_q_tiles, rank_deal_max_q_tiles=plan_config.rank_deal_max_q_tiles,
            deal_first=plan_config.deal_first, deal_one_site=DEAL_ONE_SITE, lap_turn=plan_config.lap_turn,
            lap_lists=plan_config.deal_first if LAP_LISTS is None else LAP_LISTS,
            row_writers=ROW_WRITERS, count_sort=COUNT_SORT)

    def plan_config(self, num_ctas: int) -> PlanConfig:
        return PlanConfig(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, causal=self.causal,
                          tile_q_rows=self.rows_per_tile, kv_tile=self.kv_tile, num_ctas=num_ctas,
                          item_overhead_keys=self.item_overhead_keys, allow_split=self.allow_split,
                          min_chunk_keys=self.min_chunk_keys, page_size=self.page_size, zigzag=self.zigzag,
                          sorted_deal=self.sorted_deal, line_deal=self.line_deal, even_pieces=self.even_pieces,
                          max_slack_keys=self.max_slack_keys, deal_whole_cuts=self.deal_whole_cuts,
                          deal_max_q_tiles=self.deal_max_q_tiles, rank_deal_max_q_tiles=self.rank_deal_max_q_tiles,
                          deal_first=self.deal_first, lap_turn=self.lap_turn)

    def can_implement(self) -> str | None:
        if (reason := super().can_implement()) is not None:
            return reason
        for name in ("num_kv_heads", "group_size", "rows_per_tile", "kv_tile", "page_size", "num_qo_heads",
                     "head_dim_v"):
            if getattr(self, name) < 1:
                return f"{name}={getattr(self, name)} must be >= 1"
        if self.num_qo_heads != self.num_kv_heads * self.group_size:
            return f"num_qo_heads={self.num_qo_heads} must be num_kv_heads * group_size"
        if self.rows_per_tile % self.group_size:
            return f"rows_per_tile={self.rows_per_tile} must hold whole tokens of group {self.group_size}"
        if self.item_overhead_keys < 0 or self.min_chunk_keys < 0:
            return "item_overhead_keys and min_chunk_keys must be >= 0"
        if self.sorted_deal and self.line_deal:
            return "sorted_deal and line_deal are exclusive"
        if self.lap_turn and not self.sorted_deal:
            return "lap_turn turns the sorted deal's laps: it needs sorted_deal"
        if self.deal_max_q_tiles not in DEAL_MAX_Q_TILES_CHOICES:
            return f"deal_max_q_tiles={self.deal_max_q_tiles} must be 1024 or 2048 (the sort's keys)"
        if self.rank_deal_max_q_tiles not in RANK_DEAL_MAX_Q_TILES_CHOICES:
            return f"rank_deal_max_q_tiles={self.rank_deal_max_q_tiles} must be 0 or 4096"
        if self.q_tiles_per_pass not in (0, 1, 2):
            return f"q_tiles_per_pass={self.q_tiles_per_pass} must be 1, 2 or 0 (chosen per launch)"
        if not 1 <= self.row_writers <= MAX_ROW_WRITERS:
            return f"row_writers={self.row_writers} must be 1..{MAX_ROW_WRITERS}"
        if self.items_per_thread not in (0, 1, 2):
            return f"items_per_thread={self.items_per_thread} must be 1 or 2 (0: the default, {ITEMS_PER_THREAD})"
        return None

    @property
    def rows_per_thread(self) -> int:
        return self.items_per_thread or ITEMS_PER_THREAD


class DevicePlanner:
    def __init__(self, config: DevicePlannerConfig):
        self.c = config
        self.deals = (config.sorted_deal or config.line_deal) and config.allow_split  # a deal may replace the cuts
        self.deals_first = config.deal_first and config.sorted_deal and config.allow_split  # plan_partition.deals_first
        self.min_width = min_width(config.plan_config(1))

    def __repr__(self) -> str:
        c = self.c
        return (f"DevicePlanner_H{c.num_qo_heads}x{c.num_kv_heads}_R{c.rows_per_tile}_N{c.kv_tile}_P{c.page_size}"
                f"_{'C' if c.causal else 'N'}{'Q' if c.has_qo_indptr else 'D'}")

    @cute.jit
    def __call__(self, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor,
                 kv_last_page_len: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, work_indptr: cute.Tensor,
                 items: cute.Tensor, merge_indptr: cute.Tensor, merges: cute.Tensor, q_tiles: cute.Tensor,
                 q_tile_start: cute.Tensor, requests: cute.Tensor, request_faults: cute.Tensor,
                 error_word: cute.Tensor, arrivals: cute.Tensor, num_pages: Int32, total_q: Int32,
                 max_partials: Int32, num_scan_ctas: Int32, num_writers: Int32, stream: cuda.CUstream):
        writers = Int32(1)  # one-writer builds take num_writers as 1 whatever the caller passed
        if cutlass.const_expr(self.c.row_writers > 1):
            writers = cutlass.max(cutlass.min(num_writers, Int32(self.c.row_writers)), Int32(1))
        self.kernel(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output, lse, work_indptr, items,
                    merge_indptr, merges, q_tiles, q_tile_start, requests, request_faults, error_word, arrivals,
                    num_pages, total_q, max_partials, num_scan_ctas, writers).launch(
            grid=(num_scan_ctas + writers, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream)  # writers, then scans

    @cute.kernel
    def kernel(self, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_indices: cute.Tensor,
               kv_last_page_len: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, work_indptr: cute.Tensor,
               items: cute.Tensor, merge_indptr: cute.Tensor, merges: cute.Tensor, q_tiles: cute.Tensor,
               q_tile_start: cute.Tensor, requests: cute.Tensor, request_faults: cute.Tensor,
               error_word: cute.Tensor, arrivals: cute.Tensor, num_pages: Int32, total_q: Int32,
               max_partials: Int32, num_scan_ctas: Int32, num_writers: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        started = Int64(0)
        started_ns = Int64(0)
        if cutlass.const_expr(self.c.trace_phases):
            started = cute.arch.clock64()
            started_ns = cute.arch.globaltimer()
        # The attention kernel after this one is launched with programmatic dependent launch: let it run its
        # prologue (barrier init, descriptor prefetch) now; its griddepcontrol.wait still waits for this
        # grid to finish and its writes to be visible.
        cute.arch.griddepcontrol_launch_dependents()
        smem = cutlass.utils.SmemAllocator()
        warp_sums = smem.allocate_tensor(Int64, cute.make_layout(2 * NUM_WARPS))  # block_max_pair's two halves
        flags = smem.allocate_tensor(Int32, cute.make_layout(NUM_WARPS + 2))
        cut_tile = smem.allocate_tensor(Int32, cute.make_layout(NUM_THREADS))
        cut_key = smem.allocate_tensor(Int32, cute.make_layout(NUM_THREADS))
        cta_items = smem.allocate_tensor(Int32, cute.make_layout(NUM_THREADS))  # work_indptr, in smem too
        merge_first_cut = smem.allocate_tensor(Int32, cute.make_layout(NUM_THREADS))
        merge_last_cut = smem.allocate_tensor(Int32, cute.make_layout(NUM_THREADS))
        merge_slot = smem.allocate_tensor(Int32, cute.make_layout(NUM_THREADS))
        cut_merge = smem.allocate_tensor(Int32, cute.make_layout(NUM_THREADS))
        requests_s = smem.allocate_tensor(Int32, cute.make_layout((SMEM_REQUESTS, REQUEST_FIELDS), stride=(REQUEST_FIELDS, 1)),
                                          byte_alignment=16)
        q_tiles_s = smem.allocate_tensor(Int32, cute.make_layout((SMEM_Q_TILES, Q_TILE_FIELDS), stride=(Q_TILE_FIELDS, 1)),
                                         byte_alignment=16)
        q_tile_start_s = smem.allocate_tensor(Int64, cute.make_layout(SMEM_Q_TILES + 1), byte_alignment=16)
        # item rows on their way to global: two buffers, so a chunk's bulk store reads one while the next chunk's
        # rows are built in the other (the first also serves the cuts as scratch)
        stage = smem.allocate_tensor(Int32, cute.make_layout((2 * NUM_THREADS * self.c.rows_per_thread, len(ItemField)),
                                                             stride=(len(ItemField), 1)), byte_alignment=128)
        sort_keys = None  # the sorted deal's (cost, q tile) keys: the sorted ones, then the sort's second buffer
        if cutlass.const_expr(self.deals):
            sort_keys = smem.allocate_tensor(Int64, cute.make_layout(deal_slots(self.c)), byte_alignment=16)

        batch = kv_indptr.shape[0] - 1
        num_indices = kv_indices.shape[0]
        tile_bound = Int64(batch) * ((self.c.group_size + self.c.rows_per_tile - 1) // self.c.rows_per_tile)
        if cutlass.const_expr(self.c.has_qo_indptr):
            tile_bound = Int64(batch) + (Int64(total_q) * self.c.group_size + self.c.rows_per_tile - 1) \
                // self.c.rows_per_tile
        in_shared = Int32(0)  # the batch fits the planning CTA's shared memory (SMEM_REQUESTS, SMEM_Q_TILES)
        if batch <= SMEM_REQUESTS:
            if tile_bound <= Int64(SMEM_Q_TILES):
                in_shared = Int32(1)
        several = self.c.row_writers > 1  # the build's arrival word (planner_scan.ArrivalWord)
        word = SEVERAL_WRITERS if several else ONE_WRITER
        writer = 0  # this CTA's share of the rows (a row writer); one-writer builds: CTA 0
        launch_count = 1  # the launch's row writers
        share_writers = 1  # the writers the rows are shared among: one where the plan is in the global scratch
        scans = cta != 0
        if cutlass.const_expr(several):
            writer = cta
            launch_count = num_writers
            scans = cta >= num_writers
            if in_shared != 0:
                share_writers = num_writers
        if scans:  # scan CTA cta - launch_count; the last to arrive finds every other CTA that arrives counted
            scan_and_arrive(kv_indptr, kv_indices, request_faults, error_word, items, work_indptr, arrivals, flags,
                            num_pages, batch, cta - launch_count, num_scan_ctas, num_scan_ctas + (launch_count - 1),
                            tidx, self.c.scan_delay_ns, word, share_writers)
        else:
            # the planner's own inputs to L2 before its first dependent load (the bench flushes L2 before every
            # call, as a new step would): one DRAM round trip for all of them instead of one per phase
            for line in range(tidx, (batch + L2_LINE_INT32) // L2_LINE_INT32, NUM_THREADS):
                cute.arch.prefetch((kv_indptr.iterator + line * L2_LINE_INT32).llvm_ptr, cache_level="L2")
                if cutlass.const_expr(self.c.has_qo_indptr):
                    cute.arch.prefetch((qo_indptr.iterator + line * L2_LINE_INT32).llvm_ptr, cache_level="L2")
                if line * L2_LINE_INT32 < batch:
                    cute.arch.prefetch((kv_last_page_len.iterator + line * L2_LINE_INT32).llvm_ptr,
                                       cache_level="L2")
            self.stamp(q_tile_start, 0, tidx, started)
            self.stamp(q_tile_start, 1, tidx)
            late = Int32(1)  # 1: the lists were written before every scan CTA had arrived (planner_scan.py)
            before = Int32(0)  # an early row writer's count before it (planner_scan.writer_arrives_early)
            if in_shared != 0:
                late, before = self.plan(tidx, qo_indptr, kv_indptr, kv_last_page_len, output, lse, work_indptr,
                                         items, merge_indptr, merges, q_tiles_s, q_tile_start_s, requests_s,
                                         request_faults, error_word, arrivals, warp_sums, flags, cut_tile, cut_key,
                                         cta_items, merge_first_cut, merge_last_cut, merge_slot, cut_merge, stage,
                                         sort_keys, batch, num_indices, total_q, max_partials, num_scan_ctas, writer,
                                         share_writers, launch_count, q_tile_start)
            else:
                if writer == 0:  # the global scratch has room for one planning CTA: it writes every row
                    late, before = self.plan(tidx, qo_indptr, kv_indptr, kv_last_page_len, output, lse, work_indptr,
                                             items, merge_indptr, merges, q_tiles, q_tile_start, requests,
                                             request_faults, error_word, arrivals, warp_sums, flags, cut_tile, cut_key,
                                             cta_items, merge_first_cut, merge_last_cut, merge_slot, cut_merge, stage,
                                             sort_keys, batch, num_indices, total_q, max_partials, num_scan_ctas,
                                             writer, 1, launch_count, q_tile_start)
            planning_cta_ends(items, work_indptr, request_faults, arrivals, flags, batch, num_scan_ctas, launch_count,
                              late, before, writer, share_writers, tidx, word)
            if cutlass.const_expr(several):
                self.stamp(q_tile_start, TRACE_WRITER_ENDS, tidx, "globaltimer", True)
            self.stamp(q_tile_start, TRACE_STAMPS - 3, tidx)
            self.stamp(q_tile_start, TRACE_STAMPS - 2, tidx, started_ns)
            self.stamp(q_tile_start, TRACE_STAMPS - 1, tidx, "globaltimer")

    @cute.jit
    def stamp(self, trace: cute.Tensor, slot: cutlass.Constexpr, tidx, value=None, each_cta: cutlass.Constexpr = False):
        """trace_phases builds only: thread 0 of CTA 0 (``each_cta``: of each CTA, at ``slot`` + its index) records
        ``value`` (default: clock64 now; "globaltimer": the global ns timer now) in stamp ``slot``."""
        if cutlass.const_expr(self.c.trace_phases):
            cta, _, _ = cute.arch.block_idx()
            first = cta if each_cta else 0
            if tidx == 0 and cta == first:
                now = value
                if cutlass.const_expr(value is None):
                    now = cute.arch.clock64()
                elif cutlass.const_expr(isinstance(value, str)):
                    now = cute.arch.globaltimer()
                trace[trace.shape[0] - TRACE_STAMPS + slot + first] = Int64(now)

    @cute.jit
    def plan(self, tidx, qo_indptr, kv_indptr, kv_last_page_len, output, lse, work_indptr, items, merge_indptr,
             merges, q_tiles, q_tile_start, requests, request_faults, error_word, arrivals, warp_sums, flags, cut_tile,
             cut_key, cta_items, merge_first_cut, merge_last_cut, merge_slot, cut_merge, stage, sort_keys, batch,
             num_indices, total_q, max_partials, scanners, writer, share_writers, writers, trace):
        """A planning CTA's work; ``requests``/``q_tiles``/``q_tile_start`` are shared memory when the batch fits
        (see SMEM_REQUESTS), else the global scratch; ``trace`` is the global q_tile_start (trace_phases). ``writer``
        of ``share_writers``: this CTA's rows (``planner_lists.row_share``; writer 0 writes the rest of the plan);
        ``writers``: the launch's (more where the global scratch leaves writer 0 alone). Returns ``late`` (1 unless
        the scan's marks were taken before the lists) and an early writer's count before it (``EARLY_LANE``)."""
        c = self.c
        heads = c.num_kv_heads
        num_ctas = work_indptr.shape[0] - 1
        # ---------------------------------------------------------------- rules
        bad = Int32(0)  # this thread's batch-wide faults
        # The indptr ends are checked by the threads of the first and last requests, which load them anyway, and
        # request 0's keys (even_pieces) are read from what its thread wrote, after the loop's barrier: no load
        # waits on another's value before the loop, so the rules pay one DRAM round trip, not a chain of three
        # (the phase was ~2.0 k cycles at every batch on the H200, session 28).
        if batch == 0:  # no request to check them: the ends are index 0
            if tidx == 0:
                if kv_indptr[0] != 0:
                    bad = bad | FAULT_KV_INDPTR
                if cutlass.const_expr(c.has_qo_indptr):
                    if qo_indptr[0] != 0 or total_q != 0:
                        bad = bad | FAULT_QO_INDPTR
        # One pass per 512 requests checks the rules and counts q tiles: the counts of a batch that breaks a
        # rule are discarded (batch_fault) before anything uses them.
        num_q_tiles = Int32(0)
        ragged = Int32(0)  # even_pieces: this thread's requests are not all one q tile of request 0's keys
        for base in range(0, batch, NUM_THREADS):
            b = base + tidx
            tiles = Int32(0)
            mine = Int32(0)  # the page scan's marks join before the lists (planner_scan.py)
            kv_len = Int32(0)
            if b < batch:
                page_start = kv_indptr[b]
                page_end = kv_indptr[b + 1]
                pages = page_end - page_start
                if pages < 0:
                    bad = bad | FAULT_KV_INDPTR
                q_len = Int32(1)
                token_start = b
                if cutlass.const_expr(c.has_qo_indptr):
                    token_start = qo_indptr[b]
                    token_end = qo_indptr[b + 1]
                    q_len = token_end - token_start
                    if q_len < 0:
                        bad = bad | FAULT_QO_INDPTR
                    if b == 0:
                        if token_start != 0:
                            bad = bad | FAULT_QO_INDPTR
                    if b == batch - 1:
                        if token_end != total_q:
                            bad = bad | FAULT_QO_INDPTR
                if b == 0:
                    if page_start != 0:
                        bad = bad | FAULT_KV_INDPTR
                if b == batch - 1:
                    if page_end > num_indices:
                        bad = bad | FAULT_KV_INDPTR
                requests[b, 4] = page_start
                requests[b, 5] = token_start
                last = kv_last_page_len[b]
                mine = request_rule_faults(error_word, last, b, pages, c.page_size, c.kv_tile)
                tiles = (q_len * c.group_size + c.rows_per_tile - 1) // c.rows_per_tile
                if pages > 0:
                    kv_len = (pages - 1) * c.page_size + last
                requests[b, 1] = kv_len
                requests[b, 2] = q_len
                requests[b, 3] = mine
            first, total = block_exclusive_sum(Int64(tiles), tidx, warp_sums)  # its barriers publish requests[0, 1]
            if b < batch:
                requests[b, 0] = Int32(first) + num_q_tiles
                if cutlass.const_expr(c.even_pieces):
                    if tiles != 1 or mine != 0 or kv_len != requests[0, 1]:
                        ragged = Int32(1)
            num_q_tiles = num_q_tiles + Int32(total)
        self.stamp(trace, 8, tidx)
        if bad != 0:
            _record(error_word, bad, 0)
        uniform = Int32(0)  # even_pieces: every request one q tile of the same keys, none faulted
        if cutlass.const_expr(c.even_pieces):
            votes = block_any_pair(bad != 0, ragged != 0, tidx, flags)
            batch_fault = votes & 1
            uniform = 1 - (votes >> 1)
        else:
            batch_fault = block_any(bad != 0, tidx, flags)
        self.stamp(trace, 2, tidx)
        self.stamp(trace, 3, tidx)
        capacity_bad = Int32(0)
        late = Int32(1)
        before = Int32(0)
        if batch_fault == 0:
            if Int64(num_q_tiles) * heads > Int64(items.shape[0]) or num_q_tiles > q_tiles.shape[0]:
                capacity_bad = Int32(1)
        if batch_fault == 0 and capacity_bad == 0:
            late, before = self.plan_tiles(tidx, qo_indptr, kv_indptr, kv_last_page_len, work_indptr, items,
                                           merge_indptr, merges, q_tiles, q_tile_start, requests, request_faults,
                                           error_word, arrivals, warp_sums, flags, cut_tile, cut_key, cta_items,
                                           merge_first_cut, merge_last_cut, merge_slot, cut_merge, stage, sort_keys,
                                           batch, num_q_tiles, num_ctas, max_partials, uniform, scanners, writer,
                                           share_writers, writers, trace)
            cute.arch.sync_threads()
            capacity_bad = flags[NUM_WARPS + 1]
        else:
            if capacity_bad != 0 and tidx == 0:
                _record(error_word, FAULT_CAPACITY, 0)
        if batch_fault != 0 or capacity_bad != 0:
            if writer == 0:
                self.empty_plan(tidx, output, lse, work_indptr, merge_indptr, num_ctas, total_q)
        return late, before

    @cute.jit
    def empty_plan(self, tidx, output, lse, work_indptr, merge_indptr, num_ctas, total_q):
        """No items; every output row 0 and lse -inf (the batch's index values cannot be trusted)."""
        for i in range(tidx, num_ctas + 1, NUM_THREADS):
            work_indptr[i] = Int32(0)
        for i in range(tidx, merge_indptr.shape[0], NUM_THREADS):
            merge_indptr[i] = Int32(0)
        rows = total_q if output.shape[0] == total_q else Int32(0)  # plan_*(on_device=True) has no output
        empty_rows(output, lse, tidx, NUM_THREADS, self.c.head_dim_v, 0, rows, 1)

    @cute.jit
    def plan_tiles(self, tidx, qo_indptr, kv_indptr, kv_last_page_len, work_indptr, items, merge_indptr, merges,
                   q_tiles, q_tile_start, requests, request_faults, error_word, arrivals, warp_sums, flags, cut_tile,
                   cut_key, cta_items, merge_first_cut, merge_last_cut, merge_slot, cut_merge, stage, sort_keys, batch,
                   num_q_tiles, num_ctas, max_partials, uniform, scanners, writer, share_writers, writers, trace):
        """``uniform``: 1 when every request is one q tile of the same keys, none faulted (even_pieces builds).
        Returns ``late`` and ``before`` (see :meth:`plan`)."""
        c = self.c
        heads = c.num_kv_heads
        cute.arch.sync_threads()  # every request's first q tile (requests[:, 0]) is written
        # ---------------------------------------------------------------- q tiles: rows, key end, cost line
        line = Int64(0)  # the cost line's length
        longest = Int64(0)  # this thread's longest tile (the deal's bound; the cuts' vote reduces it)
        if cutlass.const_expr(c.q_tiles_per_pass == 1):
            line, longest = q_tile_singles(c, tidx, requests, q_tiles, q_tile_start, warp_sums, batch, num_q_tiles)
        elif cutlass.const_expr(c.q_tiles_per_pass == 2):
            line, longest = q_tile_pairs(c, tidx, requests, q_tiles, q_tile_start, warp_sums, batch, num_q_tiles)
        else:  # per launch (uniform over the CTA): pairs only pay where there is more than one pass
            if num_q_tiles > NUM_THREADS:
                line, longest = q_tile_pairs(c, tidx, requests, q_tiles, q_tile_start, warp_sums, batch, num_q_tiles)
            else:
                line, longest = q_tile_singles(c, tidx, requests, q_tiles, q_tile_start, warp_sums, batch,
                                               num_q_tiles)
        if tidx == 0:
            q_tile_start[num_q_tiles] = line * heads
        cute.arch.fence_acq_rel_cta()
        cute.arch.sync_threads()
        self.stamp(trace, 4, tidx)

        # ---------------------------------------------------------------- cuts, one thread per CTA edge
        total_cost = line * heads
        width = Int64(1)
        active = Int64(0)
        if total_cost > 0:
            width = cutlass.max(div_nonneg(total_cost + num_ctas - 1, Int64(num_ctas)), Int64(self.min_width))
            active = div_nonneg(total_cost + width - 1, width)
        deal = Int32(0)  # 1: the sorted deal replaces the cuts
        deal_count = Int32(0)  # this thread's CTA's items in the deal
        dealt_max = Int64(-1)  # the busiest CTA of a deal made before the cuts (deal_first), -1: none made
        if cutlass.const_expr(self.deals_first):  # the deal first: near the mean it is kept, and no cut is made
            self.stamp(trace, 15, tidx)
            self.stamp(trace, 5, tidx)
        if cutlass.const_expr(self.deals_first and c.deal_one_site):
            deal, deal_count = deal_first_one_site(c, self.min_width, self.stamp, tidx, q_tiles, q_tile_start,
                                                   requests, warp_sums, flags, cut_tile, cut_key, stage, sort_keys,
                                                   batch, num_q_tiles, num_ctas, total_cost, width, active, uniform,
                                                   longest, trace)
        elif cutlass.const_expr(self.deals_first):
            deal, deal_count, dealt_max = deal_first(c, tidx, q_tiles, requests, sort_keys, warp_sums, num_q_tiles,
                                                     num_ctas, batch, width, uniform, longest)
            if deal == 0:
                deal, deal_count = self.cut_then_deal(tidx, q_tiles, q_tile_start, requests, warp_sums, flags,
                                                      cut_tile, cut_key, stage, sort_keys, batch, num_q_tiles,
                                                      num_ctas, total_cost, width, active, uniform, longest,
                                                      dealt_max, deal_count, trace)
        else:
            deal, deal_count = self.cut_then_deal(tidx, q_tiles, q_tile_start, requests, warp_sums, flags, cut_tile,
                                                  cut_key, stage, sort_keys, batch, num_q_tiles, num_ctas,
                                                  total_cost, width, active, uniform, longest, dealt_max, deal_count,
                                                  trace)
        self.stamp(trace, 7, tidx)
        # the scan CTAs' arrivals, read here and used before the lists: the load's latency hides behind the merges
        seen = Int32(0)
        if tidx == 0:
            seen = arrivals_seen(arrivals)

        # ---------------------------------------------------------------- merges: runs of cuts inside one tile
        edge = tidx  # one thread an edge of the cut line
        run_start = Int32(0)
        run_end = Int32(0)
        if edge <= num_ctas:
            inside = cut_key[edge] > 0
            continues = False
            if edge > 0:
                continues = inside and cut_key[edge - 1] > 0 and cut_tile[edge - 1] == cut_tile[edge]
            if inside and not continues:
                run_start = Int32(1)
            if edge < num_ctas:
                if inside and not (cut_key[edge + 1] > 0 and cut_tile[edge + 1] == cut_tile[edge]):
                    run_end = Int32(1)
            elif inside:
                run_end = Int32(1)
        # ---------------------------------------------------------------- items per CTA -> work_indptr
        count = Int32(0)
        if edge < num_ctas:
            first = cut_tile[edge]
            last = cut_tile[edge + 1] - 1
            if cut_key[edge + 1] > 0:
                last = cut_tile[edge + 1]
            count = cutlass.max(last - first + 1, Int32(0))
        if deal != 0:
            run_start = Int32(0)
            run_end = Int32(0)
            count = deal_count
        # one prefix sum for both counts: merge runs in the high 32 bits, items in the low (each total < 2^31)
        packed_before, packed_total = block_exclusive_sum((Int64(run_start) << 32) + Int64(count), tidx, warp_sums)
        merge_before = packed_before >> 32
        num_merges = packed_total >> 32
        item_before = packed_before & Int64(0xFFFFFFFF)
        num_items = packed_total & Int64(0xFFFFFFFF)
        self.stamp(trace, 12, tidx)
        merge = Int32(merge_before) + run_start - 1  # the merge of an inside cut (its run's id)
        if edge <= num_ctas:
            cut_merge[edge] = merge
            if run_start != 0:
                merge_first_cut[merge] = edge
            if run_end != 0:
                merge_last_cut[merge] = edge
        cute.arch.sync_threads()
        self.stamp(trace, 13, tidx)
        chunks = Int64(0)
        if tidx < Int32(num_merges):
            chunks = Int64(merge_last_cut[tidx] - merge_first_cut[tidx] + 2)
        if cutlass.const_expr(self.deals_first):
            slot_before = Int64(0)
            num_partials = Int64(0)
            if deal == 0:  # a deal has no merges, so no partial slots to count (uniform over the CTA)
                slot_before, num_partials = block_exclusive_sum(chunks, tidx, warp_sums)
        else:
            slot_before, num_partials = block_exclusive_sum(chunks, tidx, warp_sums)
        if tidx < Int32(num_merges):
            merge_slot[tidx] = Int32(slot_before)
        if edge <= num_ctas:
            cta_items[edge] = Int32(item_before)
            if writer == 0:
                work_indptr[edge] = Int32(item_before)
        too_big = Int32(0)
        if num_items > Int64(items.shape[0]) or num_merges > Int64(merges.shape[0]):
            too_big = Int32(1)
        if num_merges > 0 and num_partials > Int64(max_partials):
            too_big = Int32(1)
        if tidx == 0:
            flags[NUM_WARPS + 1] = too_big
            if too_big != 0:
                _record(error_word, FAULT_CAPACITY, 0)
        late, before = scan_verdict(seen, flags, requests, request_faults, arrivals, batch, scanners, writers, tidx,
                                    c.late_scan, SEVERAL_WRITERS if c.row_writers > 1 else ONE_WRITER)
        self.stamp(trace, 6, tidx)
        if too_big == 0:
            write_lists(c, self.stamp, tidx, items, merge_indptr, merges, q_tiles, requests, cut_tile, cut_key,
                        cta_items, merge_first_cut, merge_slot, cut_merge, stage, sort_keys, deal, Int32(num_items),
                        Int32(num_merges), Int32(num_partials), num_ctas, writer, share_writers, trace)
        return late, before

    @cute.jit
    def cut_then_deal(self, tidx, q_tiles, q_tile_start, requests, warp_sums, flags, cut_tile, cut_key, stage,
                      sort_keys, batch, num_q_tiles, num_ctas, total_cost, width, active, uniform, longest, dealt_max,
                      deal_count, trace):
        """The cuts (``planner_cuts.cut_line``), then whether the sorted deal replaces them (made here, or before
        them in ``deals_first`` builds: its busiest CTA ``dealt_max`` >= 0, its count ``deal_count``). Returns
        (deal, this thread's CTA's items in the deal)."""
        c = self.c
        split, snap_max, longest = cut_line(c, self.deals, self.min_width, self.stamp, tidx, q_tiles, q_tile_start,
                                            cut_tile, cut_key, stage, warp_sums, flags, trace, num_q_tiles,
                                            num_ctas, total_cost, width, active, uniform, longest)
        self.stamp(trace, 5, tidx)
        deal = Int32(0)
        if cutlass.const_expr(self.deals):
            cut_count = Int32(0)
            deal, cut_count = sorted_deal(c, tidx, split, snap_max, longest, q_tiles, q_tile_start, cut_tile,
                                          cut_key, sort_keys, warp_sums, num_q_tiles, num_ctas, width, total_cost,
                                          requests, batch, dealt_max)
            if dealt_max < 0:  # a deal made first keeps its count
                deal_count = cut_count
        return deal, deal_count


def launch_writers(config: DevicePlannerConfig, batch: int, total_q: int) -> int:
    """Row writers for a launch, from shapes alone: one a ROWS_PER_WRITER rows of the tile bound, at most
    ``config.row_writers``; one past the shared-memory batch (the global scratch holds one planning CTA's plan)."""
    rows_per_tile = config.rows_per_tile
    if config.has_qo_indptr:
        tiles = batch + -(-total_q * config.group_size // rows_per_tile)
    else:
        tiles = batch * -(-config.group_size // rows_per_tile)
    if config.row_writers <= 1 or batch > SMEM_REQUESTS or tiles > SMEM_Q_TILES:
        return 1
    return max(1, min(config.row_writers, -(-tiles * config.num_kv_heads // ROWS_PER_WRITER)))


def fake_args(config: DevicePlannerConfig) -> tuple:
    i32, i64 = cutlass.Int32, cutlass.Int64
    fake = cute.runtime.make_fake_compact_tensor
    sym = cute.sym_int
    batch_plus_1 = sym(symbol="batch_plus_1")
    total_q = sym(symbol="total_q")
    return (
        fake(i32, (sym(symbol="qo_indptr_len"),)),
        fake(i32, (batch_plus_1,)),
        fake(i32, (sym(symbol="num_indices"),)),
        fake(i32, (sym(symbol="batch"),)),
        fake(cutlass.BFloat16, (total_q, config.num_qo_heads, config.head_dim_v), stride_order=(2, 1, 0)),
        fake(cutlass.Float32, (total_q, config.num_qo_heads), stride_order=(1, 0)),
        fake(i32, (sym(symbol="ctas_plus_1"),)),
        fake(i32, (sym(symbol="max_items"), len(ItemField)), stride_order=(1, 0)),
        fake(i32, (sym(symbol="max_merges_plus_1"),)),
        fake(i32, (sym(symbol="max_merges"), len(MergeField)), stride_order=(1, 0)),
        fake(i32, (sym(symbol="max_q_tiles"), Q_TILE_FIELDS), stride_order=(1, 0)),
        fake(i64, (sym(symbol="max_q_tiles_plus_1"),)),
        fake(i32, (sym(symbol="request_rows"), REQUEST_FIELDS), stride_order=(1, 0)),
        fake(i32, (sym(symbol="request_faults"),)),
        fake(i32, (4,)),
        fake(i32, (1,)),
        Int32(1),
        Int32(1),
        Int32(1),
        Int32(1),
        Int32(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )


def build(config: DevicePlannerConfig) -> tuple[Any, tuple[Any, ...]]:
    return DevicePlanner(config), fake_args(config)


def default_configs(arch: str) -> list[DevicePlannerConfig]:
    """The planners of the three definitions' default configs."""
    from ...config import default_paged_config

    out = []
    for kind, hq, hkv, d, dv, ps, causal, qo in (
        ("gqa_paged_decode", 20, 4, 128, 128, 64, False, False),
        ("gqa_paged_prefill", 32, 4, 128, 128, 64, True, True),
        ("mla_paged_prefill", 16, 1, 576, 512, 1, True, True),
    ):
        cfg = default_paged_config(kind, arch=arch, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, head_dim_v=dv,
                                   page_size=ps, causal=causal)
        out.append(DevicePlannerConfig.for_plan(cfg.plan_config(132), arch=arch, has_qo_indptr=qo, head_dim_v=dv))
    return out


register_kernel(DevicePlannerConfig, build, configs=default_configs)

# the build policies (A/Bs, GPU tests) set this module's globals above: callers import them from here
from .planner_policies import (count_sort_policy, deal_one_site_policy, lap_lists_policy, late_scan_policy,  # noqa: E402,F401
                               q_tile_pass_policy, row_writers_policy)

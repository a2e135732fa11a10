"""The device planner's page scan and the arrival that hands its verdict over, off the planning CTA's path.

CTA 0 plans from the moment it starts; CTAs ``1 .. scanners`` check every page id at the same time (the scan was the
planning CTA's first phase: 2.5-5 k cycles before it could plan, most of the page-1 decode planner's extra cost).
A page id outside the pool marks its request in ``request_faults`` (and the device error word); those marks reach the
plan in one of two ways, both without any CTA waiting on another:

- *fast* (the common case: the scan ends long before the lists are due): just before its lists the planning CTA reads
  ``arrivals`` once. Every scan CTA has counted itself there (``count`` bits), each with a flag when it marked a fault
  (``FAULTED_SCANNER`` units); when all have arrived and one flagged, the planning CTA folds the marks into its
  requests (:func:`take_scan_faults`), so a faulted request's items are written with no keys. It then clears
  ``arrivals``.
- *late* (scan CTAs still running, e.g. one short request over a huge page table): the planning CTA writes its lists
  unaware and counts itself in ``arrivals`` too; whichever CTA arrives last (count ``scanners`` before its own) empties
  the faulted requests' items in place (:func:`empty_faulted_items`) and clears the marks and ``arrivals``.

Row writers (``DevicePlannerConfig.row_writers`` builds launched with more than one; built in session 30, off by
default): CTAs ``0 .. writers - 1`` all make the same plan, and each writes its own share of the item rows
(``planner_lists.row_share``). Several CTAs then read ``arrivals`` before their lists, so none may clear it or the marks
early, and the word is packed for it (:class:`ArrivalWord` ``SEVERAL_WRITERS``): CTAs counted in 8 bits, faulted scan
CTAs, the writers counted, and a late bit a writer. A writer sees every scan CTA arrived when the count less the writers
already counted reaches ``scanners``; then it takes the marks without clearing them and counts itself at once
(:func:`writer_arrives_early`, by a lane whose atomic runs beside the lists), and at its end only learns whether it was
last. Otherwise it writes its rows unaware and counts itself after them with its late bit. Whichever CTA arrives last
(``scanners + writers - 1`` counted before it: a scan CTA or a writer) empties the faulted requests' items in the late
writers' shares (an early writer's rows took the marks, and its copies may still be landing), then clears the marks and
``arrivals`` (:func:`clean_up`). A launch with one writer keeps the protocol above.

A page-faulted request is therefore costed on the line with its keys (the rules' faults still take them away before
the cuts); only its items lose them. The attention kernels write 0 / lse ``-inf`` for an item with no keys, split or
not (the merges fold all-``-inf`` partials to the same), and read none of its pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ...plan import ItemField
from .planner_collectives import NUM_THREADS, block_any, last_at_most
from .planner_lists import row_share

SCAN_IDS_PER_THREAD = 8  # page scan: CTAs = ceil(len(kv_indices) / (NUM_THREADS * this)), capped
MAX_SCAN_CTAS = 131  # with the planning CTA, one CTA an SM of the H200's 132 (the grid is resident at once)
L2_LINE_INT32 = 32  # the index arrays are prefetched to L2 a 128-byte line at a time
ARRIVAL_COUNT_MASK = 0xFFFF  # arrivals (one-writer builds): CTAs counted in the low bits ...
FAULTED_SCANNER = 1 << 16  # ... and scan CTAs that marked a fault above them
#: the lane that counts an early row writer (lane 0 of the last warp: the rows' builders are the first threads)
EARLY_LANE = NUM_THREADS - 32


@dataclass(frozen=True)
class ArrivalWord:
    """How a build packs ``arrivals``: CTAs counted in ``count_bits``, then scan CTAs that marked a fault (8 bits);
    with several row writers (``count_bits`` 8: at most 132 CTAs) the writers counted (4 bits) and a late bit each
    (8 bits: device_planner.MAX_ROW_WRITERS)."""

    count_bits: int

    @property
    def count_mask(self) -> int:
        return (1 << self.count_bits) - 1

    @property
    def faulted_unit(self) -> int:
        return 1 << self.count_bits

    @property
    def several(self) -> bool:
        return self.count_bits == 8

    writer_shift: ClassVar[int] = 16
    writer_unit: ClassVar[int] = 1 << 16
    late_shift: ClassVar[int] = 20
    late_unit: ClassVar[int] = 1 << 20


ONE_WRITER = ArrivalWord(16)
SEVERAL_WRITERS = ArrivalWord(8)
FAULT_PAGE_ID = 8  # device_planner's fault bit for a page id outside the pool


def scan_ctas(num_indices: int, writers: int = 1) -> int:
    """Scan CTAs for ``num_indices`` kv_indices entries (the grid is these plus the ``writers`` planning CTAs, at
    most one CTA an SM of the H200 in all)."""
    return max(1, min(MAX_SCAN_CTAS + 1 - writers, -(-num_indices // (NUM_THREADS * SCAN_IDS_PER_THREAD))))


@cute.jit
def record_fault(error_word: cute.Tensor, bits, request):
    cute.arch.atomic_or((error_word.iterator + 0).llvm_ptr, Int32(bits))
    cute.arch.atomic_min((error_word.iterator + 1).llvm_ptr, Int32(request))


@cute.jit
def load_id_batch(kv_indices: cute.Tensor, base, num_threads: cutlass.Constexpr, tidx, bound, ids: cute.Tensor):
    """``ids[k] = kv_indices[base + k * num_threads + tidx]`` for every k (0 at or past ``bound``): all of a thread's
    loads issued before any id is used, so they are in flight together (the page scans' passes)."""
    for k in cutlass.range_constexpr(cute.size(ids)):
        p = base + k * num_threads + tidx
        ids[k] = Int32(0)
        if p < bound:
            ids[k] = kv_indices[p]


@cute.jit
def page_scan(kv_indptr: cute.Tensor, kv_indices: cute.Tensor, request_faults: cute.Tensor, error_word: cute.Tensor,
              num_pages, batch, scanner, scanners, tidx) -> Int32:
    """Scan CTA ``scanner`` of ``scanners``: its grid-stride share of ``kv_indices[0 : min(kv_indptr[batch], len)]``
    checked against ``[0, num_pages)``; returns 1 on a thread that marked a fault. A thread loads
    SCAN_IDS_PER_THREAD ids before it checks any, so their loads are in flight together; the loads cover the whole
    tensor and only the checks stop at ``kv_indptr[batch]``, so no load waits for that bound."""
    num_indices = kv_indices.shape[0]
    # one DRAM round trip for the CTA's whole share instead of one per pass
    lines = (num_indices + L2_LINE_INT32 - 1) // L2_LINE_INT32
    for line in range(scanner * NUM_THREADS + tidx, lines, scanners * NUM_THREADS):
        cute.arch.prefetch((kv_indices.iterator + line * L2_LINE_INT32).llvm_ptr, cache_level="L2")
    scan_end = cutlass.min(cutlass.max(kv_indptr[batch], Int32(0)), num_indices)
    ids = cute.make_rmem_tensor((SCAN_IDS_PER_THREAD,), Int32)
    chunk = NUM_THREADS * SCAN_IDS_PER_THREAD
    found = Int32(0)
    for base in range(scanner * chunk, num_indices, scanners * chunk):
        load_id_batch(kv_indices, base, NUM_THREADS, tidx, num_indices, ids)
        for k in cutlass.range_constexpr(SCAN_IDS_PER_THREAD):
            p = base + k * NUM_THREADS + tidx
            page = ids[k]
            if p < scan_end:
                if page < 0 or page >= num_pages:
                    b = last_at_most(kv_indptr, batch, p)
                    cute.arch.atomic_or((request_faults.iterator + b).llvm_ptr, Int32(FAULT_PAGE_ID))
                    record_fault(error_word, FAULT_PAGE_ID, b)
                    error_word[2] = page
                    error_word[3] = p
                    found = Int32(1)
    return found


@cute.jit
def arrive(arrivals: cute.Tensor, flags: cute.Tensor, tidx, value) -> Int32:
    """Count this CTA in ``arrivals`` (``value``: 1, plus FAULTED_SCANNER from a scan CTA that marked a fault) after
    every thread's global writes; every thread gets the count before it (acq_rel: the last to arrive sees every other
    CTA's writes)."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()
    if tidx == 0:
        flags[0] = cute.arch.atomic_add(arrivals.iterator.llvm_ptr, Int32(value), sem="acq_rel", scope="gpu")
    cute.arch.sync_threads()
    return flags[0]


@cute.jit
def scan_and_arrive(kv_indptr, kv_indices, request_faults, error_word, items, work_indptr, arrivals, flags,
                    num_pages, batch, scanner, scanners, last_before, tidx, delay_ns: cutlass.Constexpr = 0,
                    word: cutlass.Constexpr = ONE_WRITER, share_writers=1):
    """A scan CTA's whole work: its share of the scan, its arrival, and, when it arrives last (``last_before``
    counted before it: every other scan CTA and the planning CTAs that arrive), the faulted requests' items emptied.
    ``delay_ns``: a test build's wait before the arrival (``DevicePlannerConfig.scan_delay_ns``); ``word``: the
    build's :class:`ArrivalWord`; ``share_writers``: the writers the rows are shared among."""
    found = page_scan(kv_indptr, kv_indices, request_faults, error_word, num_pages, batch, scanner, scanners, tidx)
    faulted = block_any(found != 0, tidx, flags)
    if cutlass.const_expr(delay_ns > 0):
        start = cute.arch.globaltimer()
        while cute.arch.globaltimer() - start < delay_ns:
            pass
    arrive_and_empty_if_last(items, work_indptr, request_faults, arrivals, flags, batch, last_before, faulted, tidx,
                             Int32(1) + faulted * word.faulted_unit, word, share_writers)


@cute.jit
def planner_arrives(items, work_indptr, request_faults, arrivals, flags, batch, scanners, late, tidx,
                    word: cutlass.Constexpr = ONE_WRITER):
    """The one planning CTA's end: on the fast way it clears ``arrivals`` (every scan CTA has counted itself); on
    the late way it counts itself and, if last, empties the faulted requests' items."""
    if late == 0:
        if tidx == 0:
            arrivals[0] = Int32(0)
    else:
        if tidx == 0:
            # the lists' bulk copies (async proxy) have completed: order them before the release below
            cute.arch.fence_proxy("async.global")
        value = Int32(1)
        if cutlass.const_expr(word.several):
            value = Int32(1 + word.writer_unit + word.late_unit)  # writer 0, late
        arrive_and_empty_if_last(items, work_indptr, request_faults, arrivals, flags, batch, scanners, Int32(0), tidx,
                                 value, word, Int32(1))


@cute.jit
def planning_cta_ends(items, work_indptr, request_faults, arrivals, flags, batch, scanners, writers, late, before,
                      writer, share_writers, tidx, word: cutlass.Constexpr = ONE_WRITER):
    """A planning CTA's arrival after its lists: :func:`writer_ends` in a launch of several writers, else
    :func:`planner_arrives`."""
    if cutlass.const_expr(word.several):
        if writers > 1:
            writer_ends(items, work_indptr, request_faults, arrivals, flags, batch, scanners + writers - 1, 1 - late,
                        before, writer, share_writers, tidx, word)
        else:
            planner_arrives(items, work_indptr, request_faults, arrivals, flags, batch, scanners, late, tidx, word)
    else:
        planner_arrives(items, work_indptr, request_faults, arrivals, flags, batch, scanners, late, tidx)


@cute.jit
def writer_arrives_early(arrivals, tidx, word: cutlass.Constexpr) -> Int32:
    """A row writer that took the marks (or found none) counts itself before its lists, as soon as every thread is
    done with ``arrivals`` and the marks (the caller's barrier): by one lane past the rows' builders
    (:data:`EARLY_LANE`), whose atomic then runs beside the lists. Returns the count before it, on that lane."""
    before = Int32(0)
    if tidx == EARLY_LANE:
        cute.arch.fence_acq_rel_gpu()  # the CTA's global writes (writer 0: work_indptr), released with the count
        before = cute.arch.atomic_add(arrivals.iterator.llvm_ptr, Int32(1 + word.writer_unit), sem="acq_rel",
                                      scope="gpu")
    return before


@cute.jit
def writer_ends(items, work_indptr, request_faults, arrivals, flags, batch, last_before, early, before, writer,
                share_writers, tidx, word: cutlass.Constexpr):
    """A row writer's end (launches with several), its rows in global memory (the bulk copies completed): one that
    arrived early (``early``, ``before`` on :data:`EARLY_LANE`) only learns whether it was last; a late one counts
    itself now with its late bit. The last to arrive cleans up (:func:`clean_up`)."""
    if early != 0:
        cute.arch.sync_threads()
        if tidx == EARLY_LANE:
            flags[0] = before
        cute.arch.sync_threads()
        before = flags[0]
        if (before & word.count_mask) == last_before:
            cute.arch.fence_acq_rel_gpu()
            clean_up(items, work_indptr, request_faults, arrivals, batch, before + 1 + word.writer_unit,
                     share_writers, tidx, word)
    else:
        if tidx == 0:
            cute.arch.fence_proxy("async.global")  # the bulk copies' writes, ordered before the release below
        arrive_and_empty_if_last(items, work_indptr, request_faults, arrivals, flags, batch, last_before, Int32(0),
                                 tidx, Int32(1 + word.writer_unit) + (Int32(word.late_unit) << writer), word,
                                 share_writers)


@cute.jit
def arrive_and_empty_if_last(items, work_indptr, request_faults, arrivals, flags, batch, last_before, faulted, tidx,
                             value, word: cutlass.Constexpr, share_writers):
    """Count this CTA in ``arrivals`` (``value``: 1, plus ``word.faulted_unit`` from a scan CTA that marked a fault,
    plus a row writer's units); the CTA that finds ``last_before`` counted before it is the last to arrive and cleans
    up."""
    before = arrive(arrivals, flags, tidx, value)
    if (before & word.count_mask) == last_before:
        cute.arch.fence_acq_rel_gpu()
        if cutlass.const_expr(word.several):
            clean_up(items, work_indptr, request_faults, arrivals, batch, before + value, share_writers, tidx, word)
        else:
            empty_faulted_items(items, work_indptr, request_faults, arrivals, batch, faulted + (before >> 16), tidx)


@cute.jit
def clean_up(items, work_indptr, request_faults, arrivals, batch, after, share_writers, tidx, word: cutlass.Constexpr):
    """The last CTA to arrive, builds with several writers (``after``: the word with every arrival): where a scan
    CTA marked a fault, the rows of each writer that wrote its lists unaware (its late bit) lose the faulted
    requests' keys, and the marks are cleared; then ``arrivals``. Only late writers' rows are read: an early writer's
    bulk copies may still be landing, and its rows took the marks."""
    faulted = (after >> word.count_bits) & 0xFF
    late = (after >> word.late_shift) & 0xFF
    if faulted != 0:
        if late != 0:
            num_items = work_indptr[work_indptr.shape[0] - 1]
            for k in range(share_writers):
                if ((late >> k) & 1) != 0:
                    first, end = row_share(num_items, k, share_writers)
                    empty_marked_rows(items, request_faults, first, end, tidx)
            cute.arch.sync_threads()  # every item has read its request's mark before the marks are cleared
    clear_marks(request_faults, arrivals, batch, faulted, tidx)


@cute.jit
def empty_faulted_items(items, work_indptr, request_faults, arrivals, batch, faulted, tidx):
    """The last CTA to arrive on the late way: every item of a marked request gets no keys (``KV_END = KV_START``),
    then the marks and ``arrivals`` are cleared for the next launch (and every CUDA-graph replay)."""
    if faulted != 0:
        empty_marked_rows(items, request_faults, Int32(0), work_indptr[work_indptr.shape[0] - 1], tidx)
        cute.arch.sync_threads()  # every item has read its request's mark before the marks are cleared
    clear_marks(request_faults, arrivals, batch, faulted, tidx)


@cute.jit
def empty_marked_rows(items, request_faults, first, end, tidx):
    """Item rows ``first .. end - 1`` of a request the scan marked get no keys (``KV_END = KV_START``)."""
    for i in range(first + tidx, end, NUM_THREADS):
        if request_faults[items[i, ItemField.REQUEST]] != 0:
            items[i, ItemField.KV_END] = items[i, ItemField.KV_START]


@cute.jit
def clear_marks(request_faults, arrivals, batch, faulted, tidx):
    """The last CTA's end: the scan's marks (where ``faulted``) and ``arrivals`` cleared for the next launch."""
    if faulted != 0:
        for b in range(tidx, batch, NUM_THREADS):
            if request_faults[b] != 0:
                request_faults[b] = Int32(0)
    if tidx == 0:
        arrivals[0] = Int32(0)


@cute.jit
def arrivals_seen(arrivals: cute.Tensor) -> Int32:
    """``arrivals`` read at GPU scope (relaxed: the reader fences only when it goes on to read the scan's marks)."""
    return cute.arch.load(arrivals.iterator.llvm_ptr, Int32, sem="relaxed", scope="gpu")


@cute.jit
def scan_verdict(seen, flags, requests, request_faults, arrivals, batch, scanners, writers, tidx,
                 late_scan: cutlass.Constexpr, word: cutlass.Constexpr = ONE_WRITER):
    """A planning CTA's look at the scan before its lists (thread 0 read ``seen``, :func:`arrivals_seen`): where every
    scan CTA has arrived it takes their marks, and (launches with several writers) counts itself at once. Returns
    ``late`` (1: its lists go out unaware of the scan) and an early writer's count before it (on EARLY_LANE).
    ``late_scan``: a test build's late way; ``word``: the build's :class:`ArrivalWord`."""
    several = word.several
    if tidx == 0:
        if cutlass.const_expr(late_scan):
            seen = Int32(0)
        if cutlass.const_expr(several):
            # the scan CTAs counted are the count less the writers counted; kept with the faulted count as a
            # one-writer word holds them
            seen = (((seen >> 8) & 0xFF) << 16) | ((seen & 0xFF) - ((seen >> 16) & 0xF))
        if (seen & ARRIVAL_COUNT_MASK) == scanners and (seen >> 16) != 0:
            cute.arch.fence_acq_rel_gpu()  # every scan CTA's marks, visible to the CTA after the barrier
        flags[0] = seen
    cute.arch.sync_threads()
    seen = flags[0]
    late = Int32(1)
    before = Int32(0)
    if (seen & ARRIVAL_COUNT_MASK) == scanners:
        late = Int32(0)
        if (seen >> 16) != 0:
            if cutlass.const_expr(several):  # with several writers the last to arrive clears the marks
                take_scan_faults(requests, request_faults, batch, tidx, writers == 1)
            else:
                take_scan_faults(requests, request_faults, batch, tidx)
        if cutlass.const_expr(several):
            if writers > 1:  # the marks are read: count this writer now, its atomic beside the lists
                before = writer_arrives_early(arrivals, tidx, word)
    return late, before


@cute.jit
def take_scan_faults(requests, request_faults, batch, tidx, clear=True):
    """The fast way with a flagged scan: each request's scan mark joins its rule faults (``requests[:, 3]``), so its
    items are built with no keys, and (``clear``: one row writer) the mark is cleared; with several writers the last
    CTA to arrive clears them. The caller has fenced after seeing the arrivals."""
    for b in range(tidx, batch, NUM_THREADS):
        mark = request_faults[b]
        if mark != 0:
            requests[b, 3] = requests[b, 3] | mark
            if clear:
                request_faults[b] = Int32(0)
    cute.arch.fence_acq_rel_cta()
    cute.arch.sync_threads()

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

A page-faulted request is therefore costed on the line with its keys (the rules' faults still take them away before
the cuts); only its items lose them. The attention kernels write 0 / lse ``-inf`` for an item with no keys, split or
not (the merges fold all-``-inf`` partials to the same), and read none of its pages.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ...plan import ItemField
from .planner_collectives import NUM_THREADS, block_any, last_at_most

SCAN_IDS_PER_THREAD = 8  # page scan: CTAs = ceil(len(kv_indices) / (NUM_THREADS * this)), capped
MAX_SCAN_CTAS = 131  # with the planning CTA, one CTA an SM of the H200's 132 (the grid is resident at once)
L2_LINE_INT32 = 32  # the index arrays are prefetched to L2 a 128-byte line at a time
ARRIVAL_COUNT_MASK = 0xFFFF  # arrivals: CTAs counted in the low bits ...
FAULTED_SCANNER = 1 << 16  # ... and scan CTAs that marked a fault above them
FAULT_PAGE_ID = 8  # device_planner's fault bit for a page id outside the pool


def scan_ctas(num_indices: int) -> int:
    """Scan CTAs for ``num_indices`` kv_indices entries (the grid is these plus the planning CTA)."""
    return max(1, min(MAX_SCAN_CTAS, -(-num_indices // (NUM_THREADS * SCAN_IDS_PER_THREAD))))


@cute.jit
def record_fault(error_word: cute.Tensor, bits, request):
    cute.arch.atomic_or((error_word.iterator + 0).llvm_ptr, Int32(bits))
    cute.arch.atomic_min((error_word.iterator + 1).llvm_ptr, Int32(request))


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
        for k in cutlass.range_constexpr(SCAN_IDS_PER_THREAD):
            p = base + k * NUM_THREADS + tidx
            ids[k] = Int32(0)
            if p < num_indices:
                ids[k] = kv_indices[p]
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
                    num_pages, batch, scanner, scanners, tidx, delay_ns: cutlass.Constexpr = 0):
    """A scan CTA's whole work: its share of the scan, its arrival, and, when it arrives after the planning CTA
    took the late way and every other scan CTA, the faulted requests' items emptied. ``delay_ns``: a test build's
    wait before the arrival (``DevicePlannerConfig.scan_delay_ns``)."""
    found = page_scan(kv_indptr, kv_indices, request_faults, error_word, num_pages, batch, scanner, scanners, tidx)
    faulted = block_any(found != 0, tidx, flags)
    if cutlass.const_expr(delay_ns > 0):
        start = cute.arch.globaltimer()
        while cute.arch.globaltimer() - start < delay_ns:
            pass
    arrive_and_empty_if_last(items, work_indptr, request_faults, arrivals, flags, batch, scanners, faulted, tidx)


@cute.jit
def planner_arrives(items, work_indptr, request_faults, arrivals, flags, batch, scanners, late, tidx):
    """The planning CTA's end: on the fast way it clears ``arrivals`` (every scan CTA has counted itself); on the
    late way it counts itself and, if last, empties the faulted requests' items."""
    if late == 0:
        if tidx == 0:
            arrivals[0] = Int32(0)
    else:
        if tidx == 0:
            # the lists' bulk copies (async proxy) have completed: order them before the release below
            cute.arch.fence_proxy("async.global")
        arrive_and_empty_if_last(items, work_indptr, request_faults, arrivals, flags, batch, scanners, Int32(0), tidx)


@cute.jit
def arrive_and_empty_if_last(items, work_indptr, request_faults, arrivals, flags, batch, scanners, faulted, tidx):
    """Count this CTA in ``arrivals`` (with FAULTED_SCANNER when ``faulted``: a scan CTA that marked a fault); the
    CTA that finds ``scanners`` counted before it is the last on the late way and empties the faulted items."""
    before = arrive(arrivals, flags, tidx, Int32(1) + faulted * FAULTED_SCANNER)
    if (before & ARRIVAL_COUNT_MASK) == scanners:
        cute.arch.fence_acq_rel_gpu()
        empty_faulted_items(items, work_indptr, request_faults, arrivals, batch, faulted + (before >> 16), tidx)


@cute.jit
def empty_faulted_items(items, work_indptr, request_faults, arrivals, batch, faulted, tidx):
    """The last CTA to arrive on the late way: every item of a marked request gets no keys (``KV_END = KV_START``),
    then the marks and ``arrivals`` are cleared for the next launch (and every CUDA-graph replay)."""
    if faulted != 0:
        num_items = work_indptr[work_indptr.shape[0] - 1]
        for i in range(tidx, num_items, NUM_THREADS):
            if request_faults[items[i, ItemField.REQUEST]] != 0:
                items[i, ItemField.KV_END] = items[i, ItemField.KV_START]
        cute.arch.sync_threads()  # every item has read its request's mark before the marks are cleared
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
def take_scan_faults(requests, request_faults, batch, tidx):
    """The fast way with a flagged scan: each request's scan mark joins its rule faults (``requests[:, 3]``), so its
    items are built with no keys, and the mark is cleared. The caller has fenced after seeing the arrivals."""
    for b in range(tidx, batch, NUM_THREADS):
        mark = request_faults[b]
        if mark != 0:
            requests[b, 3] = requests[b, 3] | mark
            request_faults[b] = Int32(0)
    cute.arch.fence_acq_rel_cta()
    cute.arch.sync_threads()

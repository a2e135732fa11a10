"""CTA-wide collectives of the device planner's 512-thread CTA (block prefix sum, max, any; a binary search).

Every thread of the CTA calls each of them (they hold barriers); ``warp_sums``/``flags`` are shared-memory
scratch the caller owns.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

WARP = 32
INT32_MAX = 2**31 - 1
NUM_THREADS = 512
NUM_WARPS = NUM_THREADS // WARP
assert NUM_WARPS & (NUM_WARPS - 1) == 0 and NUM_WARPS <= WARP  # block_max_pair: one warp reduces the warp maxima


@cute.jit
def warp_inclusive_sum(value, lane):
    """Inclusive prefix of ``value`` over a warp's lanes (every lane of the warp calls it)."""
    inclusive = value
    for i in cutlass.range_constexpr(WARP.bit_length() - 1):
        neighbour = cute.arch.shuffle_sync_up(inclusive, 1 << i)
        if lane >= (1 << i):
            inclusive = inclusive + neighbour
    return inclusive


@cute.jit
def block_exclusive_sum(value, tidx, warp_sums: cute.Tensor, num_warps: cutlass.Constexpr = NUM_WARPS):
    """(exclusive prefix of ``value`` over the CTA's threads, the CTA's total); ``warp_sums`` [num_warps] (the
    planner's CTA: ``NUM_WARPS``; a decode kernel's prologue, ``kernels/common/line_schedule.py``: its own)."""
    lane = tidx % WARP
    warp = tidx // WARP
    inclusive = warp_inclusive_sum(value, lane)
    if lane == WARP - 1:
        warp_sums[warp] = inclusive
    cute.arch.sync_threads()
    before = value - value
    total = value - value
    for w in cutlass.range_constexpr(num_warps):
        s = warp_sums[w]
        total = total + s
        if w < warp:
            before = before + s
    cute.arch.sync_threads()  # warp_sums is free again
    return before + inclusive - value, total


@cute.jit
def block_max(value, tidx, warp_sums: cute.Tensor):
    """The largest ``value`` (Int64) over the CTA's threads (every thread gets it); ``warp_sums`` [NUM_WARPS]."""
    return block_max_pair(value, value, tidx, warp_sums)[0]


@cute.jit
def block_max_pair(a, b, tidx, warp_sums: cute.Tensor):
    """The largest ``a`` and the largest ``b`` (Int64) over the CTA's threads, through one barrier round: a warp
    butterfly, then every warp reads the NUM_WARPS warp maxima a lane each and reduces them again; ``warp_sums``
    [2 * NUM_WARPS]."""
    for i in cutlass.range_constexpr(5):
        a = cutlass.max(a, cute.arch.shuffle_sync_bfly(a, 1 << i))
        b = cutlass.max(b, cute.arch.shuffle_sync_bfly(b, 1 << i))
    lane = tidx % WARP
    if lane == 0:
        warp_sums[tidx // WARP] = a
        warp_sums[NUM_WARPS + tidx // WARP] = b
    cute.arch.sync_threads()
    a = warp_sums[lane % NUM_WARPS]
    b = warp_sums[NUM_WARPS + lane % NUM_WARPS]
    for i in cutlass.range_constexpr(NUM_WARPS.bit_length() - 1):
        a = cutlass.max(a, cute.arch.shuffle_sync_bfly(a, 1 << i))
        b = cutlass.max(b, cute.arch.shuffle_sync_bfly(b, 1 << i))
    cute.arch.sync_threads()  # warp_sums is free again
    return a, b


@cute.jit
def block_any(predicate, tidx, flags: cute.Tensor) -> Int32:
    """1 when ``predicate`` holds on any thread of the CTA, else 0 (every thread gets it); ``flags[1 : 1 +
    NUM_WARPS]`` carries one vote per warp across the barrier."""
    lane_any = cute.arch.vote_any_sync(predicate)
    if tidx % WARP == 0:
        flags[1 + tidx // WARP] = Int32(1) if lane_any else Int32(0)
    cute.arch.sync_threads()
    any_set = Int32(0)
    for w in cutlass.range_constexpr(NUM_WARPS):
        any_set = any_set | flags[1 + w]
    return any_set


@cute.jit
def block_any_pair(first, second, tidx, flags: cute.Tensor) -> Int32:
    """:func:`block_any` of two predicates through one barrier: bit 0 for ``first``, bit 1 for ``second``."""
    first_any = cute.arch.vote_any_sync(first)
    second_any = cute.arch.vote_any_sync(second)
    if tidx % WARP == 0:
        flags[1 + tidx // WARP] = (Int32(1) if first_any else Int32(0)) | (Int32(2) if second_any else Int32(0))
    cute.arch.sync_threads()
    any_set = Int32(0)
    for w in cutlass.range_constexpr(NUM_WARPS):
        any_set = any_set | flags[1 + w]
    return any_set


@cute.jit
def div_nonneg(a, b):
    """``a // b`` for Int64 ``a >= 0``, ``b > 0``: a 32-bit division when both fit (the common case; ptxas expands a
    64-bit division into a much longer sequence). The cuts chain three; the phase measured within noise with it
    (2.50 k -> 2.57 k cycles at prefill 8 x 992), so the division was not what that phase waits on."""
    quotient = Int64(0)
    if a <= Int64(INT32_MAX) and b <= Int64(INT32_MAX):
        quotient = Int64(Int32(a) // Int32(b))
    else:
        quotient = a // b
    return quotient


@cute.jit
def last_at_most(sorted_values: cute.Tensor, count, key, column: cutlass.Constexpr = None):
    """The largest ``i`` in ``[0, count)`` with ``sorted_values[i] <= key`` (0 if none): a binary search
    (of column ``column`` of a 2-D tensor when given)."""
    lo = Int32(0)
    hi = Int32(count - 1)
    # a data-dependent loop: log2(count) steps, not SEARCH_STEPS predicated ones (a batch of 1 costs nothing)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        value = sorted_values[mid] if cutlass.const_expr(column is None) else sorted_values[mid, column]
        if value <= key:
            lo = mid
        else:
            hi = mid - 1
    return lo

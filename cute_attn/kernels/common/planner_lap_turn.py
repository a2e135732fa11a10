"""The device planner's lap turns (``PlanConfig.lap_turn``; ``plan_partition.turned_deal`` is the twin).

The sorted deal hands lap ``k``'s position ``k * m + r`` to CTA ``(r + shift_k) mod m``: after each lap the CTAs that
drew its longest cost go to the back of the order, where the serpentine reverses the whole order. A lap's leading
run (its positions at its first cost) is one binary search of the sorted costs, a thread a lap; the shifts are their
exclusive prefix sum (one block scan), kept as one Int32 a lap. Each CTA then sums its loads under both deals, and the
turned one is taken only where its busiest CTA is strictly below the serpentine's (a uniform vote, kept in shared
memory for the lists phase). All of it is parallel: no lap waits on the one before (a lap-by-lap rank of the loads,
the lap deal itself, measured 20-23 k cycles at GQA prefill 4 and 16 x 992 on the H200, session 27).

Shared memory: past the sort's keys in ``sort_keys``, :func:`turn_slots` Int64 entries: ``LAP_TURN_MAX_LAPS`` shifts
and the vote. Deals of more laps keep the serpentine.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan_partition import LAP_TURN_MAX_LAPS
from .planner_collectives import NUM_THREADS, block_exclusive_sum, block_max_pair

assert LAP_TURN_MAX_LAPS == NUM_THREADS  # one scan pass: a thread a lap
_WORDS = LAP_TURN_MAX_LAPS + 2  # Int32: each lap's shift, then the vote (1: turned) and padding


def turn_slots(c) -> int:
    """Int64 entries the lap turns take past the sort's keys (0 unless ``c.lap_turn``)."""
    return _WORDS // 2 if c.lap_turn else 0


@cute.jit
def turn_table(base: cutlass.Constexpr, sort_keys: cute.Tensor):
    """The shifts (``[0, LAP_TURN_MAX_LAPS)``) and the vote (``[LAP_TURN_MAX_LAPS]``) past ``base`` in ``sort_keys``."""
    return cute.make_tensor(cute.recast_ptr(sort_keys.iterator + base, dtype=Int32), cute.make_layout(_WORDS))


@cute.jit
def _position_cost(sort_keys: cute.Tensor, heads: cutlass.Constexpr, position):
    """The cost of dealt position ``position`` (its q tile's ``sorted_deal.sort_key``)."""
    return Int64(1 << 32) - (sort_keys[position // heads] >> 20)


@cute.jit
def turned_deal_loads(base: cutlass.Constexpr, heads: cutlass.Constexpr, tidx, sort_keys: cute.Tensor,
                      warp_sums: cute.Tensor, num_tiles, num_ctas):
    """(the deal's busiest CTA, the item count of this thread's CTA in it) of the turned deal where it beats the
    serpentine, else of the serpentine; the shifts and the vote into the table past ``base``. Every thread calls it
    (barriers); ``num_tiles`` positions in at most LAP_TURN_MAX_LAPS laps of ``num_ctas``."""
    table = turn_table(base, sort_keys)
    m = num_ctas
    laps = (num_tiles + m - 1) // m
    few = Int32(0)  # uniform: a deal of at most LAP_TURN_MAX_LAPS laps may turn; more keep the serpentine
    if laps <= LAP_TURN_MAX_LAPS:
        few = Int32(1)
    leading = Int64(0)  # this thread's lap: its positions at its first cost, mod m
    if tidx < laps:
        first = tidx * m
        lead = _position_cost(sort_keys, heads, first)
        lo = first + 1
        hi = cutlass.min(first + m, num_tiles)
        while lo < hi:  # the first position of a lower cost (costs fall along the positions)
            mid = (lo + hi) // 2
            if _position_cost(sort_keys, heads, mid) < lead:
                hi = mid
            else:
                lo = mid + 1
        leading = Int64((lo - first) % m)
    before, _ = block_exclusive_sum(leading, tidx, warp_sums)
    if tidx < laps:
        table[tidx] = Int32(before % Int64(m))
    cute.arch.sync_threads()
    serpentine_load = Int64(0)
    turned_load = Int64(0)
    serpentine_count = Int32(0)
    turned_count = Int32(0)
    if tidx < m:
        for lap in range(laps):
            position = lap * m + tidx
            if lap % 2 != 0:
                position = lap * m + m - 1 - tidx
            if position < num_tiles:
                serpentine_load = serpentine_load + _position_cost(sort_keys, heads, position)
                serpentine_count = serpentine_count + 1
            if few != 0:
                position = lap * m + (tidx - table[lap] + m) % m
                if position < num_tiles:
                    turned_load = turned_load + _position_cost(sort_keys, heads, position)
                    turned_count = turned_count + 1
    serpentine_max, turned_max = block_max_pair(serpentine_load, turned_load, tidx, warp_sums)
    busiest = serpentine_max
    count = serpentine_count
    turned = Int32(0)
    if few != 0:
        if turned_max < serpentine_max:
            busiest = turned_max
            count = turned_count
            turned = Int32(1)
    if tidx == 0:
        table[LAP_TURN_MAX_LAPS] = turned
    cute.arch.sync_threads()
    return busiest, count


@cute.jit
def turned_position(base: cutlass.Constexpr, sort_keys: cute.Tensor, lap, cta, num_ctas, position):
    """CTA ``cta``'s position on lap ``lap``: the turned deal's where :func:`turned_deal_loads` voted for it, else
    ``position`` (the serpentine's)."""
    table = turn_table(base, sort_keys)
    if table[LAP_TURN_MAX_LAPS] != 0:
        position = lap * num_ctas + (cta - table[lap] + num_ctas) % num_ctas
    return position

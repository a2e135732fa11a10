"""The device planner's sorted deal (``plan_partition``'s twin): q tiles longest first, dealt serpentine.

Run by the planning CTA after its cuts, when they split tiles: each CTA's cut load and the longest tile (block
maxima); only when the deal can win, a bitonic sort of the q tiles' (cost, index) keys in shared memory, one
compare-exchange a thread a stage (``log2(n) (log2(n) + 1) / 2`` barriers: 45 at 500 q tiles), then each CTA's
serpentine load over its laps. ``c`` is the :class:`DevicePlannerConfig` (a compile-time constant).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan_partition import SORTED_DEAL_MAX_Q_TILES, WHOLE_TILE_SHIFT
from .planner_collectives import NUM_THREADS, block_max

INT32_MAX = 2**31 - 1


@cute.jit
def tile_cost(c: cutlass.Constexpr, kv_end):
    """``piece_cost`` of a whole tile of ``kv_end`` keys, Int64."""
    return Int64((kv_end + c.kv_tile - 1) // c.kv_tile * c.kv_tile + c.item_overhead_keys)


@cute.jit
def cut_position(c: cutlass.Constexpr, edge, q_tiles, q_tile_start, cut_tile, cut_key, num_tiles, total_cost):
    """The line position of edge ``edge``'s cut: ``start(t) + k + overhead`` inside tile ``t`` at key ``k``
    (``plan_partition.cut_loads``)."""
    t = cut_tile[edge]
    k = cut_key[edge]
    position = total_cost
    if t < num_tiles:
        j = t // c.num_kv_heads
        position = q_tile_start[j] + Int64(t % c.num_kv_heads) * tile_cost(c, q_tiles[j, 3])
        if k > 0:
            position = position + Int64(k + c.item_overhead_keys)
    return position


@cute.jit
def sorted_deal(c: cutlass.Constexpr, tidx, split, q_tiles, q_tile_start, cut_tile, cut_key, sort_keys, warp_sums,
                num_q_tiles, num_ctas, width, total_cost):
    """(1 when the deal replaces the cuts, the item count of this thread's CTA in the deal). Leaves the q tiles
    in deal order in ``sort_keys`` (low 32 bits: the q tile; high: INT32_MAX - its cost)."""
    heads = c.num_kv_heads
    num_tiles = num_q_tiles * heads
    cut_load = Int64(0)
    if tidx < num_ctas:
        cut_load = (cut_position(c, tidx + 1, q_tiles, q_tile_start, cut_tile, cut_key, num_tiles, total_cost)
                    - cut_position(c, tidx, q_tiles, q_tile_start, cut_tile, cut_key, num_tiles, total_cost))
        if cut_key[tidx] > 0:
            cut_load = cut_load + Int64(c.item_overhead_keys)
    longest = Int64(0)
    for j in range(tidx, num_q_tiles, NUM_THREADS):
        longest = cutlass.max(longest, tile_cost(c, q_tiles[j, 3]))
    bound = cutlass.max(block_max(cut_load, tidx, warp_sums), width + (width >> WHOLE_TILE_SHIFT))
    longest = block_max(longest, tidx, warp_sums)
    deal = Int32(0)
    count = Int32(0)
    # the deal's busiest CTA holds the longest tile: past the bound it cannot win, so skip the sort
    if split != 0 and num_q_tiles <= SORTED_DEAL_MAX_Q_TILES and longest <= bound:
        size = Int32(1)
        while size < num_q_tiles:
            size = size * 2
        for i in range(tidx, size, NUM_THREADS):
            key = Int64(0x7FFFFFFFFFFFFFFF)  # padding sorts last
            if i < num_q_tiles:
                key = ((Int64(INT32_MAX) - tile_cost(c, q_tiles[i, 3])) << 32) | Int64(i)
            sort_keys[i] = key
        cute.arch.sync_threads()
        # bitonic sort, ascending keys = longest first, ties in line order (the keys are distinct)
        block = Int32(2)
        while block <= size:
            stride = block // 2
            while stride > 0:
                for pair in range(tidx, size // 2, NUM_THREADS):
                    lo = pair // stride * (2 * stride) + pair % stride
                    a = sort_keys[lo]
                    b = sort_keys[lo + stride]
                    if (lo & block) == 0:
                        if a > b:
                            sort_keys[lo] = b
                            sort_keys[lo + stride] = a
                    else:
                        if a < b:
                            sort_keys[lo] = b
                            sort_keys[lo + stride] = a
                cute.arch.sync_threads()
                stride = stride // 2
            block = block * 2
        load = Int64(0)
        if tidx < num_ctas:
            lap = Int32(0)
            position = tidx
            while position < num_tiles:
                load = load + (Int64(INT32_MAX) - (sort_keys[position // heads] >> 32))
                count = count + 1
                lap = lap + 1
                position = lap * num_ctas + tidx
                if lap % 2 != 0:
                    position = lap * num_ctas + num_ctas - 1 - tidx
        if block_max(load, tidx, warp_sums) <= bound:
            deal = Int32(1)
    return deal, count


@cute.jit
def dealt_tile(c: cutlass.Constexpr, sort_keys: cute.Tensor, lap, cta, num_ctas):
    """The tile (q tile * heads + head) a deal gives CTA ``cta`` on lap ``lap``: position ``lap * m + cta``, or
    ``lap * m + m - 1 - cta`` on odd laps."""
    position = lap * num_ctas + cta
    if lap % 2 != 0:
        position = lap * num_ctas + num_ctas - 1 - cta
    heads = c.num_kv_heads
    return Int32(sort_keys[position // heads] & Int64(0xFFFFFFFF)) * heads + position % heads

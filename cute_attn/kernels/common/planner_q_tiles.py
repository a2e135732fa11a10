"""The device planner's q-tile phase (:meth:`device_planner.DevicePlanner.plan_tiles`): each q tile's request, rows
and causal key end, and its cost on the line, with the cost line's prefix sum into ``q_tile_start``; one tile a thread
a pass (the default) or two neighbours (``DevicePlannerConfig.q_tiles_per_pass``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .planner_collectives import NUM_THREADS, block_exclusive_sum, last_at_most
from .sorted_deal import tile_cost


@cute.jit
def q_tile_singles(c: cutlass.Constexpr, tidx, requests, q_tiles, q_tile_start, warp_sums, batch, num_q_tiles):
    """The q-tile phase with one tile a thread a pass (512 tiles a prefix sum). Returns (the cost line's length, this
    thread's longest tile: the deal's bound needs it, and a second pass over the q tiles in the cuts' vote cost
    ~0.4 k cycles, 1.30 k -> 0.93 k at prefill 8 x 992)."""
    heads = c.num_kv_heads
    line = Int64(0)
    longest = Int64(0)
    for base in range(0, num_q_tiles, NUM_THREADS):
        j = base + tidx
        cost = Int64(0)
        if j < num_q_tiles:
            b = last_at_most(requests, batch, j, 0)  # column 0: first q tile of each request
            cost = q_tile(c, j, b, requests, q_tiles)
            longest = cutlass.max(longest, cost)
        start, total = block_exclusive_sum(cost, tidx, warp_sums)
        if j < num_q_tiles:
            q_tile_start[j] = (line + start) * heads
        line = line + total
    return line, longest


@cute.jit
def q_tile_pairs(c: cutlass.Constexpr, tidx, requests, q_tiles, q_tile_start, warp_sums, batch, num_q_tiles):
    """The q-tile phase with two neighbouring tiles a thread a pass (``DevicePlannerConfig.q_tiles_per_pass`` 2):
    one request search serves both (another only where a request starts between them), one prefix sum covers
    1024 tiles. Returns (the cost line's length, this thread's longest tile). Measured (H200, session 17): prefill
    16 x 992 4.1 k -> 2.5 k cycles, 32 x 992 8.3 k -> 4.9 k, but decode 64 x 2048 1.9 k -> 3.0 k (one tile a
    request: every second tile searched again, after the first) and 8 x 992 +0.1 k (one pass either way)."""
    heads = c.num_kv_heads
    line = Int64(0)
    longest = Int64(0)
    costs = cute.make_rmem_tensor((2,), Int64)
    for base in range(0, num_q_tiles, NUM_THREADS * 2):
        first_j = base + 2 * tidx
        b = Int32(0)
        if first_j < num_q_tiles:
            b = last_at_most(requests, batch, first_j, 0)  # column 0: first q tile of each request
        for k in cutlass.range_constexpr(2):
            j = first_j + k
            costs[k] = Int64(0)
            if j < num_q_tiles:
                if cutlass.const_expr(k > 0):
                    if b + 1 < batch:
                        if requests[b + 1, 0] <= j:
                            b = last_at_most(requests, batch, j, 0)
                costs[k] = q_tile(c, j, b, requests, q_tiles)
                longest = cutlass.max(longest, costs[k])
        start, total = block_exclusive_sum(costs[0] + costs[1], tidx, warp_sums)
        if first_j < num_q_tiles:
            q_tile_start[first_j] = (line + start) * heads
        if first_j + 1 < num_q_tiles:
            q_tile_start[first_j + 1] = (line + start + costs[0]) * heads
        line = line + total
    return line, longest

@cute.jit
def q_tile(c: cutlass.Constexpr, j, b, requests, q_tiles):
    """Q tile ``j`` of request ``b`` into ``q_tiles`` (request, first packed row, rows, causal key end); its cost."""
    kv_len = requests[b, 1]
    q_len = requests[b, 2]
    local = j - requests[b, 0]  # the tile's position on the line within its request
    if cutlass.const_expr(c.zigzag and c.causal):  # plan_partition's order: tile p/2 or n-1-(p-1)/2
        half = local // 2
        n_tiles = (q_len * c.group_size + c.rows_per_tile - 1) // c.rows_per_tile
        local = half + (local - 2 * half) * (n_tiles - 1 - 2 * half)
    row_start = local * c.rows_per_tile
    row_count = cutlass.min(Int32(c.rows_per_tile), q_len * c.group_size - row_start)
    kv_end = kv_len
    if cutlass.const_expr(c.causal):
        kv_end = (row_start + row_count - 1) // c.group_size + 1 + kv_len - q_len
        kv_end = cutlass.min(cutlass.max(kv_end, Int32(0)), kv_len)
    if requests[b, 3] != 0:
        kv_end = Int32(0)
    q_tiles[j, 0] = b
    q_tiles[j, 1] = row_start
    q_tiles[j, 2] = row_count
    q_tiles[j, 3] = kv_end
    return tile_cost(c, kv_end)

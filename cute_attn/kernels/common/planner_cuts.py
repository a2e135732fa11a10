"""The device planner's cuts of its cost line (``plan_partition.line_cuts``' twin): one thread an edge of the
``num_ctas + 1`` edges, each at ``edge * W`` on the line, split inside a tile at a kv-tile multiple or snapped to the
nearer tile edge within the slack (or even pieces of equal one-tile requests); then one vote: whole tiles when no CTA
then exceeds the whole-tile bound (with a deal, the vote also reduces the busiest whole-tile CTA and the longest tile).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan_partition import SNAP_SHIFT
from .planner_collectives import block_any, block_max_pair, div_nonneg, last_at_most
from .sorted_deal import capped_slack, tile_cost, whole_tile_bound


@cute.jit
def cut_line(c: cutlass.Constexpr, deals: cutlass.Constexpr, min_width_keys: cutlass.Constexpr,
             stamp: cutlass.Constexpr, tidx, q_tiles, q_tile_start, cut_tile, cut_key, stage, warp_sums, flags, trace,
             num_q_tiles, num_ctas, total_cost, width, active, uniform, longest):
    """Writes ``cut_tile`` / ``cut_key`` for every edge; returns (split, snap_max, longest): whether the cuts split
    tiles, the busiest whole-tile CTA and the longest tile (both reduced only when ``deals``). ``stamp``: the
    planner's trace stamp (a development build's clock64 stamps)."""
    heads = c.num_kv_heads
    num_tiles = num_q_tiles * heads
    split = Int32(0)
    slack = width >> SNAP_SHIFT  # even pieces' bound; the cuts snap within ``snap`` (capped, plan_partition)
    snap = capped_slack(c, slack)
    # plan_partition.even_pieces: equal one-tile requests cut in even pieces, each tile at a CTA edge
    pieces = Int32(0)  # 0: the line's cuts
    piece = Int32(0)
    if cutlass.const_expr(c.even_pieces and c.allow_split):
        if uniform != 0 and num_tiles > 0:
            keys = q_tiles[0, 3]
            most = cutlass.min(num_ctas // num_tiles, (keys + min_width_keys - 1) // min_width_keys)
            if keys > 0 and most >= 2:
                piece = (keys + most - 1) // most
                piece = (piece + c.kv_tile - 1) // c.kv_tile * c.kv_tile
                if piece < keys and Int64(piece) <= width + slack:
                    pieces = (keys + piece - 1) // piece
    edge = tidx
    t_snap = Int32(num_tiles)  # the same edge at the nearer tile boundary (whole tiles, no merge)
    p_snap = total_cost
    if edge <= num_ctas:
        t_cut = Int32(num_tiles)
        k_cut = Int32(0)
        if edge == 0:
            t_cut = Int32(0)
            t_snap = Int32(0)
            p_snap = Int64(0)
        elif Int64(edge) < active:
            p = Int64(edge) * width
            j = last_at_most(q_tile_start, num_q_tiles, p)
            kv_end = q_tiles[j, 3]
            cost = tile_cost(c, kv_end)
            j_start = q_tile_start[j]
            h = div_nonneg(p - j_start, cost)
            o = p - j_start - h * cost
            t = Int32(j * heads + Int32(h))
            k = (o - c.item_overhead_keys + c.kv_tile // 2) // c.kv_tile * c.kv_tile
            k = cutlass.min(cutlass.max(k, Int64(0)), Int64(kv_end))
            nearer = Int32(0)
            if 2 * o >= cost:
                nearer = Int32(1)
            t_snap = t + nearer
            p_snap = j_start + (h + Int64(nearer)) * cost
            up = Int32(0)
            inside = Int32(0)
            if cutlass.const_expr(not c.allow_split):
                up = nearer
            else:
                if k == 0 or o <= snap:
                    up = Int32(0)
                elif k >= kv_end or cost - o <= snap:
                    up = Int32(1)
                else:
                    inside = Int32(1)
            t_cut = t + up
            if inside != 0:
                t_cut = t
                k_cut = Int32(k)
        if cutlass.const_expr(c.even_pieces and c.allow_split):
            if pieces != 0:
                t_cut = Int32(num_tiles)
                k_cut = Int32(0)
                if edge < num_tiles * pieces:
                    t_cut = edge // pieces
                    k_cut = edge % pieces * piece
        cut_tile[edge] = t_cut
        cut_key[edge] = k_cut
        if cutlass.const_expr(c.allow_split):
            stage[edge, 0] = Int32(p_snap & Int64(0xFFFFFFFF))  # the stage is free until the lists
            stage[edge, 1] = Int32(p_snap >> 32)
    cute.arch.sync_threads()
    stamp(trace, 15, tidx)
    snap_max = Int64(0)  # the sorted deal's: the busiest whole-tile CTA (and `longest`, reduced below)
    if cutlass.const_expr(c.allow_split):
        # Whole tiles when no CTA's load then exceeds W + W / 2**WHOLE_TILE_SHIFT: a plan without merges
        # runs faster than the model says a split one does (no fold, fewer item starts)
        snap_load = Int64(0)
        if edge < num_ctas:
            nxt = (Int64(stage[edge + 1, 1]) << 32) | (Int64(stage[edge + 1, 0]) & Int64(0xFFFFFFFF))
            here = (Int64(stage[edge, 1]) << 32) | (Int64(stage[edge, 0]) & Int64(0xFFFFFFFF))
            snap_load = nxt - here
        if cutlass.const_expr(deals):
            # the busiest whole-tile CTA and the longest tile in one barrier round: the deal's bound needs both,
            # and whole-tile cuts within W + W / 2**DEAL_WHOLE_SHIFT then skip it without another reduction
            snap_max, longest = block_max_pair(snap_load, longest, tidx, warp_sums)
            split = Int32(0)
            if snap_max > whole_tile_bound(c, width):
                split = Int32(1)
        else:
            split = block_any(snap_load > whole_tile_bound(c, width), tidx, flags)
        if cutlass.const_expr(c.even_pieces):
            if pieces != 0:
                split = Int32(1)  # even pieces split by design: no whole-tile replacement
        if split == 0 and edge <= num_ctas:
            cut_tile[edge] = t_snap
            cut_key[edge] = Int32(0)
        cute.arch.sync_threads()
    return split, snap_max, longest

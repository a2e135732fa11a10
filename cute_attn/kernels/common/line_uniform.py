"""A line build's stretch for a uniform batch, in closed form (``PagedAttentionConfig.uniform_line``).

When every request has the same keys and none faults (the common serving step, and every bench row but the ragged
ones), the line starts are ``b * heads * cost`` and edge ``e`` at ``p = e W`` lies in tile ``p // cost``: no prefix
sum, no line-start table and no edge search. Each thread makes its edges ``e`` and ``e + 1``; one block reduction of
three maxima (the snapped spread, the load under the cuts, an inside edge) takes the whole-tile vote, the line deal
and whether the cuts need merges; the CTA's stretch is its edges ``cta`` and ``cta + 1`` and, for even pieces, merge
``t`` of ``pieces`` slots from ``t * pieces`` per tile (the piece of CTA ``c`` is slot ``c``). Line cuts with an inside
edge (not dealt) return ``fast`` 0: their merge ids need the table's block scan, and the caller derives as for any
batch. The numpy twin is ``cute_attn/line_schedule.uniform_line`` / ``uniform_stretch``; the CPU tier checks them
against the table's stretch CTA by CTA.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan_partition import SNAP_SHIFT, WHOLE_TILE_SHIFT
from .planner_collectives import WARP

__all__ = ["line_edge", "uniform_stretch", "capped_slack", "cut_in_tile", "even_pieces", "whole_tile_bound",
           "dealt_count"]


@cute.jit
def capped_slack(rules: cutlass.Constexpr, slack):
    """``slack`` capped at ``rules.max_slack_keys`` where that is set (``plan_partition.capped_slack``)."""
    result = slack
    if cutlass.const_expr(rules.max_slack_keys > 0):
        result = cutlass.min(slack, Int64(rules.max_slack_keys))
    return result


@cute.jit
def even_pieces(keys, num_tiles, m, width, rules: cutlass.Constexpr):
    """Step 2: (pieces a tile, keys a piece) of ``num_tiles`` tiles of ``keys`` keys each, or (0, 0): the line's cuts
    (``plan_partition.even_pieces``)."""
    kv_tile = rules.kv_tile
    pieces = Int32(0)
    piece = Int32(0)
    wide = Int64(keys)  # the sums below pass 2^31 at requests of ~2^31 keys (the twin's int64)
    most = cutlass.min(m // num_tiles, Int32((wide + rules.min_width - 1) // rules.min_width))
    if most >= 2:
        piece = Int32(((wide + most - 1) // most + kv_tile - 1) // kv_tile * kv_tile)
        if piece < keys and Int64(piece) <= width + (width >> SNAP_SHIFT):
            pieces = Int32((wide + piece - 1) // piece)
    return pieces, piece


@cute.jit
def whole_tile_bound(width, rules: cutlass.Constexpr):
    """The busiest CTA whole-tile cuts may leave (``plan_partition.whole_tile_bound``)."""
    bound = width + (width >> WHOLE_TILE_SHIFT)
    if cutlass.const_expr(rules.max_slack_keys > 0):
        split_worst = 2 * capped_slack(rules, width >> SNAP_SHIFT) + rules.overhead
        bound = width + cutlass.max(capped_slack(rules, width >> WHOLE_TILE_SHIFT), split_worst)
    return bound


@cute.jit
def dealt_count(num_tiles, m, cta):
    """Items of CTA ``cta`` under the line deal: whole tiles lap by lap, tile ``lap * m + cta`` on even laps and
    ``lap * m + m - 1 - cta`` on odd ones (``line_schedule.dealt_tiles``)."""
    laps = (num_tiles + m - 1) // m
    count = laps
    if laps > 0:
        final_tile = (laps - 1) * m + cta
        if (laps - 1) % 2 == 1:
            final_tile = (laps - 1) * m + m - 1 - cta
        if final_tile >= num_tiles:
            count = laps - 1
    return count


@cute.jit
def cut_in_tile(t, h, start, o, cost, keys, width, rules: cutlass.Constexpr):
    """Step 3's cut of an edge ``o`` into tile ``t`` (the ``h``-th of a run of tiles of ``cost`` from line position
    ``start``; ``keys`` keys): (cut tile, cut key, snap tile, snap position), as ``line_schedule._cut_in_tile``."""
    kv_tile = rules.kv_tile
    cut_key = Int32(0)
    k = cutlass.max(o - rules.overhead + kv_tile // 2, Int64(0)) // kv_tile * kv_tile
    k = cutlass.min(k, Int64(keys))
    nearer = Int32(1) if 2 * o >= cost else Int32(0)
    snap_tile = t + nearer
    snap_pos = start + (h + nearer) * cost
    cut_tile = snap_tile
    if cutlass.const_expr(rules.allow_split):
        slack = capped_slack(rules, width >> SNAP_SHIFT)
        cut_tile = t
        if k > 0 and o > slack:
            if k >= keys or cost - o <= slack:
                cut_tile = t + 1
            else:
                cut_key = Int32(k)
    return cut_tile, cut_key, snap_tile, snap_pos


@cute.jit
def line_edge(e, width, pieces, piece, num_tiles, total, edge_on_line):
    """Step 3 of both derivations: (cut tile, cut key, snap tile, snap position) of edge ``e``. Off the line here:
    even ``pieces`` of ``piece`` keys (edge ``e`` at key ``e % pieces * piece`` of tile ``e // pieces``), the line's
    start, or past its end (``total``); on it, ``edge_on_line(p)`` at line position ``p = e * width`` cuts the tile
    there (the table's search or the uniform closed form, each ending in :func:`cut_in_tile`)."""
    cut_tile = Int32(num_tiles)
    cut_key = Int32(0)
    snap_tile = Int32(num_tiles)
    snap_pos = total
    p = Int64(e) * width
    if pieces > 0:
        if e < num_tiles * pieces:
            cut_tile = e // pieces
            cut_key = e % pieces * piece
    elif e == 0:
        cut_tile = Int32(0)
        snap_tile = Int32(0)
        snap_pos = Int64(0)
    elif p < total:
        cut_tile, cut_key, snap_tile, snap_pos = edge_on_line(p)
    return cut_tile, cut_key, snap_tile, snap_pos


@cute.jit
def uniform_edge(e, keys, cost, width, pieces, piece, num_tiles, total, rules: cutlass.Constexpr):
    """(cut tile, cut key, snap tile, snap position) of edge ``e`` (``line_schedule.uniform_edge``): on the line, the
    tile ``p // cost`` of equal tiles."""
    def on_line(p):
        tile = p // cost
        return cut_in_tile(Int32(tile), tile, Int64(0), p - tile * cost, cost, keys, width, rules)

    return line_edge(e, width, pieces, piece, num_tiles, total, on_line)


@cute.jit
def _position(tile, key, cost, num_tiles, total, overhead: cutlass.Constexpr):
    """Where an edge at ``(tile, key)`` sits on the line (``line_schedule._position``)."""
    position = total
    if tile < num_tiles:
        position = Int64(tile) * cost
        if key > 0:
            position = position + key + overhead
    return position


@cute.jit
def _block_max3(a, b, flag, tidx, words_a: cute.Tensor, words_b: cute.Tensor, words_flag: cute.Tensor,
                num_warps: cutlass.Constexpr):
    """(max ``a``, max ``b``, max ``flag``) over the CTA (Int64, Int64, Int32; every thread calls it), one round."""
    for i in cutlass.range_constexpr(5):
        a = cutlass.max(a, cute.arch.shuffle_sync_bfly(a, 1 << i))
        b = cutlass.max(b, cute.arch.shuffle_sync_bfly(b, 1 << i))
        flag = cutlass.max(flag, cute.arch.shuffle_sync_bfly(flag, 1 << i))
    if tidx % WARP == 0:
        words_a[tidx // WARP] = a
        words_b[tidx // WARP] = b
        words_flag[tidx // WARP] = flag
    cute.arch.sync_threads()
    for w in cutlass.range_constexpr(num_warps):
        a = cutlass.max(a, words_a[w])
        b = cutlass.max(b, words_b[w])
        flag = cutlass.max(flag, words_flag[w])
    cute.arch.sync_threads()  # the words are free again
    return a, b, flag


@cute.jit
def uniform_stretch(keys, batch, m, cta, tidx, t_words64: cute.Tensor, t_words32: cute.Tensor, t_snap_pos: cute.Tensor,
                    t_cut_tile: cute.Tensor, t_cut_key: cute.Tensor, t_snap_tile: cute.Tensor,
                    num_warps: cutlass.Constexpr, rules: cutlass.Constexpr):
    """Steps 2-6 of ``batch`` requests of ``keys`` > 0 keys each (every thread of the CTA calls it): (fast, count,
    first tile, first key, end tile, end key, merge0, slot0, begin0, slots0, merge1, begin1, slots1, dealt); fast 0:
    the batch needs the table (the rest is then unset). ``t_*``: the line table's arrays (``LineTable``), its
    reduction words and its edge arrays (``t_snap_pos``: a second row of Int64 words here)."""
    heads, kv_tile = rules.heads, rules.kv_tile
    cost = Int64((keys + kv_tile - 1) // kv_tile * kv_tile) + rules.overhead
    num_tiles = batch * heads
    total = Int64(num_tiles) * cost
    width = cutlass.max((total + m - 1) // m, Int64(rules.min_width))
    pieces = Int32(0)
    piece = Int32(0)
    if cutlass.const_expr(rules.even_pieces):
        pieces, piece = even_pieces(keys, num_tiles, m, width, rules)
    # ---- steps 3-5b: this thread's edges e and e + 1, one reduction of (spread, load under the cuts, inside)
    e = tidx
    spread = Int64(0)
    load = Int64(0)
    inside = Int32(0)
    if e <= m:
        tile0, key0, snap_tile0, snap0 = uniform_edge(e, keys, cost, width, pieces, piece, num_tiles, total, rules)
        t_cut_tile[e] = tile0
        t_cut_key[e] = key0
        t_snap_tile[e] = snap_tile0
        if key0 > 0:
            inside = Int32(1)
        if e < m:
            tile1, key1, _, snap1 = uniform_edge(e + 1, keys, cost, width, pieces, piece, num_tiles, total, rules)
            if pieces == 0:
                spread = snap1 - snap0
            load = (_position(tile1, key1, cost, num_tiles, total, rules.overhead)
                    - _position(tile0, key0, cost, num_tiles, total, rules.overhead))
            if key0 > 0:
                load = load + rules.overhead
    spread, load, inside = _block_max3(spread, load, inside, tidx, t_words64, t_snap_pos, t_words32, num_warps)
    whole_tiles = Int32(0)
    whole_bound = whole_tile_bound(width, rules)
    if cutlass.const_expr(rules.allow_split):
        if pieces == 0 and spread <= whole_bound:
            whole_tiles = Int32(1)
            load = spread  # whole-tile cuts: a CTA's load is its snapped spread
            inside = Int32(0)
    dealt = Int32(0)
    if cutlass.const_expr(rules.line_deal and rules.allow_split):
        if batch <= rules.deal_max_q_tiles:
            deal_bound = load
            if whole_tiles == 0:
                deal_bound = cutlass.max(load, whole_bound)
            if Int64((num_tiles + m - 1) // m) * cost <= deal_bound:  # the serpentine's busiest CTA: every lap
                dealt = Int32(1)
    fast = Int32(1)
    if dealt == 0 and pieces == 0 and inside != 0:
        fast = Int32(0)
    # ---- step 6: the CTA's stretch (edges written before the reduction's barriers)
    first_tile = t_cut_tile[cta]
    first_key = t_cut_key[cta]
    end_tile = t_cut_tile[cta + 1]
    end_key = t_cut_key[cta + 1]
    if whole_tiles != 0:
        first_tile = t_snap_tile[cta]
        first_key = Int32(0)
        end_tile = t_snap_tile[cta + 1]
        end_key = Int32(0)
    last = end_tile - 1
    if end_key > 0:
        last = end_tile
    count = cutlass.max(last - first_tile + 1, 0)
    merge0, slot0, begin0, slots0 = Int32(-1), Int32(-1), Int32(0), Int32(0)
    merge1, begin1, slots1 = Int32(-1), Int32(0), Int32(0)
    if dealt != 0:
        count = dealt_count(num_tiles, m, cta)
    elif pieces > 0:  # even pieces: merge t has `pieces` slots from t * pieces; CTA c's piece is slot c
        if first_key > 0 or (count == 1 and end_key > 0):
            merge0 = cta // pieces
            if first_key == 0:
                merge0 = (cta + 1) // pieces
            slot0 = cta
            begin0 = merge0 * pieces
            slots0 = pieces
        if count >= 2 and end_key > 0:
            merge1 = (cta + 1) // pieces
            begin1 = merge1 * pieces
            slots1 = pieces
    return (fast, count, first_tile, first_key, end_tile, end_key, merge0, slot0, begin0, slots0, merge1, begin1,
            slots1, dealt)

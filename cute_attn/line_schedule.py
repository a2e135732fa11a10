"""Planner-free split-KV decode: every CTA derives its own stretch of the device planner's cost line (numpy twin).

A decode call with new index tensors pays the device planner (6.3-7.4 µs of GPU span on the H200, 11.7 at MLA
64 x 8192) before its attention kernel can read a work item. The planner's cuts need no sequential step
(:mod:`cute_attn.plan_partition`: prefix sums and binary searches), so each attention CTA can make them itself from
``kv_indptr`` and ``kv_last_page_len`` at its start, keep only its own stretch, and build its items as it goes: no
planner launch, no plan buffers, the same balance as the device plan (it *is* the device plan, where the plan takes
no deal). This module is the kernel's numpy twin (``kernels/common/line_schedule.py``), written step by step as the
kernel's threads take them, and the CPU tier checks it against :func:`plan_partition.partition_plan` CTA by CTA.

Steps (all threads of every CTA)

1. *requests*: request ``b``'s keys ``kv_end[b]`` (0 when its own rules fault: :func:`request_keys`) and cost
   ``piece_cost(kv_end[b])``; an exclusive prefix of ``heads * cost`` gives its line start ``line_start[b]`` (its
   tiles are its KV heads, ``cost`` apart), the total ``C``, the width ``W`` (:func:`plan_partition.line_width`).
2. *even pieces*: when every request has the same keys and no fault (the uniform decode batch) and
   :func:`plan_partition.even_pieces` cuts it, edge ``e`` is ``(e // pieces, e % pieces * piece)`` in closed form.
3. *edges* (one thread an edge, ``e = 0 .. num_ctas``): otherwise edge ``e`` sits at ``p = e W`` (past ``C``: the
   line's end); a binary search of ``line_start`` finds its request, then its tile, offset, split key and snap as
   :func:`plan_partition.line_cuts` does; the thread also keeps the nearer tile edge (``snap``).
4. *whole-tile vote*: when no CTA between snapped edges exceeds :func:`plan_partition.whole_tile_bound`, every edge
   takes its snap (a block max).
5. *merges*: edge ``e`` is *inside* when its key is > 0; a run of inside edges in one tile is one merge. A block
   exclusive sum of (inside, run start) gives each inside edge its merge ``g`` and ``inside_before[e]``; a run's
   first edge writes ``merge_indptr[g] = inside_before[e] + g`` (its first partial slot) and the merge's tile.
5b. *line deal* (``line_deal``: decode from 8 KV heads, pages 1-2): with at most ``deal_max_q_tiles`` requests, thread
   ``c`` sums its CTA's cut load (two edge positions) and its load under the serpentine deal of the tiles in line
   order (tile ``t`` to CTA ``t mod m`` on even laps ``t // m``, ``m - 1 - t mod m`` on odd ones: the CTA's laps in
   closed form); two block maxima, and the deal replaces the cuts when its busiest CTA is within
   :func:`plan_partition.deal_bound` (:func:`deal_choice`). A dealt CTA's item ``i`` is the whole tile of lap ``i``.
6. *items*: CTA ``c`` takes the tiles ``cut_tile[c] .. `` up to edge ``c + 1`` (:func:`cta_items`); its first item
   starts at ``cut_key[c]`` (a piece after an inside edge: merge ``merge_of[c]``, slot ``inside_before[c] +
   merge_of[c] + 1``) and its last ends at ``cut_key[c + 1]`` when that edge is inside (the first chunk of merge
   ``merge_of[c + 1]``, slot ``merge_indptr[merge_of[c + 1]]``): at most two split items a CTA, so a CTA's fold needs
   two merge descriptors, read from the edge table while it is in shared memory.

Applies to decode plans: one-q-tile requests, non-causal or one query token each (MLA decode: causal then masks
nothing), no sorted deal (its sort is the planner's: the MLA decode build cuts without it, :func:`cuts_only`) and no
deal before the cuts (:func:`line_reason`); the line deal is step 5b. A batch whose indptr breaks a rule has no items
(every row 0 / ``-inf``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .plan import NOT_CAUSAL_OFFSET, ItemField, PlanConfig
from .plan_partition import deal_bound, even_pieces, line_width, piece_cost, snap_slack, whole_tile_bound

__all__ = ["EdgeTable", "line_reason", "cuts_only", "request_keys", "edge_table", "deal_choice", "dealt_tiles",
           "cta_items", "cta_merge", "Stretch", "table_stretch", "UniformLine", "uniform_edge", "uniform_line",
           "uniform_stretch"]


def line_reason(config: PlanConfig, one_token: bool = False) -> str | None:
    """None when a CTA can derive ``config``'s device plan alone (no deal can replace the cuts), else why not.
    ``one_token``: every request is one query token (MLA decode), so a causal plan masks nothing: its item's
    ``CAUSAL_OFFSET`` is ``keys - 1`` and the cuts are a non-causal plan's."""
    if config.causal and not one_token:
        return "causal plans cut q tiles of unequal keys and may deal them sorted: the planner's sort is not per CTA"
    if config.sorted_deal or config.deal_first:
        return "a sorted deal may replace the cuts: its sort is the planner's, not a CTA's"
    if config.group_size > config.tile_q_rows:
        return f"group size {config.group_size} spans more than one {config.tile_q_rows}-row q tile"
    return None


def cuts_only(config: PlanConfig) -> PlanConfig:
    """``config`` without the sorted deal (and the deals made before or turned by it): the plan the MLA decode's line
    build derives. On the bench's MLA decode rows the device plan takes the cuts anyway (a request longer than a CTA's
    width cannot be dealt whole; equal requests take even pieces)."""
    import dataclasses

    return dataclasses.replace(config, sorted_deal=False, deal_first=False, lap_turn=False)


def request_keys(config: PlanConfig, kv_indptr, kv_last_page_len):
    """(keys, faulted) of each request as a CTA computes them from its index tensors: ``(pages - 1) * page_size +
    last`` (0 without pages); a request whose ``kv_last_page_len`` is outside ``1..page_size`` (``0..page_size``
    without pages) or whose keys leave int32 gets no keys. Batch rules (indptr) are the caller's."""
    kv_indptr = np.asarray(kv_indptr, dtype=np.int64)
    last = np.asarray(kv_last_page_len, dtype=np.int64)
    pages = np.diff(kv_indptr)
    lowest = (pages > 0).astype(np.int64)
    faulted = (last < lowest) | (last > config.page_size)
    faulted |= pages * config.page_size > np.iinfo(np.int32).max - 2 * config.kv_tile
    keys = np.where(pages > 0, (pages - 1) * config.page_size + last, 0)
    return np.where(faulted, 0, keys), faulted


class EdgeTable(NamedTuple):
    """What every CTA holds in shared memory after steps 1-5 (edges ``0 .. num_ctas``, merges ``0 .. n``)."""

    cut_tile: np.ndarray  # [num_ctas + 1]
    cut_key: np.ndarray
    merge_of: np.ndarray  # [num_ctas + 1] the merge of an inside edge (-1 elsewhere)
    inside_before: np.ndarray  # [num_ctas + 1] inside edges before each
    merge_indptr: np.ndarray  # [num_merges + 1] first partial slot of each merge, then the slot count
    merge_tile: np.ndarray  # [num_merges] the tile each merge splits
    width: int
    whole_tiles: bool
    even: tuple[int, int] | None  # (pieces a tile, keys a piece) when step 2 cut the batch
    dealt: bool = False  # step 5b: the line deal replaced the cuts (no merges; items by laps)


def _edge_cut(config: PlanConfig, line_start, cost, keys, total, width, e):
    """Step 3 for edge ``e`` (one thread's work): (cut tile, cut key, snap tile, snap position)."""
    heads, num_tiles = config.num_kv_heads, len(cost) * config.num_kv_heads
    p = e * width
    if e == 0:
        return 0, 0, 0, 0
    if p >= total:
        return num_tiles, 0, num_tiles, total
    j = int(np.searchsorted(line_start, p, side="right")) - 1  # the last request starting at or before p
    cj, start = int(cost[j]), int(line_start[j])
    h = (p - start) // cj
    o = p - start - h * cj
    return _cut_in_tile(config, j * heads + h, o, cj, int(keys[j]), start + h * cj, width)


def _cut_in_tile(config: PlanConfig, t: int, o: int, cost: int, keys: int, tile_position: int, width: int):
    """Step 3's cut of an edge ``o`` into tile ``t`` (``keys`` keys, modelled ``cost``, starting at
    ``tile_position`` on the line): (cut tile, cut key, snap tile, snap position)."""
    k = min(max((o - config.item_overhead_keys + config.kv_tile // 2) // config.kv_tile * config.kv_tile, 0), keys)
    nearer = int(2 * o >= cost)
    snap = (t + nearer, tile_position + nearer * cost)
    if not config.allow_split:
        return snap[0], 0, *snap
    slack = snap_slack(config, width)
    if k == 0 or o <= slack:
        return t, 0, *snap
    if k >= keys or cost - o <= slack:
        return t + 1, 0, *snap
    return t, k, *snap


def edge_table(config: PlanConfig, keys, faulted=None) -> EdgeTable:
    """Steps 1-5 for requests of ``keys`` keys (a faulted request has 0), as every CTA makes them."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    faulted = np.zeros(keys.size, dtype=bool) if faulted is None else np.asarray(faulted, dtype=bool)
    heads, m = config.num_kv_heads, config.num_ctas
    cost = piece_cost(config, keys)  # step 1
    line_start = np.concatenate([[0], np.cumsum(cost * heads)])[:-1]
    total = int((cost * heads).sum())
    width = line_width(config, total)
    num_tiles = keys.size * heads
    uniform = keys.size > 0 and not faulted.any() and (keys == keys[0]).all()
    even = even_pieces(config, int(keys[0]), num_tiles, width) if uniform else None  # step 2
    edges = np.arange(m + 1)
    whole_tiles = False
    if even is not None:
        pieces, piece = even
        cut = edges < num_tiles * pieces
        cut_tile = np.where(cut, edges // pieces, num_tiles)
        cut_key = np.where(cut, edges % pieces * piece, 0)
    else:
        cuts = np.array([_edge_cut(config, line_start, cost, keys, total, width, e) for e in edges],
                        dtype=np.int64).reshape(m + 1, 4)  # step 3
        cut_tile, cut_key = cuts[:, 0], cuts[:, 1]
        snap_tile, snap_pos = cuts[:, 2], cuts[:, 3]
        whole_tiles = bool(config.allow_split and np.diff(snap_pos).max(initial=0) <= whole_tile_bound(config, width))
        if whole_tiles:  # step 4
            cut_tile, cut_key = snap_tile, np.zeros(m + 1, dtype=np.int64)
    inside = cut_key > 0  # step 5
    continues = np.concatenate([[False], inside[1:] & inside[:-1] & (cut_tile[1:] == cut_tile[:-1])])
    run_start = inside & ~continues
    inside_before = np.cumsum(inside) - inside
    merge_of = np.where(inside, np.cumsum(run_start) - 1, -1)
    first_edge = np.nonzero(run_start)[0]
    merge_indptr = np.append(inside_before[first_edge] + np.arange(first_edge.size),
                             int(inside.sum()) + first_edge.size)
    table = EdgeTable(cut_tile.astype(np.int64), cut_key.astype(np.int64), merge_of, inside_before, merge_indptr,
                      cut_tile[first_edge].astype(np.int64), width, whole_tiles, even)
    if deal_choice(config, table, cost, line_start, total):
        return table._replace(merge_indptr=np.zeros(1, dtype=np.int64), merge_tile=np.zeros(0, dtype=np.int64),
                              dealt=True)
    return table


def dealt_tiles(config: PlanConfig, num_tiles: int, c: int) -> np.ndarray:
    """The tiles the serpentine line deal gives CTA ``c``, lap by lap (lap ``i``: ``i m + c``, or ``i m + m - 1 - c``
    on odd laps)."""
    m = config.num_ctas
    laps = np.arange(-(-num_tiles // m))
    t = laps * m + np.where(laps % 2 == 0, c, m - 1 - c)
    return t[t < num_tiles]


def deal_choice(config: PlanConfig, table: EdgeTable, cost, line_start, total: int) -> bool:
    """Step 5b: whether the line deal replaces the cuts (``plan_partition.partition``'s rule, from each CTA's two
    loads as its thread computes them)."""
    heads, m = config.num_kv_heads, config.num_ctas
    batch = len(cost)
    if not (config.line_deal and config.allow_split and 0 < batch <= config.deal_max_q_tiles):
        return False
    num_tiles = batch * heads

    def position(e):  # where edge e sits on the line
        t, k = int(table.cut_tile[e]), int(table.cut_key[e])
        if t >= num_tiles:
            return total
        b, h = divmod(t, heads)
        return int(line_start[b]) + h * int(cost[b]) + (k + config.item_overhead_keys if k > 0 else 0)

    cut_max = max(position(c + 1) - position(c) + (config.item_overhead_keys if table.cut_key[c] > 0 else 0)
                  for c in range(m))
    deal_max = max(int(cost[dealt_tiles(config, num_tiles, c) // heads].sum()) for c in range(m))
    bound = deal_bound(config, table.width, cut_max, table.whole_tiles)
    return bound is not None and deal_max <= bound


def cta_items(config: PlanConfig, table: EdgeTable, keys, kv_page_start, c: int) -> np.ndarray:
    """Step 6: CTA ``c``'s items (``plan.ItemField`` rows, in order) as its threads build them one at a time."""
    F, heads = ItemField, config.num_kv_heads
    if table.dealt:
        tiles = dealt_tiles(config, len(keys) * heads, c)
        rows = np.zeros((tiles.size, len(F)), dtype=np.int32)
        b = tiles // heads
        rows[:, F.REQUEST], rows[:, F.KV_HEAD], rows[:, F.Q_ROW_COUNT] = b, tiles % heads, config.group_size
        rows[:, F.KV_END], rows[:, F.PARTIAL_SLOT], rows[:, F.MERGE] = np.asarray(keys)[b], -1, -1
        rows[:, F.CAUSAL_OFFSET] = np.asarray(keys)[b] - 1 if config.causal else NOT_CAUSAL_OFFSET
        rows[:, F.KV_PAGE_START] = np.asarray(kv_page_start)[b] if config.page_size else -1
        return rows
    first, end_tile, end_key = int(table.cut_tile[c]), int(table.cut_tile[c + 1]), int(table.cut_key[c + 1])
    last = end_tile if end_key > 0 else end_tile - 1
    rows = np.zeros((max(last - first + 1, 0), len(F)), dtype=np.int32)
    for i, row in enumerate(rows):
        t = first + i
        b, h = divmod(t, heads)
        ks = int(table.cut_key[c]) if i == 0 else 0
        ke = end_key if t == end_tile and end_key > 0 else int(keys[b])
        merge = slot = -1
        if ks > 0:  # the piece after an inside edge
            merge = int(table.merge_of[c])
            slot = int(table.inside_before[c]) + merge + 1
        elif ke < keys[b]:  # the piece before one: its merge's first chunk
            merge = int(table.merge_of[c + 1])
            slot = int(table.merge_indptr[merge])
        row[F.REQUEST], row[F.KV_HEAD], row[F.Q_ROW_START], row[F.Q_ROW_COUNT] = b, h, 0, config.group_size
        row[F.KV_START], row[F.KV_END], row[F.PARTIAL_SLOT], row[F.MERGE] = ks, ke, slot, merge
        row[F.CAUSAL_OFFSET] = keys[b] - 1 if config.causal else NOT_CAUSAL_OFFSET
        row[F.KV_PAGE_START] = kv_page_start[b] + ks // config.page_size if config.page_size else -1
    return rows


def cta_merge(config: PlanConfig, table: EdgeTable, merge: int) -> tuple[int, int, int, int]:
    """(request, KV head, first slot, slots) of ``merge``: what a CTA's fold reads for its split items."""
    request, head = divmod(int(table.merge_tile[merge]), config.num_kv_heads)
    first = int(table.merge_indptr[merge])
    return request, head, first, int(table.merge_indptr[merge + 1]) - first



class Stretch(NamedTuple):
    """One CTA's stretch as the kernel keeps it in registers (``kernels/common/line_schedule.LineStretch``)."""

    count: int
    first_tile: int
    first_key: int
    end_tile: int
    end_key: int
    merge0: int  # item 0's merge when it is a piece (slot ``slot0``; the merge's slots ``begin0 .. + slots0``)
    slot0: int
    begin0: int
    slots0: int
    merge1: int  # the last item's merge when it ends inside a tile (its first chunk: slot ``begin1``)
    begin1: int
    slots1: int


def _dealt_count(config: PlanConfig, num_tiles: int, c: int) -> int:
    return int(dealt_tiles(config, num_tiles, c).size)


def table_stretch(config: PlanConfig, table: EdgeTable, num_tiles: int, c: int) -> Stretch:
    """CTA ``c``'s stretch read from the edge table (the kernel's general derivation)."""
    first_tile, first_key = int(table.cut_tile[c]), int(table.cut_key[c])
    end_tile, end_key = int(table.cut_tile[c + 1]), int(table.cut_key[c + 1])
    count = max(end_tile - (end_key == 0) - first_tile + 1, 0)
    if table.dealt:  # its items are the laps' whole tiles: no merges (the kernel ignores what else it read)
        return Stretch(_dealt_count(config, num_tiles, c), first_tile, first_key, end_tile, end_key, -1, -1, 0, 0,
                       -1, 0, 0)
    merge0 = slot0 = merge1 = -1
    begin0 = slots0 = begin1 = slots1 = 0
    if first_key > 0:
        merge0 = int(table.merge_of[c])
        slot0 = int(table.inside_before[c]) + merge0 + 1
    elif count == 1 and end_key > 0:
        merge0 = int(table.merge_of[c + 1])
        slot0 = int(table.merge_indptr[merge0])
    indptr = table.merge_indptr
    if merge0 >= 0:
        begin0, slots0 = int(indptr[merge0]), int(indptr[merge0 + 1] - indptr[merge0])
    if count >= 2 and end_key > 0:
        merge1 = int(table.merge_of[c + 1])
        begin1, slots1 = int(indptr[merge1]), int(indptr[merge1 + 1] - indptr[merge1])
    return Stretch(count, first_tile, first_key, end_tile, end_key, merge0, slot0, begin0, slots0, merge1, begin1,
                   slots1)


class UniformLine(NamedTuple):
    """Steps 2-5b of a uniform batch (every request ``keys`` > 0 keys, none faulted) in closed form: no line starts,
    no edge search; each thread makes its edges ``e`` and ``e + 1`` and one block reduction takes the whole-tile vote,
    the deal and whether any cut lies inside a tile."""

    keys: int
    batch: int
    cost: int  # every tile's
    width: int
    pieces: int  # even pieces a tile (step 2), or 0: the line's cuts
    piece: int
    whole_tiles: bool
    dealt: bool
    needs_table: bool  # line cuts with an inside edge, not dealt: the merges need the table's scan (step 5)


def uniform_edge(config: PlanConfig, line: UniformLine, e: int):
    """Edge ``e`` of a uniform batch: (cut tile, cut key, snap tile, snap position), as :func:`_edge_cut` makes it
    from the table (its request ``p // (heads cost)``, its tile ``p // cost``)."""
    num_tiles = line.batch * config.num_kv_heads
    total = num_tiles * line.cost
    if line.pieces:
        if e < num_tiles * line.pieces:
            return e // line.pieces, e % line.pieces * line.piece, num_tiles, total
        return num_tiles, 0, num_tiles, total
    p = e * line.width
    if e == 0:
        return 0, 0, 0, 0
    if p >= total:
        return num_tiles, 0, num_tiles, total
    t, o = divmod(p, line.cost)
    return _cut_in_tile(config, t, o, line.cost, line.keys, t * line.cost, line.width)


def _position(config: PlanConfig, line: UniformLine, tile: int, key: int) -> int:
    num_tiles = line.batch * config.num_kv_heads
    if tile >= num_tiles:
        return num_tiles * line.cost
    return tile * line.cost + (key + config.item_overhead_keys if key > 0 else 0)


def uniform_line(config: PlanConfig, keys: int, batch: int) -> UniformLine:
    """Steps 2-5b for ``batch`` requests of ``keys`` > 0 keys: each edge's thread computes its CTA's snapped spread,
    its load under the cuts and whether its edge is inside; one block max of the three decides."""
    heads, m = config.num_kv_heads, config.num_ctas
    cost = int(piece_cost(config, keys))
    num_tiles = batch * heads
    width = line_width(config, num_tiles * cost)
    even = even_pieces(config, keys, num_tiles, width)
    pieces, piece = even if even is not None else (0, 0)
    line = UniformLine(keys, batch, cost, width, pieces, piece, False, False, False)
    spread = load = inside = 0
    for e in range(m + 1):  # thread e
        tile, key, _, snap = uniform_edge(config, line, e)
        inside = max(inside, int(key > 0))
        if e < m:
            next_tile, next_key, _, next_snap = uniform_edge(config, line, e + 1)
            if not pieces:
                spread = max(spread, next_snap - snap)
            load = max(load, _position(config, line, next_tile, next_key) - _position(config, line, tile, key)
                       + (config.item_overhead_keys if key > 0 else 0))
    whole = bool(config.allow_split and not pieces and spread <= whole_tile_bound(config, width))
    cut_max = spread if whole else load  # whole-tile cuts: a CTA's load is its snapped spread
    dealt = False
    if config.line_deal and config.allow_split and batch <= config.deal_max_q_tiles:
        bound = deal_bound(config, width, cut_max, whole)
        dealt = bound is not None and -(-num_tiles // m) * cost <= bound
    needs_table = not (whole or dealt or pieces) and inside > 0
    return line._replace(whole_tiles=whole, dealt=dealt, needs_table=needs_table)


def uniform_stretch(config: PlanConfig, line: UniformLine, c: int) -> Stretch:
    """CTA ``c``'s stretch in closed form (``line.needs_table`` False): its edges ``c`` and ``c + 1``; even pieces
    merge tile by tile (merge ``t`` has ``pieces`` slots from ``t * pieces``: the piece of CTA ``c`` is slot ``c``),
    whole or dealt tiles not at all."""
    assert not line.needs_table
    num_tiles = line.batch * config.num_kv_heads

    def edge(e):
        tile, key, snap_tile, _ = uniform_edge(config, line, e)
        return (snap_tile, 0) if line.whole_tiles else (tile, key)

    (first_tile, first_key), (end_tile, end_key) = edge(c), edge(c + 1)
    count = max(end_tile - (end_key == 0) - first_tile + 1, 0)
    merge0 = slot0 = merge1 = -1
    begin0 = slots0 = begin1 = slots1 = 0
    if line.dealt:
        return Stretch(_dealt_count(config, num_tiles, c), first_tile, first_key, end_tile, end_key, -1, -1, 0, 0,
                       -1, 0, 0)
    if line.pieces:
        if first_key > 0 or (count == 1 and end_key > 0):
            merge0, slot0 = (c + (first_key == 0)) // line.pieces, c
            begin0, slots0 = merge0 * line.pieces, line.pieces
        if count >= 2 and end_key > 0:
            merge1 = (c + 1) // line.pieces
            begin1, slots1 = merge1 * line.pieces, line.pieces
    return Stretch(count, first_tile, first_key, end_tile, end_key, merge0, slot0, begin0, slots0, merge1, begin1,
                   slots1)

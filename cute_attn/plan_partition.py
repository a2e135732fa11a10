"""Partition planner: the work lists the *device* planner builds, written once in numpy (its twin and oracle).

The host planner (:mod:`cute_attn.plan`) places tiles longest-first (LPT) and splits only when that leaves
CTAs idle; its heap is sequential. On the GPU the plan must come out of one short kernel with no host
round trip, so the device planner uses a rule every step of which is a prefix sum or a binary search:

Cost line
    Tiles are numbered as in the host planner (request-major, q tile, KV head), except that with
    ``PlanConfig.zigzag`` (the causal MLA kinds) a request's q tiles lie short, long, next short, next long...
    (position ``p``: tile ``p / 2`` or ``n - 1 - (p - 1) / 2``), so adjacent tiles pair to about one cost and the
    cuts land near tile edges: a long causal request then splits far less. Tile ``t`` costs
    ``round_up(keys, kv_tile) + item_overhead_keys`` (the host planner's cost); laid end to end they make a
    line of length ``C``.

Cuts
    CTA ``c`` takes the stretch ``[c W, (c + 1) W)`` of the line, ``W = max(ceil(C / num_ctas), min_width)``,
    so the modelled loads are equal by construction (a CTA that starts inside a tile also pays one item overhead
    the line does not hold: ``min_width`` is the shortest chunk in keys, without it). A cut that falls inside a
    tile splits it at a multiple of ``kv_tile`` keys (both sides become split-KV chunks with a merge), unless it
    lies within ``W / 2**SNAP_SHIFT`` of the tile's start or end: then it snaps to that edge (no split). With
    ``allow_split=False`` every cut snaps to the nearer edge. Splits are cheap on the device path (the combine
    launch is there anyway and partials are small), so the snap window is narrow. But when cutting every edge at
    its nearer tile edge instead leaves no CTA above ``W + W / 2**WHOLE_TILE_SHIFT``, the plan takes whole tiles:
    on the GPU a plan without merges ran 4.6 µs faster at decode 64 x 2048 (no in-kernel fold, fewer item starts)
    than the split one the model rated equal.

Even pieces
    With ``PlanConfig.even_pieces``, a batch whose requests are each one q tile of the same ``K`` keys (decode,
    no faults) is cut in even pieces instead: ``k0 = min(num_ctas // tiles, ceil(K / min_width))`` pieces a tile
    at most, pieces of ``round_up(ceil(K / k0), kv_tile)`` keys, every tile starting at a CTA edge: the chunks
    the host planner's caps cut (MLA decode 64 x 8192 on 132 CTAs: halves of 4096 keys, 128 partials; the line's
    edges cut 3 pieces a request, 192 partials). Taken when ``k0 >= 2`` and a piece is no longer than
    ``W + W / 2**SNAP_SHIFT`` (the modelled busiest CTA is then no worse than the line's); the whole-tile rule is
    not (the pieces split by design), the deal runs on these cuts as on any split ones.

Sorted deal
    Contiguous cuts cannot pack many tiles of a few hundred keys against a CTA width near a thousand (the MLA seed:
    max / mean 1.18 with 21 merges). With ``PlanConfig.sorted_deal`` (the causal kinds), when the cuts had to split
    (the whole-tile rule refused) and the batch has at most ``deal_max_q_tiles`` q tiles, the q tiles are
    sorted by cost, longest first (ties: line order), their heads expanded in place, and dealt serpentine: position
    ``p`` goes to CTA ``p mod m`` on even laps ``p // m``, to ``m - 1 - p mod m`` on odd ones (whole tiles, no
    merges; a CTA's items in lap order). The deal replaces the cuts when its busiest CTA costs no more than the
    cuts' busiest or than ``W + W / 2**WHOLE_TILE_SHIFT`` (a plan without merges runs faster than modelled). Whole-tile
    cuts are dealt too when their busiest CTA exceeds ``W + W / 2**DEAL_WHOLE_SHIFT`` and the deal's is lower (tiles
    of a few hundred keys against a width of a few thousand snap unevenly: GQA prefill 8 x 992 at h20/kv4, cuts
    1.12 x the mean, the deal 1.03); :func:`deal_bound`. With ``PlanConfig.lap_turn`` each lap's CTA order is rotated
    past the CTAs that drew the last lap's longest cost instead of the serpentine's turn, where that balances better
    (:func:`turned_deal`).

Deal first
    With ``PlanConfig.deal_first`` (GQA prefill's device plans by default) the sorted deal is made before any cut
    when the longest tile is within ``W + W / 2**DEAL_FIRST_SHIFT`` (``W + W / 8``, the whole-tile rule's bound), and
    kept with no cuts made when its busiest CTA is within it too (not where even pieces may cut the batch). Else the
    cuts are made and decide against that same deal as above. A deal within ``W + W / 8`` is what the cuts-first rule
    takes anyway except where whole-tile cuts are better still; on the bench's 66 prefill rows and 400 drawn batches
    no plan changed, and the planning CTA skips its cuts on 49 of the 66.

Items
    CTA ``c``'s items are the tiles (or pieces) between its two cuts, in tile order. The tiles a run of cuts
    splits form one merge; its chunks take consecutive partial slots in key order. At most ``num_ctas - 1``
    cuts split anything, so a plan holds at most ``tiles + num_ctas - 1`` items, ``2 (num_ctas - 1)``
    partial slots and ``num_ctas - 1`` merges: inside :meth:`PlanCapacity.for_limits`.

Faults
    A request whose index values break a rule (``faulted``) keeps its tiles, with no keys: its rows get output 0
    and lse ``-inf``, and none of its page ids is read. The device planner knows the rule faults (indptr, last page
    length) before its cuts and models them so; a page id outside the pool is found by its scan CTAs while it plans,
    so that request is cut with its keys and only its items lose them (``kernels/common/planner_scan.py``).

:func:`partition_plan` is the reference for ``kernels/common/device_planner.py``: the GPU tier checks that the
kernel's work lists equal it field by field, and the CPU tier runs it through the plan executor.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from .plan import (DEAL_MAX_Q_TILES_CHOICES, NOT_CAUSAL_OFFSET, RANK_DEAL_MAX_WORK, SERPENTINE_SLACK_SHIFT, ItemField,
                   MergeField, PlanCapacity, PlanConfig, WorkPlan)

__all__ = ["DEAL_FIRST_SHIFT", "DEAL_WHOLE_SHIFT", "SNAP_SHIFT", "SORTED_DEAL_MAX_Q_TILES", "WHOLE_TILE_SHIFT", "QTiles",
           "capped_slack", "cut_loads", "deal_bound", "deal_first_bound", "deal_rank", "dealable", "deals_first",
           "even_pieces", "lap_deal", "line_cuts", "line_width", "min_width", "partition", "partition_plan",
           "piece_cost", "q_tiles", "snap_slack", "sorted_deal", "whole_dealt_plan", "whole_tile_bound"]

SNAP_SHIFT = 5  # a cut within W / 2**SNAP_SHIFT of a tile edge snaps to it
WHOLE_TILE_SHIFT = 3  # whole tiles (every cut at its nearer tile edge) when no CTA then exceeds W + W / 2**this
#: whole-tile cuts whose busiest CTA exceeds W + W / 2**this are worth a sort: the deal may balance them better
#: (GQA prefill 8 x 992 at h20/kv4: cuts 1.12 x the mean, the deal 1.03)
DEAL_WHOLE_SHIFT = 5
#: ``PlanConfig.deal_first``: a deal whose busiest CTA is within W + W / 2**this is kept before any cut is made
DEAL_FIRST_SHIFT = WHOLE_TILE_SHIFT  # as whole-tile cuts within W + W / 8 are taken over split ones
#: the device sorts q tiles in its planning CTA's shared memory (one per thread pair; ``PlanConfig.deal_max_q_tiles``)
SORTED_DEAL_MAX_Q_TILES = DEAL_MAX_Q_TILES_CHOICES[0]
RANK_THREADS = 512  # the planning CTA's threads: a ranked deal's q tiles a thread is ceil(q tiles / this)


def sort_index_bits(max_q_tiles: int) -> int:
    """Bits of the q tile index in the device's Int32 sort keys: 10 for 1024 q tiles, 11 for 2048."""
    return max_q_tiles.bit_length() - 1


def sort_tile_cap(max_q_tiles: int) -> int:
    """The deal orders q tiles by kv tiles capped here (what the device's Int32 sort keys hold above the index:
    21 bits at 1024 q tiles, 20 at 2048): longer tiles (over ~134 M / ~67 M keys) tie, and keep their line order."""
    return (1 << (31 - sort_index_bits(max_q_tiles))) - 2


SORT_TILE_CAP = sort_tile_cap(SORTED_DEAL_MAX_Q_TILES)


def _round_up(x, m):
    return -(-x // m) * m


def piece_cost(config: PlanConfig, keys):
    """The modelled cost of an item of ``keys`` keys (the host planner's)."""
    return _round_up(keys, config.kv_tile) + config.item_overhead_keys


def min_width(config: PlanConfig) -> int:
    """The shortest stretch a CTA takes: a chunk of ``min_chunk_keys`` keys (at least one kv_tile); the item
    overhead of a CTA that starts inside a tile comes on top."""
    return max(config.kv_tile, _round_up(config.min_chunk_keys, config.kv_tile))


class QTiles(NamedTuple):
    """The q tiles of a batch in cost-line order (the heads of one q tile cost the same)."""

    request: np.ndarray
    row_start: np.ndarray
    row_count: np.ndarray
    kv_end: np.ndarray  # keys the tile attends (causal: its last row's limit; 0 for a faulted request)
    causal_offset: np.ndarray
    cost: np.ndarray  # piece_cost of kv_end


def q_tiles(config: PlanConfig, q_lens, kv_lens, faulted=None) -> QTiles:
    """Every q tile of the batch as the device planner lays them on its cost line (``zigzag`` order included)."""
    q_lens = np.asarray(q_lens, dtype=np.int64).reshape(-1)
    kv_lens = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    if faulted is None:
        faulted = np.zeros(q_lens.size, dtype=bool)
    group, rows_per_tile = config.group_size, config.tile_q_rows
    rows = q_lens * group
    per_request = -(-rows // rows_per_tile)
    req = np.repeat(np.arange(q_lens.size), per_request)
    first_tile = np.cumsum(per_request) - per_request
    local = np.arange(req.size) - first_tile[req]  # the tile's position on the line within its request
    if config.zigzag and config.causal:
        # position p takes tile p / 2 (even p) or n - 1 - (p - 1) / 2 (odd p): a causal request's costs rise with
        # the tile, so each adjacent pair costs about the same (MLA n1 x 1028: 97 merges -> 0, max 1472 -> 1408)
        half = local // 2
        local = half + (local - 2 * half) * (per_request[req] - 1 - 2 * half)
    row_start = local * rows_per_tile
    row_count = np.minimum(rows_per_tile, rows[req] - row_start)
    q, kv = q_lens[req], kv_lens[req]
    if config.causal:
        kv_end = np.clip((row_start + row_count - 1) // group + 1 + kv - q, 0, kv)
        offset = kv - q
    else:
        kv_end, offset = kv.copy(), np.full(req.size, NOT_CAUSAL_OFFSET)
    kv_end[faulted[req]] = 0
    return QTiles(req, row_start, row_count, kv_end, offset, piece_cost(config, kv_end))


def cut_loads(config: PlanConfig, cost, cut_tile, cut_key) -> np.ndarray:
    """Each CTA's modelled cost under cuts ``(cut_tile, cut_key)`` (the sum of its pieces' ``piece_cost``).

    A cut inside tile ``t`` at key ``k`` sits at line position ``start(t) + k + item_overhead_keys``: the piece
    before it costs ``k + overhead``, the piece after ``cost - k``, plus the overhead of the CTA that starts there.
    """
    heads, overhead = config.num_kv_heads, config.item_overhead_keys
    tile_start = np.concatenate([[0], np.cumsum(np.repeat(cost, heads))])
    position = tile_start[cut_tile] + np.where(cut_key > 0, cut_key + overhead, 0)
    return np.diff(position) + np.where(cut_key[:-1] > 0, overhead, 0)


def sorted_deal(config: PlanConfig, cost) -> tuple[np.ndarray, np.ndarray]:
    """(q tile of each dealt position, CTA of each position): the q tiles longest first (ties in line order;
    ``line_deal``: line order, unsorted), each tile's heads in a row, dealt serpentine over ``num_ctas`` CTAs."""
    if turns_laps(config):
        return turned_deal(config, cost)
    heads, m = config.num_kv_heads, config.num_ctas
    cost = np.asarray(cost)
    if config.line_deal:
        order = np.arange(cost.size)
    else:  # cost = kv tiles * kv_tile + overhead: ordering by it is ordering by kv tiles, which the device caps
        cap = sort_tile_cap(config.deal_max_q_tiles)
        order = np.argsort(-np.minimum(cost, cap * config.kv_tile + config.item_overhead_keys),
                           kind="stable")
    position = np.arange(order.size * heads)
    lap, offset = position // m, position % m
    return order[position // heads], np.where(lap % 2 == 0, offset, m - 1 - offset)


#: ``PlanConfig.lap_turn``: deals of more laps keep the serpentine. The device planner pays ~170 cycles a lap for the
#: turned loads (H200, session 28), while what the turn can save stays within about one item a CTA whatever the laps
#: (GQA prefill 8 x 992, 15 laps: 8.7 us of the device-planned kernel; 16 x 992, 31 laps: 4.7 us against the
#: planner's 4 us). 32 laps also keep the shifts' scan within one warp.
LAP_TURN_MAX_LAPS = 32


def turns_laps(config: PlanConfig) -> bool:
    """Whether ``config``'s sorted deal may turn its laps (``PlanConfig.lap_turn``) instead of the serpentine."""
    return config.lap_turn and not config.line_deal


def lap_shifts(position_cost: np.ndarray, num_ctas: int) -> np.ndarray:
    """Each lap's rotation of the CTA order (:func:`turned_deal`): the exclusive prefix, mod ``num_ctas``, of the
    count of each lap's positions at its first (longest) cost (a whole lap of one cost: 0)."""
    m = num_ctas
    laps = -(-position_cost.size // m)
    first = np.arange(laps) * m
    lead = position_cost[first]
    lower = np.searchsorted(-position_cost, -lead, side="right")  # the first position of a lower cost (falling)
    leading = np.minimum(lower - first, m) % m
    return (np.cumsum(leading) - leading) % m


def turned_deal(config: PlanConfig, cost) -> tuple[np.ndarray, np.ndarray]:
    """(q tile of each dealt position, CTA of each position) of ``PlanConfig.lap_turn``: :func:`sorted_deal`'s
    positions, lap ``k``'s position ``k * m + r`` to CTA ``(r + shift_k) mod m``: after each lap the CTAs that drew
    its longest cost go to the back of the order (:func:`lap_shifts`), where the serpentine reverses the order
    whatever the lap held. Where a lap's costs come in two runs and the loads are within their difference, that is
    the lap deal's order (the least loaded CTAs first: GQA prefill 8 x 992's busiest CTA 1.082 -> 1.024 of the mean,
    as the lap deal). Taken only where its busiest CTA is strictly below the serpentine's (h5/kv1 8 x 992: 1.208
    against 1.149) and the deal has at most ``LAP_TURN_MAX_LAPS`` laps; else the serpentine."""
    m = config.num_ctas
    serpentine = sorted_deal(dataclasses.replace(config, lap_turn=False), cost)
    tile = serpentine[0]
    if -(-tile.size // m) > LAP_TURN_MAX_LAPS or tile.size == 0:
        return serpentine
    position_cost = np.asarray(cost)[tile]
    position = np.arange(tile.size)
    cta = (position % m + lap_shifts(position_cost, m)[position // m]) % m
    turned_max = np.bincount(cta, weights=position_cost, minlength=m).max()
    serpentine_max = np.bincount(serpentine[1], weights=position_cost, minlength=m).max()
    return (tile, cta) if turned_max < serpentine_max else serpentine


def lap_deal(config: PlanConfig, cost) -> tuple[np.ndarray, np.ndarray]:
    """(q tile of each dealt position, CTA of each position): :func:`sorted_deal`'s positions (q tiles longest first,
    each tile's heads in a row), dealt lap by lap, a lap's longest position to its least loaded CTA (host plans only:
    ``PlanConfig.whole_deal`` "lap"). Counts stay within one a CTA, as in the serpentine deal, and each CTA's items stay
    longest first; where equal costs come in clumps (GQA prefill 4 x 992: 7.5 laps) the serpentine's fixed turn puts
    a lap's clump on the CTAs that drew the last one (busiest 1.082 of the mean; by loads 1.024)."""
    m = config.num_ctas
    tile, _ = sorted_deal(dataclasses.replace(config, line_deal=False), cost)
    position_cost = np.asarray(cost)[tile]
    loads = np.zeros(m, dtype=np.int64)
    cta = np.empty(tile.size, dtype=np.int64)
    for start in range(0, tile.size, m):
        lap = slice(start, min(start + m, tile.size))
        least = np.argsort(loads, kind="stable")[: lap.stop - lap.start]  # the lap's costs fall: longest first
        cta[lap] = least
        loads[least] += position_cost[lap]
    return tile, cta


def whole_dealt_plan(config: PlanConfig, q_lens, kv_lens, capacity: PlanCapacity) -> WorkPlan:
    """The whole-tile plan (no merges) of :func:`lap_deal` (``whole_deal`` "lap") or of :func:`sorted_deal`
    ("serpentine": ValueError past ``config.deal_max_q_tiles`` q tiles, which the device would not deal)."""
    q_lens = np.asarray(q_lens, dtype=np.int64).reshape(-1)
    kv_lens = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    pages = -(-kv_lens // config.page_size) if config.page_size else np.zeros(q_lens.size, dtype=np.int64)
    req, row_start, row_count, kv_end, offset, cost = q_tiles(config, q_lens, kv_lens, np.zeros(q_lens.size, bool))
    if config.whole_deal == "serpentine" and req.size > config.deal_max_q_tiles:
        raise ValueError(f"{req.size} q tiles: the serpentine deal takes at most {config.deal_max_q_tiles}")
    tile, cta = (lap_deal if config.whole_deal == "lap" else sorted_deal)(config, cost)
    loads = np.bincount(cta, weights=cost[tile], minlength=config.num_ctas).astype(np.int64)
    return _dealt_plan(config, capacity, tile, cta, loads, req, row_start, row_count, kv_end, offset,
                       np.cumsum(pages) - pages)


def capped_slack(config: PlanConfig, slack: int) -> int:
    """``slack`` keys, at most ``config.max_slack_keys`` where that is set."""
    return min(slack, config.max_slack_keys) if config.max_slack_keys > 0 else slack


def snap_slack(config: PlanConfig, width: int) -> int:
    """How near a tile edge a cut snaps to it: ``W / 2**SNAP_SHIFT`` keys (capped)."""
    return capped_slack(config, width >> SNAP_SHIFT)


def whole_tile_bound(config: PlanConfig, width: int) -> int:
    """The busiest CTA whole-tile cuts may leave and still be taken: ``W + W / 2**WHOLE_TILE_SHIFT``; with
    ``max_slack_keys`` that slack capped, but never below what split cuts may leave themselves (a CTA whose edges
    both snap outward, plus the item overhead of one that starts inside a tile): splitting would buy nothing."""
    if config.max_slack_keys <= 0:
        return width + (width >> WHOLE_TILE_SHIFT)
    split_worst = 2 * snap_slack(config, width) + config.item_overhead_keys
    return width + max(capped_slack(config, width >> WHOLE_TILE_SHIFT), split_worst)


def even_pieces(config: PlanConfig, keys: int, num_tiles: int, width: int) -> tuple[int, int] | None:
    """(pieces a tile, keys a piece) when ``num_tiles`` equal tiles of ``keys`` keys are cut in even pieces (the
    module docstring's rule), else None."""
    if not (config.even_pieces and config.allow_split) or keys <= 0 or num_tiles <= 0:
        return None
    most = min(config.num_ctas // num_tiles, -(-keys // min_width(config)))
    if most < 2:
        return None
    piece = _round_up(-(-keys // most), config.kv_tile)
    if piece >= keys or piece > width + (width >> SNAP_SHIFT):
        return None
    return -(-keys // piece), piece


def line_width(config: PlanConfig, total: int) -> int:
    """``W``, a CTA's stretch of a cost line of length ``total``: ``max(ceil(total / num_ctas), min_width)``."""
    return max(-(-total // config.num_ctas), min_width(config)) if total else 1


def deals_first(config: PlanConfig, batch: int, num_q_tiles: int) -> bool:
    """Whether the sorted deal may be made before the cuts (``PlanConfig.deal_first``): a sorted (not line) deal of
    a batch the device can order. :func:`partition` makes it when the longest tile is within
    :func:`deal_first_bound` (else it could not be kept: the cuts go first), and keeps it when its busiest CTA is too,
    unless even pieces may cut the batch (every request one q tile of the same keys); otherwise the cuts decide as
    :func:`deal_bound` says, against the same deal."""
    return config.deal_first and config.sorted_deal and config.allow_split and dealable(config, batch, num_q_tiles)


def deal_first_bound(width: int) -> int:
    """The busiest CTA a deal tried first may have and be kept with no cuts made: ``W + W / 2**DEAL_FIRST_SHIFT``."""
    return width + (width >> DEAL_FIRST_SHIFT)


def line_cuts(config: PlanConfig, kv_end, cost, uniform_keys: int = 0):
    """(cut_tile, cut_key, width, whole_tiles): each CTA edge's cut of the cost line (``num_ctas + 1`` edges),
    the width ``W`` of a CTA's stretch and whether the whole-tile cuts were taken. ``uniform_keys``: every q tile
    is a whole request of this many keys (0: not so), for the even pieces."""
    heads, m = config.num_kv_heads, config.num_ctas
    q_start = np.concatenate([[0], np.cumsum(cost)]) * heads  # line position of q tile j's head 0
    total = int(q_start[-1])
    num_tiles = cost.size * heads

    # cuts: (tile, key) per CTA edge, edge c at position c * W
    width = line_width(config, total)
    if (even := even_pieces(config, uniform_keys, num_tiles, width)) is not None:
        pieces, piece = even
        edge = np.arange(m + 1)
        cut = edge < num_tiles * pieces
        cut_tile = np.where(cut, edge // pieces, num_tiles).astype(np.int64)
        cut_key = np.where(cut, edge % pieces * piece, 0).astype(np.int64)
        return cut_tile, cut_key, width, False
    active = -(-total // width) if total else 0
    cut_tile = np.full(m + 1, num_tiles, dtype=np.int64)
    cut_key = np.zeros(m + 1, dtype=np.int64)
    cut_tile[0] = 0
    slack = snap_slack(config, width)
    snap_tile = cut_tile.copy()
    snap_pos = np.full(m + 1, total, dtype=np.int64)
    snap_pos[0] = 0
    # every edge at once (a loop over edges cost ~3 us an edge in numpy scalars)
    c = np.arange(1, max(active, 1))
    p = c * width
    j = np.searchsorted(q_start, p, side="right") - 1
    cj, start = cost[j], q_start[j]
    h = (p - start) // cj
    o = p - start - h * cj
    t = j * heads + h
    k = np.clip((o - config.item_overhead_keys + config.kv_tile // 2) // config.kv_tile * config.kv_tile, 0, kv_end[j])
    nearer = (2 * o >= cj).astype(np.int64)
    snap_tile[c], snap_pos[c] = t + nearer, start + (h + nearer) * cj
    if not config.allow_split:
        inside, up = np.zeros(c.size, dtype=bool), nearer
    else:
        low = (k == 0) | (o <= slack)  # snaps to the tile's start
        up = (~low & ((k >= kv_end[j]) | (cj - o <= slack))).astype(np.int64)  # to its end
        inside = ~low & (up == 0)  # splits it at key k
    cut_tile[c] = np.where(inside, t, t + up)
    cut_key[c] = np.where(inside, k, 0)
    tolerance = whole_tile_bound(config, width)
    whole_tiles = bool(config.allow_split and np.diff(snap_pos).max(initial=0) <= tolerance)
    if whole_tiles:
        cut_tile, cut_key = snap_tile, np.zeros(m + 1, dtype=np.int64)
    return cut_tile, cut_key, width, whole_tiles


def dealable(config: PlanConfig, batch: int, num_q_tiles: int) -> bool:
    """Whether the device can order ``num_q_tiles`` q tiles for a deal: its sort's keys (``deal_max_q_tiles``), or,
    past them, its ranks (``rank_deal_max_q_tiles``: causal, no line deal, batch x ceil(q tiles / 512) at most
    ``RANK_DEAL_MAX_WORK``)."""
    if 0 < num_q_tiles <= config.deal_max_q_tiles:
        return True
    return (config.causal and config.sorted_deal and 0 < num_q_tiles <= config.rank_deal_max_q_tiles
            and batch * -(-num_q_tiles // RANK_THREADS) <= RANK_DEAL_MAX_WORK)


def tiles_reaching(config: PlanConfig, q_len: int, kv_len: int, faulted: bool, x: int, cap: int) -> int:
    """How many q tiles of a causal request hold at least ``x`` kv tiles (capped at ``cap``): a suffix of its tiles in
    natural order, since a tile's key end never falls along them (``kernels/common/rank_sort.py`` mirrors this)."""
    g, rows = config.group_size, config.tile_q_rows
    n = -(-q_len * g // rows)
    if x <= 0:
        return n
    if x > cap or faulted:
        return 0
    keys = (x - 1) * config.kv_tile + 1  # at least x kv tiles <=> a key end of at least this
    if keys > kv_len:
        return 0
    z = keys - 1 - (kv_len - q_len)  # the tile's last row must reach token z
    if z <= 0:
        return n
    if q_len <= z:
        return 0
    return max(n - g * z // rows, 0)


def zigzag_before(n: int, lo: int, hi: int, position: int) -> int:
    """How many of a zigzag request's tiles ``lo .. hi - 1`` (natural order, ``n`` tiles) lie before line ``position``
    (``q_tiles``: even positions take tiles 0, 1, ... of the first half, odd ones n - 1, n - 2, ...)."""
    half = (n + 1) // 2
    low = max(0, min(hi, half, (position + 1) // 2) - lo)
    high = 0
    if position >= 2:
        high = max(0, hi - max(lo, half, n - 1 - (position - 2) // 2))
    return low + high


def deal_rank(config: PlanConfig, q_lens, kv_lens, faulted, b: int, position: int, kv_end: int) -> int:
    """The place in the deal order (``sorted_deal``: capped kv tiles, most first, ties in line order) of request
    ``b``'s q tile at line ``position`` (within the request) with ``kv_end`` keys, from the requests' shapes alone:
    the longer tiles of every request, the equal ones of earlier requests, then its own equal ones before it."""
    cap = sort_tile_cap(config.deal_max_q_tiles)
    k = min(-(-kv_end // config.kv_tile), cap)
    rank = 0
    for other in range(len(q_lens)):
        rank += tiles_reaching(config, q_lens[other], kv_lens[other], faulted[other], k if other < b else k + 1, cap)
    n = -(-q_lens[b] * config.group_size // config.tile_q_rows)
    lo = n - tiles_reaching(config, q_lens[b], kv_lens[b], faulted[b], k, cap)
    hi = n - tiles_reaching(config, q_lens[b], kv_lens[b], faulted[b], k + 1, cap)
    if not (config.zigzag and config.causal):
        return rank + position - lo
    return rank + zigzag_before(n, lo, hi, position)


def deal_bound(config: PlanConfig, width: int, cut_max: int, whole_tiles: bool) -> int | None:
    """The busiest CTA a sorted deal may have to replace the cuts, or None when the deal is not tried: split cuts
    give way to a deal no worse than them or than the whole-tile rule's bound (:func:`whole_tile_bound`: no merges
    runs faster than modelled); whole-tile cuts whose busiest CTA exceeds ``W + W / 2**DEAL_WHOLE_SHIFT`` only to a
    strictly better one (``deal_whole_cuts``: any whole-tile cuts, to a deal within ``1 / 2**SERPENTINE_SLACK_SHIFT``
    of them). A line deal (``PlanConfig.line_deal``) replaces whole-tile cuts whenever it is no worse."""
    if whole_tiles and config.line_deal:
        return cut_max
    if not whole_tiles:
        return max(cut_max, whole_tile_bound(config, width))
    if config.deal_whole_cuts:
        return cut_max + (cut_max >> SERPENTINE_SLACK_SHIFT)
    if cut_max > width + (width >> DEAL_WHOLE_SHIFT):
        return cut_max - 1
    return None


def partition_plan(config: PlanConfig, q_lens, kv_lens, *, kv_page_start=None, token_start=None, faulted=None,
                   capacity: PlanCapacity | None = None) -> WorkPlan:
    """The device planner's plan of one batch.

    ``kv_page_start[b]``: request b's first position in kv_indices (``kv_indptr[b]``; default: the cumulated
    page counts); ``token_start[b]``: its first query row (``qo_indptr[b]``; default: cumulated q_lens);
    ``faulted[b]``: its index values broke a rule (its tiles get no keys).
    """
    return partition(config, q_lens, kv_lens, kv_page_start=kv_page_start, token_start=token_start,
                     faulted=faulted, capacity=capacity)[0]


def partition(config: PlanConfig, q_lens, kv_lens, *, kv_page_start=None, token_start=None, faulted=None,
              capacity: PlanCapacity | None = None) -> tuple[WorkPlan, bool]:
    """(:func:`partition_plan`'s plan, whether it is a deal)."""
    F, MF = ItemField, MergeField
    q_lens = np.asarray(q_lens, dtype=np.int64).reshape(-1)
    kv_lens = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    batch = q_lens.size
    if faulted is None:
        faulted = np.zeros(batch, dtype=bool)
    if token_start is None:
        token_start = np.cumsum(q_lens) - q_lens
    if kv_page_start is None:
        pages = -(-kv_lens // config.page_size) if config.page_size else np.zeros(batch, dtype=np.int64)
        kv_page_start = np.cumsum(pages) - pages
    if capacity is None:
        capacity = PlanCapacity.for_limits(config, max_batch=batch, max_total_q=int(q_lens.sum()))
    heads, m = config.num_kv_heads, config.num_ctas

    req, row_start, row_count, kv_end, offset, cost = q_tiles(config, q_lens, kv_lens, faulted)
    # every request one q tile of the same keys (no faults: a faulted tile has none): the even pieces' case
    uniform = batch > 0 and np.array_equal(req, np.arange(batch)) and (kv_end == kv_end[0]).all()
    dealt = None  # (tile, cta, loads) of the sorted deal, once made

    def deal():
        dealt_tile, dealt_cta = sorted_deal(config, cost)
        return dealt_tile, dealt_cta, np.bincount(dealt_cta, weights=cost[dealt_tile], minlength=m).astype(np.int64)

    def dealt_plan():
        return _dealt_plan(config, capacity, dealt[0], dealt[1], dealt[2], req, row_start, row_count, kv_end, offset,
                           kv_page_start), True

    first_bound = deal_first_bound(line_width(config, int(cost.sum()) * heads))
    if deals_first(config, batch, req.size) and cost.max() <= first_bound:  # the deal before any cut
        dealt = deal()
        if not (uniform and config.even_pieces) and dealt[2].max() <= first_bound:  # kept near the mean
            return dealt_plan()
    cut_tile, cut_key, width, whole_tiles = line_cuts(config, kv_end, cost, int(kv_end[0]) if uniform else 0)
    if (config.sorted_deal or config.line_deal) and config.allow_split and dealable(config, batch, req.size):
        bound = deal_bound(config, width, int(cut_loads(config, cost, cut_tile, cut_key).max()), whole_tiles)
        if bound is not None:
            dealt = dealt or deal()
            if dealt[2].max() <= bound:
                return dealt_plan()

    # merges: a run of cuts inside one tile splits it into (run length + 1) chunks
    inside = cut_key > 0
    continues = np.concatenate([[False], inside[1:] & inside[:-1] & (cut_tile[1:] == cut_tile[:-1])])
    run_start = inside & ~continues
    merge_of_cut = np.cumsum(run_start) - 1  # meaningful at inside cuts
    first_cut_of_merge = np.nonzero(run_start)[0]
    num_merges = first_cut_of_merge.size
    chunks = np.bincount(merge_of_cut[inside], minlength=num_merges) + 1
    slot_base = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    num_partials = int(slot_base[-1])

    # items, CTA-major, tile order inside a CTA
    first = cut_tile[:-1]
    last = np.where(cut_key[1:] > 0, cut_tile[1:], cut_tile[1:] - 1)
    counts = np.maximum(last - first + 1, 0)
    num_items = int(counts.sum())
    if num_items > capacity.max_items or num_partials > capacity.max_partials or num_merges > capacity.max_merges:
        raise ValueError(f"partition plan exceeds capacity: {num_items} items / {num_partials} partial slots / "
                         f"{num_merges} merges, capacity {capacity}")
    work_indptr = np.zeros(m + 1, dtype=np.int32)
    work_indptr[1:] = np.cumsum(counts)
    items = np.zeros((capacity.max_items, len(F)), dtype=np.int32)
    # one row per item, vectorised (a Python loop over items cost 40 ms at 4096 decode requests)
    cta = np.repeat(np.arange(m), counts)
    t = first[cta] + (np.arange(num_items) - work_indptr[cta])
    j, h = t // heads, t % heads
    b = req[j]
    ks = np.where(t == cut_tile[cta], cut_key[cta], 0)
    ke = np.where((t == cut_tile[cta + 1]) & (cut_key[cta + 1] > 0), cut_key[cta + 1], kv_end[j])
    merge = np.full(num_items, -1, dtype=np.int64)
    slot = np.full(num_items, -1, dtype=np.int64)
    starts = ks > 0  # the piece after an inside cut: its merge's chunk (c - first cut + 1)
    g = merge_of_cut[cta[starts]]
    merge[starts], slot[starts] = g, slot_base[g] + cta[starts] - first_cut_of_merge[g] + 1
    ends = ~starts & (ke < kv_end[j])  # the piece before one: its merge's first chunk
    g = merge_of_cut[cta[ends] + 1]
    merge[ends], slot[ends] = g, slot_base[g]
    rows = items[:num_items]
    rows[:, F.REQUEST], rows[:, F.KV_HEAD] = b, h
    rows[:, F.Q_ROW_START], rows[:, F.Q_ROW_COUNT] = row_start[j], row_count[j]
    rows[:, F.KV_START], rows[:, F.KV_END] = ks, ke
    rows[:, F.PARTIAL_SLOT], rows[:, F.CAUSAL_OFFSET], rows[:, F.MERGE] = slot, offset[j], merge
    rows[:, F.KV_PAGE_START] = kv_page_start[b] + ks // config.page_size if config.page_size else -1
    cta_cost = np.bincount(cta, weights=piece_cost(config, ke - ks), minlength=m).astype(np.int64)

    merge_indptr = np.zeros(capacity.max_merges + 1, dtype=np.int32)
    merge_indptr[: num_merges + 1] = slot_base
    merge_indptr[num_merges + 1:] = num_partials
    merges = np.zeros((capacity.max_merges, len(MF)), dtype=np.int32)
    for g, c0 in enumerate(first_cut_of_merge):
        j, h = divmod(int(cut_tile[c0]), heads)
        merges[g] = (req[j], h, row_start[j], row_count[j], token_start[req[j]])
    return WorkPlan(config=config, capacity=capacity, num_ctas=int((counts > 0).sum()), work_indptr=work_indptr,
                    items=items, num_items=num_items, merge_indptr=merge_indptr, merges=merges,
                    num_merges=num_merges, num_partials=num_partials, cta_cost=cta_cost), False


def _dealt_plan(config, capacity, dealt_tile, dealt_cta, loads, req, row_start, row_count, kv_end, offset,
                kv_page_start) -> WorkPlan:
    """The plan of a sorted deal: CTA-major items, each CTA's in lap order, whole tiles, no merges."""
    F = ItemField
    heads, m = config.num_kv_heads, config.num_ctas
    counts = np.bincount(dealt_cta, minlength=m)
    num_items = int(counts.sum())
    if num_items > capacity.max_items:
        raise ValueError(f"partition plan exceeds capacity: {num_items} items, capacity {capacity}")
    work_indptr = np.zeros(m + 1, dtype=np.int32)
    work_indptr[1:] = np.cumsum(counts)
    items = np.zeros((capacity.max_items, len(F)), dtype=np.int32)
    # a stable sort by CTA keeps each CTA's positions in lap order
    by_cta = np.argsort(dealt_cta, kind="stable")
    j = dealt_tile[by_cta]
    b = req[j]
    rows = items[:num_items]
    rows[:, F.REQUEST], rows[:, F.KV_HEAD] = b, by_cta % heads
    rows[:, F.Q_ROW_START], rows[:, F.Q_ROW_COUNT] = row_start[j], row_count[j]
    rows[:, F.KV_START], rows[:, F.KV_END] = 0, kv_end[j]
    rows[:, F.PARTIAL_SLOT], rows[:, F.CAUSAL_OFFSET], rows[:, F.MERGE] = -1, offset[j], -1
    rows[:, F.KV_PAGE_START] = kv_page_start[b] if config.page_size else -1
    return WorkPlan(config=config, capacity=capacity, num_ctas=int((counts > 0).sum()), work_indptr=work_indptr,
                    items=items, num_items=num_items, merge_indptr=np.zeros(capacity.max_merges + 1, dtype=np.int32),
                    merges=np.zeros((capacity.max_merges, len(MergeField)), dtype=np.int32), num_merges=0,
                    num_partials=0, cta_cost=loads)

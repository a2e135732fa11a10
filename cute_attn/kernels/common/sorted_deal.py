"""The device planner's sorted deal (``plan_partition``'s twin): q tiles longest first, dealt serpentine.

Run by the planning CTA after its cuts, whose vote already reduced the busiest whole-tile CTA and the longest tile;
where the cuts split, each CTA's cut load (one more reduction). Only when the cuts split tiles or their whole tiles
leave a CTA above ``W + W / 2**DEAL_WHOLE_SHIFT`` (``plan_partition.deal_bound``), and the deal can win, a bitonic
sort of the q tiles' Int32 (capped kv tiles, index) keys over a fixed 512, 1024 or (``c.deal_max_q_tiles`` 2048)
2048 keys, up to four a thread in registers, every stage unrolled: those under a warp's stride by shuffles, those
under the block's through shared memory, the rest between a thread's own keys (:func:`fast_sort`); then each CTA's
serpentine load over its laps. Past the sort's keys a small causal batch is ranked instead (``rank_sort.py``,
``rank_deal_max_q_tiles``; off by default). The line deal (``line_deal``, small-page decode) takes the keys in line
order, unsorted. ``c`` is the :class:`DevicePlannerConfig` (a compile-time constant). The sort is 5.0 k cycles at
the MLA seed's 500 q tiles on the H200 (session 14; a runtime-sized Int64 sort before it: 14.4 k).

Lap turns (``c.lap_turn``; ``plan_partition.turned_deal`` is the twin): lap ``k``'s position ``k * m + r`` goes to CTA
``(r + shift_k) mod m``: after each lap the CTAs that drew its longest cost go to the back of the order, where the
serpentine reverses the whole order. A lap's leading run (its positions at its first cost) is one binary search of
the sorted costs, a lane a lap; the shifts are their exclusive prefix sum (one warp scan), one Int32 a lap past the
sort's keys (:func:`turn_slots`). Each CTA sums its loads under both deals, and the turned one is taken only where
its busiest CTA is strictly below the serpentine's (a uniform vote, kept beside the shifts for the lists phase). No lap
waits on the one before: a lap-by-lap rank of the loads (the lap deal itself) measured 20-23 k cycles at GQA prefill
4 and 16 x 992 on the H200 (session 27). Deals of more than ``LAP_TURN_MAX_LAPS`` laps keep the serpentine.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan import DEAL_MAX_Q_TILES_CHOICES, RANK_DEAL_MAX_WORK, SERPENTINE_SLACK_SHIFT
from ...plan_partition import (DEAL_WHOLE_SHIFT, LAP_TURN_MAX_LAPS, SNAP_SHIFT, WHOLE_TILE_SHIFT, sort_index_bits,
                                sort_tile_cap)
from .planner_collectives import NUM_THREADS, WARP, block_max, block_max_pair, warp_inclusive_sum
from .count_sort import COUNT_BINS, count_order, key_tiles
from .rank_sort import rank_sort

INDEX_BITS = 20  # sort_key (what the deal reads): the q tile index in the low bits (< 2**20), 2**32 - cost above
# fast_sort's Int32 keys: (sort_tile_cap - kv tiles, capped) << index bits | q tile index; the padding sorts after all
FAST_PADDING_KEY = 2**31 - 1
for _most in DEAL_MAX_Q_TILES_CHOICES:  # PlanConfig.deal_max_q_tiles: what the sort builds
    assert (sort_tile_cap(_most) << sort_index_bits(_most)) | (_most - 1) < FAST_PADDING_KEY
    assert _most % NUM_THREADS == 0 and _most // NUM_THREADS <= 4


def keys_per_thread(c) -> int:
    """The sort keys a thread holds in registers: 2 (1024 q tiles) or 4 (2048)."""
    return c.deal_max_q_tiles // NUM_THREADS


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
def capped_slack(c: cutlass.Constexpr, slack):
    """``plan_partition.capped_slack`` of the build: ``slack`` (Int64), at most ``c.max_slack_keys`` in builds that
    set it (others emit nothing)."""
    if cutlass.const_expr(c.max_slack_keys > 0):
        slack = cutlass.min(slack, Int64(c.max_slack_keys))
    return slack


@cute.jit
def whole_tile_bound(c: cutlass.Constexpr, width):
    """``plan_partition.whole_tile_bound`` of the build (Int64 ``width``)."""
    bound = width + (width >> WHOLE_TILE_SHIFT)
    if cutlass.const_expr(c.max_slack_keys > 0):
        split_worst = 2 * capped_slack(c, width >> SNAP_SHIFT) + c.item_overhead_keys
        bound = width + cutlass.max(capped_slack(c, width >> WHOLE_TILE_SHIFT), split_worst)
    return bound


def sort_key_slots(c) -> int:
    """The Int64 entries of the deal's ``sort_keys``: the sorted keys and the bitonic sort's second buffer, or a ranked
    deal's keys (``rank_deal_max_q_tiles``), whichever is more; the lap turns' tables past them
    (:func:`turn_slots`; ``PlanConfig.lap_turn``) are in :func:`deal_slots`."""
    return max(2 * c.deal_max_q_tiles, c.rank_deal_max_q_tiles)


def deal_slots(c) -> int:
    """The Int64 entries the planner allocates for ``sort_keys``: :func:`sort_key_slots` and the lap turns' tables."""
    return sort_key_slots(c) + turn_slots(c)


@cute.jit
def dealable(c: cutlass.Constexpr, num_q_tiles, batch):
    """``plan_partition.dealable`` of the build (1 or 0): the sort's keys, or past them a ranked deal's bound."""
    ok = Int32(0)
    if num_q_tiles <= c.deal_max_q_tiles:
        ok = Int32(1)
    if cutlass.const_expr(c.rank_deal_max_q_tiles > 0 and c.causal and c.sorted_deal):
        passes = (num_q_tiles + NUM_THREADS - 1) // NUM_THREADS
        if num_q_tiles <= c.rank_deal_max_q_tiles and batch * passes <= RANK_DEAL_MAX_WORK:
            ok = Int32(1)
    return ok


@cute.jit
def sorted_deal(c: cutlass.Constexpr, tidx, split, snap_max, longest, q_tiles, q_tile_start, cut_tile, cut_key,
                sort_keys, warp_sums, num_q_tiles, num_ctas, width, total_cost, requests, batch, dealt_max):
    """(1 when the deal replaces the cuts, the item count of this thread's CTA in the deal). ``split``: the cuts
    split tiles (else they are whole tiles, the busiest ``snap_max``); ``longest``: the longest tile's cost (both
    from the cuts' vote). ``dealt_max``: the busiest CTA of a deal made before the cuts
    (``planner_deal_first.deal_first``), which is not made again; -1: none was. Leaves the q tiles in deal order in
    ``sort_keys[0 : num_q_tiles]`` (:func:`sort_key` layout); every thread calls it."""
    deal = Int32(0)
    count = Int32(0)
    bound = cuts_bound(c, tidx, split, snap_max, q_tiles, q_tile_start, cut_tile, cut_key, warp_sums, num_q_tiles,
                       num_ctas, width, total_cost)
    if dealt_max >= 0:  # made before the cuts: its busiest CTA holds the longest tile too, so the same rule
        if dealt_max <= bound:
            deal = Int32(1)
    # the deal's busiest CTA holds the longest tile: past the bound it cannot win, so skip the sort (uniform)
    elif dealable(c, num_q_tiles, batch) != 0 and longest <= bound:
        busiest, count = deal_loads(c, tidx, q_tiles, requests, sort_keys, warp_sums, num_q_tiles, num_ctas, batch)
        if busiest <= bound:
            deal = Int32(1)
    return deal, count


@cute.jit
def cuts_bound(c: cutlass.Constexpr, tidx, split, snap_max, q_tiles, q_tile_start, cut_tile, cut_key, warp_sums,
               num_q_tiles, num_ctas, width, total_cost):
    """``plan_partition.deal_bound`` (Int64; -1: no deal may replace the cuts): split cuts give way to a deal no worse
    than them or than the whole-tile rule; whole-tile cuts above W + W / 2**DEAL_WHOLE_SHIFT only to a strictly better
    one, the others are kept. ``split`` is uniform over the CTA (each CTA's load under split cuts: one reduction)."""
    num_tiles = num_q_tiles * c.num_kv_heads
    bound = snap_max - 1
    if cutlass.const_expr(c.line_deal):
        bound = snap_max  # a line deal replaces whole-tile cuts whenever it is no worse
    elif cutlass.const_expr(c.deal_whole_cuts):
        bound = snap_max + (snap_max >> SERPENTINE_SLACK_SHIFT)  # any whole-tile cuts, to a deal within 1/16
    elif snap_max <= width + (width >> DEAL_WHOLE_SHIFT):
        bound = Int64(-1)
    if split != 0:
        cut_load = Int64(0)
        if tidx < num_ctas:
            cut_load = (cut_position(c, tidx + 1, q_tiles, q_tile_start, cut_tile, cut_key, num_tiles, total_cost)
                        - cut_position(c, tidx, q_tiles, q_tile_start, cut_tile, cut_key, num_tiles, total_cost))
            if cut_key[tidx] > 0:
                cut_load = cut_load + Int64(c.item_overhead_keys)
        bound = cutlass.max(block_max(cut_load, tidx, warp_sums), whole_tile_bound(c, width))
    return bound


@cute.jit
def deal_loads(c: cutlass.Constexpr, tidx, q_tiles, requests, sort_keys, warp_sums, num_q_tiles, num_ctas, batch):
    """(the deal's busiest CTA, the item count of this thread's CTA in it): the q tiles ordered (sorted, ranked or,
    for a line deal, as they stand) into ``sort_keys``, then each CTA's load over its laps: serpentine, or with
    ``c.lap_turn`` turned where that wins (:func:`turned_deal_loads`)."""
    heads = c.num_kv_heads
    num_tiles = num_q_tiles * heads
    count = Int32(0)
    if cutlass.const_expr(c.line_deal):  # line order: the keys as they stand, no sort
        for r in cutlass.range_constexpr(keys_per_thread(c)):
            i = tidx + r * NUM_THREADS
            if i < num_q_tiles:
                sort_keys[i] = sort_key(tile_cost(c, q_tiles[i, 3]), i)
        cute.arch.sync_threads()
    elif cutlass.const_expr(c.rank_deal_max_q_tiles > 0 and c.causal):
        if num_q_tiles > c.deal_max_q_tiles:  # past the sort's keys: ranked (rank_sort.py)
            sort_by_ranks(c, tidx, q_tiles, requests, sort_keys, num_q_tiles, batch)
        else:
            sort_bitonic(c, tidx, q_tiles, sort_keys, num_q_tiles, warp_sums)
    else:
        sort_bitonic(c, tidx, q_tiles, sort_keys, num_q_tiles, warp_sums)
    busiest = Int64(0)
    if cutlass.const_expr(c.lap_turn):
        busiest, count = turned_deal_loads(c, tidx, sort_keys, warp_sums, num_tiles, num_ctas)
    else:
        busiest, count = serpentine_loads(c, tidx, sort_keys, warp_sums, num_tiles, num_ctas)
    return busiest, count


@cute.jit
def serpentine_loads(c: cutlass.Constexpr, tidx, sort_keys, warp_sums, num_tiles, num_ctas):
    """(the serpentine deal's busiest CTA, the item count of this thread's CTA in it)."""
    heads = c.num_kv_heads
    load = Int64(0)
    count = Int32(0)
    if tidx < num_ctas:
        lap = Int32(0)
        position = tidx
        while position < num_tiles:
            load = load + key_cost(sort_keys[position // heads])
            count = count + 1
            lap = lap + 1
            position = serpentine_position(lap, tidx, num_ctas)
    return block_max(load, tidx, warp_sums), count


@cute.jit
def serpentine_position(lap, cta, num_ctas):
    """The serpentine's position for CTA ``cta`` on lap ``lap``: ``lap * m + cta``, or ``lap * m + m - 1 - cta`` on
    odd laps."""
    position = lap * num_ctas + cta
    if lap % 2 != 0:
        position = lap * num_ctas + num_ctas - 1 - cta
    return position


@cute.jit
def sort_bitonic(c: cutlass.Constexpr, tidx, q_tiles, sort_keys, num_q_tiles, warp_sums):
    """The q tiles longest first by :func:`fast_sort` of their Int32 keys into ``sort_keys[0 : num_q_tiles]``; in
    ``count_sort`` builds, by counting where every tile holds fewer than ``COUNT_BINS`` kv tiles (``count_sort.py``;
    uniform over the CTA: one block max first)."""
    if cutlass.const_expr(c.count_sort):
        tiles = cute.make_rmem_tensor((keys_per_thread(c),), Int32)
        most_tiles = Int64(0)
        for r in cutlass.range_constexpr(keys_per_thread(c)):
            i = tidx + r * NUM_THREADS
            tiles[r] = Int32(0)
            if i < num_q_tiles:
                tiles[r] = key_tiles(c, q_tiles[i, 3])
                most_tiles = cutlass.max(most_tiles, Int64(tiles[r]))
        if block_max(most_tiles, tidx, warp_sums) < Int64(COUNT_BINS):
            slots = cute.make_rmem_tensor((keys_per_thread(c),), Int32)
            count_order(c, tiles, slots, num_q_tiles, tidx, sort_keys, warp_sums)
            for r in cutlass.range_constexpr(keys_per_thread(c)):
                i = tidx + r * NUM_THREADS
                if i < num_q_tiles:
                    sort_keys[slots[r]] = sort_key(tile_cost(c, q_tiles[i, 3]), i)
            cute.arch.sync_threads()
        else:
            sort_bitonic_keys(c, tidx, q_tiles, sort_keys, num_q_tiles)
    else:
        sort_bitonic_keys(c, tidx, q_tiles, sort_keys, num_q_tiles)


@cute.jit
def sort_bitonic_keys(c: cutlass.Constexpr, tidx, q_tiles, sort_keys, num_q_tiles):
    """The bitonic way of :func:`sort_bitonic`."""
    keys32 = cute.make_rmem_tensor((keys_per_thread(c),), Int32)
    for r in cutlass.range_constexpr(keys_per_thread(c)):
        keys32[r] = Int32(FAST_PADDING_KEY)
        i = tidx + r * NUM_THREADS
        if i < num_q_tiles:
            keys32[r] = fast_sort_key(c, q_tiles[i, 3], i)
    fast_sort(c, keys32, num_q_tiles, tidx, q_tiles, sort_keys)


@cute.jit
def sort_by_ranks(c: cutlass.Constexpr, tidx, q_tiles, requests, sort_keys, num_q_tiles, batch):
    """The same order by :mod:`rank_sort` (a thread's q tiles walk the requests once; no key limit but
    ``sort_key_slots``), for batches past the sort's keys:
    ``deal_max_q_tiles < num_q_tiles <= rank_deal_max_q_tiles``."""
    most = c.rank_deal_max_q_tiles // NUM_THREADS
    rank = cute.make_rmem_tensor((most,), Int32)
    if num_q_tiles <= 4 * NUM_THREADS:
        rank_sort(c, 4, tidx, q_tiles, requests, num_q_tiles, batch, rank)
    else:
        rank_sort(c, most, tidx, q_tiles, requests, num_q_tiles, batch, rank)
    for r in cutlass.range_constexpr(most):
        i = tidx + r * NUM_THREADS
        if i < num_q_tiles:
            sort_keys[rank[r]] = sort_key(tile_cost(c, q_tiles[i, 3]), i)
    cute.arch.sync_threads()


@cute.jit
def sort_key(cost, index):
    """Ascending keys = longest first, ties by q tile index (distinct keys): ``(2**32 - cost) << 20 | index``."""
    return ((Int64(1 << 32) - cost) << INDEX_BITS) | Int64(index)


@cute.jit
def key_cost(key):
    return Int64(1 << 32) - (key >> INDEX_BITS)


@cute.jit
def _exchange(mine, theirs, index, stride, block):
    """A bitonic compare-exchange seen from key ``index``: the lower index of a pair keeps the smaller key in an
    ascending block (``index & block == 0``), the larger in a descending one; the upper index the other."""
    low = cutlass.min(mine, theirs)
    high = cutlass.max(mine, theirs)
    votes = Int32(0)
    if (index & stride) == 0:
        votes = votes + 1
    if (index & block) != 0:
        votes = votes + 1
    kept = low
    if votes != 1:
        kept = high
    return kept


@cute.jit
def fast_sort_key(c: cutlass.Constexpr, kv_end, index):
    """Ascending Int32 keys = longest first (kv tiles, capped at ``sort_tile_cap`` as the numpy twin caps them), ties
    by q tile index."""
    cap = sort_tile_cap(c.deal_max_q_tiles)
    tiles = cutlass.min((kv_end + c.kv_tile - 1) // c.kv_tile, Int32(cap))
    return ((Int32(cap) - tiles) << sort_index_bits(c.deal_max_q_tiles)) | index


@cute.jit
def fast_sort(c: cutlass.Constexpr, keys: cute.Tensor, num_q_tiles, tidx, q_tiles: cute.Tensor, sort_keys: cute.Tensor):
    """The q tiles longest first from Int32 keys (one shuffle an exchange) over a fixed 512, 1024 or 2048 keys (the
    fewest that hold ``num_q_tiles``), every stage unrolled (no runtime stride branches); the sorted q tiles are then
    written to ``sort_keys[0 : c.deal_max_q_tiles]`` as :func:`sort_key` keys with their true costs, which the deal
    reads. The Int32 exchanges use ``sort_keys``' second half."""
    most = c.deal_max_q_tiles
    scratch = cute.make_tensor(cute.recast_ptr(sort_keys.iterator + most, dtype=Int32), cute.make_layout(2 * most))
    if cutlass.const_expr(most == 2 * NUM_THREADS):
        if num_q_tiles <= NUM_THREADS:
            _bitonic_sort_unrolled(keys, NUM_THREADS, most, tidx, scratch)
        else:
            _bitonic_sort_unrolled(keys, most, most, tidx, scratch)
    else:
        if num_q_tiles <= NUM_THREADS:
            _bitonic_sort_unrolled(keys, NUM_THREADS, most, tidx, scratch)
        elif num_q_tiles <= 2 * NUM_THREADS:
            _bitonic_sort_unrolled(keys, 2 * NUM_THREADS, most, tidx, scratch)
        else:
            _bitonic_sort_unrolled(keys, most, most, tidx, scratch)
    for r in cutlass.range_constexpr(keys_per_thread(c)):
        i = tidx + r * NUM_THREADS
        if i < num_q_tiles:
            index = scratch[i] & ((1 << sort_index_bits(most)) - 1)
            sort_keys[i] = sort_key(tile_cost(c, q_tiles[index, 3]), index)
    cute.arch.sync_threads()


def bitonic_stages(size: int, half: int = 1024) -> list[tuple[int, int, int]]:
    """``(block, stride, scratch half)`` of every stage of a bitonic sort of ``size`` keys, in order; the half
    alternates over the shared-memory exchanges (``0`` or ``half``, the scratch's second half: ``deal_max_q_tiles``)
    so that no barrier is needed between one exchange's reads and the next one's writes."""
    stages, buffer, block = [], 0, 2
    while block <= size:
        stride = block // 2
        while stride > 0:
            stages.append((block, stride, buffer))
            if WARP <= stride < NUM_THREADS:
                buffer = half - buffer
            stride //= 2
        block *= 2
    return stages


@cute.jit
def _bitonic_sort_unrolled(keys: cute.Tensor, size: cutlass.Constexpr[int], half: cutlass.Constexpr[int], tidx,
                           scratch: cute.Tensor):
    """Sort ``size`` (512, 1024 or 2048) Int32 keys ascending into ``scratch[0 : size]``, key ``tidx + r *
    NUM_THREADS`` in ``keys[r]``: every (block, stride) stage is a trace-time constant, a stride under a warp a
    shuffle, under NUM_THREADS a shared-memory exchange (alternate halves of ``scratch``, ``half`` apart: one
    barrier), NUM_THREADS and up between the thread's own keys."""
    per_thread = size // NUM_THREADS
    for block, stride, buffer in bitonic_stages(size, half):
        if cutlass.const_expr(stride < WARP):
            for r in cutlass.range_constexpr(per_thread):
                theirs = cute.arch.shuffle_sync_bfly(keys[r], stride)
                keys[r] = _exchange(keys[r], theirs, tidx + r * NUM_THREADS, stride, block)
        elif cutlass.const_expr(stride < NUM_THREADS):
            for r in cutlass.range_constexpr(per_thread):
                scratch[buffer + tidx + r * NUM_THREADS] = keys[r]
            cute.arch.sync_threads()
            for r in cutlass.range_constexpr(per_thread):
                index = tidx + r * NUM_THREADS
                keys[r] = _exchange(keys[r], scratch[buffer + (index ^ stride)], index, stride, block)
        else:  # the thread's keys r and r + stride / NUM_THREADS; whether the pair ascends is r's alone (tidx < block)
            step = stride // NUM_THREADS
            for r in cutlass.range_constexpr(per_thread):
                if cutlass.const_expr(r & step == 0):
                    low = cutlass.min(keys[r], keys[r + step])
                    high = cutlass.max(keys[r], keys[r + step])
                    if cutlass.const_expr((r * NUM_THREADS) & block == 0):
                        keys[r + step] = high
                        keys[r] = low
                    else:
                        keys[r + step] = low
                        keys[r] = high
    cute.arch.sync_threads()  # every read of the last exchange is done before the result overwrites scratch
    for r in cutlass.range_constexpr(per_thread):
        scratch[tidx + r * NUM_THREADS] = keys[r]
    cute.arch.sync_threads()


@cute.jit
def dealt_tile(c: cutlass.Constexpr, sort_keys: cute.Tensor, lap, cta, num_ctas, turned):
    """The tile (q tile * heads + head) a deal gives CTA ``cta`` on lap ``lap``: position ``lap * m + cta``, or
    ``lap * m + m - 1 - cta`` on odd laps (:func:`serpentine_position`); with lap turns, where they won the vote
    (``turned``, :func:`deal_turned`), ``lap * m + (cta - shift) mod m``."""
    position = serpentine_position(lap, cta, num_ctas)
    if cutlass.const_expr(c.lap_turn):
        if turned != 0:
            position = turned_position(lap, cta, turn_table(c, sort_keys)[lap], num_ctas)
    heads = c.num_kv_heads
    return Int32(sort_keys[position // heads] & Int64((1 << INDEX_BITS) - 1)) * heads + position % heads


# ------------------------------------------------------------------------------ lap turns (c.lap_turn)

assert LAP_TURN_MAX_LAPS <= WARP  # the shifts' scan: one warp, a lane a lap
_WORDS = LAP_TURN_MAX_LAPS + 2  # Int32: each lap's shift, then the vote (1: turned) and padding


def turn_slots(c) -> int:
    """Int64 entries the lap turns take past the sort's keys (0 unless ``c.lap_turn``)."""
    return _WORDS // 2 if c.lap_turn else 0


@cute.jit
def turn_table(c: cutlass.Constexpr, sort_keys: cute.Tensor):
    """The shifts (``[0, LAP_TURN_MAX_LAPS)``) and the vote (``[LAP_TURN_MAX_LAPS]``) past the sort's keys."""
    return cute.make_tensor(cute.recast_ptr(sort_keys.iterator + sort_key_slots(c), dtype=Int32),
                            cute.make_layout(_WORDS))


@cute.jit
def turned_deal_loads(c: cutlass.Constexpr, tidx, sort_keys: cute.Tensor, warp_sums: cute.Tensor, num_tiles,
                      num_ctas):
    """(the deal's busiest CTA, the item count of this thread's CTA in it) of the turned deal where it beats the
    serpentine, else of the serpentine; the shifts and the vote into :func:`turn_table`. Every thread calls it
    (barriers). Deals of more than LAP_TURN_MAX_LAPS laps take the serpentine without pricing the turn."""
    table = turn_table(c, sort_keys)
    laps = (num_tiles + num_ctas - 1) // num_ctas
    busiest = Int64(0)
    count = Int32(0)
    if laps > LAP_TURN_MAX_LAPS:  # uniform
        busiest, count = serpentine_loads(c, tidx, sort_keys, warp_sums, num_tiles, num_ctas)
        if tidx == 0:
            table[LAP_TURN_MAX_LAPS] = Int32(0)
        cute.arch.sync_threads()
    else:
        busiest, count = _priced_turn(c, tidx, sort_keys, warp_sums, num_tiles, num_ctas, laps, table)
    return busiest, count


@cute.jit
def _priced_turn(c: cutlass.Constexpr, tidx, sort_keys: cute.Tensor, warp_sums: cute.Tensor, num_tiles, num_ctas,
                 laps, table: cute.Tensor):
    """:func:`turned_deal_loads` of at most LAP_TURN_MAX_LAPS laps: warp 0 finds each lap's leading run (a binary
    search a lane) and scans the shifts; then each CTA's loads under both deals, and the vote."""
    heads = c.num_kv_heads
    m = num_ctas
    if tidx < WARP:
        leading = Int32(0)  # this lane's lap: its positions at its first cost, mod m
        if tidx < laps:
            first = tidx * m
            lead = key_cost(sort_keys[first // heads])
            lo = first + 1
            hi = cutlass.min(first + m, num_tiles)
            while lo < hi:  # the first position of a lower cost (costs fall along the positions)
                mid = (lo + hi) // 2
                if key_cost(sort_keys[mid // heads]) < lead:
                    hi = mid
                else:
                    lo = mid + 1
            leading = lo - first
            if leading == m:
                leading = Int32(0)
        inclusive = warp_inclusive_sum(leading, tidx)
        if tidx < laps:  # at most LAP_TURN_MAX_LAPS * m: an Int32 remainder
            table[tidx] = (inclusive - leading) % m
    cute.arch.sync_threads()
    serpentine_load = Int64(0)
    turned_load = Int64(0)
    serpentine_count = Int32(0)
    turned_count = Int32(0)
    if tidx < m:
        # unrolled, and branch-free (a clamped position's key times 0 or 1), so that the laps' shared-memory loads
        # issue back to back: a guard a load put each in its own branch region, one latency after another (SASS,
        # session 28; the rolled loop with a division: ~280 cycles a lap on the H200, unrolled with guards ~170)
        for lap in cutlass.range(laps, unroll=4):
            cost, dealt = _position_cost(c, sort_keys, serpentine_position(lap, tidx, m), num_tiles)
            serpentine_load = serpentine_load + cost
            serpentine_count = serpentine_count + dealt
            cost, dealt = _position_cost(c, sort_keys, turned_position(lap, tidx, table[lap], m), num_tiles)
            turned_load = turned_load + cost
            turned_count = turned_count + dealt
    serpentine_max, turned_max = block_max_pair(serpentine_load, turned_load, tidx, warp_sums)
    busiest = serpentine_max
    count = serpentine_count
    turned = Int32(0)
    if turned_max < serpentine_max:
        busiest = turned_max
        count = turned_count
        turned = Int32(1)
    if tidx == 0:
        table[LAP_TURN_MAX_LAPS] = turned
    cute.arch.sync_threads()
    return busiest, count


@cute.jit
def _position_cost(c: cutlass.Constexpr, sort_keys: cute.Tensor, position, num_tiles):
    """(the cost of deal position ``position``, 1), or (0, 0) past the last of ``num_tiles``: the key is loaded at the
    clamped position either way, so a loop of these has no branch around its loads."""
    dealt = Int32(position < num_tiles)
    key = sort_keys[cutlass.min(position, num_tiles - 1) // c.num_kv_heads]
    return key_cost(key) * Int64(dealt), dealt


@cute.jit
def deal_turned(c: cutlass.Constexpr, sort_keys):
    """1 where :func:`turned_deal_loads` voted for the turned deal, else 0 (always 0 without ``c.lap_turn`` or a
    deal). The lists phase reads it once a pass, not once an item (+1.6 k cycles at 32 x 992, session 28)."""
    turned = Int32(0)
    if cutlass.const_expr(c.lap_turn and sort_keys is not None):
        turned = turn_table(c, sort_keys)[LAP_TURN_MAX_LAPS]
    return turned


@cute.jit
def turned_position(lap, cta, shift, num_ctas):
    """The turned deal's position for CTA ``cta`` on lap ``lap`` of shift ``shift``: ``lap * m + (cta - shift) mod m``
    for ``cta``, ``shift`` in ``[0, m)``, the modulo a select, not a division (:func:`serpentine_position`'s twin)."""
    rotated = cta - shift
    if rotated < 0:
        rotated = rotated + num_ctas
    return lap * num_ctas + rotated

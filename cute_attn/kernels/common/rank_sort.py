"""The sorted deal's order past its sort's keys: each q tile's rank from the requests' shapes
(``rank_deal_max_q_tiles``).

The deal orders q tiles by kv tiles (capped at ``sort_tile_cap``), most first, ties in line order (the numpy twin's
stable argsort). In a causal request a tile's key end never falls along its tiles (natural order), so the tiles of
request ``b`` with at least ``x`` kv tiles are a suffix of closed length (:func:`tiles_reaching`), and a tile of
``k`` kv tiles sits at

    rank = sum_{b' < b} count_{b'}(>= k) + sum_{b' >= b} count_{b'}(>= k + 1) + (its own equal tiles before it)

where the last term is its line position less the first equal tile's (a natural line) or a count over the zigzag's two
halves (:func:`zigzag_before`). ``plan_partition.deal_rank`` is the numpy mirror (``tests/test_rank_deal.py`` checks it
against the stable sort). Each thread walks the requests once for its q tiles, so the planner takes this way only for
small batches (``plan_partition.dealable``: batch x ceil(q tiles / 512) <= ``RANK_DEAL_MAX_WORK``) and only past the
bitonic sort's keys: at 8 x 992 prefill (1984 q tiles, 8 requests) it measured no faster than that sort (session 24:
5.8 k against 5.4 k cycles), but it has no key limit but the keys' shared memory. Built in session 24; correct on the
H200 in session 25, its 16K A/B within noise (``config.RANK_DEAL_MAX_Q_TILES``, off).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ...plan_partition import sort_tile_cap
from .planner_collectives import NUM_THREADS


@cute.jit
def tiles_reaching(c: cutlass.Constexpr, q_len, kv_len, faulted, n, x):
    """``plan_partition.tiles_reaching`` on the device (Int32; ``n``: the request's q tiles)."""
    cap = sort_tile_cap(c.deal_max_q_tiles)
    count = Int32(0)
    if x <= 0:
        count = n
    elif x <= cap and faulted == 0:
        keys = (x - 1) * c.kv_tile + 1
        if keys <= kv_len:
            z = keys - 1 - (kv_len - q_len)
            if z <= 0:
                count = n
            elif q_len > z:
                count = cutlass.max(n - c.group_size * z // c.rows_per_tile, Int32(0))
    return count


@cute.jit
def zigzag_before(n, lo, hi, position):
    """``plan_partition.zigzag_before``: how many of tiles ``lo .. hi - 1`` of a zigzag request lie before
    ``position`` on its line (even positions: the first half in order; odd: the second half from its end)."""
    half = (n + 1) // 2
    low = cutlass.max(cutlass.min(cutlass.min(hi, half), (position + 1) // 2) - lo, Int32(0))
    high = Int32(0)
    if position >= 2:  # (position - 2) // 2 >= 0: no negative division (PTX truncates toward zero)
        high = cutlass.max(hi - cutlass.max(cutlass.max(lo, half), n - 1 - (position - 2) // 2), Int32(0))
    return low + high


@cute.jit
def rank_sort(c: cutlass.Constexpr, per_thread: cutlass.Constexpr, tidx, q_tiles, requests, num_q_tiles, batch,
              rank: cute.Tensor):
    """``rank[r]`` = the deal position of q tile ``tidx + r * NUM_THREADS`` for ``r < per_thread`` (where it exists).
    ``requests`` columns: first q tile, kv_len, q_len, rule faults (the q tiles' own view)."""
    cap = sort_tile_cap(c.deal_max_q_tiles)
    bucket = cute.make_rmem_tensor((per_thread,), Int32)
    owner = cute.make_rmem_tensor((per_thread,), Int32)
    for r in cutlass.range_constexpr(per_thread):
        i = tidx + r * NUM_THREADS
        rank[r] = Int32(0)
        bucket[r] = Int32(0)
        owner[r] = Int32(-1)
        if i < num_q_tiles:
            owner[r] = q_tiles[i, 0]
            bucket[r] = cutlass.min((q_tiles[i, 3] + c.kv_tile - 1) // c.kv_tile, Int32(cap))
    for b in range(batch):
        kv_len = requests[b, 1]
        q_len = requests[b, 2]
        faulted = requests[b, 3]
        n = (q_len * c.group_size + c.rows_per_tile - 1) // c.rows_per_tile
        for r in cutlass.range_constexpr(per_thread):
            if owner[r] >= 0:
                k = bucket[r]
                if b < owner[r]:
                    rank[r] = rank[r] + tiles_reaching(c, q_len, kv_len, faulted, n, k)
                else:
                    longer = tiles_reaching(c, q_len, kv_len, faulted, n, k + 1)
                    rank[r] = rank[r] + longer
                    if b == owner[r]:  # its own equal tiles before it on the line
                        lo = n - tiles_reaching(c, q_len, kv_len, faulted, n, k)
                        position = tidx + r * NUM_THREADS - requests[b, 0]
                        if cutlass.const_expr(c.zigzag):
                            rank[r] = rank[r] + zigzag_before(n, lo, n - longer, position)
                        else:
                            rank[r] = rank[r] + position - lo

"""The sorted deal's order without a sort: each q tile's rank computed from the requests' shapes.

The deal orders q tiles by kv tiles (capped at ``sort_tile_cap``), most first, ties in line order (the numpy twin's
stable argsort). In a causal request without zigzag a q tile's key end never falls along its tiles, so the tiles of
request ``b`` with at least ``x`` kv tiles are a suffix of its tiles, whose length has a closed form
(:func:`tiles_reaching`). A tile of request ``b`` at ``local`` with ``k`` kv tiles then sits at

    rank = sum_{b' < b} count_{b'}(>= k) + sum_{b' >= b} count_{b'}(>= k + 1) + local - n_b + count_b(>= k)

(the longer tiles of every request, the equal ones of earlier requests, its place among its own equal ones), and is
written to ``sort_keys[rank]`` once: a permutation, the same order the bitonic sort (``sorted_deal.fast_sort``) builds.
A thread's tiles walk the requests once (``batch`` steps, each tile O(1) a step), so it pays where ``batch`` times a
thread's tiles is small (``RANK_SORT_MAX_WORK``), and skips the bitonic sort's ten barrier-separated shared-memory
stages. Checked exhaustively against the stable argsort in ``tests/test_rank_sort.py`` (CPU, the formula's numpy
mirror) and by the GPU tier's twin tests (device lists equal ``plan_partition``'s).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ...plan_partition import sort_tile_cap
from .planner_collectives import NUM_THREADS

#: the rank sort runs when batch x (a thread's q tiles) is at most this (else the bitonic sort); 8 x 992 prefill
#: (1984 q tiles: four a thread) is 32, the MLA seed (28 requests, 500 q tiles) 28
RANK_SORT_MAX_WORK = 64


def tiles_reaching_py(q_len: int, kv_len: int, faulted: bool, x: int, *, group: int, rows: int, kv_tile: int,
                      cap: int) -> int:
    """The numpy twin's view of :func:`tiles_reaching`: how many q tiles of a causal request hold at least ``x`` kv
    tiles (capped at ``cap``)."""
    n = -(-q_len * group // rows)
    if x <= 0:
        return n
    if x > cap or faulted:
        return 0
    keys = (x - 1) * kv_tile + 1  # at least x kv tiles <=> a key end of at least this
    if keys > kv_len:
        return 0
    z = keys - 1 - (kv_len - q_len)  # the tile's last row must reach token z
    if z <= 0:
        return n
    if q_len <= z:
        return 0
    return max(n - group * z // rows, 0)


@cute.jit
def tiles_reaching(c: cutlass.Constexpr, q_len, kv_len, faulted, n, x):
    """:func:`tiles_reaching_py` on the device (Int32; ``n``: the request's q tiles)."""
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
            rank[r] = i - requests[owner[r], 0]  # its place in its request
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
                    rank[r] = rank[r] + tiles_reaching(c, q_len, kv_len, faulted, n, k + 1)
                    if b == owner[r]:
                        rank[r] = rank[r] + tiles_reaching(c, q_len, kv_len, faulted, n, k) - n

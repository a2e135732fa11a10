"""The sorted deal's order by counting, where the q tiles' keys take few values (``DevicePlannerConfig.count_sort``).

The deal wants the q tiles most kv tiles first, ties in index order (the numpy twin's stable sort; ``sorted_deal``'s
bitonic sort orders the same keys). Where every tile holds fewer than :data:`COUNT_BINS` kv tiles (a 992-key causal
request has 8 at kv_tile 128, one of 16 K keys 128 at kv_tile 64: past the bins the bitonic sort stays), a key's bin
is ``COUNT_BINS - 1 - tiles`` and its slot is

    (keys in lower bins) + (keys of its bin in earlier chunks) + (keys of its bin before it in its chunk)

where a chunk is one warp's 32 keys of one round (a thread holds key ``tidx + r * NUM_THREADS`` in round ``r``), so
chunks in (round, warp) order are index order. The last term is ``popc(match.any(bin) & lanemask_lt)``; each key
group's first lane writes its count to ``counts[bin, chunk]`` (bin-major), and one block-wide exclusive scan of those
counts gives the first two terms. Four barriers and one scan against the bitonic sort's 45-66 stages (it measured
5.4 k cycles at 2048 keys, session 24). The counts live where the bitonic sort keeps its second buffer: the Int32 view
of ``sort_keys[most : 2 * most]``, ``COUNT_BINS`` x (warps x rounds) of them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan_partition import sort_tile_cap
from .planner_collectives import NUM_THREADS, NUM_WARPS, WARP, block_exclusive_sum

COUNT_BINS = 64  # kv tiles a key may hold (0 .. COUNT_BINS - 1) for the counting order


def count_chunks(most: int) -> int:
    """Chunks of 32 keys over ``most`` keys (warps x rounds)."""
    return NUM_WARPS * (most // NUM_THREADS)


def count_slots(most: int) -> int:
    """Int32 counts the order needs: the bitonic sort's second buffer holds exactly these (``2 * most``)."""
    return COUNT_BINS * count_chunks(most)


for _most in (1024, 2048):
    assert count_slots(_most) == 2 * _most and count_slots(_most) % NUM_THREADS == 0
    assert COUNT_BINS - 1 <= sort_tile_cap(_most)


@cute.jit
def key_tiles(c: cutlass.Constexpr, kv_end):
    """A q tile's kv tiles as the sort keys hold them (capped: ``sorted_deal.fast_sort_key``)."""
    return cutlass.min((kv_end + c.kv_tile - 1) // c.kv_tile, Int32(sort_tile_cap(c.deal_max_q_tiles)))


@cute.jit
def count_order(c: cutlass.Constexpr, tiles: cute.Tensor, slots: cute.Tensor, num_q_tiles, tidx,
                sort_keys: cute.Tensor, warp_sums: cute.Tensor):
    """``slots[r]`` = the deal-order slot of this thread's q tile of round ``r`` (``tidx + r * NUM_THREADS``, if
    below ``num_q_tiles``), from ``tiles[r]``, its kv tiles (every tile below COUNT_BINS; the caller checked). Every
    thread calls it; the counts use ``sort_keys``' second half, so the caller may write ``sort_keys[slots[r]]`` at
    once."""
    most = c.deal_max_q_tiles
    rounds = most // NUM_THREADS
    chunks = count_chunks(most)
    per_thread = count_slots(most) // NUM_THREADS
    counts = cute.make_tensor(cute.recast_ptr(sort_keys.iterator + most, dtype=Int32),
                              cute.make_layout(count_slots(most)))
    lane = tidx % WARP
    warp = tidx // WARP
    for e in cutlass.range_constexpr(per_thread):
        counts[tidx + e * NUM_THREADS] = Int32(0)
    cute.arch.sync_threads()
    ranks = cute.make_rmem_tensor((rounds,), Int32)
    below = cute.arch.lanemask_lt()
    for r in cutlass.range_constexpr(rounds):
        i = tidx + r * NUM_THREADS
        valid = Int32(i < num_q_tiles)
        # a key past num_q_tiles matches no key of a bin (COUNT_BINS + lane is its own)
        bin_ = (COUNT_BINS - 1 - tiles[r]) * valid + (COUNT_BINS + lane) * (1 - valid)
        group = cute.arch.match_sync(0xFFFFFFFF, bin_, "any")
        ranks[r] = Int32(cute.arch.popc(group & below))
        if valid != 0:
            if ranks[r] == 0:  # the group's first lane counts it
                counts[bin_ * chunks + r * NUM_WARPS + warp] = Int32(cute.arch.popc(group))
    cute.arch.sync_threads()
    # bin-major exclusive scan: a thread's per_thread consecutive counts, then the CTA's prefix of their sums
    firsts = cute.make_rmem_tensor((per_thread,), Int32)
    run = Int32(0)
    for e in cutlass.range_constexpr(per_thread):
        firsts[e] = run
        run = run + counts[tidx * per_thread + e]
    before, _ = block_exclusive_sum(Int64(run), tidx, warp_sums)
    for e in cutlass.range_constexpr(per_thread):
        counts[tidx * per_thread + e] = Int32(before) + firsts[e]
    cute.arch.sync_threads()
    for r in cutlass.range_constexpr(rounds):
        bin_ = cutlass.max(cutlass.min(COUNT_BINS - 1 - tiles[r], Int32(COUNT_BINS - 1)), Int32(0))
        slots[r] = counts[bin_ * chunks + r * NUM_WARPS + warp] + ranks[r]


def count_order_host(tiles, most: int):
    """:func:`count_order`'s slots in numpy (tests): ``tiles`` the q tiles' kv tiles in index order (each below
    COUNT_BINS, at most ``most`` of them); the same chunks, bins and bin-major scan."""
    import numpy as np

    tiles = np.asarray(tiles, dtype=np.int64)
    n = tiles.size
    rounds, chunks = most // NUM_THREADS, count_chunks(most)
    index = np.arange(n)
    chunk = (index // NUM_THREADS) * NUM_WARPS + (index % NUM_THREADS) // WARP
    bins = COUNT_BINS - 1 - tiles
    counts = np.zeros(COUNT_BINS * chunks, dtype=np.int64)
    np.add.at(counts, bins * chunks + chunk, 1)
    bases = np.concatenate(([0], np.cumsum(counts)[:-1]))
    ranks = np.zeros(n, dtype=np.int64)
    for i in range(n):  # keys of its bin before it in its chunk (its warp's lanes below it)
        lane_start = i - i % WARP
        ranks[i] = int(np.sum(bins[lane_start:i] == bins[i]))
    assert rounds * NUM_THREADS == most
    return bases[bins * chunks + chunk] + ranks

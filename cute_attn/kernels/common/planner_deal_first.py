"""The device planner's deal before its cuts (``PlanConfig.deal_first``; ``plan_partition.deals_first`` is the twin).

Where the longest tile is within ``W + W / 2**DEAL_FIRST_SHIFT`` the planning CTA makes the sorted deal before any
cut and keeps it, with no cuts made, when its busiest CTA is within that bound too (and even pieces cannot take the
batch); otherwise it cuts and decides against the same deal by ``sorted_deal.cuts_bound``, as the cuts-first rule
does. Two builds of the same rule:

- :func:`deal_first` (the default): the deal here, and ``sorted_deal.sorted_deal`` after the cuts makes it where this
  did not; the deal's unrolled sort is in the kernel twice.
- :func:`deal_first_one_site` (``DevicePlannerConfig.deal_one_site``, an A/B build): the cuts, when they must come
  first, at one call site and the deal at one (``cut_line`` twice instead), so the sort's code is in the kernel once.
  H200, session 25, MLA prefill's default call (200 runs, one machine): cuts first 46.0 / 58.8 us (the seed /
  1 / 1028), two sites 47.3 / 59.9, one site 46.8 / 59.4: half of what deal-first costs MLA there is the code's size.
  Session 26, GQA prefill (deal-first's kind; 200 runs): two sites 169.1 / 40.4 us (8 x 992 / 1 x 992 at h16/kv1),
  one site 170.8 / 40.9, so the default stays two sites (GPU tests and memcheck / racecheck of both clean).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan_partition import DEAL_FIRST_SHIFT
from .planner_collectives import block_max
from .planner_cuts import cut_line
from .sorted_deal import cuts_bound, deal_loads, dealable


@cute.jit
def deal_first(c: cutlass.Constexpr, tidx, q_tiles, requests, sort_keys, warp_sums, num_q_tiles, num_ctas, batch,
               width, uniform, longest):
    """(1 when the deal is kept with no cuts made, the item count of this thread's CTA in it, its busiest CTA or -1
    when it was not made). It is made when the longest tile (``longest``: this thread's) fits the bound, so could be
    kept (a batch of few long tiles goes to the cuts with no sort: GQA prefill 1 x 992 at h16/kv1); kept near the mean
    and not where even pieces may cut the batch. Every thread calls it."""
    deal = Int32(0)
    count = Int32(0)
    busiest = Int64(-1)
    bound = width + (width >> DEAL_FIRST_SHIFT)
    if dealable(c, num_q_tiles, batch) != 0:
        if block_max(longest, tidx, warp_sums) <= bound:
            busiest, count = deal_loads(c, tidx, q_tiles, requests, sort_keys, warp_sums, num_q_tiles, num_ctas,
                                        batch)
            if busiest <= bound and uniform == 0:
                deal = Int32(1)
    return deal, count, busiest


@cute.jit
def deal_first_one_site(c: cutlass.Constexpr, min_width_keys: cutlass.Constexpr, stamp: cutlass.Constexpr, tidx,
                        q_tiles, q_tile_start, requests, warp_sums, flags, cut_tile, cut_key, stage, sort_keys, batch,
                        num_q_tiles, num_ctas, total_cost, width, active, uniform, longest, trace):
    """The whole decision (deal first, else cut; then the deal against the cuts) with ``deal_loads`` at one call site.
    Returns (deal, the item count of this thread's CTA in it). Every thread calls it."""
    first_bound = width + (width >> DEAL_FIRST_SHIFT)
    can_deal = dealable(c, num_q_tiles, batch)
    first = Int32(0)  # uniform over the CTA: the deal comes before any cut
    if can_deal != 0:
        if block_max(longest, tidx, warp_sums) <= first_bound:
            first = Int32(1)
    bound = first_bound
    make = first
    if first == 0:  # the cuts first, as the cuts-first rule
        split, snap_max, longest = cut_line(c, True, min_width_keys, stamp, tidx, q_tiles, q_tile_start, cut_tile,
                                            cut_key, stage, warp_sums, flags, trace, num_q_tiles, num_ctas,
                                            total_cost, width, active, uniform, longest)
        stamp(trace, 5, tidx)
        bound = cuts_bound(c, tidx, split, snap_max, q_tiles, q_tile_start, cut_tile, cut_key, warp_sums,
                           num_q_tiles, num_ctas, width, total_cost)
        if can_deal != 0 and longest <= bound:
            make = Int32(1)
    busiest = Int64(-1)
    count = Int32(0)
    if make != 0:
        busiest, count = deal_loads(c, tidx, q_tiles, requests, sort_keys, warp_sums, num_q_tiles, num_ctas, batch)
    deal = Int32(0)
    if first != 0:
        if busiest <= first_bound and uniform == 0:
            deal = Int32(1)  # kept: no cuts made
        else:  # made first and not kept: the cuts now, and the same rule against them
            split, snap_max, longest = cut_line(c, True, min_width_keys, stamp, tidx, q_tiles, q_tile_start,
                                                cut_tile, cut_key, stage, warp_sums, flags, trace, num_q_tiles,
                                                num_ctas, total_cost, width, active, uniform, longest)
            stamp(trace, 5, tidx)
            if busiest <= cuts_bound(c, tidx, split, snap_max, q_tiles, q_tile_start, cut_tile, cut_key, warp_sums,
                                     num_q_tiles, num_ctas, width, total_cost):
                deal = Int32(1)
    elif make != 0 and busiest <= bound:
        deal = Int32(1)
    return deal, count

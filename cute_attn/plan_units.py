"""The planner-free prefill's units on the host: the numpy twin of ``kernels/common/unit_schedule.py``.

A self-scheduling build (``PagedAttentionConfig.dynamic_schedule``) makes no plan: its CTAs take unit indices from a
counter and decode each from ``qo_indptr`` alone. This module says which item each index is, in numpy, so tests and
the cost model (``tools/dynamic_schedule_model.py``) use exactly the kernel's order:

* :func:`unit_items` -- every unit as an unsplit work item (``plan.ItemField`` rows), in unit order: requests in batch
  order, a request's q tiles from its last (most keys under the causal mask) to its first, KV heads innermost; or,
  for a build with ``rank_major_units`` k and a batch whose requests all have as many q tiles and at most k units a
  CTA (:func:`rank_major`), rank-major: every request's last q tile, then every second-last, ..., requests then KV
  heads inside a rank (longest first, the order list scheduling balances best at one or two units a CTA);
* :func:`locate_as_the_kernel_does` -- the producer warp's search for a unit's request step by step (32-request
  windows of a warp-wide prefix, resumed at the request where the CTA's previous unit was), for CPU tests of it;
* :func:`unit_costs`, :func:`claim_ahead_makespan`, :func:`claim_late_makespan` -- the planner's cost model of the
  kernel's schedule (the counter hands unit n + 1 to the CTA that claims first; the early build claims as its
  current unit's loads begin, the ``late_claim`` build once its last K tile is issued), and
  :func:`self_schedule_wins`, the rule a host plan uses to launch the self-scheduling build instead of its items.
"""

from __future__ import annotations

import heapq

import numpy as np

from .plan import ItemField, PlanConfig, _cost, _tiles

WARP = 32

__all__ = ["request_units", "rank_major", "unit_items", "locate_as_the_kernel_does", "unit_costs",
           "claim_ahead_makespan", "claim_late_makespan", "self_schedule_wins"]


def request_units(config: PlanConfig, q_lens) -> np.ndarray:
    """Units of each request: its q tiles of ``config.tile_q_rows`` packed rows, times the KV heads."""
    rows = np.asarray(q_lens, dtype=np.int64) * config.group_size
    return -(-rows // config.tile_q_rows) * config.num_kv_heads


def rank_major(config: PlanConfig, q_lens, rank_major_units: int) -> bool:
    """Whether a build with ``rank_major_units`` (``PagedAttentionConfig.rank_major_units``) takes this batch's units
    rank-major, as the kernel decides it (``unit_schedule.check_batch``): every request has as many units, and the
    batch at most ``rank_major_units`` a CTA (``config.num_ctas`` CTAs)."""
    units = request_units(config, q_lens)
    return bool(rank_major_units > 0 and units.size and np.all(units == units[0])
                and units.sum() <= rank_major_units * config.num_ctas)


def unit_items(config: PlanConfig, q_lens, kv_lens, rank_major_units: int = 0) -> np.ndarray:
    """``[units, len(ItemField)]`` int32: unit ``u``'s item (what the kernel's ``unit_fields`` computes for it), in the
    order of a build with ``rank_major_units`` (module docstring)."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    tiles = _tiles(config, q_lens, kv_lens)  # q tiles request-major, ascending within a request
    request = tiles.q_tiles[:, ItemField.REQUEST]
    last = np.searchsorted(request, request, side="right") - 1  # each q tile's request's last tile
    rank = last - np.arange(request.size)  # 0: a request's last (longest) tile
    if rank_major(config, q_lens, rank_major_units):
        order = np.lexsort((request, rank))  # by rank, then request
    else:
        order = np.lexsort((rank, request))  # by request, then from its last tile down
    heads = config.num_kv_heads
    items = np.repeat(tiles.q_tiles[order], heads, axis=0)
    items[:, ItemField.KV_HEAD] = np.tile(np.arange(heads, dtype=np.int32), order.size)
    items[:, ItemField.KV_PAGE_START] = -1  # a unit reads its pages from kv_indptr (the kernel keeps no such field)
    return items


def locate_as_the_kernel_does(units_per_request: np.ndarray, unit_indices) -> list[tuple[int, int]]:
    """``(request, local)`` of each unit index of one CTA (increasing, as the counter hands them out), found as the
    producer warp finds them (``unit_schedule.locate_unit``): lanes hold the units of requests ``base .. base + 31``,
    an inclusive prefix over them, and the lowest lane whose prefix passes ``u`` is its request; ``base`` / ``before``
    carry over to the CTA's next unit. An index past the batch's units gives ``(batch, 0)``."""
    batch = len(units_per_request)
    total = int(np.sum(units_per_request))
    base = before = 0
    out = []
    for u in unit_indices:
        if u >= total:
            out.append((batch, 0))
            continue
        while True:
            mine = [int(units_per_request[base + lane]) if base + lane < batch else 0 for lane in range(WARP)]
            inclusive = np.cumsum(mine)
            if u < before + inclusive[-1]:
                first = int(np.flatnonzero(before + inclusive > u)[0])
                start = before + int(inclusive[first]) - mine[first]
                out.append((base + first, u - start))
                base, before = base + first, start
                break
            base, before = base + WARP, before + int(inclusive[-1])
            if base >= batch:
                out.append((batch, 0))
                break
    return out


def unit_costs(config: PlanConfig, q_lens, kv_lens, rank_major_units: int = 0) -> np.ndarray:
    """Each unit's cost in the planner's model (``plan._cost``: keys rounded to the kv tile, plus the item overhead),
    in the counter's order."""
    items = unit_items(config, q_lens, kv_lens, rank_major_units)
    return _cost(items[:, ItemField.KV_END].astype(np.int64), config)


def claim_ahead_makespan(costs, num_ctas: int) -> int:
    """Busiest CTA when each CTA claims its next unit as it starts its current one (the first two rounds of claims
    go round the CTAs in order: every CTA takes one, then a second, before any finishes)."""
    costs = [int(c) for c in costs]
    queued = [[] for _ in range(num_ctas)]
    taken = 0
    for _ in range(2):
        for cta in range(num_ctas):
            if taken < len(costs):
                queued[cta].append(costs[taken])
                taken += 1
    heap = [(queued[cta].pop(0), cta) for cta in range(num_ctas) if queued[cta]]
    heapq.heapify(heap)
    ends = [0] * num_ctas
    while heap:
        end, cta = heapq.heappop(heap)
        ends[cta] = end
        if queued[cta]:
            current = queued[cta].pop(0)
            if taken < len(costs):
                queued[cta].append(costs[taken])
                taken += 1
            heapq.heappush(heap, (end + current, cta))
    return max(ends)


def claim_late_makespan(costs, num_ctas: int, lead: int) -> int:
    """Busiest CTA when each CTA claims its next unit ``lead`` key-equivalents before its current one ends (its last
    K tile issued), never before the current one starts."""
    costs = np.asarray(costs, dtype=np.int64).tolist()  # Python ints: the loop below is the model's host time
    ends = [0] * num_ctas
    heap = []
    for cta, cost in enumerate(costs[:num_ctas]):
        ends[cta] = cost
        heap.append((max(0, cost - lead), cta))
    heapq.heapify(heap)
    replace = heapq.heapreplace
    for cost in costs[num_ctas:]:
        cta = heap[0][1]
        start = ends[cta]
        end = start + cost
        ends[cta] = end
        replace(heap, (max(start, end - lead), cta))
    return max(ends)


def self_schedule_wins(config: PlanConfig, q_lens, kv_lens, host_busiest: int, late_claim: bool,
                       min_units_per_cta: int, max_units: int, rank_major_units: int = 0) -> bool:
    """Whether the self-scheduling build runs this batch no slower than a host plan whose busiest CTA costs
    ``host_busiest``: at least ``min_units_per_cta`` units a CTA (fewer: the route only ties the plan and pays its
    start's index checks, MLA 1 / 43 10.5 against 9.5 us), and the model's busiest CTA under the build's claim no
    higher than the plan's. The H200 (session 37) ran the route at or below the host plan on every row where this
    holds (GQA prefill 4..32 x 992 0.92-0.98x, 4 x 512 / 4096 0.99x, h32/kv16 0.93x; MLA 1 x 16384 a tie) and above
    it where the model says the plan is better (ragged 12 1.04x, h5/kv1 1.19x, the MLA seed 1.07x, 20 x 3842 1.01x).
    A rank-major batch (``rank_major_units``) must also win in request-major order: the rank-major order alone
    modelled wins at h5/kv1 and h6/kv1 8 x 992 where the route ran 1.03x the plan (H100, session 42).
    Past ``max_units`` it says no without modelling: the model is a Python heap, ~0.5 us a unit on the host."""
    units = int(request_units(config, q_lens).sum())
    if not min_units_per_cta * config.num_ctas <= units <= max_units:
        return False
    orders = (rank_major_units, 0) if rank_major(config, q_lens, rank_major_units) else (0,)
    for order in orders:
        costs = unit_costs(config, q_lens, kv_lens, order)
        if late_claim:
            busiest = claim_late_makespan(costs, config.num_ctas, 2 * config.kv_tile)
        else:
            busiest = claim_ahead_makespan(costs, config.num_ctas)
        if busiest > host_busiest:
            return False
    return True

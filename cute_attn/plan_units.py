"""The planner-free prefill's units on the host: the numpy twin of ``kernels/common/unit_schedule.py``.

A self-scheduling build (``PagedAttentionConfig.dynamic_schedule``) makes no plan: its CTAs take unit indices from a
counter and decode each from ``qo_indptr`` alone. This module says which item each index is, in numpy, so tests and
the cost model (``tools/dynamic_schedule_model.py``) use exactly the kernel's order:

* :func:`unit_items` -- every unit as an unsplit work item (``plan.ItemField`` rows), in unit order: requests in batch
  order, a request's q tiles from its last (most keys under the causal mask) to its first, KV heads innermost;
* :func:`locate_as_the_kernel_does` -- the producer warp's search for a unit's request step by step (32-request
  windows of a warp-wide prefix, resumed at the request where the CTA's previous unit was), for CPU tests of it.
"""

from __future__ import annotations

import numpy as np

from .plan import ItemField, PlanConfig, _tiles

WARP = 32

__all__ = ["request_units", "unit_items", "locate_as_the_kernel_does"]


def request_units(config: PlanConfig, q_lens) -> np.ndarray:
    """Units of each request: its q tiles of ``config.tile_q_rows`` packed rows, times the KV heads."""
    rows = np.asarray(q_lens, dtype=np.int64) * config.group_size
    return -(-rows // config.tile_q_rows) * config.num_kv_heads


def unit_items(config: PlanConfig, q_lens, kv_lens) -> np.ndarray:
    """``[units, len(ItemField)]`` int32: unit ``u``'s item (what the kernel's ``unit_fields`` computes for it)."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    tiles = _tiles(config, q_lens, kv_lens)  # q tiles request-major, ascending within a request
    request = tiles.q_tiles[:, ItemField.REQUEST]
    last = np.searchsorted(request, request, side="right") - 1  # each q tile's request's last tile
    order = np.lexsort((last - np.arange(request.size), request))  # by request, then from its last tile down
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

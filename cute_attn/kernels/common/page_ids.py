"""Page ids for stages built from several small pages (device helpers, both arches).

A stage (key tile) of ``kv_tile`` keys with pages of ``page_size < kv_tile`` keys is ``kv_tile / page_size`` TMA
boxes, one per page, each with its page id as the box coordinate. The producer warp loads the ids it needs from
``kv_indices`` one per lane (coalesced, :func:`load_lane_page_ids`), then hands each box its id with a warp
shuffle (:func:`lane_page_id`); one elected lane then issues the stage's boxes back to back
(``common/tma_issue.py``). Ids of pages wholly past the item's keys are -1: such a box is out of bounds, which TMA
zero-fills while still counting its bytes, so a stage's full mbarrier always expects the whole stage.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

IDS_PER_LOAD = 32  # one page id per lane of the producer warp
LANE_IDS_BELOW = 8  # prefill: pages of 8+ keys keep their per-page id loads (<= 16 per tile); smaller ones use lanes


def id_loads(pages_per_stage: int) -> int:
    """Id registers per lane for one stage (page 1 in a 128-key tile: 4)."""
    return max(1, pages_per_stage // IDS_PER_LOAD)


@cute.jit
def load_lane_page_ids(kv_indices: cute.Tensor, lane_pages: cute.Tensor, first_index: Int32, n_pages: Int32,
                       lane: Int32):
    """``lane_pages[c] = kv_indices[first_index + 32 c + lane]`` for pages ``32 c + lane < n_pages``, else -1."""
    for c in cutlass.range_constexpr(cute.size(lane_pages)):
        p = c * IDS_PER_LOAD + lane
        lane_pages[c] = Int32(-1)
        if p < n_pages:
            lane_pages[c] = kv_indices[first_index + p]


@cute.jit
def rotate_lane_page_ids(kv_indices: cute.Tensor, lane_pages: cute.Tensor, next_pages: cute.Tensor, next_first: Int32,
                         next_count: Int32, lane: Int32):
    """Software-pipelined ids: this round's move from ``next_pages`` (loaded a round earlier) to ``lane_pages``,
    and the next round's (``next_count`` pages from ``kv_indices[next_first]``; none when ``<= 0``) load into
    ``next_pages``. Their latency (a DRAM round trip on a new step's indices) then overlaps this round's box issue
    instead of stalling its first shuffle: at page 1 a round is one stage, so every stage paid it."""
    for c in cutlass.range_constexpr(cute.size(lane_pages)):
        lane_pages[c] = next_pages[c]
    load_lane_page_ids(kv_indices, next_pages, next_first, next_count, lane)


@cute.jit
def lane_page_id(lane_pages: cute.Tensor, i: cutlass.Constexpr[int], lane_offset: Int32 = 0) -> Int32:
    """Page ``lane_offset + i`` of the ids :func:`load_lane_page_ids` loaded (``lane_offset + i % 32 < 32``)."""
    return cute.arch.shuffle_sync(lane_pages[i // IDS_PER_LOAD], lane_offset + i % IDS_PER_LOAD)


@cute.jit
def load_tile_page_ids(kv_indices: cute.Tensor, page_ids: cute.Tensor, page_base: Int32, kv_base: Int32,
                       kv_end: Int32, page_size: cutlass.Constexpr[int]):
    """Pages of 8+ keys: ``page_ids[i]`` = the id of the tile's ``i``-th page (the tile starts at key ``kv_base`` of
    a request whose ids start at ``kv_indices[page_base]``), -1 for a page wholly past ``kv_end`` (TMA zero-fills
    its out-of-bounds box)."""
    for i in cutlass.range_constexpr(cute.size(page_ids)):
        pid = Int32(-1)
        if kv_base + i * page_size < kv_end:
            pid = kv_indices[page_base + kv_base // page_size + i]
        page_ids[i] = pid

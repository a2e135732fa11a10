"""Planner: request lengths -> fixed-capacity int32 work lists that persistent kernels consume.

Pure numpy, no torch, no GPU. Engines plan once per batch and replay the plan for every layer.

Units of work
    Query rows are *packed GQA rows*: row ``r`` of request ``b`` for KV head ``h`` is query token
    ``r // group`` and query head ``h * group + r % group``, so all query heads that read one KV head
    share each K/V tile (decode: the ``group`` heads of one token fill one tile). A *tile* is up to
    ``tile_q_rows`` consecutive packed rows of one (request, KV head). Its KV range is causally trimmed:
    keys past what its last row can see are never visited.

Split-KV
    A tile whose key range is long compared with the per-CTA share is cut into KV chunks (aligned to
    ``kv_tile``); each chunk writes a partial (o, lse) into a *partial slot*, and a merge entry lists
    the slots the combine step folds into the final output. A merge's slots are contiguous
    (``merge_indptr[m] .. merge_indptr[m+1]-1``) and each split item names its merge (``ItemField.MERGE``),
    so a kernel can fold the merge itself once its last chunk is done (decode does). Tiles are split only
    when the unsplit schedule leaves CTAs idle or unbalanced (max load > ``balance_limit`` x mean).

Scheduling
    Cost of an item = keys it visits (rounded to ``kv_tile``) + ``item_overhead_keys``. Items are placed
    longest-first on the least-loaded CTA (LPT).

Fixed capacity (CUDA graphs)
    Every array has a length fixed by :class:`PlanCapacity`, so device buffers allocated once can take
    any plan that fits, and a captured graph replays it. :meth:`PlanCapacity.for_limits` gives
    capacities that provably hold every batch within stated limits; :func:`plan_work` raises
    ``ValueError`` rather than return a plan that does not fit.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

__all__ = ["ItemField", "MergeField", "PlanConfig", "PlanCapacity", "WorkPlan", "plan_work", "MAX_CHUNKS_PER_CTA"]

MAX_CHUNKS_PER_CTA = 4  # split search tries 1..4 chunks per CTA; bounds the split items (see for_limits)
_EXACT_LPT_MAX_ITEMS = 4096  # beyond this, the round-based LPT (vectorised) is used


class ItemField(IntEnum):
    """Columns of ``WorkPlan.items`` (int32)."""

    REQUEST = 0
    KV_HEAD = 1
    Q_ROW_START = 2  # first packed row, relative to the request
    Q_ROW_COUNT = 3
    KV_START = 4  # keys [KV_START, KV_END) of the request
    KV_END = 5
    PARTIAL_SLOT = 6  # -1: write the final output directly; else the partial buffer slot
    CAUSAL_OFFSET = 7  # token t sees key j iff j <= t + CAUSAL_OFFSET (kv_len - q_len; huge if not causal)
    MERGE = 8  # -1 when PARTIAL_SLOT is -1; else the merge whose slot range holds PARTIAL_SLOT


class MergeField(IntEnum):
    """Columns of ``WorkPlan.merges`` (int32); slots are ``merge_indptr[m] .. merge_indptr[m+1]-1``."""

    REQUEST = 0
    KV_HEAD = 1
    Q_ROW_START = 2
    Q_ROW_COUNT = 3
    TOKEN_START = 4  # global row of the request's first query token (qo_indptr[request])


NOT_CAUSAL_OFFSET = np.iinfo(np.int32).max // 2


@dataclass(frozen=True)
class PlanConfig:
    """What the planner needs to know about the kernel and the machine."""

    num_qo_heads: int
    num_kv_heads: int
    causal: bool
    tile_q_rows: int  # packed rows per tile (the kernel's M tile)
    kv_tile: int  # keys per KV step; split chunks are multiples of it
    num_ctas: int  # persistent CTAs the kernel launches (SM count x CTAs per SM)
    item_overhead_keys: int = 128  # fixed cost of a work item, in key-equivalents
    balance_limit: float = 1.25  # split when the unsplit max CTA load exceeds this x the mean
    max_imbalance: float = 1.3  # among ways to split, prefer those within this max/mean CTA load
    allow_split: bool = True
    min_chunk_keys: int = 0  # split chunks are at least this long (fewer partials to merge; a tuning knob)

    def __post_init__(self):
        for name in ("num_qo_heads", "num_kv_heads", "tile_q_rows", "kv_tile", "num_ctas"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlanConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"PlanConfig.num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.item_overhead_keys < 0:
            raise ValueError("PlanConfig.item_overhead_keys must be >= 0")

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


@dataclass(frozen=True)
class PlanCapacity:
    """Lengths of the plan arrays (and so of the device buffers a CUDA graph captures)."""

    max_items: int
    max_partials: int
    max_merges: int

    @staticmethod
    def for_limits(config: PlanConfig, *, max_batch: int, max_total_q: int) -> "PlanCapacity":
        """Capacities that hold every plan of at most ``max_batch`` requests and ``max_total_q`` query tokens.

        Tiles: request b has ``ceil(q_b * group / tile_q_rows) <= q_b * group / tile_q_rows + 1`` tiles per
        KV head. The split search uses a chunk cap ``C >= total_keys / (MAX_CHUNKS_PER_CTA * num_ctas)``;
        a tile is split only if its keys exceed ``C``, so fewer than ``S = MAX_CHUNKS_PER_CTA * num_ctas``
        tiles are split (one merge each), and they make ``sum(ceil(keys / C)) <= 2 S`` chunks, each
        taking one partial slot. All items: ``tiles + S``.
        """
        tiles = config.num_kv_heads * (math.ceil(max_total_q * config.group_size / config.tile_q_rows) + max_batch)
        splits = MAX_CHUNKS_PER_CTA * config.num_ctas if config.allow_split else 0
        return PlanCapacity(max_items=tiles + splits, max_partials=min(tiles + splits, 2 * splits),
                            max_merges=min(tiles, splits))


@dataclass(frozen=True)
class WorkPlan:
    """Fixed-capacity int32 work lists. Only the first ``num_*`` rows of each array are meaningful."""

    config: PlanConfig
    capacity: PlanCapacity
    num_ctas: int  # CTAs that have work; the kernel may launch config.num_ctas, the rest exit at once
    work_indptr: np.ndarray  # [config.num_ctas + 1]: CTA c runs items work_indptr[c] .. work_indptr[c+1]-1
    items: np.ndarray  # [max_items, len(ItemField)]
    num_items: int
    merge_indptr: np.ndarray  # [max_merges + 1]: partial slots of each merge
    merges: np.ndarray  # [max_merges, len(MergeField)]
    num_merges: int
    num_partials: int
    cta_cost: np.ndarray  # [config.num_ctas] modelled cost per CTA (for inspection and tests)

    def valid_items(self) -> np.ndarray:
        return self.items[: self.num_items]

    def valid_merges(self) -> np.ndarray:
        return self.merges[: self.num_merges]


# ---------------------------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------------------------
def _tiles(config: PlanConfig, q_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """One row per (request, kv head, q tile): [request, kv_head, row_start, row_count, kv_end, offset]."""
    group = config.group_size
    rows = q_lens * group
    tiles_per_req = -(-rows // config.tile_q_rows)
    req = np.repeat(np.arange(q_lens.size, dtype=np.int64), tiles_per_req)
    first_tile = np.cumsum(tiles_per_req) - tiles_per_req
    tile_in_req = np.arange(req.size, dtype=np.int64) - first_tile[req]
    row_start = tile_in_req * config.tile_q_rows
    row_count = np.minimum(config.tile_q_rows, rows[req] - row_start)
    kv = kv_lens[req]
    if config.causal:
        offset = kv - q_lens[req]
        last_token = (row_start + row_count - 1) // group
        kv_end = np.clip(last_token + 1 + offset, 0, kv)
    else:
        offset = np.full_like(kv, NOT_CAUSAL_OFFSET)
        kv_end = kv
    per_head = np.stack([req, row_start, row_count, kv_end, offset], axis=1)
    heads = np.arange(config.num_kv_heads, dtype=np.int64)
    # order: request-major, then tile, then kv head
    out = np.empty((per_head.shape[0], config.num_kv_heads, 6), dtype=np.int64)
    out[:, :, 0] = per_head[:, None, 0]
    out[:, :, 1] = heads[None, :]
    out[:, :, 2:] = per_head[:, None, 1:]
    return out.reshape(-1, 6)


def _round_up(x, m):
    return -(-x // m) * m


def _chunks(tiles: np.ndarray, cap: int | None, kv_tile: int):
    """Cut each tile's key range [0, kv_end) into chunks of at most ``cap`` keys (kv_tile aligned)."""
    kv_end = tiles[:, 4]
    if cap is None:
        n = np.ones(tiles.shape[0], dtype=np.int64)
    else:
        n = np.maximum(1, -(-kv_end // cap))
    # even chunks, each a multiple of kv_tile, so the last one is the short one
    step = _round_up(-(-kv_end // n), kv_tile)
    n = np.maximum(1, -(-kv_end // np.maximum(step, 1)))
    tile_id = np.repeat(np.arange(tiles.shape[0]), n)
    first = np.cumsum(n) - n
    k = np.arange(tile_id.size) - first[tile_id]
    start = np.minimum(k * step[tile_id], kv_end[tile_id])
    end = np.minimum(start + step[tile_id], kv_end[tile_id])
    return tile_id, start, end, n


def _cost(start, end, config: PlanConfig):
    return _round_up(end - start, config.kv_tile) + config.item_overhead_keys


# ---------------------------------------------------------------------------------------------
# LPT
# ---------------------------------------------------------------------------------------------
def _lpt(costs: np.ndarray, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Longest processing time first onto the least-loaded CTA. Returns (cta of each item, loads)."""
    order = np.argsort(-costs, kind="stable")
    cta = np.empty(costs.size, dtype=np.int64)
    if costs.size <= _EXACT_LPT_MAX_ITEMS:
        heap = [(0, c) for c in range(num_ctas)]
        for i in order.tolist():
            load, c = heap[0]
            cta[i] = c
            heapq.heapreplace(heap, (load + int(costs[i]), c))
        loads = np.zeros(num_ctas, dtype=np.int64)
        np.add.at(loads, cta, costs)
        return cta, loads
    # Round-based LPT: each round of num_ctas items (descending) goes to the CTAs in ascending load.
    loads = np.zeros(num_ctas, dtype=np.int64)
    for r0 in range(0, order.size, num_ctas):
        idx = order[r0 : r0 + num_ctas]
        targets = np.argsort(loads, kind="stable")[: idx.size]
        cta[idx] = targets
        loads[targets] += costs[idx]
    return cta, loads


def _schedule(config: PlanConfig, chunks):
    """LPT schedule of one way of cutting the tiles: (chunks, costs, cta of each chunk, CTA loads)."""
    costs = _cost(chunks[1], chunks[2], config)
    cta, loads = _lpt(costs, config.num_ctas)
    return chunks, costs, cta, loads


def _rank(config: PlanConfig, schedule) -> tuple:
    """Balanced schedules (max/mean <= max_imbalance) first, then the shortest makespan, then fewer chunks."""
    chunks, _, _, loads = schedule
    return (_balance(loads) > config.max_imbalance, int(loads.max()), chunks[0].size)


def _balance(loads: np.ndarray) -> float:
    busy = loads.sum()
    return float(loads.max() * loads.size / busy) if busy else 1.0


# ---------------------------------------------------------------------------------------------
# Planner
# ---------------------------------------------------------------------------------------------
def plan_work(config: PlanConfig, q_lens, kv_lens, capacity: PlanCapacity | None = None) -> WorkPlan:
    """Plan one batch. ``q_lens``/``kv_lens``: per-request query tokens and keys (host ints)."""
    q_lens = np.asarray(q_lens, dtype=np.int64).reshape(-1)
    kv_lens = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    if q_lens.shape != kv_lens.shape:
        raise ValueError(f"q_lens and kv_lens must have one entry per request, got {q_lens.size} and {kv_lens.size}")
    if (q_lens < 0).any() or (kv_lens < 0).any():
        raise ValueError("q_lens and kv_lens must be >= 0")
    if capacity is None:
        capacity = PlanCapacity.for_limits(config, max_batch=q_lens.size, max_total_q=int(q_lens.sum()))
    m = config.num_ctas
    tiles = _tiles(config, q_lens, kv_lens)

    unsplit = _chunks(tiles, None, config.kv_tile)
    best = _schedule(config, unsplit)
    needs_split = tiles.shape[0] < m or _balance(best[3]) > config.balance_limit
    if config.allow_split and needs_split and tiles.shape[0]:
        total_keys = int(tiles[:, 4].sum())
        for per_cta in range(1, MAX_CHUNKS_PER_CTA + 1):
            cap = max(config.kv_tile, _round_up(config.min_chunk_keys, config.kv_tile),
                      _round_up(-(-total_keys // (per_cta * m)), config.kv_tile))
            candidate = _schedule(config, _chunks(tiles, cap, config.kv_tile))
            if _rank(config, candidate) < _rank(config, best):
                best = candidate
    (tile_id, start, end, n_chunks), costs, cta, loads = best
    token_start = np.cumsum(q_lens) - q_lens
    return _assemble(config, capacity, tiles, token_start, tile_id, start, end, n_chunks, costs, cta, loads)


def _assemble(config, capacity, tiles, token_start, tile_id, start, end, n_chunks, costs, cta, loads) -> WorkPlan:
    F = ItemField
    m = config.num_ctas
    num_items = tile_id.size
    split = n_chunks[tile_id] > 1
    num_partials = int(split.sum())
    split_tiles = np.nonzero(n_chunks > 1)[0]
    num_merges = split_tiles.size
    if num_items > capacity.max_items or num_partials > capacity.max_partials or num_merges > capacity.max_merges:
        raise ValueError(
            f"plan exceeds capacity: {num_items} items / {num_partials} partial slots / {num_merges} merges, "
            f"capacity {capacity.max_items} / {capacity.max_partials} / {capacity.max_merges}; "
            "raise the PlanCapacity (PlanCapacity.for_limits gives a safe one)"
        )
    # partial slots: chunks of one split tile take consecutive slots, in tile order
    slot = np.full(num_items, -1, dtype=np.int64)
    slot[split] = np.arange(num_partials)
    # merge of each split chunk: split tiles are numbered in tile order, like their slots
    merge_of_tile = np.full(n_chunks.size, -1, dtype=np.int64)
    merge_of_tile[split_tiles] = np.arange(num_merges)
    merge = merge_of_tile[tile_id]
    merge_indptr = np.zeros(capacity.max_merges + 1, dtype=np.int32)
    merges = np.zeros((capacity.max_merges, len(MergeField)), dtype=np.int32)
    if num_merges:
        merge_indptr[1 : num_merges + 1] = np.cumsum(n_chunks[split_tiles])
        merge_indptr[num_merges + 1 :] = merge_indptr[num_merges]
        merges[:num_merges, :4] = tiles[split_tiles][:, [0, 1, 2, 3]]
        merges[:num_merges, MergeField.TOKEN_START] = token_start[tiles[split_tiles][:, 0]]

    # CTA-major; inside a CTA, longest first so the tail of the schedule holds the short items
    top = int(costs.max()) + 1 if num_items else 1
    order = np.argsort(cta * top + (top - 1 - costs), kind="stable")
    t = tiles[tile_id[order]]
    items = np.zeros((capacity.max_items, len(ItemField)), dtype=np.int32)
    valid = items[:num_items]
    valid[:, [F.REQUEST, F.KV_HEAD, F.Q_ROW_START, F.Q_ROW_COUNT]] = t[:, :4]
    valid[:, F.KV_START] = start[order]
    valid[:, F.KV_END] = end[order]
    valid[:, F.PARTIAL_SLOT] = slot[order]
    valid[:, F.CAUSAL_OFFSET] = t[:, 5]
    valid[:, F.MERGE] = merge[order]
    counts = np.bincount(cta, minlength=m)
    work_indptr = np.zeros(m + 1, dtype=np.int32)
    work_indptr[1:] = np.cumsum(counts)
    return WorkPlan(
        config=config, capacity=capacity, num_ctas=int((counts > 0).sum()), work_indptr=work_indptr,
        items=items, num_items=num_items, merge_indptr=merge_indptr, merges=merges, num_merges=num_merges,
        num_partials=num_partials, cta_cost=loads,
    )

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
    longest-first (ties in tile order) on the least-loaded CTA (LPT, ties to the lower CTA): one at a
    time up to ``_EXACT_LPT_MAX_ITEMS`` items, beyond that in rounds of ``num_ctas`` items. Each CTA runs
    its items longest first, so the tail of the schedule holds the short ones.

Host cost
    Planning runs on the host for every batch (budget: 4096 decode requests in < 5 ms; ``tools/bench.py
    --plan-only``). Hence: per-q-tile arrays where the KV heads would only repeat them, stable sorts of
    8/16-bit ranks (numpy radix-sorts those) instead of int64 sorts, two numpy calls per LPT round, and
    few temporaries the size of all items (fresh large arrays cost page faults on every plan).

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
from typing import NamedTuple

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
    KV_PAGE_START = 9  # kv_indices position of the page holding key KV_START: kv_indptr[REQUEST] +
    #                    KV_START // page_size (so a kernel skips the kv_indptr load); -1 if page_size is 0


class MergeField(IntEnum):
    """Columns of ``WorkPlan.merges`` (int32); slots are ``merge_indptr[m] .. merge_indptr[m+1]-1``."""

    REQUEST = 0
    KV_HEAD = 1
    Q_ROW_START = 2
    Q_ROW_COUNT = 3
    TOKEN_START = 4  # global row of the request's first query token (qo_indptr[request])


NOT_CAUSAL_OFFSET = np.iinfo(np.int32).max // 2


SERPENTINE_SLACK_SHIFT = 4  # whole_deal "serpentine": taken within 1/16 of the plan it replaces
#: ``PlanConfig.deal_max_q_tiles`` values: the device planner's Int32 sort of 1024 keys (two a thread, the default)
#: or 2048 (four a thread)
DEAL_MAX_Q_TILES_CHOICES = (1024, 2048)
#: ``PlanConfig.rank_deal_max_q_tiles`` values: 0 (off) or the most q tiles a ranked deal holds (``rank_sort.py``)
RANK_DEAL_MAX_Q_TILES_CHOICES = (0, 4096)
#: a ranked deal's work bound: batch x ceil(q tiles / 512) (each of the planning CTA's 512 threads walks the requests
#: once for each of its q tiles)
RANK_DEAL_MAX_WORK = 64

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
    page_size: int = 0  # tokens per KV page, for ItemField.KV_PAGE_START (0: not planned, the column is -1)
    #: device plans of causal kinds: a request's q tiles lie on the cost line short, long, next short, next long...
    #: (``plan_partition``), so adjacent tiles pair up and the CTA cuts fall near tile edges (fewer splits); the
    #: MLA kinds take it, whose split partials are 512 fp32 a row
    zigzag: bool = False
    #: device plans of causal kinds: when the cuts must split tiles, the q tiles sorted longest first and dealt
    #: serpentine over the CTAs (whole tiles, no merges) replace them unless their busiest CTA is worse
    #: (``plan_partition``; the MLA seed: max / mean 1.18 with 21 merges -> 1.06 with none)
    sorted_deal: bool = False
    #: host plans (``plan_work``) take the device twin's sorted deal where it deals, instead of the LPT. GQA prefill
    #: on the H200 (session 15, one process, 8 x 992 at five head layouts, 4 x 992, 16 x 992): the deal 1-7% faster
    #: than the LPT the model rates as balanced (each CTA gets the same number of items, a lap each); MLA prefill
    #: the other way (the seed 39.4 against 34.0 us), so only the GQA prefill kind sets it
    host_deal: bool = False
    #: device plans of decode: whole tiles dealt serpentine in line order (no sort; request-major, KV head minor)
    #: instead of contiguous cuts when the deal's busiest CTA is no worse. Contiguous cuts run a request's KV heads
    #: one after another on a CTA; the deal (like the host LPT) runs them at once on neighbouring CTAs, so a cache
    #: row's KV heads are read together. Set where ``ops/gqa_decode.line_deals`` says (pages 1 and 2, and any page from
    #: 8 KV heads: measured in session 16)
    line_deal: bool = False
    #: host plans (``plan_work``) take the device twin's plan (``plan_partition``) when its modelled busiest CTA is
    #: strictly lower than the LPT's: its line cuts split long requests where they fall, the LPT's candidates cut every
    #: request at one cap. H200 (sessions 14-15, one process, the twin measured as the device-planned call): MLA decode
    #: ragged 64 x 1..32768 8320 against 9600 modelled, 302.4 against 341.1 us; 64 x 8192 4224 / 4352, 163.5 / 165.9;
    #: where the two tie in the model the LPT was as fast or faster (MLA prefill seed 34.0 / 39.4, decode 1 x 3232
    #: 10.2 / 13.1), so ties keep it
    host_twin: bool = True
    #: device plans (``plan_partition``): a batch of equal one-tile requests (decode) is cut into even pieces of
    #: whole kv tiles, each tile at a CTA edge, as the host's caps cut it, instead of where the line's edges fall
    #: (MLA decode 64 x 8192: 2 chunks a request and 128 partials instead of 3 and 192)
    even_pieces: bool = False
    #: device plans (``plan_partition``): the slack that buys a plan without a split, capped at this many keys (0: no
    #: cap): a cut snaps to a tile edge within ``min(W / 2**SNAP_SHIFT, max_slack_keys)``, whole-tile cuts are taken
    #: within ``W + min(W / 2**WHOLE_TILE_SHIFT, max_slack_keys)``. At W in the hundreds of thousands an eighth of W
    #: is tens of thousands of keys (MLA prefill 16K: whole tiles 3.1% above the mean, ~230 us), far more than the
    #: merges a split costs
    max_slack_keys: int = 0
    #: host plans (``plan_work``, with ``host_deal``) of whole q tiles dealt over the CTAs, whatever the twin did:
    #: "lap" -- lap by lap onto the least loaded CTAs (``plan_partition.lap_deal``), taken where its busiest CTA is
    #: strictly lower; "serpentine" -- the twin's serpentine deal (``sorted_deal``) in place of a plan without merges
    #: where its busiest CTA is within a sixteenth (batches of at most ``deal_max_q_tiles`` q tiles); "": neither (``ops/gqa_prefill.WHOLE_DEAL`` says what measured)
    whole_deal: str = ""
    #: device plans (and their twin): whole-tile cuts give way to the serpentine deal whenever its busiest CTA is within
    #: ``1 / 2**SERPENTINE_SLACK_SHIFT`` of theirs (``plan_partition.deal_bound``), the rule host plans take with
    #: ``whole_deal`` "serpentine"; without it, only cuts above ``W + W / 2**DEAL_WHOLE_SHIFT``, to a strictly better deal
    deal_whole_cuts: bool = False
    #: device plans (and their twin): the most q tiles the sorted deal takes (the planning CTA's Int32 bitonic sort of
    #: 1024 keys, two a thread, or 2048, four); a batch of more keeps the cuts (GQA prefill 32 x 992 at h32/kv4: 1984)
    deal_max_q_tiles: int = DEAL_MAX_Q_TILES_CHOICES[0]
    #: device plans (and their twin): the sorted deal also takes a causal batch past ``deal_max_q_tiles``, up to this
    #: many q tiles, when batch x ceil(q tiles / 512) <= RANK_DEAL_MAX_WORK: the planning CTA ranks the q tiles from
    #: the requests' shapes instead of sorting them (``kernels/common/rank_sort.py``; MLA prefill 1 x 16384's 4096 q
    #: tiles: the twin's busiest CTA 1.0315 -> 1.0024 of the mean). 0: off
    rank_deal_max_q_tiles: int = 0
    #: device plans (and their twin) of the sorted deal: deal before cutting, and keep the deal without cutting at all
    #: when its busiest CTA is within ``W + W / 2**DEAL_FIRST_SHIFT`` (``plan_partition.deal_first_bound``); otherwise
    #: cut and decide by ``deal_bound`` as before. The planning CTA then skips its cuts phase, the cuts' vote and
    #: the partial slots' scan (no merges) on the batches the deal takes anyway
    deal_first: bool = False
    #: device plans (and their twin) of the sorted deal: lap ``k``'s position ``k * m + r`` goes to CTA
    #: ``(r + shift_k) mod m``, each lap moving the CTAs that drew its longest cost to the back of the order
    #: (``plan_partition.turned_deal``), where its busiest CTA is strictly below the serpentine's and the deal has at
    #: most ``LAP_TURN_MAX_LAPS`` laps. The serpentine's fixed turn puts a lap's clump of equal costs on the CTAs that
    #: drew the last one (GQA prefill 8 x 992 h32/kv4: busiest CTA 1.082 of the mean against the lap deal's 1.024,
    #: which the turn matches; per-CTA stamps on the H200: the last CTA ends 149.3 against 140.4 us, session 27)
    lap_turn: bool = False

    def __post_init__(self):
        if self.line_deal and self.sorted_deal:
            raise ValueError("line_deal and sorted_deal are exclusive (line_deal deals the line order, unsorted)")
        for name in ("num_qo_heads", "num_kv_heads", "tile_q_rows", "kv_tile", "num_ctas"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlanConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"PlanConfig.num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.item_overhead_keys < 0:
            raise ValueError("PlanConfig.item_overhead_keys must be >= 0")
        if self.page_size < 0:
            raise ValueError(f"PlanConfig.page_size must be >= 0, got {self.page_size}")
        if self.deal_max_q_tiles not in DEAL_MAX_Q_TILES_CHOICES:
            raise ValueError(f"PlanConfig.deal_max_q_tiles must be 1024 or 2048, got {self.deal_max_q_tiles}")
        if self.rank_deal_max_q_tiles not in RANK_DEAL_MAX_Q_TILES_CHOICES:
            raise ValueError(f"PlanConfig.rank_deal_max_q_tiles must be 0 or 4096, got {self.rank_deal_max_q_tiles}")

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
# Tiles and chunks
# ---------------------------------------------------------------------------------------------
class _Tiles(NamedTuple):
    """The unsplit work. Tiles are numbered request-major, then q tile, then KV head: tile ``t`` is q tile
    ``t // num_heads`` (rows of one request) for KV head ``t % num_heads``. All but the head is the same
    for the heads of a q tile, so it is kept once per q tile."""

    q_tiles: np.ndarray  # [Q, len(ItemField)] int32: q tile as an item of KV head 0, keys [0, KV_END), unsplit
    kv_end: np.ndarray  # [Q] int64: the KV_END column, kept wide for the cost arithmetic
    num_heads: int

    @property
    def count(self) -> int:
        return self.kv_end.size * self.num_heads


def _tiles(config: PlanConfig, q_lens: np.ndarray, kv_lens: np.ndarray) -> _Tiles:
    F = ItemField
    group, tile_rows = config.group_size, config.tile_q_rows
    rows = q_lens * group
    tiles_per_req = -(-rows // tile_rows)
    if (tiles_per_req == 1).all():  # decode, short prefill: q tile b is request b, rows [0, rows[b])
        req, row_start, row_count, q, kv = np.arange(q_lens.size), 0, rows, q_lens, kv_lens
    else:
        req = np.repeat(np.arange(q_lens.size), tiles_per_req)
        first_tile = np.cumsum(tiles_per_req) - tiles_per_req
        row_start = (np.arange(req.size) - first_tile[req]) * tile_rows
        row_count = np.minimum(tile_rows, rows[req] - row_start)
        q, kv = q_lens[req], kv_lens[req]
    if config.causal:
        offset = kv - q
        last_token = (row_start + row_count - 1) // group
        kv_end = np.clip(last_token + 1 + offset, 0, kv)
    else:
        offset, kv_end = NOT_CAUSAL_OFFSET, kv
    q_tiles = np.empty((req.size, len(F)), dtype=np.int32)
    q_tiles[:, F.REQUEST] = req
    q_tiles[:, F.KV_HEAD] = 0
    q_tiles[:, F.Q_ROW_START] = row_start
    q_tiles[:, F.Q_ROW_COUNT] = row_count
    q_tiles[:, F.KV_START] = 0
    q_tiles[:, F.KV_END] = kv_end
    q_tiles[:, F.PARTIAL_SLOT] = -1
    q_tiles[:, F.CAUSAL_OFFSET] = offset
    q_tiles[:, F.MERGE] = -1
    return _Tiles(q_tiles, kv_end, config.num_kv_heads)


def _tile_items(tiles: _Tiles, tile_ids: np.ndarray, out: np.ndarray) -> None:
    """Write tiles ``tile_ids`` as unsplit items into ``out`` ([len(tile_ids), len(ItemField)] int32)."""
    q_tile, head = np.divmod(tile_ids, tiles.num_heads)
    np.take(tiles.q_tiles, q_tile, axis=0, out=out, mode="clip")  # "clip" (all in range): no bounce buffer
    out[:, ItemField.KV_HEAD] = head


def _round_up(x, m):
    return -(-x // m) * m


def _cost(keys, config: PlanConfig):
    return _round_up(keys, config.kv_tile) + config.item_overhead_keys


class _Chunks(NamedTuple):
    """Tiles cut along keys: chunk ``i`` is keys [start[i], end[i]) of tile tile_id[i]."""

    tile_id: np.ndarray
    start: np.ndarray
    end: np.ndarray
    per_tile: np.ndarray  # chunks of each tile


def _chunks(kv_end: np.ndarray, cap: int, kv_tile: int) -> _Chunks:
    """Cut each tile's key range [0, kv_end) into chunks of at most ``cap`` keys (kv_tile aligned)."""
    n = np.maximum(1, -(-kv_end // cap))
    # even chunks, each a multiple of kv_tile, so the last one is the short one
    step = _round_up(-(-kv_end // n), kv_tile)
    n = np.maximum(1, -(-kv_end // np.maximum(step, 1)))
    tile_id = np.repeat(np.arange(kv_end.size), n)
    first = np.cumsum(n) - n
    chunk_step = step[tile_id]
    start = (np.arange(tile_id.size) - first[tile_id]) * chunk_step  # < kv_end, as n = ceil(kv_end / step)
    end = np.minimum(start + chunk_step, kv_end[tile_id])
    return _Chunks(tile_id, start, end, n)


def _small_uint(max_value: int):
    """The narrowest unsigned dtype holding 0..max_value, if 8 or 16 bits do: numpy's stable sort of
    such ints is a radix sort, an order of magnitude faster than its int64 sort."""
    return np.uint8 if max_value < 1 << 8 else np.uint16 if max_value < 1 << 16 else None


def _longest_first(costs: np.ndarray, kv_tile: int) -> np.ndarray:
    """``np.argsort(-costs, kind="stable")``: costs descending, ties in index order.

    Costs differ by multiples of kv_tile (see _cost), so ``(max - cost) // kv_tile`` ranks them
    without ties between different costs; that rank usually fits 8 or 16 bits.
    """
    if costs.size == 0:
        return np.zeros(0, dtype=np.intp)
    top = costs.max()
    dtype = _small_uint(int((top - costs.min()) // kv_tile))
    if dtype is None:
        return np.argsort(-costs, kind="stable")
    return np.argsort(((top - costs) // kv_tile).astype(dtype), kind="stable")


# ---------------------------------------------------------------------------------------------
# LPT
# ---------------------------------------------------------------------------------------------
def _lpt(costs_desc: np.ndarray, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Longest processing time first onto the least-loaded CTA, ties to the lower CTA.

    ``costs_desc`` holds the items' costs in descending order. Returns (CTA of each of those items, as
    the narrowest uint that holds it; load of each CTA). Up to _EXACT_LPT_MAX_ITEMS items are placed
    one at a time (a heap); beyond, in rounds: each round of num_ctas items goes, largest first, to the
    CTAs in ascending load.

    A CTA is tracked as the single key ``load * num_ctas + cta``: ascending keys are ascending loads
    with ties to the lower CTA, so one sort of plain ints (or a heap of ints) ranks the CTAs; the item
    that lands on a CTA adds ``cost * num_ctas`` to its key, and ``key % num_ctas`` names the CTA.
    """
    m, n = num_ctas, costs_desc.size
    # the largest key is below (sum of costs + 1) * m; where that could pass int64, Python ints do it
    dtype = object if n and (int(costs_desc[0]) * n + 1) * m >= 1 << 63 else np.int64
    costs_desc = costs_desc.astype(dtype, copy=False)
    if n <= _EXACT_LPT_MAX_ITEMS:
        heap = list(range(m))  # the keys of m empty CTAs, ascending: already a heap
        # heapreplace returns the smallest key, the CTA that takes the item, as it adds the item
        picked = [heapq.heapreplace(heap, heap[0] + w) for w in (costs_desc * m).tolist()]
        picked, final = np.array(picked, dtype=dtype) % m, np.array(heap, dtype=dtype)
    else:
        rounds = -(-n // m)
        # keys[r] = the CTAs' keys before round r, ascending; a last partial round adds 0 to the rest
        add = np.zeros((rounds, m), dtype=dtype)
        np.multiply(costs_desc, m, out=add.reshape(-1)[:n])
        keys = np.empty((rounds + 1, m), dtype=dtype)
        keys[0] = list(range(m))
        key_rows, add_rows = list(keys), list(add)  # row views, made once: the loop is 2 numpy calls a round
        for r in range(rounds):
            np.add(key_rows[r], add_rows[r], out=key_rows[r + 1])
            key_rows[r + 1].sort()  # keys are unique, so any sort gives the one order
        picked, final = keys[:rounds], keys[rounds]
        np.remainder(picked, m, out=picked)  # row r: the CTAs that took round r's items, in item order
        picked = picked.reshape(-1)[:n]
    cta_of = picked.astype(_small_uint(m - 1) or np.int64)
    loads = np.empty(m, dtype=np.int64)
    loads[(final % m).astype(np.int64)] = final // m
    return cta_of, loads


class _Schedule(NamedTuple):
    chunks: _Chunks | None  # None: the whole tiles, none cut
    order: np.ndarray  # chunk (or tile) indices, longest first, ties in index order: the LPT's order
    cta_of: np.ndarray  # CTA of chunk order[j]
    loads: np.ndarray  # [num_ctas] modelled cost per CTA


def _whole_tile_schedule(config: PlanConfig, tiles: _Tiles) -> _Schedule:
    """LPT schedule of the tiles, none cut. Sorted per q tile: the heads of a q tile have one cost
    and consecutive tile indices, so longest first keeps them together, in head order."""
    costs = _cost(tiles.kv_end, config)
    q_order = _longest_first(costs, config.kv_tile)
    heads = tiles.num_heads
    order = (q_order[:, None] * heads + np.arange(heads)).reshape(-1)
    cta_of, loads = _lpt(np.repeat(costs[q_order], heads), config.num_ctas)
    return _Schedule(None, order, cta_of, loads)


def _split_schedule(config: PlanConfig, chunks: _Chunks) -> _Schedule:
    """LPT schedule of one way of cutting the tiles."""
    costs = _cost(chunks.end - chunks.start, config)
    order = _longest_first(costs, config.kv_tile)
    cta_of, loads = _lpt(costs[order], config.num_ctas)
    return _Schedule(chunks, order, cta_of, loads)


def _rank(config: PlanConfig, schedule: _Schedule) -> tuple:
    """Balanced schedules (max/mean <= max_imbalance) first, then the shortest makespan, then fewer chunks."""
    loads = schedule.loads
    return (_balance(loads) > config.max_imbalance, int(loads.max()), schedule.order.size)


def _balance(loads: np.ndarray) -> float:
    busy = loads.sum()
    return float(loads.max() * loads.size / busy) if busy else 1.0


# ---------------------------------------------------------------------------------------------
# Planner
# ---------------------------------------------------------------------------------------------
def plan_work(config: PlanConfig, q_lens, kv_lens, capacity: PlanCapacity | None = None) -> WorkPlan:
    """Plan one batch. ``q_lens``/``kv_lens``: per-request query tokens and keys (host ints).

    Requests' pages are taken to be laid out as the entry rules require (``kv_indptr[0] == 0`` and
    ``1 <= kv_last_page_len <= page_size`` for a request with pages), so request ``b``'s pages start at
    ``sum(ceil(kv_lens[:b] / page_size))`` in ``kv_indices``: ``ItemField.KV_PAGE_START`` is built from that.
    """
    q_lens = np.asarray(q_lens, dtype=np.int64).reshape(-1)
    kv_lens = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    if q_lens.shape != kv_lens.shape:
        raise ValueError(f"q_lens and kv_lens must have one entry per request, got {q_lens.size} and {kv_lens.size}")
    if (q_lens < 0).any() or (kv_lens < 0).any():
        raise ValueError("q_lens and kv_lens must be >= 0")
    if capacity is None:
        capacity = PlanCapacity.for_limits(config, max_batch=q_lens.size, max_total_q=int(q_lens.sum()))
    twin = None  # the device twin's plan: taken when it deals (host_deal) or is modelled better (host_twin)
    if (config.host_deal and config.sorted_deal) or config.host_twin:
        from .plan_partition import partition  # plan_partition imports this module

        try:
            twin, dealt = partition(config, q_lens, kv_lens, capacity=capacity)
        except ValueError:  # a caller's capacity sized for the LPT alone: keep it
            twin, dealt = None, False
        if dealt and config.host_deal:
            # the twin's deal is the serpentine already: only the lap deal is another candidate
            return _whole_dealt(config, q_lens, kv_lens, capacity, twin) if config.whole_deal == "lap" else twin
    m = config.num_ctas
    tiles = _tiles(config, q_lens, kv_lens)

    best = _whole_tile_schedule(config, tiles)
    needs_split = tiles.count < m or _balance(best.loads) > config.balance_limit
    if config.allow_split and needs_split and tiles.count:
        kv_end = np.repeat(tiles.kv_end, tiles.num_heads)  # per tile
        total_keys, longest = int(kv_end.sum()), int(kv_end.max())
        shortest_cap = max(config.kv_tile, _round_up(config.min_chunk_keys, config.kv_tile))
        caps = [max(shortest_cap, _round_up(-(-total_keys // (per_cta * m)), config.kv_tile))
                for per_cta in range(1, MAX_CHUNKS_PER_CTA + 1)]
        # The longest tile in 2..4 even pieces: where the caps above leave each long request a short last chunk
        # (MLA decode 64 x 8192 on 132 CTAs: 3 chunks a request, 192 partials), these cut it in whole halves at the
        # same modelled makespan and fewer chunks, which the rank prefers (H200, session 18: 160.3 -> 157.6 us).
        # Only caps >= the smallest above, so the capacity bound (for_limits) still holds.
        caps += [cap for pieces in range(2, MAX_CHUNKS_PER_CTA + 1)
                 if (cap := max(shortest_cap, _round_up(-(-longest // pieces), config.kv_tile))) >= caps[-1]]
        tried = set()
        for cap in caps:
            # A cap no tile exceeds cuts nothing (the unsplit schedule again); a repeated cap is the same candidate
            if cap >= longest or cap in tried:
                continue
            tried.add(cap)
            candidate = _split_schedule(config, _chunks(kv_end, cap, config.kv_tile))
            if _rank(config, candidate) < _rank(config, best):
                best = candidate
    token_start = np.cumsum(q_lens) - q_lens
    plan = _assemble(config, capacity, tiles, token_start, best)
    _fill_page_starts(config, kv_lens, plan)
    if config.host_twin and tiles.count and twin is not None and twin.cta_cost.max() < plan.cta_cost.max():
        plan = twin
    return _whole_dealt(config, q_lens, kv_lens, capacity, plan) if tiles.count else plan


def _whole_dealt(config: PlanConfig, q_lens, kv_lens, capacity: PlanCapacity, plan: WorkPlan) -> WorkPlan:
    """``whole_deal``: "lap" -- the lap deal's whole-tile plan where its busiest CTA is strictly below ``plan``'s;
    "serpentine" -- the serpentine deal's in place of a plan without merges, where the batch's q tiles are few enough
    for the device's sort and its busiest CTA is within ``1 / 2**SERPENTINE_SLACK_SHIFT`` of ``plan``'s (8 x 992
    h32/kv4: 1.057)."""
    if not (config.whole_deal and config.host_deal):
        return plan
    if config.whole_deal == "serpentine" and plan.num_merges:  # in place of whole tiles only (as measured): a split
        return plan  # plan's balance is what its merges buy
    from .plan_partition import whole_dealt_plan  # plan_partition imports this module

    try:
        dealt = whole_dealt_plan(config, q_lens, kv_lens, capacity)
    except ValueError:  # too many q tiles, or a caller's capacity too small for every whole tile: keep the plan
        return plan
    bound = plan.cta_cost.max()
    if config.whole_deal == "serpentine":  # its pattern against the model's balance, within a sixteenth
        bound += bound >> SERPENTINE_SLACK_SHIFT
        return dealt if dealt.cta_cost.max() <= bound else plan
    return dealt if dealt.cta_cost.max() < bound else plan  # "lap": for its balance only (ties keep the plan)


def _fill_page_starts(config: PlanConfig, kv_lens: np.ndarray, plan: WorkPlan) -> None:
    F = ItemField
    valid = plan.items[: plan.num_items]
    if config.page_size == 0:
        valid[:, F.KV_PAGE_START] = -1
        return
    pages = -(-kv_lens // config.page_size)
    first_page = np.cumsum(pages) - pages
    if pages.sum() >= 1 << 31:
        raise ValueError(f"{int(pages.sum())} pages do not fit int32 page indices")
    valid[:, F.KV_PAGE_START] = first_page[valid[:, F.REQUEST]] + valid[:, F.KV_START] // config.page_size


def _assemble(config: PlanConfig, capacity: PlanCapacity, tiles: _Tiles, token_start: np.ndarray,
              schedule: _Schedule) -> WorkPlan:
    F = ItemField
    m = config.num_ctas
    chunks = schedule.chunks
    num_items = schedule.order.size
    if chunks is None:
        split_tiles, num_partials = np.zeros(0, dtype=np.intp), 0
    else:
        split_tiles = np.nonzero(chunks.per_tile > 1)[0]
        num_partials = int(chunks.per_tile[split_tiles].sum())  # every chunk of a split tile takes a slot
    num_merges = split_tiles.size
    if num_items > capacity.max_items or num_partials > capacity.max_partials or num_merges > capacity.max_merges:
        raise ValueError(
            f"plan exceeds capacity: {num_items} items / {num_partials} partial slots / {num_merges} merges, "
            f"capacity {capacity.max_items} / {capacity.max_partials} / {capacity.max_merges}; "
            "raise the PlanCapacity (PlanCapacity.for_limits gives a safe one)"
        )
    merge_indptr = np.zeros(capacity.max_merges + 1, dtype=np.int32)
    merges = np.zeros((capacity.max_merges, len(MergeField)), dtype=np.int32)
    if num_merges:
        merge_indptr[1 : num_merges + 1] = np.cumsum(chunks.per_tile[split_tiles])
        merge_indptr[num_merges + 1 :] = merge_indptr[num_merges]
        merged = np.empty((num_merges, len(F)), dtype=np.int32)
        _tile_items(tiles, split_tiles, merged)
        merges[:num_merges, :4] = merged[:, :4]  # REQUEST, KV_HEAD, Q_ROW_START, Q_ROW_COUNT
        merges[:num_merges, MergeField.TOKEN_START] = token_start[merged[:, F.REQUEST]]

    # CTA-major; inside a CTA, longest first so the tail of the schedule holds the short items. The
    # LPT order is already longest first (ties in index order), so a stable sort by CTA finishes it.
    order = schedule.order[np.argsort(schedule.cta_of, kind="stable")]
    items = np.zeros((capacity.max_items, len(F)), dtype=np.int32)
    valid = items[:num_items]
    if chunks is None:
        _tile_items(tiles, order, valid)
    else:
        _tile_items(tiles, chunks.tile_id[order], valid)
        # partial slots: chunks of one split tile take consecutive slots, in tile order; split tiles
        # are numbered (their merges) in tile order too
        split = chunks.per_tile[chunks.tile_id] > 1
        slot = np.full(chunks.tile_id.size, -1, dtype=np.int64)
        slot[split] = np.arange(num_partials)
        merge_of_tile = np.full(chunks.per_tile.size, -1, dtype=np.int64)
        merge_of_tile[split_tiles] = np.arange(num_merges)
        valid[:, F.KV_START] = chunks.start[order]
        valid[:, F.KV_END] = chunks.end[order]
        valid[:, F.PARTIAL_SLOT] = slot[order]
        valid[:, F.MERGE] = merge_of_tile[chunks.tile_id[order]]
    counts = np.bincount(schedule.cta_of, minlength=m)
    work_indptr = np.zeros(m + 1, dtype=np.int32)
    work_indptr[1:] = np.cumsum(counts)
    return WorkPlan(
        config=config, capacity=capacity, num_ctas=int((counts > 0).sum()), work_indptr=work_indptr,
        items=items, num_items=num_items, merge_indptr=merge_indptr, merges=merges, num_merges=num_merges,
        num_partials=num_partials, cta_cost=schedule.loads,
    )

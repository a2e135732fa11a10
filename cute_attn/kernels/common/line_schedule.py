"""Planner-free split-KV decode: each CTA derives its own stretch of the device planner's cost line at its start.

The numpy twin is ``cute_attn/line_schedule.py`` (its docstring holds the steps; the CPU tier checks it against
``plan_partition.partition`` CTA by CTA). Here every thread of the CTA runs steps 1-5 before the warp roles split,
on a table in shared memory that aliases the K/V ring (nothing is loaded into the ring before the last barrier
here), then keeps its CTA's stretch in registers:

* step 1, requests: thread ``t`` takes a contiguous share of the batch (``kv_indptr``, ``kv_last_page_len``: a few
  KB, in L2 after the first CTA), checks the rules (``index_rules``), writes each request's keys and cost, and a block
  prefix sum of the shares' costs turns the costs into line starts;
* steps 2-4, one thread an edge (``num_ctas + 1 <= threads``, the host's and this kernel's check): even pieces in
  closed form, or the edge's binary search of the line starts, its split key and snap; the whole-tile vote is a
  block max;
* step 5: one block prefix sum of (inside, run start) per edge gives merge ids and first slots;
* step 5b (``line_deal``): thread ``c`` sums its CTA's cut load and its serpentine-deal load (its laps in closed form),
  two block maxima decide;
* step 6 (:func:`line_item`): the CTA's item ``i`` from its stretch and its request's two indptr words.

Checks, as in the planner-free prefill (``unit_schedule.py``): a broken indptr (or a batch past the table, or a grid
past the threads: a capacity fault) leaves every CTA without items, writing its grid-stride share of the rows 0 /
``-inf``; a request breaking its own rules is a tile with no keys; page ids are scanned a grid-stride share a CTA
(``unit_schedule.scan_page_ids``) and a bad one marks its request, whose rows the last CTA to finish
(:func:`finish_line`) writes 0 / ``-inf``. Nothing outside the pool is read: TMA boxes are bounds-checked by the
tensor map (an id outside it is a zero-filled box), and the row gathers zero-fill a row whose id is outside it
(``row_gather.gather_one_row_pages``: ``src-size`` 0; the MLA loads' ``mla._page_row``: id -1). Split items fold in
the kernel (``decode_merge.arrive_and_fold``): at most two a CTA, its first and last item.

State (zero between launches): ``merge_counters`` (the fold resets each), ``unit_state[UNITS_DONE, FAULTS_SEEN]``
and the request marks (the last CTA resets them).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...plan import NOT_CAUSAL_OFFSET, PlanConfig
from ...plan import ItemField as F
from ...plan_partition import WHOLE_TILE_SHIFT, min_width
from .decode_merge import arrive_and_fold
from .index_rules import FAULT_CAPACITY, FAULT_KV_INDPTR, empty_rows, request_rule_faults
from .line_uniform import cut_in_tile, dealt_count, even_pieces, line_edge, uniform_stretch, whole_tile_bound
from .planner_collectives import WARP, block_exclusive_sum, last_at_most
from .planner_scan import load_id_batch, record_fault
from .unit_schedule import finish_schedule, scan_page_ids

__all__ = ["LineRules", "LineStretch", "table_bytes", "table_requests", "derive_stretch", "start_line", "end_line",
           "line_item", "fold_line_merges", "finish_line"]

INT32_MAX = 2**31 - 1
MAX_WARPS = 32
_WORDS_BYTES = 8 * MAX_WARPS + 4 * 3 * MAX_WARPS  # Int64 and Int32 reduction words
_EDGE_INT32_ARRAYS = 7  # cut tile, cut key, snap tile, inside before, merge of, merge indptr, merge tile
#: the most requests a line build's table holds (the host routes larger batches to the device planner)
MAX_LINE_REQUESTS = 8192


@dataclass(frozen=True)
class LineRules:
    """The plan rules a line build bakes in (``PlanConfig`` of the decode config; batch and CTAs are runtime)."""

    heads: int
    group: int
    kv_tile: int
    page_size: int
    overhead: int
    min_width: int
    even_pieces: bool
    allow_split: bool
    max_slack_keys: int
    line_deal: bool
    deal_max_q_tiles: int
    causal: bool  # one query token a request (MLA decode): CAUSAL_OFFSET is keys - 1, masking nothing
    scan_ids: int = 1  # page ids a thread checks a pass (``PagedAttentionConfig.scan_ids_per_thread``)
    uniform_line: bool = False  # a uniform batch's stretch in closed form (``PagedAttentionConfig.uniform_line``)

    @staticmethod
    def of(plan_config: PlanConfig) -> "LineRules":
        c = plan_config
        return LineRules(c.num_kv_heads, c.group_size, c.kv_tile, c.page_size, c.item_overhead_keys, min_width(c),
                         c.even_pieces and c.allow_split, c.allow_split, c.max_slack_keys, c.line_deal,
                         c.deal_max_q_tiles, c.causal)


#: the plan rules every line build bakes in besides its config's own: ``config.EVEN_PIECES`` and ``MAX_SLACK_KEYS`` as
#: they stand by default, and (GQA decode) the landed line-deal policy (``ops/gqa_decode.line_deals``); none is a
#: config field, so none is in the compile key, and a build is refused while a policy says otherwise
LINE_EVEN_PIECES = True
LINE_MAX_SLACK_KEYS = 0


def gqa_line_rules(config) -> LineRules:
    """The plan rules a GQA decode line build of ``config`` derives with: its device plan's under the landed
    policies."""
    import dataclasses

    from ...ops.gqa_decode import line_deals

    return dataclasses.replace(LineRules.of(config.plan_config(1)), even_pieces=LINE_EVEN_PIECES,
                               max_slack_keys=LINE_MAX_SLACK_KEYS,
                               line_deal=line_deals(config.page_size, config.num_kv_heads, policy_now=False),
                               scan_ids=config.scan_ids_per_thread, uniform_line=config.uniform_line)


def mla_line_rules(config) -> LineRules:
    """The plan rules the one-token MLA decode's line build derives with: the plan's cuts without the sorted deal
    (``line_schedule.cuts_only``), under the landed policies."""
    import dataclasses

    from ...line_schedule import cuts_only

    return dataclasses.replace(LineRules.of(cuts_only(config.plan_config(1))), even_pieces=LINE_EVEN_PIECES,
                               max_slack_keys=LINE_MAX_SLACK_KEYS, line_deal=False,
                               scan_ids=config.scan_ids_per_thread, uniform_line=config.uniform_line)


def baked_rules_reason(plan_config, baked: LineRules) -> str | None:
    """Why a line build whose rules are ``baked`` would not cut as ``plan_config``'s device plan (None: it would)."""
    now = (plan_config.even_pieces and plan_config.allow_split, plan_config.max_slack_keys, plan_config.line_deal)
    if now != (baked.even_pieces, baked.max_slack_keys, baked.line_deal):
        return (f"line_schedule builds cut with even_pieces={baked.even_pieces}, max_slack_keys="
                f"{baked.max_slack_keys}, line_deal={baked.line_deal}; the plan policies now say {now[0]}, {now[1]}, "
                f"{now[2]}")
    return None


def gqa_line_reason(config, requests: int) -> str | None:
    """Why a GQA decode kernel (either arch) does not make the ``line_schedule`` build of ``config`` (None: it
    does); ``requests``: what its table holds."""
    from ...line_schedule import line_reason

    if config.kind != "gqa_paged_decode":
        return "line_schedule builds are decode's (one query token a request)"
    plan_config = config.plan_config(1)
    if (reason := line_reason(plan_config)) is not None:
        return reason
    if (reason := baked_rules_reason(plan_config, gqa_line_rules(config))) is not None:
        return reason
    if requests < 1:
        return "the K ring is too small for the line table"
    return None


def _edge_bytes(num_threads: int) -> int:
    return 8 * num_threads + 4 * _EDGE_INT32_ARRAYS * (num_threads + 1)


def table_bytes(num_threads: int, requests: int) -> int:
    """Shared memory of the table for ``requests`` requests (8-byte line starts, 4-byte keys)."""
    edges = -(-(_WORDS_BYTES + _edge_bytes(num_threads)) // 8) * 8
    return edges + 12 * requests


def table_requests(num_threads: int, ring_bytes: int) -> int:
    """The most requests a table in ``ring_bytes`` of aliased ring holds (capped at ``MAX_LINE_REQUESTS``)."""
    return max(0, min(MAX_LINE_REQUESTS, (ring_bytes - table_bytes(num_threads, 0)) // 12))


class LineTable:
    """The table's shared-memory arrays, carved from ``base`` (the ring's first byte, 1024-byte aligned)."""

    def __init__(self, base, num_threads: int, requests: int):
        def carve(offset, dtype, n):
            ptr = cute.recast_ptr(base + offset, dtype=dtype)
            return cute.make_tensor(ptr, cute.make_layout(n)), offset + n * (dtype.width // 8)

        self.words64, o = carve(0, Int64, MAX_WARPS)
        self.words32, o = carve(o, Int32, 3 * MAX_WARPS)
        self.snap_pos, o = carve(o, Int64, num_threads)
        arrays = []
        for _ in range(_EDGE_INT32_ARRAYS):
            a, o = carve(o, Int32, num_threads + 1)
            arrays.append(a)
        (self.cut_tile, self.cut_key, self.snap_tile, self.inside_before, self.merge_of, self.merge_indptr,
         self.merge_tile) = arrays
        o = -(-o // 8) * 8
        self.line_start, o = carve(o, Int64, requests)
        self.keys, o = carve(o, Int32, requests)
        self.requests = requests

    def arrays(self) -> tuple:
        return (self.words64, self.words32, self.snap_pos, self.cut_tile, self.cut_key, self.snap_tile,
                self.inside_before, self.merge_of, self.merge_indptr, self.merge_tile, self.line_start, self.keys)


class LineStretch:
    """One CTA's stretch in registers: what :func:`line_item` and the fold read (``count`` 0: no items)."""

    def __init__(self, kv_indptr, kv_last_page_len, rules, batch, count, first_tile, first_key, end_tile, end_key,
                 merge0, slot0, begin0, slots0, merge1, begin1, slots1, dealt, cta, num_ctas, num_pages):
        self.kv_indptr, self.kv_last_page_len, self.rules, self.batch = kv_indptr, kv_last_page_len, rules, batch
        self.count, self.first_tile, self.first_key, self.end_tile, self.end_key = (count, first_tile, first_key,
                                                                                    end_tile, end_key)
        self.merge0, self.slot0, self.begin0, self.slots0 = merge0, slot0, begin0, slots0  # item 0 when it splits
        self.merge1, self.begin1, self.slots1 = merge1, begin1, slots1  # item count - 1 when it ends inside a tile
        self.dealt, self.cta, self.num_ctas = dealt, cta, num_ctas  # dealt: item i is lap i's whole tile
        self.num_pages = num_pages  # the pool the page ids were scanned against

    def __getitem__(self, index):
        """``stretch[it, field]``: item ``it``'s field, derived (:func:`line_item`), where a kernel reads a plan's
        ``items[it, field]``; each read derives the item again (its loads hit L1)."""
        it, field = index
        return line_field(self, it, int(field))


@cute.jit
def request_keys(kv_indptr: cute.Tensor, kv_last_page_len: cute.Tensor, b, page_size: cutlass.Constexpr,
                 kv_tile: cutlass.Constexpr):
    """(keys, fault bits) of request ``b``: ``(pages - 1) * page_size + last``, 0 without pages or when its own rules
    fault (``index_rules.request_rule_faults``)."""
    pages = kv_indptr[b + 1] - kv_indptr[b]
    last = kv_last_page_len[b]
    faults = request_rule_faults(None, last, b, pages, page_size, kv_tile)
    keys = Int32(0)
    if faults == 0 and pages > 0:
        keys = (pages - 1) * page_size + last
    return keys, faults


@cute.jit
def _block_or_min_max(bits, low, high, tidx, words: cute.Tensor, num_warps: cutlass.Constexpr):
    """(OR of ``bits``, min of ``low``, max of ``high``) over the CTA (Int32; every thread calls it)."""
    for i in cutlass.range_constexpr(5):
        bits = bits | cute.arch.shuffle_sync_bfly(bits, 1 << i)
        low = cutlass.min(low, cute.arch.shuffle_sync_bfly(low, 1 << i))
        high = cutlass.max(high, cute.arch.shuffle_sync_bfly(high, 1 << i))
    if tidx % WARP == 0:
        words[tidx // WARP] = bits
        words[MAX_WARPS + tidx // WARP] = low
        words[2 * MAX_WARPS + tidx // WARP] = high
    cute.arch.sync_threads()
    for w in cutlass.range_constexpr(num_warps):
        bits = bits | words[w]
        low = cutlass.min(low, words[MAX_WARPS + w])
        high = cutlass.max(high, words[2 * MAX_WARPS + w])
    cute.arch.sync_threads()  # the words are free again
    return bits, low, high


@cute.jit
def _block_max64(value, tidx, words: cute.Tensor, num_warps: cutlass.Constexpr):
    """The largest Int64 ``value`` over the CTA (every thread calls it and gets it)."""
    for i in cutlass.range_constexpr(5):
        value = cutlass.max(value, cute.arch.shuffle_sync_bfly(value, 1 << i))
    if tidx % WARP == 0:
        words[tidx // WARP] = value
    cute.arch.sync_threads()
    for w in cutlass.range_constexpr(num_warps):
        value = cutlass.max(value, words[w])
    cute.arch.sync_threads()
    return value


@cute.jit
def _request_cost(line_start: cute.Tensor, b, batch, total, heads: cutlass.Constexpr):
    """Request ``b``'s tile cost from the line starts (its ``heads`` tiles lie one cost apart)."""
    end = total
    if b + 1 < batch:
        end = line_start[b + 1]
    return (end - line_start[b]) // heads


@cute.jit
def _edge_position(cut_tile: cute.Tensor, cut_key: cute.Tensor, line_start: cute.Tensor, e, batch, total,
                   rules: cutlass.Constexpr):
    """Where edge ``e`` sits on the line (``plan_partition.cut_loads``): its tile's start, plus its key and the item
    overhead when it is inside the tile; past the last tile, the line's end."""
    t = cut_tile[e]
    position = total
    if t < batch * rules.heads:
        b = t // rules.heads
        position = line_start[b] + (t - b * rules.heads) * _request_cost(line_start, b, batch, total, rules.heads)
        if cut_key[e] > 0:
            position = position + cut_key[e] + rules.overhead
    return position


@cute.jit
def derive_stretch(kv_indptr: cute.Tensor, kv_last_page_len: cute.Tensor, kv_indices: cute.Tensor, num_pages,
                   output: cute.Tensor, lse: cute.Tensor, request_faults: cute.Tensor, unit_state: cute.Tensor,
                   error_word: cute.Tensor, table: LineTable, tidx, num_threads: cutlass.Constexpr,
                   head_dim: cutlass.Constexpr, rules: cutlass.Constexpr) -> LineStretch:
    """Steps 1-5 of the module docstring on every thread of the CTA, then its own stretch (step 6's inputs)."""
    kv_tile, page_size = rules.kv_tile, rules.page_size
    # the table's arrays as locals: a plain Python object cannot cross the kernel's run-time ifs and loops
    arrays = table.arrays()
    (t_words64, t_words32, t_snap_pos, t_cut_tile, t_cut_key, t_snap_tile, t_inside_before, t_merge_of, t_merge_indptr,
     t_merge_tile, t_line_start, t_keys) = arrays
    capacity = table.requests
    num_warps = num_threads // WARP
    cta, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    m = Int32(grid)
    batch = kv_indptr.shape[0] - 1
    first_ids = None
    if cutlass.const_expr(rules.scan_ids > 1):
        # the scan's first chunk loaded now, in flight beside step 1's loads: its addresses need no bound but the
        # tensor's (ids past kv_indptr[batch] are loaded, never checked), so it waits out no load of its own
        first_ids = cute.make_rmem_tensor((rules.scan_ids,), Int32)
        load_id_batch(kv_indices, cta * num_threads * rules.scan_ids, num_threads, tidx, kv_indices.shape[0],
                      first_ids)
    # ---- step 1: requests (a contiguous share a thread), their rules, keys and costs
    bad = Int32(0)
    if batch > capacity or m + 1 > num_threads:
        bad = Int32(FAULT_CAPACITY)
    share = (batch + num_threads - 1) // num_threads
    lo = cutlass.min(tidx * share, batch)
    hi = cutlass.min(lo + share, batch)
    if bad != 0:
        hi = lo
    own = Int64(0)
    low = Int32(INT32_MAX)
    high = Int32(-1)
    for b in range(lo, hi):
        if kv_indptr[b + 1] < kv_indptr[b]:
            bad = bad | FAULT_KV_INDPTR
        keys, faults = request_keys(kv_indptr, kv_last_page_len, b, page_size, kv_tile)
        if faults != 0:
            low = Int32(-1)  # a faulted request: the batch is not uniform
            if cta == 0:
                record_fault(error_word, faults, b)
        cost = Int64((keys + kv_tile - 1) // kv_tile * kv_tile) + rules.overhead
        t_keys[b] = keys
        t_line_start[b] = cost
        own = own + cost
        low = cutlass.min(low, keys)
        high = cutlass.max(high, keys)
    if tidx == 0:
        if kv_indptr[0] != 0 or kv_indptr[batch] > kv_indices.shape[0]:
            bad = bad | FAULT_KV_INDPTR
    if cutlass.const_expr(rules.uniform_line):
        # the uniformity first (every request the same keys, none faulted): its closed form needs no line starts
        bad, low, high = _block_or_min_max(bad, low, high, tidx, t_words32, num_warps)
        fast = Int32(0)
        count, first_tile, first_key, end_tile, end_key = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
        merge0, slot0, begin0, slots0 = Int32(-1), Int32(-1), Int32(0), Int32(0)
        merge1, begin1, slots1 = Int32(-1), Int32(0), Int32(0)
        dealt = Int32(0)
        if batch > 0 and low == high and low > 0 and bad == 0:
            (fast, count, first_tile, first_key, end_tile, end_key, merge0, slot0, begin0, slots0, merge1, begin1,
             slots1, dealt) = uniform_stretch(low, batch, m, cta, tidx, t_words64, t_words32, t_snap_pos,
                                             t_cut_tile, t_cut_key, t_snap_tile, num_warps, rules)
        if fast == 0:
            before, line_total = block_exclusive_sum(own, tidx, t_words64, num_warps)
            (count, first_tile, first_key, end_tile, end_key, merge0, slot0, begin0, slots0, merge1, begin1, slots1,
             dealt) = _table_stretch(before, line_total, lo, hi, bad, low, high, batch, m, cta, tidx, arrays,
                                     num_warps, rules)
    else:
        before, line_total = block_exclusive_sum(own, tidx, t_words64, num_warps)
        bad, low, high = _block_or_min_max(bad, low, high, tidx, t_words32, num_warps)
        (count, first_tile, first_key, end_tile, end_key, merge0, slot0, begin0, slots0, merge1, begin1, slots1,
         dealt) = _table_stretch(before, line_total, lo, hi, bad, low, high, batch, m, cta, tidx, arrays,
                                 num_warps, rules)
    # every thread has read and written the table through the generic proxy; the ring's next writer is TMA (the async
    # proxy): each thread's accesses are fenced into it before the barrier that lets the producer start
    cute.arch.fence_view_async_shared()
    cute.arch.sync_threads()
    if bad != 0:
        empty_rows(output, lse, tidx, num_threads, head_dim, cta * num_threads, output.shape[0], grid)
        if cta == 0 and tidx == 0:
            record_fault(error_word, bad, 0)
    else:
        scan_page_ids(kv_indptr, kv_indices, num_pages, tidx, num_threads, unit_state, request_faults, error_word,
                      ids_per_thread=rules.scan_ids, first_ids=first_ids)
    # any thread's marks (each fenced) happen before this CTA counts itself out (finish_line, by the storing threads
    # only): a CTA without items counts out at once, while another role's threads might still be scanning
    cute.arch.sync_threads()
    return LineStretch(kv_indptr, kv_last_page_len, rules, batch, count, first_tile, first_key, end_tile, end_key,
                       merge0, slot0, begin0, slots0, merge1, begin1, slots1, dealt, cta, m, num_pages)


@cute.jit
def _table_edge(p, t_line_start: cute.Tensor, t_keys: cute.Tensor, batch, heads, total, width,
                rules: cutlass.Constexpr):
    """Step 3 on the table: the cut of the edge at line position ``p`` inside the q tile whose line run holds it
    (its start found by a search of the line starts)."""
    j = last_at_most(t_line_start, batch, p)
    start = t_line_start[j]
    end = total
    if j + 1 < batch:
        end = t_line_start[j + 1]
    cj = (end - start) // heads
    h = (p - start) // cj
    o = p - start - h * cj
    return cut_in_tile(j * heads + Int32(h), h, start, o, cj, t_keys[j], width, rules)


@cute.jit
def _table_stretch(before, line_total, lo, hi, bad, low, high, batch, m, cta, tidx, arrays,
                   num_warps: cutlass.Constexpr, rules: cutlass.Constexpr):
    """Steps 1 (the line starts from the costs step 1 wrote) to 6 on the table, for any batch: the CTA's stretch
    (count, first_tile, first_key, end_tile, end_key, merge0, slot0, begin0, slots0, merge1, begin1, slots1, dealt).
    ``before`` / ``line_total``: the block prefix of this thread's costs."""
    heads = rules.heads
    (t_words64, t_words32, t_snap_pos, t_cut_tile, t_cut_key, t_snap_tile, t_inside_before, t_merge_of, t_merge_indptr,
     t_merge_tile, t_line_start, t_keys) = arrays
    e = tidx
    for b in range(lo, hi):  # costs -> line starts (a request's KV heads are its tiles, one cost apart)
        cost = t_line_start[b]
        t_line_start[b] = before * heads
        before = before + cost
    total = line_total * heads
    num_tiles = batch * heads
    width = Int64(1)
    if total > 0:
        width = cutlass.max((total + m - 1) // m, Int64(rules.min_width))
    # ---- step 2: even pieces of a uniform batch
    pieces = Int32(0)
    piece = Int32(0)
    if cutlass.const_expr(rules.even_pieces):
        if batch > 0 and low == high and low > 0 and bad == 0:
            pieces, piece = even_pieces(low, num_tiles, m, width, rules)
    cute.arch.sync_threads()  # line starts and keys are in
    # ---- step 3: one thread an edge
    e = tidx
    if e <= m and bad == 0:
        cut_tile, cut_key, snap_tile, snap_pos = line_edge(
            e, width, pieces, piece, num_tiles, total,
            lambda p: _table_edge(p, t_line_start, t_keys, batch, heads, total, width, rules))
        t_cut_tile[e] = cut_tile
        t_cut_key[e] = cut_key
        t_snap_tile[e] = snap_tile
        t_snap_pos[e] = snap_pos
    cute.arch.sync_threads()
    # ---- step 4: the whole-tile vote
    whole_tiles = Int32(0)
    whole_bound = width + (width >> WHOLE_TILE_SHIFT)
    if cutlass.const_expr(rules.allow_split):
        spread = Int64(0)
        if e < m and bad == 0 and pieces == 0:
            spread = t_snap_pos[e + 1] - t_snap_pos[e]
        spread = _block_max64(spread, tidx, t_words64, num_warps)
        bound = whole_tile_bound(width, rules)
        whole_bound = bound
        if pieces == 0 and spread <= bound:
            whole_tiles = Int32(1)
            if e <= m and bad == 0:
                t_cut_tile[e] = t_snap_tile[e]
                t_cut_key[e] = Int32(0)
        cute.arch.sync_threads()
    # ---- step 5b: the line deal, when no worse than the cuts (plan_partition.deal_bound)
    dealt = Int32(0)
    if cutlass.const_expr(rules.line_deal and rules.allow_split):
        if batch > 0 and batch <= rules.deal_max_q_tiles and bad == 0:  # the same on every thread
            cut_load = Int64(0)
            deal_load = Int64(0)
            if e < m:
                cut_load = (_edge_position(t_cut_tile, t_cut_key, t_line_start, e + 1, batch, total, rules)
                            - _edge_position(t_cut_tile, t_cut_key, t_line_start, e, batch, total, rules))
                if t_cut_key[e] > 0:
                    cut_load = cut_load + rules.overhead
                for lap in range((num_tiles + m - 1) // m):
                    t = lap * m + e
                    if lap % 2 == 1:
                        t = lap * m + m - 1 - e
                    if t < num_tiles:
                        deal_load = deal_load + _request_cost(t_line_start, t // heads, batch, total, heads)
            cut_max = _block_max64(cut_load, tidx, t_words64, num_warps)
            deal_max = _block_max64(deal_load, tidx, t_words64, num_warps)
            deal_bound = cut_max
            if whole_tiles == 0:
                deal_bound = cutlass.max(cut_max, whole_bound)
            if deal_max <= deal_bound:
                dealt = Int32(1)
    # ---- step 5: merges (runs of inside edges in one tile), their ids and first slots
    inside = Int32(0)
    run_start = Int32(0)
    if e <= m and bad == 0:
        if t_cut_key[e] > 0:
            inside = Int32(1)
            run_start = Int32(1)
            if e > 0:
                if t_cut_key[e - 1] > 0 and t_cut_tile[e - 1] == t_cut_tile[e]:
                    run_start = Int32(0)
    packed_before, packed_total = block_exclusive_sum(inside | (run_start << 16), tidx, t_words32, num_warps)
    inside_before = packed_before & 0xFFFF
    merge = (packed_before >> 16) + run_start - 1
    if inside != 0:
        t_merge_of[e] = merge
        if run_start != 0:
            t_merge_indptr[merge] = inside_before + merge
            t_merge_tile[merge] = t_cut_tile[e]
    if e <= m:
        t_inside_before[e] = inside_before
    if tidx == 0:
        t_merge_indptr[packed_total >> 16] = (packed_total & 0xFFFF) + (packed_total >> 16)
    cute.arch.sync_threads()
    # ---- the CTA's stretch, into registers
    count = Int32(0)
    first_tile = Int32(0)
    first_key = Int32(0)
    end_tile = Int32(0)
    end_key = Int32(0)
    merge0, slot0, begin0, slots0 = Int32(-1), Int32(-1), Int32(0), Int32(0)
    merge1, begin1, slots1 = Int32(-1), Int32(0), Int32(0)
    if bad == 0:
        first_tile = t_cut_tile[cta]
        first_key = t_cut_key[cta]
        end_tile = t_cut_tile[cta + 1]
        end_key = t_cut_key[cta + 1]
        last = end_tile - 1
        if end_key > 0:
            last = end_tile
        count = cutlass.max(last - first_tile + 1, 0)
        if first_key > 0:  # item 0 starts after an inside edge
            merge0 = t_merge_of[cta]
            slot0 = t_inside_before[cta] + merge0 + 1
        elif count == 1 and end_key > 0:  # item 0 is its merge's first chunk
            merge0 = t_merge_of[cta + 1]
            slot0 = t_merge_indptr[merge0]
        if merge0 >= 0:
            begin0 = t_merge_indptr[merge0]
            slots0 = t_merge_indptr[merge0 + 1] - begin0
        if count >= 2 and end_key > 0:  # the last item is the first chunk of the next merge
            merge1 = t_merge_of[cta + 1]
            begin1 = t_merge_indptr[merge1]
            slots1 = t_merge_indptr[merge1 + 1] - begin1
    if dealt != 0:  # whole tiles lap by lap
        count = dealt_count(num_tiles, m, cta)
        merge0 = Int32(-1)
        merge1 = Int32(-1)
    return count, first_tile, first_key, end_tile, end_key, merge0, slot0, begin0, slots0, merge1, begin1, slots1, dealt

@cute.jit
def start_line(line, ring, kv_indices: cute.Tensor, output: cute.Tensor, lse: cute.Tensor, tidx,
               num_threads: cutlass.Constexpr, head_dim: cutlass.Constexpr, rules: cutlass.Constexpr,
               requests: cutlass.Constexpr) -> LineStretch:
    """A line build's start, every thread of the CTA before its roles split: :func:`derive_stretch` on a table over
    ``ring`` (the K stages' first byte: nothing is loaded there before this returns). ``line``: the build's
    ``(kv_indptr, kv_last_page_len, request_faults, unit_state, error_word, num_pages)``."""
    kv_indptr, kv_last_page_len, request_faults, unit_state, error_word, num_pages = line
    table = LineTable(cute.recast_ptr(ring, dtype=cutlass.Int8), num_threads, requests)
    return derive_stretch(kv_indptr, kv_last_page_len, kv_indices, num_pages, output, lse, request_faults,
                          unit_state, error_word, table, tidx, num_threads, head_dim, rules)


@cute.jit
def end_line(s: LineStretch, line, merge_counters, arrival, partial_out, partial_lse, output, lse, lse_out_scale,
             tidx, barrier_id: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int],
             head_dim: cutlass.Constexpr[int], qo_indptr=None, wide: cutlass.Constexpr[bool] = False):
    """A line build's end, by the threads that stored its outputs and partials: :func:`fold_line_merges`, then
    :func:`finish_line` (the count-out; the last CTA empties the requests a bad page id marked)."""
    fold_line_merges(s, merge_counters, arrival, partial_out, partial_lse, output, lse, lse_out_scale, tidx,
                     barrier_id, num_threads, qo_indptr, wide)
    _, _, request_faults, unit_state, _, _ = line
    finish_line(s, unit_state, request_faults, output, lse, tidx, num_threads, head_dim, barrier_id, arrival)


@cute.jit
def line_item(s: LineStretch, it, row: cute.Tensor):
    """Item ``it`` of the CTA's stretch into ``row`` (indexed by ``ItemField``), as ``cta_items`` builds it."""
    rules = s.rules
    t = s.first_tile + it
    if s.dealt != 0:  # lap it's whole tile
        t = it * s.num_ctas + s.cta
        if it % 2 == 1:
            t = it * s.num_ctas + s.num_ctas - 1 - s.cta
    b = t // rules.heads
    keys, _ = request_keys(s.kv_indptr, s.kv_last_page_len, b, rules.page_size, rules.kv_tile)
    kv_start = Int32(0)
    if it == 0 and s.dealt == 0:
        kv_start = s.first_key
    kv_end = keys
    if t == s.end_tile and s.end_key > 0 and s.dealt == 0:
        kv_end = s.end_key
    slot = Int32(-1)
    merge = Int32(-1)
    if it == 0 and s.merge0 >= 0:
        slot = s.slot0
        merge = s.merge0
    elif it == s.count - 1 and s.merge1 >= 0:
        slot = s.begin1
        merge = s.merge1
    row[F.REQUEST] = b
    row[F.KV_HEAD] = t - b * rules.heads
    row[F.Q_ROW_START] = Int32(0)
    row[F.Q_ROW_COUNT] = Int32(rules.group)
    row[F.KV_START] = kv_start
    row[F.KV_END] = kv_end
    row[F.PARTIAL_SLOT] = slot
    if cutlass.const_expr(rules.causal):
        row[F.CAUSAL_OFFSET] = keys - 1
    else:
        row[F.CAUSAL_OFFSET] = Int32(NOT_CAUSAL_OFFSET)
    row[F.MERGE] = merge
    row[F.KV_PAGE_START] = s.kv_indptr[b] + kv_start // rules.page_size


@cute.jit
def line_field(s: LineStretch, it, field: cutlass.Constexpr[int]):
    """One field of item ``it`` (:class:`LineStretch`'s indexing)."""
    row = cute.make_rmem_tensor((len(F),), Int32)
    line_item(s, it, row)
    return row[field]


@cute.jit
def fold_line_merges(s: LineStretch, merge_counters, arrival, partial_out, partial_lse, output, lse, lse_out_scale,
                     tidx, barrier_id: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int], qo_indptr=None,
                     wide: cutlass.Constexpr[bool] = False):
    """After the item loop, by the threads that stored the partials: the CTA's (at most two) split items arrive in
    their merges, and the last arrival of each folds it (``decode_merge.arrive_and_fold``; MLA: ``qo_indptr`` and the
    wide fold of 512-column rows)."""
    rules = s.rules
    cute.arch.fence_acq_rel_gpu()
    for merge, begin, slots, tile in ((s.merge0, s.begin0, s.slots0, s.first_tile),  # item 0, then the last
                                      (s.merge1, s.begin1, s.slots1, s.first_tile + s.count - 1)):
        if merge >= 0:
            arrive_and_fold(merge, begin, slots, tile // rules.heads, tile % rules.heads, Int32(0), Int32(rules.group),
                            merge_counters, arrival, rules.group, partial_out, partial_lse, output, lse, lse_out_scale,
                            tidx, barrier_id, num_threads, qo_indptr, wide)


@cute.jit
def finish_line(s: LineStretch, unit_state: cute.Tensor, request_faults: cute.Tensor, output: cute.Tensor,
                lse: cute.Tensor, tidx, num_threads: cutlass.Constexpr, head_dim: cutlass.Constexpr,
                barrier_id: cutlass.Constexpr, word: cute.Tensor):
    """The storing threads' end (every output and fold of the CTA done): each fences its stores, then the planner-free
    prefill's count-out (``unit_schedule.finish_schedule``, request ``b`` one token ``b``): the last CTA writes the
    rows of every request a bad page id marked 0 / ``-inf`` (after every other CTA's stores and folds) and zeroes the
    state and the marks for the next launch."""
    cute.arch.fence_acq_rel_gpu()
    finish_schedule(unit_state, request_faults, None, output, lse, tidx, num_threads, head_dim, barrier_id, word,
                    batch=s.batch)

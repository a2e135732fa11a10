"""Planner-free scheduling of a causal prefill (GQA and MLA; sm_90a, and sm_100a twins compiled only): CTAs take whole
(request, q tile, KV head) units from a counter.

A device plan costs a prefill call its planner (10-22 µs in-kernel at 1-32 x 992, H200) and the combine launch that
must follow a plan the host never sees (~2.3 µs with nothing to fold). A kernel that schedules itself pays neither,
as FA3's varlen tile scheduler does: its producer warp takes the next unit index from an atomic counter in global
memory, decodes it from ``qo_indptr`` alone and hands it to the rest of the CTA with the Q tile. No unit is split, so
nothing merges and no combine follows. ``tools/dynamic_schedule_model.py`` models the balance (session 32: as
balanced as the host plan on every GQA bench prefill row).

Unit order (request-major, FA3's): requests in batch order; inside a request its q tiles from the last (the most
keys under the causal mask) to the first, each tile's KV heads innermost. Unit ``u`` of request ``b`` (``local = u -
first_unit(b)``) is q tile ``tiles(b) - 1 - local // kv_heads`` of KV head ``local % kv_heads``. The producer warp finds
``b`` by a warp-wide prefix over 32 requests at a time, resumed where its previous unit was found (a CTA's units only
grow), so a CTA walks the batch once in all. ``cute_attn/plan_units.py`` is the numpy twin of both (CPU-tested against
the host plan's unsplit items).

Rank-major (``PagedAttentionConfig.rank_major_units`` k > 0; session 39, not run): where every request has as many
units and the batch at most k a CTA (:func:`check_batch` finds both; every CTA the same answer), unit ``u`` is q tile
``tiles - 1 - u // (batch * kv_heads)`` of request ``u % (batch * kv_heads) // kv_heads``: every request's last tile,
then every second-last, ... (longest first across the batch, no search). Any other batch keeps the order above.

Claim time: the producer takes unit n+1 from the counter as unit n's loads begin (its latency hidden under them), or,
with ``PagedAttentionConfig.late_claim`` (session 36, the default since session 37), once unit n's last K tile is
issued. Claimed a unit ahead, every CTA holds two units before any finishes one, so at one or two units a CTA the
longest units pair up: the H200 measured the planner-free kernel at 1.20x the host plan on 1 x 992 and 1.30x on MLA
1 x 1028, where ``tools/dynamic_schedule_model.py --claim`` models 1.21x / 1.38x ahead and 1.00x late; claimed late
it ran 1.01x on both (session 37).

Checks, all in the kernel (no plan and no check launch: a 1.7 µs check launch before the kernel cost the call ~6 µs of
GPU span on the H200, the host issuing the second launch ~6 µs after the first):

* *batch rules*, every CTA at its start over the whole batch (:func:`batch_rules`, all threads, before the warp roles
  split; the indptrs are a few KB in L2): ``qo_indptr`` / ``kv_indptr`` start at 0, never decrease, end at
  ``total_q`` / at most ``len(kv_indices)``. A broken batch has no units (each CTA's first index is past the end, and
  it still counts itself out): each CTA writes its grid-stride share of the rows as output 0 / lse ``-inf``
  (``index_rules.empty_rows``), CTA 0 records the fault.
* *request rules* (``index_rules.request_rule_faults``, the planner's own): ``kv_last_page_len`` in ``1..page_size`` (0 for no pages), the keys
  within int32; CTA 0's batch pass reports them, and the producer applies them when it decodes a unit
  (:func:`unit_fields`): a broken request's units get no keys (0 / ``-inf``).
* *page ids*: each CTA scans its grid-stride share of ``kv_indices`` at its start (:func:`scan_page_ids`), and the
  producer checks the ids it loads for its key tiles again: an id outside ``[0, num_pages)`` is never read (TMA boxes
  are bounds-checked by the tensor map; row gathers turn it into -1, a zero-filled row), and marks its request in
  ``request_faults`` and ``unit_state[FAULTS_SEEN]`` (:func:`mark_page_fault`). Other units of that
  request may already be written, so the last CTA to finish its work (:func:`finish_schedule`) writes every marked
  request's rows 0 / ``-inf`` after all the others, then clears the marks.
Every fault also goes to the device error word (:mod:`cute_attn.device_errors`), as the planner's do.

State (``unit_state``, int32 ``[UNIT_STATE_WORDS]``, zero between launches): ``[UNIT_COUNTER]`` the next unit,
``[UNITS_DONE]`` CTAs that finished, ``[FAULTS_SEEN]`` 1 once a page id outside the pool was found. The last CTA to
finish zeroes them (and the marks it acted on), so the next launch (or a CUDA-graph replay) starts clean with no host
work.

Hand-off (``SLOT_FIELDS`` int32 a Q stage, in shared memory): the producer warp waits for the Q stage to be free,
one elected lane writes the unit's fields into the stage's slot and arrives on the stage's full mbarrier (release:
its own writes), which publishes them with the Q tile's bytes. Each consumer warp's lane 0, the lane that later
releases the stage for its warp, reads the fields and shuffles them to the others (:func:`read_slot`): with every
lane writing or reading the slot, compute-sanitizer's racecheck saw the lanes that do not arrive race the other side.
The other gathering warps of a row-gather build get the unit from warp 0 through their own slots and a named
barrier. A slot with ``VALID`` 0 and no bytes ends the CTA's work.

The MLA prefill's load role (``common/mla.load_units``: 128 threads gather Q and K rows, one Q stage) hands units over
in a ring instead (:func:`publish_ring_unit`, ``UNIT_RING`` entries): warp 0 writes unit ``n`` into entry
``n % UNIT_RING`` before the load threads' named barrier, all of them read it there, and the consumers read it after
their Q wait (thread 0 arrives on the Q stage after its write; every consumer thread arrives on the stage's empty
barrier, so each read is ordered before the rewrite that waits on it; ``tests/test_unit_ring_model.py`` runs the
argument for the ring's size as a model).

The sm_100a twins' roles drift apart by up to the Q and K stages, so there the ring is a pipeline of its own
(:func:`send_ring_unit` / :func:`wait_ring_unit`: an entry's full barrier takes the producer lane's arrival, its empty
barrier every reading thread's, after each copied the fields into registers).
"""

from __future__ import annotations

from enum import IntEnum

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .index_rules import FAULT_KV_INDPTR, FAULT_PAGE_ID, FAULT_QO_INDPTR, empty_rows, request_rule_faults
from .planner_collectives import WARP, last_at_most, warp_inclusive_sum
from .planner_scan import load_id_batch, record_fault

UNIT_COUNTER, UNITS_DONE, FAULTS_SEEN = 0, 1, 2
UNIT_STATE_WORDS = 4
PREFETCH_LINE_IDS = 32  # int32 page ids in a 128-byte L2 line (scan_page_ids_batched's prefetch)
MIXED_UNITS = 1 << 30  # batch_rules' bit beside the fault bits (index_rules.FAULT_*): requests of unequal unit counts


class SlotField(IntEnum):
    """One unit's fields in its Q stage's slot."""

    REQUEST = 0
    KV_HEAD = 1
    Q_ROW_START = 2
    Q_ROW_COUNT = 3
    KV_END = 4  # 0 for a request the index checks faulted: no keys, output 0 / lse -inf
    CAUSAL_OFFSET = 5
    KV_LEN = 6
    VALID = 7


SLOT_FIELDS = len(SlotField)


class UnitSource:
    """What a self-scheduling build's roles read their units from: the counter and the marks in global memory, the
    hand-off slots in shared memory (``row_slots``: the GQA row gathers' second set, else None), the batch's size and
    units (:func:`batch_rules`, every thread), the pool size the page ids are checked against."""

    def __init__(self, unit_state, slots, row_slots, request_faults, kv_last_page_len, error_word, num_pages, batch,
                 total, rank_major=None):
        self.unit_state, self.slots, self.row_slots = unit_state, slots, row_slots
        self.request_faults, self.kv_last_page_len, self.error_word = request_faults, kv_last_page_len, error_word
        self.num_pages, self.batch, self.total = num_pages, batch, total
        self.rank_major = rank_major  # rank_major_units builds: 1 where this batch is taken rank-major; None: never


def dynamic_launch(units, work_indptr) -> tuple:
    """``(kernel keyword arguments, grid CTAs)`` of a launch: a self-scheduling entry's ``units`` (``call_dynamic``:
    ``(kv_last_page_len, request_faults, unit_state, num_ctas, error_word, num_pages)``) as the kernel's arguments of
    those names and its grid; a planned launch (``units`` None): none, and one CTA a plan slot."""
    if units is None:
        return {}, work_indptr.shape[0] - 1
    kv_last_page_len, request_faults, unit_state, num_ctas, error_word, num_pages = units
    return dict(kv_last_page_len=kv_last_page_len, request_faults=request_faults, unit_state=unit_state,
                error_word=error_word, num_pages=num_pages), num_ctas


def ring_smem_bytes(rule_threads: int = 0, pipeline: bool = False) -> int:
    """Shared memory a self-scheduling build adds for its unit ring (16-byte aligned), the ring's full / empty
    mbarriers where it is a unit pipeline (sm_100a), and the batch rules' two words a warp of ``rule_threads``
    threads (0: the kernel lends them from a buffer of its own)."""
    ring = 4 * UNIT_RING * SLOT_FIELDS + 16
    barriers = 8 * 2 * UNIT_RING + 16 if pipeline else 0
    words = 4 * 2 * rule_threads // 32 + 16 if rule_threads else 0
    return ring + barriers + words


@cute.jit
def take_unit(unit_state: cute.Tensor, lane) -> Int32:
    """The warp's next unit index (one relaxed atomic by lane 0, broadcast)."""
    u = Int32(0)
    if lane == 0:
        u = cute.arch.atomic_add((unit_state.iterator + UNIT_COUNTER).llvm_ptr, Int32(1), sem="relaxed", scope="gpu")
    return cute.arch.shuffle_sync(u, 0)


@cute.jit
def request_units(qo_indptr: cute.Tensor, b, batch, group: cutlass.Constexpr, rows: cutlass.Constexpr,
                  kv_heads: cutlass.Constexpr) -> Int32:
    """Units of request ``b`` (0 past the batch): its q tiles of ``rows`` packed rows, times the KV heads."""
    units = Int32(0)
    if b < batch:
        q_len = qo_indptr[b + 1] - qo_indptr[b]
        units = (q_len * group + rows - 1) // rows * kv_heads
    return units


@cute.jit
def locate_unit(u, qo_indptr: cute.Tensor, batch, base, before, lane, group: cutlass.Constexpr,
                rows: cutlass.Constexpr, kv_heads: cutlass.Constexpr):
    """``(request, local, base, before)``: the request holding unit ``u`` (below the batch's units) and ``u``'s index in
    it, found by a warp-wide prefix from request ``base``, whose first unit is ``before``; the returned ``base`` /
    ``before`` resume the next search at the found request (every lane of the warp calls it)."""
    searching = Int32(1)
    request = Int32(0)
    local = Int32(0)
    while searching != 0:
        mine = request_units(qo_indptr, base + lane, batch, group, rows, kv_heads)
        inclusive = warp_inclusive_sum(mine, lane)
        window = cute.arch.shuffle_sync(inclusive, WARP - 1)
        if u < before + window:
            past = cute.arch.vote_ballot_sync(before + inclusive > u)
            first = Int32(cute.arch.popc((past & (0 - past)) - 1))  # the lowest lane past u
            start = before + cute.arch.shuffle_sync(inclusive - mine, first)
            request = base + first
            local = u - start
            base = request
            before = start
            searching = Int32(0)
        else:
            base = base + WARP
            before = before + window
            if base >= batch:  # u past the batch: a broken count; end the CTA's work rather than loop
                request = batch
                searching = Int32(0)
    return request, local, base, before


@cute.jit
def find_unit(u, qo_indptr: cute.Tensor, source: UnitSource, base, before, lane, group: cutlass.Constexpr,
              rows: cutlass.Constexpr, kv_heads: cutlass.Constexpr):
    """``(request, local, base, before)`` of unit ``u`` (:func:`locate_unit`); ``request == batch`` once ``u`` is past
    the batch's units (all of them for a broken batch, whose count is 0)."""
    request = source.batch
    local = Int32(0)
    if u < source.total:
        if cutlass.const_expr(source.rank_major is None):
            request, local, base, before = locate_unit(u, qo_indptr, source.batch, base, before, lane, group, rows,
                                                       kv_heads)
        else:
            if source.rank_major != 0:  # (module docstring) no search: q tile rank, then request, then head
                per_rank = source.batch * kv_heads
                rank = u // per_rank
                within = u - rank * per_rank
                request = within // kv_heads
                local = rank * kv_heads + within - request * kv_heads
            else:
                request, local, base, before = locate_unit(u, qo_indptr, source.batch, base, before, lane, group,
                                                           rows, kv_heads)
    return request, local, base, before


@cute.jit
def unit_fields(request, local, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, kv_last_page_len: cute.Tensor,
                group: cutlass.Constexpr, rows: cutlass.Constexpr,
                kv_heads: cutlass.Constexpr, page_size: cutlass.Constexpr, kv_tile: cutlass.Constexpr):
    """``(kv_head, q_row_start, q_row_count, kv_end, causal_offset, kv_len)`` of unit ``local`` of ``request``, as the
    host plan's unsplit item of that q tile and head (``plan._tiles``); a request breaking its own rules (module
    docstring) gets no keys (every lane of the producer warp calls it)."""
    q_len = qo_indptr[request + 1] - qo_indptr[request]
    packed = q_len * group
    tiles = (packed + rows - 1) // rows
    rank = local // kv_heads
    kv_head = local - rank * kv_heads
    row_start = (tiles - 1 - rank) * rows
    row_count = cutlass.min(packed - row_start, Int32(rows))
    pages = kv_indptr[request + 1] - kv_indptr[request]
    last = kv_last_page_len[request]
    faults = request_rule_faults(None, last, request, pages, page_size, kv_tile)
    kv_len = Int32(0)
    if pages > 0 and faults == 0:
        kv_len = (pages - 1) * page_size + last
    offset = kv_len - q_len
    kv_end = cutlass.min(cutlass.max((row_start + row_count - 1) // group + 1 + offset, Int32(0)), kv_len)
    if faults != 0:  # every unit of the request sees it: no keys, rows 0 / lse -inf (batch_rules reported it)
        kv_end = Int32(0)
    return kv_head, row_start, row_count, kv_end, offset, kv_len


@cute.jit
def write_slot(slots: cute.Tensor, stage, request, kv_head, row_start, row_count, kv_end, offset, kv_len, valid):
    """The unit's fields into the stage's slot (by the lane that then arrives: :func:`publish_unit`)."""
    slots[stage, int(SlotField.REQUEST)] = request
    slots[stage, int(SlotField.KV_HEAD)] = kv_head
    slots[stage, int(SlotField.Q_ROW_START)] = row_start
    slots[stage, int(SlotField.Q_ROW_COUNT)] = row_count
    slots[stage, int(SlotField.KV_END)] = kv_end
    slots[stage, int(SlotField.CAUSAL_OFFSET)] = offset
    slots[stage, int(SlotField.KV_LEN)] = kv_len
    slots[stage, int(SlotField.VALID)] = valid


@cute.jit
def publish_unit(pipe_q, q_state, q_bytes: cutlass.Constexpr, slots: cute.Tensor, request, kv_head, row_start,
                 row_count, kv_end, offset, kv_len):
    """Once the Q stage is free, one elected lane writes the unit into its slot and arrives on the stage's full barrier
    expecting the Q box's bytes (its arrive releases its own slot writes to the consumers' acquiring wait)."""
    pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
    with cute.arch.elect_one():
        write_slot(slots, q_state.index, request, kv_head, row_start, row_count, kv_end, offset, kv_len, Int32(1))
        cute.arch.mbarrier_arrive_and_expect_tx(pipe_q.producer_get_barrier(q_state), q_bytes)


#: entries of a unit ring (:func:`publish_ring_unit`): the MLA load role writes unit ``n`` into entry ``n % UNIT_RING``
#: before it waits for the Q stage, so an entry is rewritten while its consumers may still read the unit of three
#: hand-offs before (its late fields, after the Q stage's release); three entries suffice (two do not:
#: ``tests/test_unit_ring_model.py``), four keep the index a mask
UNIT_RING = 4


@cute.jit
def publish_ring_unit(ring: cute.Tensor, entry, request, local, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor,
                      source: UnitSource, lane, group: cutlass.Constexpr, rows: cutlass.Constexpr,
                      kv_heads: cutlass.Constexpr, page_size: cutlass.Constexpr, kv_tile: cutlass.Constexpr):
    """Unit ``local`` of ``request`` (``request == batch``: none left, ``VALID`` 0) into ring entry ``entry``: every
    lane of the calling warp decodes it, lane 0 writes it. The readers meet it behind a barrier (the load threads'
    named barrier, the consumers' Q wait: lane 0 of warp 0 arrives on the Q stage after it wrote)."""
    zero = Int32(0)
    kv_head, row_start, row_count, kv_end, offset, kv_len, valid = zero, zero, zero, zero, zero, zero, zero
    if request < source.batch:
        kv_head, row_start, row_count, kv_end, offset, kv_len = unit_fields(
            request, local, qo_indptr, kv_indptr, source.kv_last_page_len, group, rows, kv_heads, page_size, kv_tile)
        valid = Int32(1)
    if lane == 0:
        write_slot(ring, entry, request, kv_head, row_start, row_count, kv_end, offset, kv_len, valid)
    return kv_head, row_start, row_count, kv_end, offset, kv_len


@cute.jit
def send_ring_unit(pipe_u, u_state, ring: cute.Tensor, request, local, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor,
                   source: UnitSource, lane, group: cutlass.Constexpr, rows: cutlass.Constexpr,
                   kv_heads: cutlass.Constexpr, page_size: cutlass.Constexpr, kv_tile: cutlass.Constexpr):
    """A unit pipeline's producer warp (sm_100a; ``pipe_u`` a ``PipelineAsync`` over the ring's entries, one producer
    arrival, every consuming thread's arrival): once entry ``u_state.index`` is free, the unit goes into it
    (:func:`publish_ring_unit`) and lane 0 arrives on its full barrier (release: its own writes). The caller advances
    ``u_state`` (outside any branch that only the producer warp takes: every thread of a load warpgroup tracks it).
    Returns ``(kv_head, q_row_start, q_row_count, kv_end, causal_offset, kv_len)``."""
    pipe_u.producer_acquire(u_state)
    fields = publish_ring_unit(ring, u_state.index, request, local, qo_indptr, kv_indptr, source, lane, group, rows,
                               kv_heads, page_size, kv_tile)
    if lane == 0:
        pipe_u.producer_commit(u_state)
    return fields


@cute.jit
def first_ring_unit(pipe_u, ring: cute.Tensor):
    """A consuming role's start: its own pipeline state (each role makes one inside its branch: one state object
    shared by the role branches fails to trace) and the first entry's ``VALID`` (:func:`wait_ring_unit`)."""
    from cutlass import pipeline as cpipe

    u_state = cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, UNIT_RING)
    return u_state, wait_ring_unit(pipe_u, u_state, ring)


@cute.jit
def wait_ring_unit(pipe_u, u_state, ring: cute.Tensor) -> Int32:
    """A unit pipeline's consuming thread: wait for the next entry (held until :func:`take_held_unit`) and return
    its ``VALID`` (0: the end). A role's loop carries only this and the state; the fields it needs are read inside
    the loop (:func:`take_held_unit`), so none is live across the loop's back edge (carrying all eight cost the
    sm_100a MLA kernel 24 bytes of spills at its 128 registers a thread)."""
    pipe_u.consumer_wait(u_state)
    return ring[u_state.index, int(SlotField.VALID)]


@cute.jit
def ring_unit_fields(ring: cute.Tensor, u_state):
    """The held entry's ``(request, kv_head, q_row_start, q_row_count, kv_end, causal_offset, kv_len)``."""
    i = u_state.index
    return (ring[i, int(SlotField.REQUEST)], ring[i, int(SlotField.KV_HEAD)], ring[i, int(SlotField.Q_ROW_START)],
            ring[i, int(SlotField.Q_ROW_COUNT)], ring[i, int(SlotField.KV_END)], ring[i, int(SlotField.CAUSAL_OFFSET)],
            ring[i, int(SlotField.KV_LEN)])


@cute.jit
def take_held_unit(pipe_u, u_state, ring: cute.Tensor):
    """The held entry's fields (:func:`ring_unit_fields`), then the entry given back (every reading thread arrives
    itself, after its reads) and the state stepped to the next."""
    fields = ring_unit_fields(ring, u_state)
    pipe_u.consumer_release(u_state)
    u_state.advance()
    return fields


@cute.jit
def read_slot(slots: cute.Tensor, stage, field: cutlass.Constexpr) -> Int32:
    """A consumer warp's read of one slot field: lane 0 (the lane that releases the Q stage for its warp) loads it
    and shuffles it to the others, so no lane's read is left unordered against the producer's next write."""
    value = Int32(0)
    if cute.arch.lane_idx() == 0:
        value = slots[stage, field]
    return cute.arch.shuffle_sync(value, 0)


@cute.jit
def end_of_work(pipe_q, q_state, slots: cute.Tensor):
    """The CTA's last hand-off: once the Q stage is free, a slot with ``VALID`` 0 and an arrive with no bytes."""
    pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
    zero = Int32(0)
    with cute.arch.elect_one():
        write_slot(slots, q_state.index, zero, zero, zero, zero, zero, zero, zero, zero)
        cute.arch.mbarrier_arrive(pipe_q.producer_get_barrier(q_state))


@cute.jit
def batch_rules(qo_indptr: cute.Tensor, kv_indptr: cute.Tensor, num_indices, total_q, tidx,
                num_threads: cutlass.Constexpr, words: cute.Tensor, group: cutlass.Constexpr,
                rows: cutlass.Constexpr, kv_heads: cutlass.Constexpr, kv_last_page_len: cute.Tensor,
                error_word: cute.Tensor, report_requests, page_size: cutlass.Constexpr, kv_tile: cutlass.Constexpr,
                barrier_id: cutlass.Constexpr = None, uniform: cutlass.Constexpr = False):
    """(fault bits, units) of the batch, on every thread of the CTA (all call it; ``words``: ``2 * num_threads // 32``
    shared int32, scratch): one pass of ``num_threads`` requests at a time, then a block reduction. Where
    ``report_requests`` (one CTA), each request's own rules go to the error word as well. ``uniform``: the fault bits
    also carry ``MIXED_UNITS`` where some request has another unit count than request 0 (the caller strips it)."""
    batch = kv_indptr.shape[0] - 1
    bad = Int32(0)
    units = Int32(0)
    first_units = Int32(0)
    if cutlass.const_expr(uniform):
        first_units = request_units(qo_indptr, Int32(0), batch, group, rows, kv_heads)
    if batch == 0:
        if tidx == 0:
            if kv_indptr[0] != 0:
                bad = bad | FAULT_KV_INDPTR
            if qo_indptr[0] != 0 or total_q != 0:
                bad = bad | FAULT_QO_INDPTR
    for b in range(tidx, batch, num_threads):
        page_start = kv_indptr[b]
        page_end = kv_indptr[b + 1]
        token_start = qo_indptr[b]
        token_end = qo_indptr[b + 1]
        q_len = token_end - token_start
        if page_end < page_start:
            bad = bad | FAULT_KV_INDPTR
        if q_len < 0:
            bad = bad | FAULT_QO_INDPTR
        if b == 0:
            if token_start != 0:
                bad = bad | FAULT_QO_INDPTR
            if page_start != 0:
                bad = bad | FAULT_KV_INDPTR
        if b == batch - 1:
            if token_end != total_q:
                bad = bad | FAULT_QO_INDPTR
            if page_end > num_indices:
                bad = bad | FAULT_KV_INDPTR
        if q_len > 0:
            units = units + (q_len * group + rows - 1) // rows * kv_heads
        if cutlass.const_expr(uniform):
            mine = Int32(0)
            if q_len > 0:
                mine = (q_len * group + rows - 1) // rows * kv_heads
            if mine != first_units:
                bad = bad | MIXED_UNITS
        if report_requests:  # reported here too: a request without queries has no unit whose decode would see it
            request_rule_faults(error_word, kv_last_page_len[b], b, page_end - page_start, page_size, kv_tile)
    for i in cutlass.range_constexpr(5):  # warp reduction: OR of the bits, sum of the units
        bad = bad | cute.arch.shuffle_sync_bfly(bad, 1 << i)
        units = units + cute.arch.shuffle_sync_bfly(units, 1 << i)
    warp = tidx // WARP
    num_warps = num_threads // WARP
    if tidx % WARP == 0:
        words[warp] = units
        words[num_warps + warp] = bad
    _sync(num_threads, barrier_id)
    total = Int32(0)
    faults = Int32(0)
    for w in cutlass.range_constexpr(num_warps):
        total = total + words[w]
        faults = faults | words[num_warps + w]
    return faults, total


@cute.jit
def check_batch(tidx, cta, num_threads: cutlass.Constexpr, qo_indptr: cute.Tensor, kv_indptr: cute.Tensor,
                kv_indices: cute.Tensor, kv_last_page_len: cute.Tensor, output: cute.Tensor, lse: cute.Tensor,
                slots: cute.Tensor, rule_words: cute.Tensor, request_faults: cute.Tensor, unit_state: cute.Tensor,
                error_word: cute.Tensor, num_pages, group: cutlass.Constexpr, rows: cutlass.Constexpr,
                kv_heads: cutlass.Constexpr, head_dim: cutlass.Constexpr, page_size: cutlass.Constexpr,
                kv_tile: cutlass.Constexpr, row_slots=None, barrier_id: cutlass.Constexpr = None,
                rank_major_units: cutlass.Constexpr = 0):
    """A self-scheduling kernel's start, every thread of the CTA before the roles split: the batch's rules and units
    (:func:`batch_rules`; CTA 0 reports each request's own); a broken batch gets no unit and this CTA writes its
    grid-stride share of the rows 0 / lse -inf (CTA 0 records the fault), a valid one has its page ids scanned, a
    share a CTA (:func:`scan_page_ids`). Returns the roles' :class:`UnitSource`. ``barrier_id``: the threads calling it
    are one role's (``num_threads`` of them, a named barrier), not the CTA's. ``rank_major_units`` (> 0): the source
    says whether this batch is taken rank-major (module docstring; the same answer in every CTA)."""
    faults, total = batch_rules(qo_indptr, kv_indptr, kv_indices.shape[0], output.shape[0], tidx, num_threads,
                                rule_words, group, rows, kv_heads, kv_last_page_len, error_word, cta == 0, page_size,
                                kv_tile, barrier_id, uniform=rank_major_units > 0)
    rank_major = None
    if cutlass.const_expr(rank_major_units > 0):
        ctas, _, _ = cute.arch.grid_dim()
        rank_major = Int32(0)
        if (faults & MIXED_UNITS) == 0 and total <= rank_major_units * ctas:
            rank_major = Int32(1)
        faults = faults & ~MIXED_UNITS
    if faults != 0:
        total = Int32(0)
        grid, _, _ = cute.arch.grid_dim()
        empty_rows(output, lse, tidx, num_threads, head_dim, cta * num_threads, output.shape[0], grid)
        if cta == 0 and tidx == 0:
            record_fault(error_word, faults, 0)
    else:
        scan_page_ids(kv_indptr, kv_indices, num_pages, tidx, num_threads, unit_state, request_faults, error_word)
    # any thread's marks happen before this CTA's count (finish_schedule), whose release the last CTA reads, and
    # every read of rule_words before the count reuses it
    _sync(num_threads, barrier_id)
    return UnitSource(unit_state, slots, row_slots, request_faults, kv_last_page_len, error_word, num_pages,
                      kv_indptr.shape[0] - 1, total, rank_major)


@cute.jit
def _sync(num_threads: cutlass.Constexpr, barrier_id: cutlass.Constexpr):
    """The CTA's barrier, or (``barrier_id``) the named one of the ``num_threads`` threads of one role."""
    if cutlass.const_expr(barrier_id is None):
        cute.arch.sync_threads()
    else:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)


@cute.jit
def scan_page_ids(kv_indptr: cute.Tensor, kv_indices: cute.Tensor, num_pages, tidx, num_threads: cutlass.Constexpr,
                  unit_state: cute.Tensor, request_faults: cute.Tensor, error_word: cute.Tensor,
                  ids_per_thread: cutlass.Constexpr[int] = 1, first_ids=None):
    """This CTA's grid-stride share of ``kv_indices[0 : kv_indptr[batch]]`` (a valid batch's): an id outside
    ``[0, num_pages)`` marks its request, read by any unit or not (a request without queries reads none of its
    pages, yet its bad id is reported, as the planner's scan does). ``ids_per_thread`` > 1 (the line builds'
    ``scan_ids_per_thread``): :func:`scan_page_ids_batched`, whose first chunk the caller may have loaded
    (``first_ids``)."""
    cta, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    batch = kv_indptr.shape[0] - 1
    end = cutlass.min(kv_indptr[batch], kv_indices.shape[0])
    if cutlass.const_expr(ids_per_thread > 1):
        scan_page_ids_batched(kv_indptr, kv_indices, num_pages, tidx, num_threads, unit_state, request_faults,
                              error_word, ids_per_thread, cta, grid, batch, end, first_ids)
    else:
        for p in range(cta * num_threads + tidx, end, grid * num_threads):
            page = kv_indices[p]
            if page < 0 or page >= num_pages:
                mark_page_fault(unit_state, request_faults, error_word, last_at_most(kv_indptr, batch, p), page, p)


@cute.jit
def scan_page_ids_batched(kv_indptr: cute.Tensor, kv_indices: cute.Tensor, num_pages, tidx,
                          num_threads: cutlass.Constexpr, unit_state: cute.Tensor, request_faults: cute.Tensor,
                          error_word: cute.Tensor, ids_per_thread: cutlass.Constexpr[int], cta, grid, batch, end,
                          first_ids=None):
    """:func:`scan_page_ids` with ``ids_per_thread`` loads in flight a thread: the CTA's chunks of ``num_threads *
    ids_per_thread`` ids are first prefetched to L2 (a 128-byte line a thread a chunk: one DRAM round trip for the
    CTA's whole share), then each chunk's ids are loaded, ``ids_per_thread`` a thread, before any is checked
    (``planner_scan.load_id_batch``, as the device planner's ``page_scan`` does). A pass of the one-load loop waits
    out a whole load; at page 1 a CTA's share is ~11 of them at 64 x 8192 (session 40). ``first_ids``: the CTA's
    first chunk, loaded at the kernel's start (``line_schedule.derive_stretch``), so only the later chunks wait."""
    chunk = num_threads * ids_per_thread
    first = cta * chunk
    if cutlass.const_expr(first_ids is not None):
        first = first + grid * chunk
        for k in cutlass.range_constexpr(ids_per_thread):
            _check_scanned_id(kv_indptr, num_pages, unit_state, request_faults, error_word, batch, end,
                              cta * chunk + k * num_threads + tidx, first_ids[k])
    if tidx * PREFETCH_LINE_IDS < chunk:  # a chunk is chunk / 32 lines: one a thread
        for base in range(first + tidx * PREFETCH_LINE_IDS, end, grid * chunk):
            cute.arch.prefetch((kv_indices.iterator + base).llvm_ptr, cache_level="L2")
    ids = cute.make_rmem_tensor((ids_per_thread,), Int32)
    for base in range(first, end, grid * chunk):
        load_id_batch(kv_indices, base, num_threads, tidx, end, ids)
        for k in cutlass.range_constexpr(ids_per_thread):
            _check_scanned_id(kv_indptr, num_pages, unit_state, request_faults, error_word, batch, end,
                              base + k * num_threads + tidx, ids[k])


@cute.jit
def _check_scanned_id(kv_indptr: cute.Tensor, num_pages, unit_state: cute.Tensor, request_faults: cute.Tensor,
                      error_word: cute.Tensor, batch, end, p, page):
    """Id ``page`` at ``p`` of the scan: one outside ``[0, num_pages)`` before ``end`` marks its request."""
    if p < end and (page < 0 or page >= num_pages):
        mark_page_fault(unit_state, request_faults, error_word, last_at_most(kv_indptr, batch, p), page, p)


@cute.jit
def mark_page_fault(unit_state: cute.Tensor, request_faults: cute.Tensor, error_word: cute.Tensor, request, page,
                    position):
    """A page id outside the pool in one of ``request``'s units: mark the request for :func:`finish_schedule`."""
    cute.arch.atomic_or((request_faults.iterator + request).llvm_ptr, Int32(FAULT_PAGE_ID))
    unit_state[FAULTS_SEEN] = Int32(1)
    record_fault(error_word, FAULT_PAGE_ID, request)
    error_word[2] = page
    error_word[3] = position
    cute.arch.fence_acq_rel_gpu()  # before this CTA's count (finish_schedule), which the last CTA reads after


@cute.jit
def check_tile_ids(page_ids: cute.Tensor, page_base, kv_base, kv_end, page_size: cutlass.Constexpr, num_pages,
                   source, request, lane):
    """Pages of 8+ keys (every lane holds the tile's ids, -1 past ``kv_end``): an id of the request's outside
    ``[0, num_pages)`` marks it (lane 0) and becomes -1 (a zero-filled box: TMA never reads outside its tensor)."""
    for i in cutlass.range_constexpr(cute.size(page_ids)):
        if kv_base + i * page_size < kv_end:
            pid = page_ids[i]
            if pid < 0 or pid >= num_pages:
                if lane == 0:
                    mark_page_fault(source.unit_state, source.request_faults, source.error_word, request, pid,
                                    page_base + kv_base // page_size + i)
                page_ids[i] = Int32(-1)


@cute.jit
def check_lane_ids(lane_pages: cute.Tensor, first_index, n_pages, num_pages, source, request, lane):
    """Ids loaded one per lane (``page_ids.load_lane_page_ids``): one outside ``[0, num_pages)`` marks its request
    and becomes -1 (a zero-filled row or box: nothing outside the pool is read)."""
    for c in cutlass.range_constexpr(cute.size(lane_pages)):
        p = c * WARP + lane
        if p < n_pages:
            pid = lane_pages[c]
            if pid < 0 or pid >= num_pages:
                mark_page_fault(source.unit_state, source.request_faults, source.error_word, request, pid,
                                first_index + p)
                lane_pages[c] = Int32(-1)


@cute.jit
def finish_schedule(unit_state: cute.Tensor, request_faults: cute.Tensor, qo_indptr: cute.Tensor, output: cute.Tensor,
                    lse: cute.Tensor, ctid, num_threads: cutlass.Constexpr, head_dim: cutlass.Constexpr,
                    barrier_id: cutlass.Constexpr, word: cute.Tensor, batch=None):
    """The consumers' end (all ``num_threads`` of them, every row they own stored): count the CTA out (one acq_rel
    atomic after a named barrier, so the count publishes every consumer's stores); the last CTA writes the marked
    requests' rows 0 / lse -inf and zeroes the state and the marks for the next launch. ``qo_indptr`` None (GQA
    decode's line build, ``line_schedule.finish_line``): request ``b`` is token ``b`` of a batch of ``batch``."""
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    grid, _, _ = cute.arch.grid_dim()
    if ctid == 0:
        word[0] = cute.arch.atomic_add((unit_state.iterator + UNITS_DONE).llvm_ptr, Int32(1), sem="acq_rel",
                                       scope="gpu")
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    if word[0] == Int32(grid) - 1:
        if unit_state[FAULTS_SEEN] != 0:
            if cutlass.const_expr(qo_indptr is None):
                requests = batch
            else:
                requests = qo_indptr.shape[0] - 1
            for b in range(requests):
                if request_faults[b] != 0:
                    if cutlass.const_expr(qo_indptr is None):
                        empty_rows(output, lse, ctid, num_threads, head_dim, b * output.shape[1], b + 1, 1)
                    else:
                        empty_rows(output, lse, ctid, num_threads, head_dim, qo_indptr[b] * output.shape[1],
                                   qo_indptr[b + 1], 1)
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)  # every thread read the marks
            for b in range(ctid, requests, num_threads):
                request_faults[b] = Int32(0)
        if ctid == 0:
            unit_state[UNIT_COUNTER] = Int32(0)
            unit_state[UNITS_DONE] = Int32(0)
            unit_state[FAULTS_SEEN] = Int32(0)

"""The sm_90a planner-free MLA prefill's unit ring, as an executable model (CPU): is an entry ever rewritten while a
consumer warpgroup may still read it?

``common/mla.load_units`` writes unit ``n`` into ring entry ``n % UNIT_RING`` *before* it waits for the (single) Q
stage, and the output warpgroup releases the Q stage on arrival, then reads the unit's late fields after its main
loop. The argument in ``unit_schedule.py`` says three entries suffice. This model runs the load role and both consumer
warpgroups as coroutines over the kernel's synchronisation (the Q stage, two K stages both warpgroups release, the
per-tile ``P_BARRIER`` and per-unit ``FINAL_BARRIER`` between them, the smem-epilogue split's held last K stage) under
random interleavings, and checks every ring read sees its own unit: it holds for 3 and 4 entries, and fails for 2
(so the model can see the hazard it rules out).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

END = -1


class Hazard(AssertionError):
    """A consumer read a ring entry that held another unit."""


class Kernel:
    """The shared state: the ring, the Q stage (1), the K stages, two named barriers' generations."""

    def __init__(self, ring_entries: int, k_stages: int = 2):
        self.ring = [None] * ring_entries
        self.q_full = 0  # Q fills committed
        self.q_free = 1  # Q stage frees (starts free); a fill waits for q_free > fills so far
        self.q_releases = {}  # fill index -> warpgroups that released it
        self.k_full = 0
        self.k_stages = k_stages
        self.k_released = 0  # K tiles released by both warpgroups
        self.k_rel = {}
        self.barrier = {}  # (name, generation) -> arrivals

    def read(self, unit: int) -> None:
        got = self.ring[unit % len(self.ring)]
        if got != unit:
            raise Hazard(f"entry {unit % len(self.ring)} read for unit {unit} holds {got}")

    def release_q(self, fill: int, who: str) -> None:
        self.q_releases.setdefault(fill, set()).add(who)
        if len(self.q_releases[fill]) == 2:
            self.q_free += 1

    def release_k(self, tile: int, who: str) -> None:
        self.k_rel.setdefault(tile, set()).add(who)
        while len(self.k_rel.get(self.k_released, ())) == 2:
            self.k_released += 1


def load_role(k: Kernel, tiles: list):
    """Entry, then Q, then the unit's K tiles; the next entry written after them (``load_units``)."""
    fills = 0
    k_tiles = 0
    k.ring[0] = 0 if tiles else END
    for u, n in enumerate(tiles):
        yield lambda: k.q_free > fills  # producer_acquire(Q)
        fills += 1
        k.q_full = fills
        for _ in range(n):
            yield lambda: k.k_released + k.k_stages > k_tiles  # producer_acquire(K)
            k_tiles += 1
            k.k_full = k_tiles
        k.ring[(u + 1) % len(k.ring)] = u + 1 if u + 1 < len(tiles) else END
        yield lambda: True
    yield lambda: k.q_free > fills  # the end: an arrive with no copies
    k.q_full = fills + 1


def barrier(k: Kernel, name: str, gen: int):
    k.barrier[(name, gen)] = k.barrier.get((name, gen), 0) + 1
    yield lambda: k.barrier[(name, gen)] == 2


def score_role(k: Kernel, tiles: list, held_last: bool):
    """WG1: Q wait, early reads; per tile S, Q released after the last, P_BARRIER, PV, K released (the last only after
    the epilogue with ``held_last``); late reads, FINAL_BARRIER."""
    k_tile = 0
    p_gen = 0
    for u, n in enumerate(tiles):
        yield lambda: k.q_full > u
        k.read(u)
        for t in range(n):
            yield lambda: k.k_full > k_tile
            if t == n - 1:
                k.release_q(u, "wg1")
            yield from barrier(k, "P", p_gen)
            p_gen += 1
            if not (held_last and t == n - 1):
                k.release_k(k_tile, "wg1")
            k_tile += 1
        if n == 0:
            k.release_q(u, "wg1")
        k.read(u)  # late fields
        yield from barrier(k, "FINAL", u)
        if held_last and n:
            k.release_k(k_tile - 1, "wg1")
    yield lambda: k.q_full > len(tiles)
    if k.ring[len(tiles) % len(k.ring)] != END:
        raise Hazard("the end entry was overwritten")


def output_role(k: Kernel, tiles: list, held_last: bool):
    """WG2: Q wait, early read, Q released at once; per tile P_BARRIER, PV, K released; late reads, FINAL_BARRIER."""
    k_tile = 0
    p_gen = 0
    for u, n in enumerate(tiles):
        yield lambda: k.q_full > u
        k.read(u)
        k.release_q(u, "wg2")
        for t in range(n):
            yield lambda: k.k_full > k_tile
            yield from barrier(k, "P", p_gen)
            p_gen += 1
            if not (held_last and t == n - 1):
                k.release_k(k_tile, "wg2")
            k_tile += 1
        k.read(u)  # late fields
        yield from barrier(k, "FINAL", u)
        if held_last and n:
            k.release_k(k_tile - 1, "wg2")
    yield lambda: k.q_full > len(tiles)


def run(tiles: list, ring_entries: int, held_last: bool, seed: int) -> None:
    """One random interleaving to the end; Hazard on a bad read, AssertionError on a deadlock."""
    k = Kernel(ring_entries)
    rng = random.Random(seed)
    actors = [load_role(k, tiles), score_role(k, tiles, held_last), output_role(k, tiles, held_last)]
    waiting = [next(a) for a in actors]
    live = set(range(len(actors)))
    while live:
        ready = [i for i in live if waiting[i]()]
        assert ready, "deadlock"
        i = rng.choice(ready)
        try:
            waiting[i] = next(actors[i])
        except StopIteration:
            live.discard(i)


UNITS = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(tiles=UNITS, ring_entries=st.sampled_from([3, 4]), held_last=st.booleans(), seed=st.integers(0, 2**32))
def test_three_or_more_entries_are_never_read_stale(tiles, ring_entries, held_last, seed):
    run(tiles, ring_entries, held_last, seed)


def test_two_entries_would_be_read_stale():
    """The model sees the hazard the ring's size rules out: with 2 entries some interleaving reads a rewritten one."""
    for seed in range(2000):
        try:
            run([1, 1, 1, 1, 1, 1], 2, held_last=False, seed=seed)
        except Hazard:
            return
    pytest.fail("no interleaving of 2 entries read a stale unit: the model is too weak to check the ring")


def test_the_kernel_uses_a_ring_the_model_clears():
    from cute_attn.kernels.common.unit_schedule import UNIT_RING

    assert UNIT_RING >= 3

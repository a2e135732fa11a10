"""The sm_100a self-scheduling prefills' roles (GQA and MLA) as an executable model (CPU): can the unit pipeline deadlock
them?

The kernel (``kernels/sm100/prefill_roles.py``) has never run: there is no Blackwell GPU here. Its planned roles hand
work through six pipelines; the self-scheduling build adds a seventh, the unit ring, which the load warp fills and the
MMA warp, the softmax and the correction warps each drain (a role waits for a unit, copies it, releases the entry).
This model runs the four roles as coroutines over bounded queues with the kernel's stage counts and per-unit steps,
under random interleavings, for units with 0..3 key tiles: every run must finish (no role waits forever). A ring of 0
entries (the load warp could never send) must deadlock, so the model can see one.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


class Pipe:
    """A pipeline of ``stages`` over one producer and ``consumers`` consuming roles (each releases every stage)."""

    def __init__(self, stages: int, consumers: int = 1):
        self.stages, self.produced = stages, 0
        self.released = [0] * consumers

    def can_acquire(self) -> bool:
        return self.produced - min(self.released) < self.stages

    def can_wait(self, consumer: int = 0) -> bool:
        return self.produced > self.released[consumer]


def acquire(p: Pipe):
    yield lambda: p.can_acquire()
    p.produced += 1  # (the fill and its commit)


def consume(p: Pipe, who: int = 0):
    yield lambda: p.can_wait(who)
    p.released[who] += 1


def load_role(k, units):
    for n in units + [None]:  # None: the VALID 0 entry
        yield from acquire(k["u"])
        if n:
            yield from acquire(k["q"])
            yield from acquire(k["kv"])  # K0
            for _ in range(1, n):
                yield from acquire(k["kv"])  # Kj
                yield from acquire(k["kv"])  # V(j-1)
            yield from acquire(k["kv"])  # V(n-1)


def mma_role(k, units):
    for n in units:
        yield from consume(k["u"], 0)
        if not n:
            continue
        yield lambda: k["q"].can_wait()
        yield from qk(k)
        for j in range(1, n):
            yield from qk(k)
            yield from pv(k)
        k["q"].released[0] += 1  # Q released after the item's last S
        yield from pv(k)
    yield from consume(k["u"], 0)  # the end


def qk(k):
    yield lambda: k["kv"].can_wait()
    yield from acquire(k["s"])
    k["kv"].released[0] += 1


def pv(k):
    yield lambda: k["kv"].can_wait()
    yield lambda: k["o"].can_acquire()
    yield from consume(k["p"])
    k["kv"].released[0] += 1
    k["o"].produced += 1


def softmax_role(k, units):
    for n in units:
        yield from consume(k["u"], 1)
        for j in range(n):
            yield lambda: k["s"].can_wait()
            yield from acquire(k["p"])
            k["s"].released[0] += 1
            if j > 0:
                yield from acquire(k["c"])  # the row scale
        if n:
            yield from acquire(k["c"])  # (row_sum, row_max)
    yield from consume(k["u"], 1)


def correction_role(k, units):
    for n in units:
        yield from consume(k["u"], 2)
        for _ in range(1, n):
            yield from consume(k["c"])
            yield from consume(k["o"])  # rescale O, then release it
        if n:
            yield from consume(k["c"])
            yield from consume(k["o"])  # the epilogue reads O, then releases it
    yield from consume(k["u"], 2)


def mla_load_role(k, units):
    """The MLA twin's load warpgroup: Q only for units with keys, then one stage a key tile (K and V = its ckv)."""
    for n in units + [None]:
        yield from acquire(k["u"])
        if n:
            yield from acquire(k["q"])
            for _ in range(n):
                yield from acquire(k["kv"])


def mla_mma_role(k, units):
    """The MLA twin's MMA warp: S0, S1, PV0, S2, PV1, ...: a stage is held from its S to its PV; Q released after the
    last S."""
    for n in units:
        yield from consume(k["u"], 0)
        if not n:
            continue
        yield lambda: k["q"].can_wait()
        yield from mla_qk(k, held=0)
        for j in range(1, n):
            yield from mla_qk(k, held=1)  # S_j while stage j - 1 waits for its PV
            if j == n - 1:
                k["q"].released[0] += 1
            yield from pv(k)
        if n == 1:
            k["q"].released[0] += 1
        yield from pv(k)
    yield from consume(k["u"], 0)


def mla_qk(k, held: int):
    """S_j: wait for the stage past the ``held`` ones (S'd, their PV not yet issued, so not released)."""
    kv_seen = k["kv"].released[0] + held
    yield lambda: k["kv"].produced > kv_seen
    yield from acquire(k["s"])


def run(units: list, seed: int, ring: int = 4, q_stages: int = 2, mla: bool = False) -> None:
    if mla:  # the MLA twin's stages: 1 Q, 2 K (V is the stage's ckv), 2 S, 1 P, 1 O, 2 C
        k = dict(u=Pipe(ring, consumers=3), q=Pipe(1), kv=Pipe(2), s=Pipe(2), p=Pipe(1), o=Pipe(1), c=Pipe(2))
        actors = [mla_load_role(k, units), mla_mma_role(k, units), softmax_role(k, units), correction_role(k, units)]
    else:
        k = dict(u=Pipe(ring, consumers=3), q=Pipe(q_stages), kv=Pipe(4), s=Pipe(2), p=Pipe(2), o=Pipe(1), c=Pipe(2))
        actors = [load_role(k, units), mma_role(k, units), softmax_role(k, units), correction_role(k, units)]
    rng = random.Random(seed)
    waiting = [next(a) for a in actors]
    live = set(range(len(actors)))
    while live:
        ready = [i for i in live if waiting[i]()]
        assert ready, f"deadlock: roles {sorted(live)} wait"
        i = rng.choice(ready)
        try:
            waiting[i] = next(actors[i])
        except StopIteration:
            live.discard(i)


@settings(max_examples=300, deadline=None)
@given(units=st.lists(st.integers(0, 3), min_size=0, max_size=10), seed=st.integers(0, 2**32),
       q_stages=st.sampled_from([1, 2]), mla=st.booleans())
def test_the_roles_never_deadlock_on_the_unit_ring(units, seed, q_stages, mla):
    """GQA at head dims 128 (two Q stages) and 256 (one), and the MLA twin (one Q stage, two K stages each held from
    its S to its PV), for any mix of units with and without keys and an empty batch."""
    run(units, seed, q_stages=q_stages, mla=mla)


@pytest.mark.parametrize("mla", [False, True])
def test_a_ring_without_entries_deadlocks(mla):
    try:
        run([1, 2], seed=0, ring=0, mla=mla)
    except AssertionError as e:
        assert "deadlock" in str(e)
        return
    raise AssertionError("the model ran with no ring entry: it cannot see a deadlock")

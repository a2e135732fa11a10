"""Per-warpgroup named barriers whose id is an immediate, never a register.

A kernel whose warpgroups each sync on their own barrier (id ``base + warpgroup``) could write one
``bar.sync`` with the id computed at run time (``BAR.SYNC Rn, count`` in SASS). The GPU orders that
correctly, but compute-sanitizer's racecheck does not follow it: with such a barrier in the sm90 decode
kernel, racecheck reported a shared-memory hazard across a later ``bar.sync 3, 256`` that orders the two
accesses (``tools/racecheck_probe.py`` reproduces it in 30 lines; ``docs/perf/h200-sanitizer.txt``). One
branch per warpgroup with an immediate id costs a warp-uniform branch and keeps the sanitizer's view of
the program exact, which is what its clean reports are worth.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def warpgroup_barrier_sync(base_id: cutlass.Constexpr[int], warpgroup, num_threads: cutlass.Constexpr[int],
                           num_warpgroups: cutlass.Constexpr[int] = 2):
    """``bar.sync base_id + warpgroup, num_threads`` with the id as an immediate (warp-uniform ``warpgroup``)."""
    for w in cutlass.range_constexpr(num_warpgroups):
        if warpgroup == w:
            cute.arch.barrier(barrier_id=base_id + w, number_of_threads=num_threads)


@cute.jit
def warpgroup_barrier_arrive(base_id: cutlass.Constexpr[int], warpgroup, num_threads: cutlass.Constexpr[int],
                             num_warpgroups: cutlass.Constexpr[int] = 2):
    """``bar.arrive base_id + warpgroup, num_threads`` with the id as an immediate."""
    for w in cutlass.range_constexpr(num_warpgroups):
        if warpgroup == w:
            cute.arch.barrier_arrive(barrier_id=base_id + w, number_of_threads=num_threads)

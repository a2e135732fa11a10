"""Tensor memory (TMEM) ownership and tcgen05 hand-off fences, shared by the sm_100a prefill kernels.

Both prefill kernels hold all ``TMEM_COLUMNS`` for the CTA's lifetime: one warp of the correction role
allocates them before its role loop and frees them after every other TMEM user (softmax and MMA warps)
has arrived on a named barrier; each user waits for the allocation (another named barrier) before its
first TMEM access. Barrier ids and the allocating warp differ per kernel, so they are arguments.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32
from cutlass import pipeline as cpipe
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values
from cutlass.memory import TmemAllocator

from ..common.limits import TMEM_COLUMNS

# softmax (4 warps) + correction (4 warps) + the MMA warp: the warps that touch TMEM in both kernels
TMEM_USER_WARPS = 4 + 4 + 1


def fence_before_sync():
    """``tcgen05.fence::before_thread_sync``: order this thread's tcgen05 ops before a following arrive."""
    cute.arch.inline_ptx("tcgen05.fence::before_thread_sync;")


def fence_after_sync():
    """``tcgen05.fence::after_thread_sync``: order tcgen05 ops after a barrier wait behind the other side's."""
    cute.arch.inline_ptx("tcgen05.fence::after_thread_sync;")


class PrefillTmem:
    """All of TMEM for one CTA: the allocator plus the barrier its users meet on before it is freed."""

    def __init__(self, holder: cute.Pointer, alloc_barrier_id: int, free_barrier_id: int, allocator_warp: int):
        users = 32 * TMEM_USER_WARPS
        self.allocator = TmemAllocator(holder, barrier_for_retrieve=cpipe.NamedBarrier(alloc_barrier_id, users),
                                       allocator_warp_id=allocator_warp)
        self.users_done = cpipe.NamedBarrier(free_barrier_id, users)

    # the DSL carries this object through the role dispatch's runtime `if`s: its only runtime value is the
    # allocator's (the smem word that receives the TMEM address)
    def __extract_mlir_values__(self):
        return extract_mlir_values(self.allocator)

    def __new_from_mlir_values__(self, values) -> "PrefillTmem":
        carried = object.__new__(PrefillTmem)
        carried.allocator = new_from_mlir_values(self.allocator, values)
        carried.users_done = self.users_done
        return carried

    def allocate(self):
        """Allocator warp, before its role: take every column; this CTA allocates nothing more."""
        self.allocator.allocate(TMEM_COLUMNS)
        self.allocator.relinquish_alloc_permit()

    def base(self) -> cute.Pointer:
        """Every user, before its first TMEM access: the allocation's base address (column 0, lane 0)."""
        self.allocator.wait_for_alloc()
        return self.allocator.retrieve_ptr(Float32)

    def release(self):
        """A non-allocating user, after its role: it will touch TMEM no more."""
        self.users_done.arrive()

    def free(self):
        """Allocator warp, after its role: wait until the other users are done, then deallocate."""
        self.users_done.arrive_and_wait()
        self.allocator.free(self.allocator.retrieve_ptr(Float32), TMEM_COLUMNS)

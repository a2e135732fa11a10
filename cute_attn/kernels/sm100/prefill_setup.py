"""Kernel-entry setup shared by the sm_100a prefill kernels: mbarrier storage, the role pipelines, TMEM.

Both kernels (``gqa_prefill.py``, ``mla_prefill.py``) run the same protocol between one MMA thread and
two 128-thread warpgroups: ``s`` (MMA -> softmax, "S_j in TMEM"), ``p`` (softmax -> MMA, "P_j written"),
``o`` (MMA -> correction, "PV_j landed") and ``c`` (softmax -> correction, the smem vector ring). Only
how Q and K/V arrive differs (TMA from one load warp vs. a ``cp.async`` load warpgroup), so each kernel
creates its ``q`` and ``kv`` pipelines itself, between :class:`PrefillBarriers` (the storage) and
:meth:`PrefillBarriers.create_role_pipelines`.

The steps keep one fixed order: shared-memory offsets follow allocation order and each pipeline
initialises its mbarriers when it is created, so q, kv, s, p, o, c is also the order of the ``mbarrier.init``
instructions in both kernels.
"""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass import pipeline as cpipe
from cutlass.memory import SmemAllocator

from .tmem import PrefillTmem

WARPGROUP_THREADS = 128  # the softmax and the correction role are one warpgroup each


class PrefillBarriers:
    """The shared-memory words of one CTA's six pipelines (a full and an empty mbarrier per stage; ``o`` has
    one stage) and of the TMEM address, allocated right after the kernel's data buffers."""

    def __init__(self, smem: SmemAllocator, q_stages: int, kv_stages: int, s_stages: int, p_stages: int,
                 c_stages: int):
        self.q = smem.allocate_array(Int64, 2 * q_stages, byte_alignment=8)
        self.kv = smem.allocate_array(Int64, 2 * kv_stages, byte_alignment=8)
        self.s = smem.allocate_array(Int64, 2 * s_stages, byte_alignment=8)
        self.p = smem.allocate_array(Int64, 2 * p_stages, byte_alignment=8)
        self.o = smem.allocate_array(Int64, 2, byte_alignment=8)
        self.c = smem.allocate_array(Int64, 2 * c_stages, byte_alignment=8)
        self.tmem_holder = smem.allocate_array(Int32, 1, byte_alignment=4)
        self.s_stages, self.p_stages, self.c_stages = s_stages, p_stages, c_stages

    @staticmethod
    def smem_bytes(q_stages: int, kv_stages: int, s_stages: int, p_stages: int, c_stages: int) -> int:
        """Bytes the constructor allocates (before alignment): for the kernels' ``smem_bytes``."""
        return 8 * 2 * (q_stages + kv_stages + s_stages + p_stages + 1 + c_stages) + 4

    def create_role_pipelines(self, tmem_alloc_barrier_id: int, tmem_free_barrier_id: int, tmem_allocator_warp: int):
        """After the kernel's ``q`` and ``kv`` pipelines: create ``s``, ``p``, ``o``, ``c`` and the TMEM owner,
        then fence and wait for every mbarrier init of the CTA, so that all six pipelines are usable.

        Returns ``(pipe_s, pipe_p, pipe_o, pipe_c, tmem)``.
        """
        mma_thread = cpipe.CooperativeGroup(cpipe.Agent.Thread, 1)
        warpgroup = cpipe.CooperativeGroup(cpipe.Agent.Thread, WARPGROUP_THREADS)
        pipe_s = cpipe.PipelineUmmaAsync.create(num_stages=self.s_stages, producer_group=mma_thread,
                                                consumer_group=warpgroup, barrier_storage=self.s, defer_sync=True)
        pipe_p = cpipe.PipelineAsyncUmma.create(num_stages=self.p_stages, producer_group=warpgroup,
                                                consumer_group=mma_thread, barrier_storage=self.p, defer_sync=True)
        pipe_o = cpipe.PipelineUmmaAsync.create(num_stages=1, producer_group=mma_thread, consumer_group=warpgroup,
                                                barrier_storage=self.o, defer_sync=True)
        pipe_c = cpipe.PipelineAsync.create(num_stages=self.c_stages, producer_group=warpgroup,
                                            consumer_group=warpgroup, barrier_storage=self.c, defer_sync=True)
        tmem = PrefillTmem(self.tmem_holder, tmem_alloc_barrier_id, tmem_free_barrier_id,
                           allocator_warp=tmem_allocator_warp)
        # every pipeline above was created with defer_sync: one fence + CTA barrier covers them all
        cpipe.pipeline_init_arrive(is_relaxed=True)
        cpipe.pipeline_init_wait()
        return pipe_s, pipe_p, pipe_o, pipe_c, tmem

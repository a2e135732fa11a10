"""Host side of a planner-free call: one launch of a self-scheduling attention kernel, no plan, no host sync.

The default call (no plan, ``check_indices=False``) of a kind whose spec says so (``OpSpec.self_schedule``) takes
this route instead of the device planner's (:mod:`cute_attn.device_planning`): the attention kernel built with
``dynamic_schedule``, whose CTAs check the batch's index rules themselves and take units from a counter
(``kernels/common/unit_schedule.py``). No planner, no check launch, no plan buffers, no combine, no device-to-host
copy. The only state is the counter and the per-request marks, zero between launches (the kernel's last CTA clears
them), one set per CUDA stream: capturable in a CUDA graph once made, and a replay schedules whatever the index
tensors then hold.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .buffers import allocate_outside_graph_pools
from .compile import compile_kernel
from .device_errors import error_word
from .device_planning import index_positions
from .kernels.common.paged_launch import LN2, LOG2_E
from .kernels.common.unit_schedule import UNIT_STATE_WORDS

__all__ = ["UnitScheduleRoute", "UnitScratch", "recorded_launches"]


@dataclass
class UnitScratch:
    """One stream's counter and request marks (zero between launches); a ``line_schedule`` build's split-KV scratch."""

    unit_state: torch.Tensor  # [UNIT_STATE_WORDS] int32
    request_faults: torch.Tensor  # [max(batch, 1)] int32
    ones: torch.Tensor  # [max(batch, 1)] int32 of 1: kv_last_page_len of a page-size-1 call without one (MLA ps1)
    merge_counters: torch.Tensor | None = None  # line_schedule: [max(num_ctas, 1)] int32, zero between launches
    partial_out: torch.Tensor | None = None  # line_schedule: [2 * num_ctas, tile_q_rows, head_dim_v] fp32
    partial_lse: torch.Tensor | None = None  # line_schedule: [2 * num_ctas, tile_q_rows] fp32

    @staticmethod
    def allocate(batch: int, device, config=None, num_ctas: int = 0) -> "UnitScratch":
        """``config``: a ``line_schedule`` build's, whose at most ``num_ctas - 1`` merges of at most ``2 (num_ctas -
        1)`` partials (``plan_partition``'s bound) get their counters and slots here."""
        def make():
            scratch = UnitScratch(torch.zeros(UNIT_STATE_WORDS, dtype=torch.int32, device=device),
                                  torch.zeros(max(batch, 1), dtype=torch.int32, device=device),
                                  torch.ones(max(batch, 1), dtype=torch.int32, device=device))
            if config is not None and config.line_schedule:
                slots = max(2 * num_ctas, 1)
                scratch.merge_counters = torch.zeros(max(num_ctas, 1), dtype=torch.int32, device=device)
                scratch.partial_out = torch.empty(slots, config.tile_q_rows, config.head_dim_v, dtype=torch.float32,
                                                  device=device)
                scratch.partial_lse = torch.empty(slots, config.tile_q_rows, dtype=torch.float32, device=device)
            return scratch

        return allocate_outside_graph_pools(device, make)


@dataclass
class UnitScheduleRoute:
    """A self-scheduling call shape, resolved once: where the index tensors sit, the chain, one scratch per stream."""

    positions: tuple  # argument positions of qo_indptr, kv_indptr, kv_indices, kv_last_page_len
    config: object  # the attention kernel's PagedAttentionConfig (dynamic_schedule=True)
    num_ctas: int
    batch: int
    num_pages: int
    scratch: dict  # stream handle -> UnitScratch
    kernel: object = None  # the compiled build (its entry issues the checks, then the attention kernel)

    schedules_itself = True  # api._launch: no plan slot, no launcher

    @staticmethod
    def resolve(spec, config, problem, num_ctas: int) -> "UnitScheduleRoute":
        return UnitScheduleRoute(index_positions(spec), config, num_ctas, problem.batch_size, problem.num_pages, {})

    def stream_scratch(self, stream: int, device) -> UnitScratch:
        """The scratch of launches on ``stream``, made on the first (zero-filled: make it outside a CUDA-graph
        capture, or the fill is recorded, not run)."""
        scratch = self.scratch.get(stream)
        if scratch is None:
            scratch = self.scratch[stream] = UnitScratch.allocate(self.batch, device, self.config, self.num_ctas)
        return scratch

    def launch(self, args: tuple, output, lse, natural_lse: bool, stream: int, device) -> None:
        if self.kernel is None:
            self.kernel = compile_kernel(self.config)
        scratch = self.stream_scratch(stream, device)
        qo, kvp, kvi, last = (None if p is None else args[p] for p in self.positions)
        if last is None:
            last = scratch.ones
        # the query and cache tensors before the first index tensor (q, k, v; MLA's four)
        data = args[:min(p for p in self.positions if p is not None)]
        if self.config.line_schedule:  # decode (kernels/common/line_schedule.py): merges fold in-kernel
            indptrs = (kvp,) if qo is None else (qo, kvp)  # GQA decode has no qo_indptr; MLA's one-token entry has
            self.kernel(*data, *indptrs, kvi, last, scratch.merge_counters, scratch.request_faults, scratch.unit_state,
                        error_word(device), output, lse, scratch.partial_out, scratch.partial_lse,
                        float(args[-1]) * LOG2_E, LN2 if natural_lse else 1.0, self.num_pages, self.num_ctas)
            return
        self.kernel(*data, qo, kvp, kvi, last, scratch.request_faults, scratch.unit_state, error_word(device), output,
                    lse, float(args[-1]) * LOG2_E, LN2 if natural_lse else 1.0, self.num_pages, self.num_ctas)


@contextlib.contextmanager
def recorded_launches():
    """The routes launched inside the block, one entry a launch (the route of *this* call, not whatever an earlier call
    left in api's route cache): how the GPU tiers and the sanitizer cases know a policy's call took its route."""
    routes = []
    original = UnitScheduleRoute.launch

    def launch(self, *args, **kwargs):
        routes.append(self)
        return original(self, *args, **kwargs)

    UnitScheduleRoute.launch = launch
    try:
        yield routes
    finally:
        UnitScheduleRoute.launch = original

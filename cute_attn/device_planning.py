"""Host side of device planning: buffers sized from shapes alone, and the planner launch.

A call with new index tensors then costs two launches (planner, attention), issued by one host call
(``kernels/common/launch_chain.py``), and no device-to-host copy: the
capacity comes from the shapes the host already knows (``batch = len(kv_indptr) - 1`` and ``total_q =
q.shape[0]``, through :meth:`PlanCapacity.for_limits`, which provably holds every plan of such a batch), the
planner (``kernels/common/device_planner.py``) fills the work lists in the caller's stream, and the index
checks leave their verdict in the device error word (:mod:`cute_attn.device_errors`). Everything here is
capturable in a CUDA graph once the buffers exist: a replay re-plans from whatever the index tensors then hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffers import allocate_outside_graph_pools
from .compile import compile_kernel
from .device_errors import error_word
from .kernels.common.device_planner import (MAX_CTAS, Q_TILE_FIELDS, REQUEST_FIELDS, DevicePlannerConfig,
                                            launch_writers, scan_ctas)
from .kernels.common.combine import CombineConfig
from .kernels.common.launch_chain import LaunchChainConfig
from .plan import PlanCapacity

__all__ = ["PlannerScratch", "DevicePlanRoute", "planner_config", "allocate_planned", "planner_fits",
           "launch_planner", "planner_arguments"]


@dataclass
class PlannerScratch:
    """The planner's own per-launch buffers (zero between launches where it says so)."""

    q_tiles: torch.Tensor  # [max_items, 4] int32
    q_tile_start: torch.Tensor  # [max_items + 1] int64
    requests: torch.Tensor  # [max(batch, 1), REQUEST_FIELDS] int32
    request_faults: torch.Tensor  # [max(batch, 1)] int32, zero between launches
    arrivals: torch.Tensor  # [1] int32, zero between launches
    ones: torch.Tensor  # [max(batch, 1)] int32: kv_last_page_len of kinds without one (page size 1: MLA)
    writers: int = 1  # the planning CTAs a launch has (device_planner.launch_writers: from the shapes alone)
    sizes: tuple = ()  # (capacity, num_ctas, batch, writers) the plan's buffers were made for (planner_fits)

    @staticmethod
    def allocate(capacity: PlanCapacity, batch: int, device, writers: int = 1) -> "PlannerScratch":
        rows = max(batch, 1)
        return PlannerScratch(
            q_tiles=torch.empty(capacity.max_items, Q_TILE_FIELDS, dtype=torch.int32, device=device),
            q_tile_start=torch.empty(capacity.max_items + 1, dtype=torch.int64, device=device),
            requests=torch.empty(rows, REQUEST_FIELDS, dtype=torch.int32, device=device),
            request_faults=torch.zeros(rows, dtype=torch.int32, device=device),
            arrivals=torch.zeros(1, dtype=torch.int32, device=device),
            ones=torch.ones(rows, dtype=torch.int32, device=device),
            writers=writers,
        )


def planner_config(spec, config, num_ctas: int) -> DevicePlannerConfig:
    if num_ctas > MAX_CTAS:
        raise ValueError(f"the device planner handles at most {MAX_CTAS} CTAs, the kernel launches {num_ctas}")
    return DevicePlannerConfig.for_plan(config.plan_config(num_ctas), arch=config.arch,
                                        has_qo_indptr="qo_indptr" in spec.arg_names, head_dim_v=config.head_dim_v)


def allocate_planned(config, capacity: PlanCapacity, num_ctas: int, batch: int, device, writers: int = 1):
    """A :class:`~cute_attn.api.DevicePlan` with the planner's scratch: its lists are written on the device (by
    ``writers`` planning CTAs)."""
    from .api import DevicePlan

    def make():
        plan = DevicePlan.allocate(config, capacity, num_ctas, device)
        plan.planner = PlannerScratch.allocate(capacity, batch, device, writers)
        plan.planner.sizes = (capacity, num_ctas, batch, writers)
        return plan

    return allocate_outside_graph_pools(device, make)  # kept for the route's later calls: not in a graph's pool


def planner_fits(plan, route: "DevicePlanRoute") -> bool:
    """Whether ``plan`` (from :func:`allocate_planned`) has the buffers ``route``'s planner writes."""
    return plan.planner is not None and plan.planner.sizes == (route.capacity, route.num_ctas, route.batch,
                                                               route.writers)


def index_positions(spec) -> tuple:
    """Argument positions of ``qo_indptr`` (or None), ``kv_indptr``, ``kv_indices``, ``kv_last_page_len`` (or None) in
    ``spec``'s entry."""
    names = spec.arg_names
    return tuple(names.index(n) if n in names else None
                 for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"))


@dataclass
class DevicePlanRoute:
    """What a device-planned call shape needs, resolved once: where the index tensors sit among the arguments,
    the planner, the capacity, and one DevicePlan per CUDA stream (plans on two streams must not share lists)."""

    positions: tuple  # argument positions of qo_indptr (or None), kv_indptr, kv_indices, kv_last_page_len (or None)
    planner_config: DevicePlannerConfig  # compiled on first use: plan_*(on_device=True) launches it alone
    chains: dict  # (attention config, with combine) -> the compiled planner + attention [+ combine] launch
    capacity: PlanCapacity
    num_ctas: int
    batch: int
    num_pages: int
    total_q: int
    slots: dict  # stream handle -> DevicePlan
    writers: int = 1  # the planner's row writers (device_planner.launch_writers of this shape)

    schedules_itself = False  # api._launch: plan into a slot, then the kind's launcher (unit_schedule_route: True)

    @staticmethod
    def resolve(spec, config, problem, num_ctas: int) -> "DevicePlanRoute":
        positions = index_positions(spec)
        pconfig = planner_config(spec, config, num_ctas)
        capacity = PlanCapacity.for_limits(pconfig.plan_config(num_ctas), max_batch=problem.batch_size,
                                           max_total_q=problem.total_q)
        return DevicePlanRoute(positions, pconfig, {}, capacity, num_ctas, problem.batch_size,
                               problem.num_pages, problem.total_q, {},
                               launch_writers(pconfig, problem.batch_size, problem.total_q))

    def chain(self, config, with_combine: bool):
        """The planner, ``config``'s attention kernel and (``with_combine``) its combine as one host function
        (``kernels/common/launch_chain.py``), compiled on first use."""
        key = (id(config), with_combine)
        hit = self.chains.get(key)
        if hit is None or hit[0] is not config:
            stages = (self.planner_config, config, *((CombineConfig.for_paged(config),) if with_combine else ()))
            hit = self.chains[key] = (config, compile_kernel(LaunchChainConfig(arch=config.arch, stages=stages)))
        return hit[1]

    def slot(self, config, stream: int, device):
        plan = self.slots.get(stream)
        if plan is None:
            plan = self.slots[stream] = allocate_planned(config, self.capacity, self.num_ctas, self.batch, device,
                                                         self.writers)
        return plan

    def plan(self, device_plan, args: tuple, output, lse) -> None:
        """Launch the planner alone (``plan_*(..., on_device=True)``)."""
        compile_kernel(self.planner_config)(*self.planner_args(device_plan, args, output, lse))

    def planner_args(self, device_plan, args: tuple, output, lse) -> tuple:
        qo, kvp, kvi, last = (None if p is None else args[p] for p in self.positions)
        return planner_arguments(device_plan, qo, kvp, kvi, last, output, lse, self.num_pages, self.total_q)

    def planned(self, device_plan, args: tuple, output, lse) -> tuple:
        """What the attention launcher takes as ``planned=``: this route (its :meth:`chain`) and the planner's
        arguments."""
        return self, self.planner_args(device_plan, args, output, lse)


def launch_planner(planner, device_plan, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output, lse,
                   num_pages: int, total_q: int) -> None:
    """Plan into ``device_plan`` (which holds the planner's scratch) from the index tensors, in the current stream."""
    planner(*planner_arguments(device_plan, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output, lse,
                               num_pages, total_q))


def planner_arguments(device_plan, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, output, lse,
                      num_pages: int, total_q: int) -> tuple:
    """The planner's arguments in its order (the stream is the caller's current one, from the tvm-ffi env)."""
    s = device_plan.planner
    device = kv_indptr.device
    if kv_last_page_len is None:
        kv_last_page_len = s.ones
    return (qo_indptr if qo_indptr is not None else kv_indptr, kv_indptr, kv_indices, kv_last_page_len, output, lse,
            device_plan.work_indptr, device_plan.items, device_plan.merge_indptr, device_plan.merges, s.q_tiles,
            s.q_tile_start, s.requests, s.request_faults, error_word(device), s.arrivals, num_pages, total_q,
            device_plan.partial_out.shape[0], scan_ctas(kv_indices.shape[0], s.writers), s.writers)

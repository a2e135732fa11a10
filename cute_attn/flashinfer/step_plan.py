"""One batch's device plan, shared by every ``run()`` between two ``plan()`` calls: FlashInfer's plan-once-per-step.

An engine plans once per step and runs every layer with that plan. A wrapper's ``run()`` could call the entry point's
default (planned on the GPU at every call), but then every layer pays the device planner: ~7-9 µs a decode layer,
10-22 µs a prefill one on the H200. Instead the first ``run()`` after a ``plan()`` launches the device planner once
(``plan_<kind>(..., on_device=True)``: no host sync) and every ``run()`` passes that plan (``plan=``), as an engine
that calls cute_attn directly would. A later step's first ``run()`` plans again into the same buffers when the
shapes allow (``api.plan_for(recycle=)``), so a steady state allocates nothing.

A batch the entry point's default call schedules without any plan (the planner-free prefills, where their policy is
on: ``api.self_schedules``) gets no plan: its runs take that route. The decode kinds' planner-free builds (the line
schedule) are not taken here: they derive their work at every call, and a plan made once a step is cheaper over an
engine's layers (``OpSpec.self_schedule_when_reused``).

CUDA graphs (the wrappers' ``use_cuda_graph=True``): the captured ``run()`` launches read the plan's buffers, so
``plan()`` itself re-plans into them, from the graph's index buffers it has just refilled, right after the copies in
the same stream. Replays then run every layer on the new batch's plan with no planner in the graph.
"""

from __future__ import annotations

import importlib

__all__ = ["StepPlan"]

# the package object, whatever its import name (an exported FlashInfer-Bench Solution ships a copy under another one)
_package = importlib.import_module(__package__.rpartition(".")[0])


class StepPlan:
    """The device plan of a wrapper's current batch (``graph``: the wrapper's ``use_cuda_graph=True``)."""

    def __init__(self, graph: bool = False) -> None:
        self._graph = graph
        self._plan = None  # the DevicePlan the runs since the last plan() use (None: the next run() plans;
        # _NO_PLAN: they take the planner-free default call)
        self._kept = None  # the last DevicePlan made: recycled, or (graph mode) planned into again
        # graph mode: (spec, entry arguments) of the run that made it, the inputs plan() re-plans from (eager mode
        # keeps no tensor of the caller's alive)
        self._inputs = None

    def new_batch(self) -> None:
        """``plan()`` has set a new batch. Eager: the next ``run()`` plans. Graph mode: plan now, in place, from the
        same index buffers (their new values) and the inputs of the run that made the plan, since replays never
        call ``run()`` again; before any ``run()`` there is nothing to re-plan (the first ``run()`` plans). If that
        re-plan fails, no plan is left for a ``run()`` to take."""
        self._plan = None
        if self._graph and self._kept is not None:
            spec, args = self._inputs
            self._plan = _package.api.plan_for(spec, args, arch=None, num_sms=None, on_device=True, into=self._kept)

    def for_run(self, spec, args: tuple):
        """The plan for a ``run()`` of ``spec``'s kind with entry arguments ``args`` (canonical order, outputs
        omitted): planned by the first ``run()`` after a ``plan()``, in the kept plan's buffers when they fit
        these shapes; None for a batch the default call schedules itself."""
        if self._plan is None and _package.api.self_schedules(spec, args, reused=True):
            self._plan = _NO_PLAN
        if self._plan is None:
            if _capturing(args):  # a plan made here would hold values only once the graph replays
                raise RuntimeError("cute_attn.flashinfer: the first run() of a batch is being captured in a CUDA "
                                   "graph; construct the wrapper with use_cuda_graph=True and make one run() before "
                                   "capturing (it makes the device plan the captured runs read, outside the graph)")
            plan = _package.api.plan_for(spec, args, arch=None, num_sms=None, on_device=True, recycle=self._kept)
            self._plan = self._kept = plan
            if self._graph:
                self._inputs = (spec, args)
        return None if self._plan is _NO_PLAN else self._plan


def _capturing(args: tuple) -> bool:
    import torch

    device = args[0].device
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_NO_PLAN = object()  # a batch the default call schedules itself (api.self_schedules)

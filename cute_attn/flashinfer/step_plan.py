"""One batch's device plan, shared by every ``run()`` between two ``plan()`` calls: FlashInfer's plan-once-per-step.

An engine plans once per step and runs every layer with that plan. A wrapper's ``run()`` could call the entry point's
default (planned on the GPU at every call), but then every layer pays the device planner: ~7-9 µs a decode layer,
10-22 µs a prefill one on the H200. Instead the first ``run()`` after a ``plan()`` launches the device planner once
(``plan_<kind>(..., on_device=True)``: no host sync) and every ``run()`` passes that plan (``plan=``), as an engine
that calls cute_attn directly would. A later step's first ``run()`` plans again into the same buffers when the
shapes allow (``api.plan_for(into=)``), so a steady state allocates nothing.

A batch the entry point's default call schedules without any plan (the planner-free prefills, where their policy is
on: ``api.self_schedules``) gets no plan: its runs take that route.

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
    """The device plan of a wrapper's current batch."""

    def __init__(self) -> None:
        self._plan = None  # the DevicePlan the runs since the last plan() use (None: the next run() plans;
        # _NO_PLAN: they take the planner-free default call)
        self._kept = None  # the last DevicePlan made, planned into again when the shapes allow
        self._inputs = None  # (spec, entry arguments) it was last planned from (graph mode re-plans from them)

    def new_batch(self, graph: bool) -> None:
        """``plan()`` has set a new batch. Eager: the next ``run()`` plans. Graph mode: plan now, in place, from the
        same index buffers (their new values) and the inputs of the last ``run()``, since replays never call
        ``run()`` again; before any ``run()`` there is nothing to re-plan (the first ``run()`` plans)."""
        if graph and self._kept is not None:
            spec, args = self._inputs
            self._plan = _package.api.plan_for(spec, args, arch=None, num_sms=None, on_device=True, into=self._kept)
        else:
            self._plan = None

    def for_run(self, spec, args: tuple):
        """The plan for a ``run()`` of ``spec``'s kind with entry arguments ``args`` (canonical order, outputs
        omitted): planned by the first ``run()`` after a ``plan()``, into the kept buffers when they fit; None for
        a batch the default call schedules itself."""
        if self._plan is None and _package.api.self_schedules(spec, args):
            self._plan = _NO_PLAN
        if self._plan is None:
            plan_for = _package.api.plan_for
            plan = None
            if self._kept is not None:
                try:
                    plan = plan_for(spec, args, arch=None, num_sms=None, on_device=True, into=self._kept)
                except ValueError:  # not the kept plan's shapes: a new one (whose rules name any bad input)
                    plan = None
            if plan is None:
                plan = plan_for(spec, args, arch=None, num_sms=None, on_device=True)
            self._plan = self._kept = plan
            self._inputs = (spec, args)
        return None if self._plan is _NO_PLAN else self._plan


_NO_PLAN = object()  # a batch the default call schedules itself (api.self_schedules)

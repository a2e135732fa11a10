"""One host call that launches the device planner and then the attention kernel that consumes its lists.

Why: a cold call (new index tensors) costs two launches. Made from Python as two tvm-ffi calls, the attention
kernel's launch reached the GPU ~20 µs after the planner's (the second call's argument conversion and the glue
between them), so the GPU sat idle between two kernels of a few µs each (``tools/cold_timeline.py``). Compiled
as one ``@cute.jit`` host function, the two ``cuLaunchKernelEx`` calls are issued back to back from C++, and the
attention kernel (programmatic dependent launch) starts its prologue while the planner runs.

The fused function takes the planner's arguments (without its stream), then the attention kernel's (without its
stream), then one stream: exactly the two kernels' own argument lists, so each kernel's rules and fake arguments
stay where they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import cutlass.cute as cute

from ...compile import register_kernel, registered_build
from ...config import KernelConfig
from .device_planner import DevicePlannerConfig


@dataclass(frozen=True)
class PlannedLaunchConfig(KernelConfig):
    """A planner build and the attention build that consumes its lists (both of ``arch``)."""

    kernel_name: ClassVar[str] = "planned_launch"

    planner: DevicePlannerConfig = None
    attention: KernelConfig = None

    def can_implement(self) -> str | None:
        if (reason := super().can_implement()) is not None:
            return reason
        if not isinstance(self.planner, DevicePlannerConfig) or not isinstance(self.attention, KernelConfig):
            return "planner must be a DevicePlannerConfig and attention a KernelConfig"
        if self.planner.arch != self.arch or self.attention.arch != self.arch:
            return f"planner ({self.planner.arch}) and attention ({self.attention.arch}) must target arch={self.arch}"
        return self.planner.can_implement() or self.attention.can_implement()

    def cache_key(self) -> str:
        return f"{self.kernel_name}({self.planner.cache_key()}+{self.attention.cache_key()})"


class PlanThenAttend:
    def __init__(self, planner, attention, num_planner_args: int):
        self.planner = planner
        self.attention = attention
        self.num_planner_args = num_planner_args

    def __repr__(self) -> str:
        return f"PlanThenAttend({self.planner!r}, {self.attention!r})"

    @cute.jit
    def __call__(self, *args):
        n = self.num_planner_args
        stream = args[len(args) - 1]
        self.planner(*args[:n], stream)
        self.attention(*args[n:len(args) - 1], stream)


def build(config: PlannedLaunchConfig) -> tuple[Any, tuple[Any, ...]]:
    planner, planner_fake = registered_build(config.planner)
    attention, attention_fake = registered_build(config.attention)
    fused = PlanThenAttend(planner, attention, len(planner_fake) - 1)
    return fused, (*planner_fake[:-1], *attention_fake[:-1], planner_fake[-1])


register_kernel(PlannedLaunchConfig, build)

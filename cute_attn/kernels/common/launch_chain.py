"""One host call that launches several kernels back to back: planner -> attention -> combine, or any prefix.

Why: made from Python as separate tvm-ffi calls, each launch reaches the GPU some 10-20 µs after the previous
one (argument conversion and the glue between calls), and a kernel shorter than that leaves the GPU idle:
the device planner before the attention kernel (a cold call: ``tools/cold_timeline.py``, session 6), and the
combine after a short attention kernel (MLA decode at batch 1: a 36 µs span over 25 µs of kernels, session 10).
Compiled as one ``@cute.jit`` host function, the ``cuLaunchKernelEx`` calls are issued back to back from C++,
and each later kernel (programmatic dependent launch) is resident before the one it waits for ends.

The fused function takes each stage's own arguments without its stream, stage after stage, then one stream:
exactly the kernels' own argument lists, so each kernel's rules and fake arguments stay where they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import cutlass
import cutlass.cute as cute

from ...compile import register_kernel, registered_build
from ...config import KernelConfig


@cute.jit
def wait_for_previous_grid(release_dependents: cutlass.Constexpr):
    """``griddepcontrol.wait`` (the kernel is launched with programmatic dependent launch: the previous grid has
    finished and flushed when it returns), then, when ``release_dependents``, ``griddepcontrol.launch_dependents``:
    the next launch in the stream may be dispatched once every CTA of this grid got here. Safe for any follower: a
    kernel launched without programmatic dependent launch still starts after this grid ends, and ours wait for it
    before their first global access."""
    cute.arch.griddepcontrol_wait()
    if cutlass.const_expr(release_dependents):
        cute.arch.griddepcontrol_launch_dependents()


@dataclass(frozen=True)
class LaunchChainConfig(KernelConfig):
    """Kernel builds (all of ``arch``) launched in this order from one host call."""

    kernel_name: ClassVar[str] = "launch_chain"

    stages: tuple = ()

    def can_implement(self) -> str | None:
        if (reason := super().can_implement()) is not None:
            return reason
        if len(self.stages) < 2 or not all(isinstance(s, KernelConfig) for s in self.stages):
            return "stages must be two or more KernelConfigs"
        for stage in self.stages:
            if stage.arch != self.arch:
                return f"every stage must target arch={self.arch}; {type(stage).kernel_name} targets {stage.arch}"
        for stage in self.stages:
            if (reason := stage.can_implement()) is not None:
                return reason
        return None

    def cache_key(self) -> str:
        return f"{self.kernel_name}({'+'.join(s.cache_key() for s in self.stages)})"


class LaunchChain:
    def __init__(self, kernels: tuple, arg_counts: tuple):
        self.kernels = kernels
        # stage i takes args[bounds[i]:bounds[i + 1]] (its stream excluded)
        self.bounds = tuple(sum(arg_counts[:i]) for i in range(len(arg_counts) + 1))

    def __repr__(self) -> str:
        return f"LaunchChain({', '.join(repr(k) for k in self.kernels)})"

    @cute.jit
    def __call__(self, *args):
        stream = args[len(args) - 1]
        for i in cutlass.range_constexpr(len(self.kernels)):
            self.kernels[i](*args[self.bounds[i]:self.bounds[i + 1]], stream)


def build(config: LaunchChainConfig) -> tuple[Any, tuple[Any, ...]]:
    built = [registered_build(stage) for stage in config.stages]
    chain = LaunchChain(tuple(k for k, _ in built), tuple(len(fake) - 1 for _, fake in built))
    fake = tuple(a for _, stage_fake in built for a in stage_fake[:-1])
    return chain, (*fake, built[0][1][-1])


register_kernel(LaunchChainConfig, build)

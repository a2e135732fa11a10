"""Timing for tools/bench.py: the package's cold-L2 timer (``cute_attn.timing``) plus the bench's extras.

The flush, the CUDA-event wall time and the CUPTI span live in ``cute_attn/timing.py`` so that the
tuning API (``cute_attn.tuning``) times variants exactly as the bench times workloads; they are
re-exported here under their old names for the tools. What stays here is bench-only: the host-side
median of the planner and the FLOP/byte rates.
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional

from cute_attn.timing import (  # noqa: F401  (re-exported for tools/*.py)
    ITER_PREFIX,
    Timing,
    make_l2_flusher,
    measure,
    profile_calls,
    time_gpu_span,
    time_wall,
)
from cute_attn.timing import iteration_spans as _iteration_spans  # noqa: F401  (the old private name)

__all__ = ["ITER_PREFIX", "Timing", "make_l2_flusher", "measure", "median_ms", "profile_calls", "rates",
           "time_gpu_span", "time_wall"]


def median_ms(fn: Callable[[], object], iters: int = 50, warmup: int = 3) -> float:
    """Host-side median milliseconds of fn() (used for the planner, which is pure numpy)."""
    import time

    for _ in range(warmup):
        fn()
    samples: List[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def rates(flops: int, nbytes: int, us: Optional[float]) -> Dict[str, Optional[float]]:
    """TFLOP/s and TB/s for a time in µs (None when there is no time)."""
    if not us or us <= 0:
        return {"tflops": None, "tbps": None}
    sec = us * 1e-6
    return {"tflops": flops / sec / 1e12, "tbps": nbytes / sec / 1e12}

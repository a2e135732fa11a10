"""GPU timing with a cold L2, modelled on how FlashInfer-Bench times kernels (the bench's and the tuner's).

Two numbers per call, both medians over ``iters`` runs after ``warmup`` runs, each run preceded by
an L2 flush (cold L2, as a serving engine sees it after other layers ran):

- gpu span: CUPTI kernel records (via torch.profiler) of the kernels *launched by the call*,
  last end - first start. Kernels are attributed to a call by the correlation id of their
  launch, and launches to a call by a record_function range around it, so the flush kernel
  (launched outside the range) never counts. Sum of kernel durations is kept too.
- wall: CUDA events around the call after a sync, so host overhead (Python, planning,
  launch latency) shows up as idle GPU time between the events.

torch is imported inside the functions: importing this module touches no GPU.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ITER_PREFIX = "bench_iter_"
#: fewer samples than this make a median that moves by more than the differences being tuned for
MIN_ITERS = 50
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Timing:
    gpu_us: float | None  # median span of the call's kernels (None if CUPTI gave nothing)
    gpu_sum_us: float | None  # median sum of the call's kernel durations
    wall_us: float  # median CUDA-event time around the call, host overhead included
    n_kernels: int | None  # kernels per call (median), a sanity signal for multi-kernel paths
    status: str  # "ok" or why gpu_us is missing


def make_l2_flusher(device=None, mode: str = "dirty") -> Callable[[], None]:
    """Return flush(): evict whatever the last call left in L2 with a buffer of twice the L2 size.

    mode "dirty" (the benchmark's, as FlashInfer's and Triton's timers do): zero the buffer, so L2 is
    left full of dirty lines that the timed call's misses must write back to HBM. mode "clean": read
    the buffer instead, leaving L2 full of clean lines (``tools/flush_study.py`` compares the two).
    """
    import torch

    if mode not in ("dirty", "clean"):
        raise ValueError(f"mode must be 'dirty' or 'clean', got {mode!r}")
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    l2 = int(getattr(props, "L2_cache_size", 0) or 64 * 1024 * 1024)
    buf = torch.zeros(2 * l2 // 4, dtype=torch.int32, device=device if device is not None else "cuda")

    def flush_dirty() -> None:
        buf.zero_()

    def flush_clean() -> None:
        buf.max()  # reads every line; writes 4 bytes

    return flush_dirty if mode == "dirty" else flush_clean


def time_wall(run: Callable[[], object], flush: Callable[[], None], iters: int, warmup: int) -> list[float]:
    """CUDA-event microseconds per call; sync before each so the start event waits for nothing."""
    import torch

    for _ in range(warmup):
        flush()
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(iters):
        flush()
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def iteration_spans(events: Sequence[dict], prefix: str = ITER_PREFIX) -> list[dict[str, float] | None]:
    """Per annotated iteration: {"span", "sum", "n"} in µs from a chrome-trace event list.

    Primary: launches (runtime/driver API records) inside the iteration's CPU range -> their
    correlation ids -> GPU records. Fallback, when a build does not record the launching API
    (e.g. a driver-API launch kineto does not trace): GPU records that *start* inside the
    range; this is still exact because the caller synchronizes before leaving the range and
    after the flush, so no other kernel can run inside it.
    """
    iters = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith(prefix)), key=lambda e: float(e["ts"]))
    launches = sorted(((float(e["ts"]), e.get("args", {}).get("correlation")) for e in events
                       if e.get("cat") in _LAUNCH_CATS), key=lambda t: t[0])
    gpu = [e for e in events if e.get("cat") in _GPU_CATS]
    by_corr: dict[object, list[dict]] = {}
    for g in gpu:
        by_corr.setdefault(g.get("args", {}).get("correlation"), []).append(g)

    out: list[dict[str, float] | None] = []
    for it in iters:
        t0, t1 = float(it["ts"]), float(it["ts"]) + float(it.get("dur", 0.0))
        corr = {c for ts, c in launches if t0 <= ts <= t1 and c is not None}
        ks = [g for c in corr for g in by_corr.get(c, [])]
        if not ks:
            ks = [g for g in gpu if t0 <= float(g["ts"]) <= t1]
        if not ks:
            out.append(None)
            continue
        first = min(float(g["ts"]) for g in ks)
        last = max(float(g["ts"]) + float(g.get("dur", 0.0)) for g in ks)
        out.append({"span": last - first, "sum": sum(float(g.get("dur", 0.0)) for g in ks), "n": len(ks)})
    return out


def profile_calls(run: Callable[[], object], flush: Callable[[], None], iters: int, warmup: int):
    """``iters`` flushed calls under torch.profiler (CUPTI), each inside its own annotated range."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        flush()
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            flush()
            torch.cuda.synchronize()  # the flush finishes before the range opens
            with record_function(f"{ITER_PREFIX}{i}"):
                run()
                torch.cuda.synchronize()  # the call finishes before the range closes
    return prof


def profile_events(run: Callable[[], object], flush: Callable[[], None], iters: int, warmup: int) -> list[dict]:
    """Profile ``iters`` flushed calls under torch.profiler (CUPTI) and return the trace's events (chrome format)."""
    prof = profile_calls(run, flush, iters, warmup)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="bench_trace_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)


def time_gpu_span(run: Callable[[], object], flush: Callable[[], None], iters: int,
                  warmup: int) -> list[dict[str, float] | None]:
    """Profile ``iters`` flushed calls under torch.profiler (CUPTI) and return per-call spans."""
    return iteration_spans(profile_events(run, flush, iters, warmup))


def measure(run: Callable[[], object], flush: Callable[[], None], iters: int = MIN_ITERS,
            warmup: int = 10) -> Timing:
    """Both measurements; CUPTI failures degrade to gpu_us=None with a status, never raise."""
    wall = time_wall(run, flush, iters, warmup)
    try:
        spans = time_gpu_span(run, flush, iters, warmup)
    except Exception as exc:  # profiler unavailable/broken: keep the wall number
        return Timing(None, None, statistics.median(wall), None, f"no_cupti:{type(exc).__name__}: {exc}")
    good = [s for s in spans if s is not None]
    if not good:
        return Timing(None, None, statistics.median(wall), None, "cupti_no_kernels")
    status = "ok" if len(good) == len(spans) else f"cupti_partial:{len(good)}/{len(spans)}"
    return Timing(
        gpu_us=statistics.median(s["span"] for s in good),
        gpu_sum_us=statistics.median(s["sum"] for s in good),
        wall_us=statistics.median(wall),
        n_kernels=int(statistics.median(s["n"] for s in good)),
        status=status,
    )


@dataclass
class ColdL2Timer:
    """``timer(run) -> Timing``: :func:`measure` behind a flush of the current device's L2, made at first use.

    Refuses fewer than :data:`MIN_ITERS` samples: the tuner picks a default config from these medians.
    """

    iters: int = MIN_ITERS
    warmup: int = 10
    flush_mode: str = "dirty"
    _flush: Callable[[], None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.iters < MIN_ITERS:
            raise ValueError(f"iters={self.iters}: a median of fewer than {MIN_ITERS} flushed runs is too noisy")
        if self.warmup < 1:
            raise ValueError("warmup must be >= 1 (the first launch of a kernel loads its module)")
        if self.flush_mode not in ("dirty", "clean"):
            raise ValueError(f"flush_mode must be 'dirty' or 'clean', got {self.flush_mode!r}")

    def __call__(self, run: Callable[[], object]) -> Timing:
        if self._flush is None:
            self._flush = make_l2_flusher(mode=self.flush_mode)
        return measure(run, self._flush, self.iters, self.warmup)

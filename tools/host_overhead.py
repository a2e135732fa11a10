"""Where the host time of one cute_attn call goes: per-piece timings, the goal metric and a cProfile.

    python tools/host_overhead.py [--calls 500]     # GPU: decode, 16 requests, plan cached
    python tools/host_overhead.py --cpu-pieces      # no GPU needed: the same Python path on CPU tensors

Small problems keep the GPU faster than the host, so the per-call host time is what is measured. A
repeated call takes the API's fast path (``api._FAST``: one lookup and one metadata compare, then the
launch); the lines marked "miss" are what a call that does not match an earlier one adds.

``--cpu-pieces`` stubs the CUDA device rule and installs a no-op compiled function for the decode config,
so everything but the tvm-ffi call itself runs: the numbers are the Python work around the launch.
On a GPU the goal metric is printed too: CUDA-event time of one call minus its kernels' span (CUPTI),
as ``tools/bench.py`` measures it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_call_us(fn, calls: int, cuda: bool) -> float:
    """Best of 5 loops of ``calls`` calls (the minimum filters scheduler noise on a shared host)."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
        sync()
    return best / calls * 1e6


def _cpu_stand_ins(config) -> None:
    """CPU mode: pass the device rule and make the compiled kernel a no-op (the launch path stays real)."""
    from cute_attn import api, compile as compile_mod

    api._require_cuda = lambda device: None
    compile_mod._MEMORY[config] = compile_mod.CompileInfo(lambda *args: None, "memory", 0.0, Path("none.o"),
                                                          Path("none.ptx"))


def main(argv=None) -> int:
    import torch

    import cute_attn
    from cute_attn import api, testing, validate
    from cute_attn.ops.gqa_decode import SPEC as DECODE
    from cute_attn.compile import compile_kernel
    from cute_attn.kernels.common import paged_launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--cpu-pieces", action="store_true", help="time the Python path on CPU tensors (no GPU)")
    p.add_argument("--no-profile", action="store_true", help="skip the cProfile listing")
    args = p.parse_args(argv)
    cuda = not args.cpu_pieces
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device: use --cpu-pieces")

    case = testing.make_gqa_decode_case([64] * 16, device="cuda" if cuda else "cpu")
    out, lse = case.new_outputs()
    inputs = case.inputs()
    index = (case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    # CPU: an explicit arch and SM count (nothing to ask); the sm_90a decode launcher (registers on import)
    options = {} if cuda else dict(arch="sm_90a", num_sms=132)
    problem, _ = validate.check_gqa_paged_decode(*inputs, out, lse, check_indices=False)
    config = api._make_config(DECODE, problem, options.get("arch"))
    if not cuda:
        import cute_attn.kernels.sm90.gqa_decode  # noqa: F401

        _cpu_stand_ins(config)

    def public():  # the host-planned route (check_indices=True): its plan cache and fast path
        cute_attn.gqa_paged_decode(*inputs, out, lse, check_indices=True, **options)

    public()
    plan_key = (config, options.get("num_sms"), problem.num_pages, problem.total_q)
    plan = api._PLANS.get(plan_key, index)
    key = next(k for k in api._FAST.entries if k[0] is DECODE and k[4] is None)
    sig = api._signature(DECODE, inputs, out, lse)
    hit = api._FAST.lookup(key, sig, index, None)
    assert hit is not None and hit.device_plan is plan, "the repeated call did not hit the fast path"

    # the compiled function's real arguments, captured from one launch (robust to signature changes)
    resolved = paged_launch._RESOLVED[id(config)]
    captured = []
    paged_launch._RESOLVED[id(config)] = (*resolved[:3], lambda *a: captured.append(a))
    public()
    paged_launch._RESOLVED[id(config)] = resolved
    fn, raw_args = resolved[3], captured[0]

    def full_path():  # a miss: the fast path forgotten, the plan cache still hit
        api._FAST.entries.clear()
        public()

    pieces = {
        "public, check_indices=True (host-planned fast path)": public,
        "public, plan= passed, check_indices=False (fast path)":
            lambda: cute_attn.gqa_paged_decode(*inputs, out, lse, plan=plan, check_indices=False, **options),
        "  fast path: signature (tensor metadata)":
            lambda: api._signature(DECODE, inputs, out, lse),
        "  fast path: lookup + compare": lambda: api._FAST.lookup(key, sig, index, None),
        "  fast path: launch (kernel.launch -> launch_paged -> fn)":
            lambda: hit.launcher(plan, *inputs, out, lse, natural_lse=False),
        f"  compiled fn call ({len(raw_args)} args{', no-op stand-in' if not cuda else ', tvm-ffi'})":
            lambda: fn(*raw_args),
        "public, full path (miss; plan cache hit)": full_path,
        "  miss: validate (metadata only)":
            lambda: validate.check_gqa_paged_decode(*inputs, out, lse, check_indices=False),
        "  miss: config (cached)": lambda: api._make_config(DECODE, problem, options.get("arch")),
        "  miss: plan cache lookup": lambda: api._PLANS.get(plan_key, index),
        "  compile_kernel (memory hit; off the launch path)": lambda: compile_kernel(config),
        "public, check_indices=True again (order check)": public,
    }
    if cuda:
        pieces["empty torch op (x.zero_())"] = lambda: case.kv_indptr[:0].zero_()
        # the cold call (issue 9's host-time goal): new index tensors every call, as an engine step or
        # FlashInfer-Bench's harness passes them; the default device route plans on the GPU
        positions = [i for i, a in enumerate(inputs) if any(a is t for t in index)]
        ring = []
        for _ in range(8):
            fresh = list(inputs)
            for i in positions:
                fresh[i] = inputs[i].clone()
            ring.append(tuple(fresh))
        turn = [0]

        def cold():
            turn[0] = (turn[0] + 1) % len(ring)
            cute_attn.gqa_paged_decode(*ring[turn[0]], out, lse)

        cold()
        pieces["public default (device planner + attention), same tensors"] = \
            lambda: cute_attn.gqa_paged_decode(*inputs, out, lse)
        pieces["public default, new index tensors each call (device planner + attention)"] = cold
        print(f"GPU: {torch.cuda.get_device_name()}  plan: {plan.plan.num_items} items, {plan.plan.num_merges} merges")
    else:
        print(f"CPU only (--cpu-pieces): compiled fn is a no-op; plan: {plan.plan.num_items} items, "
              f"{plan.plan.num_merges} merges")
    for name, f in pieces.items():
        print(f"{per_call_us(f, args.calls, cuda):9.2f} us  {name}")

    if cuda:  # the goal metric: event time around one call minus the GPU span of its kernels
        import bench_timing

        flush = bench_timing.make_l2_flusher()
        for name, run in (("fast path", public), ("full path (miss)", full_path), ("cold (device planner)", cold)):
            t = bench_timing.measure(run, flush, iters=100, warmup=10)
            gap = f"{t.wall_us - t.gpu_us:.1f}" if t.gpu_us is not None else "n/a"
            print(f"wall - span, {name}: {gap} us  (wall {t.wall_us:.1f}, span {t.gpu_us}, "
                  f"{t.n_kernels} kernels, {t.status})")

    if not args.no_profile:
        prof = cProfile.Profile()
        prof.enable()
        profiled = cold if cuda else public  # on a GPU the cold call is the one with a host-time goal
        for _ in range(args.calls):
            profiled()
        prof.disable()
        if cuda:
            torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

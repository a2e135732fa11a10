"""Compile-time variants of the sm_90a GQA prefill, side by side with FA4, in one process (GPU only).

    python tools/prefill_variants.py OUT.json [--iters 50] [--warmup 10] [--variants baseline,overlap,...]
                                              [--workloads n1,n4,n32,n4_q512_kv4096] [--no-fa4]

For each variant (``PagedAttentionConfig`` field overrides, see ``VARIANTS``) and workload: plan once with
the default config (``cute_attn.plan_gqa_paged_prefill``), upload the same plan for the variant config
(``DevicePlan.upload``), run the registered launcher, check output and lse against ``case.reference()``
(``testing.assert_close_benchmark``), then time it with ``bench_timing.measure`` (cold L2, CUPTI span).
FA4 (``flash_attn.cute``) runs on the same cases through ``bench_peers`` when it imports.

Failures (compile error, mismatch, launch error) are recorded per row and the script goes on. A watchdog
writes the JSON gathered so far and exits with status 3 if one step hangs (e.g. a pipeline deadlock).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
import traceback

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TOOLS)
sys.path.insert(0, os.path.dirname(_TOOLS))

import bench_timing  # noqa: E402
import bench_workloads as bw  # noqa: E402

VARIANTS = {  # run in this order: the riskiest last, so a hang loses the least
    "baseline": dict(intra_wg_overlap=False, smem_epilogue=False),
    "smem_epilogue": dict(intra_wg_overlap=False, smem_epilogue=True),
    "overlap": dict(intra_wg_overlap=True, smem_epilogue=False),
    "both": dict(intra_wg_overlap=True, smem_epilogue=True),
}
WORKLOADS = {
    "n1": ([992], [992]),
    "n4": ([992] * 4, [992] * 4),
    "n32": ([992] * 32, [992] * 32),
    "n4_q512_kv4096": ([512] * 4, [4096] * 4),
}
STEP_TIMEOUT_S = 100


class Watchdog:
    """Exit the process (after saving results) when one step runs longer than ``timeout`` seconds."""

    def __init__(self, save, timeout: float):
        self.save, self.timeout, self.timer = save, timeout, None

    def step(self, what: str):
        self.cancel()

        def fire():
            print(f"\n[watchdog] '{what}' ran past {self.timeout:.0f} s: saving and exiting", flush=True)
            self.save(hung=what)
            os._exit(3)

        self.timer = threading.Timer(self.timeout, fire)
        self.timer.daemon = True
        self.timer.start()

    def cancel(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _close(actual, expected, name: str):
    """(passed, note) from testing.assert_close_benchmark."""
    from cute_attn import testing

    try:
        testing.assert_close_benchmark(actual, expected, name)
        return True, ""
    except AssertionError as exc:
        return False, f"{name}: {str(exc).splitlines()[0][:200]}"


def run_ours(variant: str, overrides: dict, plan, case, ref, flush, iters: int, warmup: int) -> dict:
    import torch

    from cute_attn.api import DevicePlan
    from cute_attn.compile import compile_kernel
    from cute_attn.kernels import find_launcher

    config = dataclasses.replace(plan.config, **overrides)
    row = dict(impl=variant, config=config.cache_key())
    t0 = time.perf_counter()
    compile_kernel(config)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    out, lse = case.new_outputs()
    device_plan = DevicePlan.upload(config, plan.plan, out.device)  # GQA (q) and MLA (q_nope) cases alike
    launcher = find_launcher(config)
    args = tuple(case.inputs())

    def run():
        launcher(device_plan, *args, out, lse)

    run()
    torch.cuda.synchronize()
    ok_o, why_o = _close(out, ref[0], "output")
    ok_l, why_l = _close(lse, ref[1], "lse")
    row.update(passed=ok_o and ok_l, note="; ".join(x for x in (why_o, why_l) if x))
    t = bench_timing.measure(run, flush, iters=iters, warmup=warmup)
    row.update(gpu_us=t.gpu_us, wall_us=t.wall_us, n_kernels=t.n_kernels, timing_status=t.status)
    return row


def run_fa4(case, ref, flush, iters: int, warmup: int) -> dict:
    import torch

    import bench_peers as bp

    prep = bp.setup_fa4_gqa(case, bw.PREFILL)
    result = prep()
    torch.cuda.synchronize()
    passed, why = bp.check(prep.normalize(result), ref)
    t = bench_timing.measure(prep, flush, iters=iters, warmup=warmup)
    return dict(impl="fa4", passed=passed, note=why, gpu_us=t.gpu_us, wall_us=t.wall_us, n_kernels=t.n_kernels,
                timing_status=t.status)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--no-fa4", action="store_true")
    args = ap.parse_args(argv)

    import torch

    import cute_attn

    variants = [v for v in args.variants.split(",") if v]
    workloads = [w for w in args.workloads.split(",") if w]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")

    torch.cuda.init()
    rows: list[dict] = []
    meta = dict(device=torch.cuda.get_device_name(), iters=args.iters, warmup=args.warmup,
                variants={v: VARIANTS[v] for v in variants}, started=time.strftime("%Y-%m-%d %H:%M:%S"))

    def save(hung: str | None = None):
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta, hung=hung, rows=rows), f, indent=1)

    dog = Watchdog(save, STEP_TIMEOUT_S)
    flush = bench_timing.make_l2_flusher()

    # cases, references and default plans once per workload
    cases = {}
    for name in workloads:
        q_lens, kv_lens = WORKLOADS[name]
        label = bw.prefill_label(len(q_lens), q_lens[0], kv_lens[0])
        wl = bw.Workload(bw.PREFILL, label, tuple(q_lens), tuple(kv_lens))
        dog.step(f"setup {name}")
        case = wl.build_case("cuda", seed=bw.stable_seed(label))
        ref = case.reference()
        plan = cute_attn.plan_gqa_paged_prefill(*case.inputs())
        torch.cuda.synchronize()
        cases[name] = (wl, case, ref, plan)

    impls = list(variants)
    if not args.no_fa4:
        impls.insert(1 if "baseline" in impls else 0, "fa4")
    for impl in impls:
        for name in workloads:
            wl, case, ref, plan = cases[name]
            dog.step(f"{impl} {name}")
            base = dict(workload=name, label=wl.label, flops=bw.workload_flops(wl))
            try:
                if impl == "fa4":
                    row = run_fa4(case, ref, flush, args.iters, args.warmup)
                else:
                    row = run_ours(impl, VARIANTS[impl], plan, case, ref, flush, args.iters, args.warmup)
            except Exception as exc:  # compile error, unsupported, launch failure: record and go on
                row = dict(impl=impl, passed=False, gpu_us=None, note=f"error: {type(exc).__name__}: {exc}"[:500])
                traceback.print_exc()
                if impl == "fa4" and "Unavailable" in type(exc).__name__:
                    row["note"] = f"skipped: {exc}"
            row = dict(base, **row)
            if row.get("gpu_us"):
                row["tflops"] = row["flops"] / (row["gpu_us"] * 1e-6) / 1e12
            rows.append(row)
            print(f"{impl:>14} {name:>15}  gpu {row.get('gpu_us') or float('nan'):9.1f} us  "
                  f"passed={row.get('passed')}  {row.get('note', '')}", flush=True)
            save()
    dog.cancel()

    # summary table: rows = workloads, columns = impls; ratio = fa4 / impl (>= 1.25 is the target)
    by = {(r["impl"], r["workload"]): r for r in rows}
    print("\nGPU span (us, cold L2, median of", args.iters, ") | speed-up vs FA4 (fa4/impl) | vs baseline")
    print(f"{'workload':>15} | " + " | ".join(f"{i:>24}" for i in impls))
    for name in workloads:
        cells = []
        fa4 = (by.get(("fa4", name)) or {}).get("gpu_us")
        bl = (by.get(("baseline", name)) or {}).get("gpu_us")
        for impl in impls:
            r = by.get((impl, name)) or {}
            us = r.get("gpu_us")
            if not us:
                cells.append(f"{'-':>24}")
                continue
            flag = "" if r.get("passed") else " FAIL"
            rel = f" {fa4 / us:4.2f}x" if fa4 and impl != "fa4" else ""
            relb = f" {bl / us:4.2f}b" if bl and impl not in ("fa4", "baseline") else ""
            cells.append(f"{us:8.1f}{rel}{relb}{flag}".rjust(24))
        print(f"{name:>15} | " + " | ".join(cells))
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(f"\nwrote {args.out}")
    return 0 if all(r.get("passed") or str(r.get("note", "")).startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

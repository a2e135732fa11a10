"""A/B of the sm_90a MLA prefill kernel's variants beside FlashInfer fa3, in one process (GPU only).

    python tools/mla_prefill_variants.py OUT.json [--iters 50] [--warmup 10] [--variants full_s,shared_s]
                                                  [--workloads n1_q1028_kv1038,n28_q1954_kv2044,n1_q16384_kv16387 | all]
                                                  [--no-flashinfer]

``full_s``: both consumer warpgroups compute all of S (the kernel the GPU tier validated first); ``shared_s``:
``share_scores=True``, S computed once per tile (``kernels/sm90/mla_prefill_shared_s.py``); ``score_wg``:
``score_warpgroup=True``, one warpgroup computes S and the softmax, the other only its half of O
(``kernels/sm90/mla_prefill_score_wg.py``); ``score_wg_ovl``: the same with ``intra_wg_overlap`` (the score
warpgroup's PV GEMM issued right before the next S GEMM). The workloads are the
bench's recorded MLA batches (``bench_workloads.MLA_RECORDED``, the same per-request splits and 1M-row pool as
``tools/bench.py``); ``all`` runs every recorded one. Per workload: one plan with the default config
(``cute_attn.plan_mla_paged_prefill``; the consumer split does not change the plan), uploaded for each variant's config
(``DevicePlan.upload``), run through the registered launcher, checked against the float32 reference
(``testing.assert_close_benchmark``), then timed with ``bench_timing.measure`` (cold L2, CUPTI span). FlashInfer's
``BatchMLAPagedAttentionWrapper(backend="fa3")`` runs on the same case (``bench_peers``).

Failures are recorded per row and the script goes on; the watchdog of ``prefill_variants.py`` saves and exits with
status 3 if a step hangs (e.g. a barrier deadlock). Flip the default afterwards in one line:
``cute_attn/ops/mla_prefill.py: SM90_CONSUMERS``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TOOLS)
sys.path.insert(0, os.path.dirname(_TOOLS))

import bench_timing  # noqa: E402
import bench_workloads as bw  # noqa: E402
from prefill_variants import Watchdog, run_ours  # noqa: E402

from cute_attn.ops.mla_prefill import CONSUMER_KNOBS  # noqa: E402

# every variant names each consumer knob (CONSUMER_KNOBS: the others off), so none inherits the default split's
_VARIANT_KNOBS = {  # the validated kernels first: a hang in a new one loses the least
    "full_s": dict(share_scores=False, score_warpgroup=False),
    "shared_s": dict(share_scores=True, score_warpgroup=False),
    "score_wg": dict(share_scores=False, score_warpgroup=True),
    "score_wg_ovl": dict(share_scores=False, score_warpgroup=True, intra_wg_overlap=True),
    "score_wg_sepi": dict(share_scores=False, score_warpgroup=True, smem_epilogue=True),
    # the load role's rows by one 16-byte chunk column a thread (the session-12 kernels), not by 128-byte segments
    "score_wg_chunk_columns": dict(share_scores=False, score_warpgroup=True, row_segments=False),
    # 32-key stages: 4 in the smem of 2 (more of the gather in flight: is the load path the limit?)
    "full_s_kv32": dict(share_scores=False, score_warpgroup=False, kv_tile=32),
    # measurement builds of score_wg (wrong outputs by design: their rows fail the check and are timed anyway):
    # the load role alone (consumers wait and release), the consumers alone (stages committed without copies)
    "probe_loads": dict(share_scores=False, score_warpgroup=True, probe="loads_only"),
    "probe_compute": dict(share_scores=False, score_warpgroup=True, probe="compute_only"),
}
VARIANTS = {name: {**CONSUMER_KNOBS, **knobs} for name, knobs in _VARIANT_KNOBS.items()}
DEFAULT_WORKLOADS = ("n1_q1028_kv1038", "n28_q1954_kv2044", "n1_q16384_kv16387")
STEP_TIMEOUT_S = 240  # the 16K case's reference and compile fit; a deadlocked kernel does not


def mla_workloads() -> dict:
    return {w.label: w for w in bw.all_workloads() if w.kernel == bw.MLA}


def run_flashinfer(case, ref, flush, iters: int, warmup: int) -> dict:
    import torch

    import bench_peers as bp

    prep = bp.setup_flashinfer_mla(case, "fa3")
    result = prep()
    torch.cuda.synchronize()
    passed, why = bp.check(prep.normalize(result), ref)
    t = bench_timing.measure(prep, flush, iters=iters, warmup=warmup)
    return dict(impl="flashinfer_fa3", passed=passed, note=why, gpu_us=t.gpu_us, wall_us=t.wall_us,
                n_kernels=t.n_kernels, timing_status=t.status)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="labels, or 'all'")
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args(argv)

    known = mla_workloads()
    variants = [v for v in args.variants.split(",") if v]
    workloads = list(known) if args.workloads == "all" else [w for w in args.workloads.split(",") if w]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    for w in workloads:
        if w not in known:
            raise SystemExit(f"unknown workload {w!r}; known: {', '.join(known)}")

    import torch

    import cute_attn

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
    impls = list(variants) + ([] if args.no_flashinfer else ["flashinfer_fa3"])
    for name in workloads:  # one case at a time: the 1M-row pool is 1.1 GB
        wl = known[name]
        dog.step(f"setup {name}")
        case = wl.build_case("cuda", seed=bw.stable_seed(wl.label))
        ref = case.reference()
        plan = cute_attn.plan_mla_paged_prefill(*case.inputs())
        torch.cuda.synchronize()
        for impl in impls:
            dog.step(f"{impl} {name}")
            base = dict(workload=name, flops=bw.workload_flops(wl))
            try:
                if impl == "flashinfer_fa3":
                    row = run_flashinfer(case, ref, flush, args.iters, args.warmup)
                else:
                    row = run_ours(impl, VARIANTS[impl], plan, case, ref, flush, args.iters, args.warmup)
            except Exception as exc:  # compile error, launch failure, missing peer: record and go on
                row = dict(impl=impl, passed=False, gpu_us=None, note=f"error: {type(exc).__name__}: {exc}"[:500])
                traceback.print_exc()
                if impl == "flashinfer_fa3" and "Unavailable" in type(exc).__name__:
                    row["note"] = f"skipped: {exc}"
            row = dict(base, **row)
            if row.get("gpu_us"):
                row["tflops"] = row["flops"] / (row["gpu_us"] * 1e-6) / 1e12
            rows.append(row)
            print(f"{impl:>15} {name:>20}  gpu {row.get('gpu_us') or float('nan'):9.1f} us  "
                  f"{row.get('tflops') or float('nan'):6.1f} TFLOP/s  passed={row.get('passed')}  {row.get('note', '')}",
                  flush=True)
            save()
        del case, ref, plan
        torch.cuda.empty_cache()
    dog.cancel()

    by = {(r["impl"], r["workload"]): r for r in rows}
    print("\nGPU span us (cold L2, median of", args.iters, ") | TFLOP/s | fa3/impl (>= 1.0 is the target) | "
          "full_s/impl")
    print(f"{'workload':>20} | " + " | ".join(f"{i:>30}" for i in impls))
    for name in workloads:
        fa3 = (by.get(("flashinfer_fa3", name)) or {}).get("gpu_us")
        full = (by.get(("full_s", name)) or {}).get("gpu_us")
        cells = []
        for impl in impls:
            r = by.get((impl, name)) or {}
            us = r.get("gpu_us")
            if not us:
                cells.append(f"{'-':>30}")
                continue
            cell = f"{us:8.1f} {r['tflops']:6.1f}"
            cell += f" {fa3 / us:4.2f}x" if fa3 and impl != "flashinfer_fa3" else ""
            cell += f" {full / us:4.2f}b" if full and impl not in ("flashinfer_fa3", "full_s") else ""
            cells.append((cell + ("" if r.get("passed") else " FAIL")).rjust(30))
        print(f"{name:>20} | " + " | ".join(cells))
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(f"\nwrote {args.out}")
    return 0 if all(r.get("passed") or str(r.get("note", "")).startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

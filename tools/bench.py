#!/usr/bin/env python
"""Benchmark cute_attn against FlashInfer and FlashAttention-4 on the three target definitions and the family.

    python tools/bench.py                       # everything, GPU needed for timings
    python tools/bench.py --kernel decode --quick --json out.json
    python tools/bench.py --kernel family --quick   # issue 10: page 1 / 16 / 64 decode, page-1 prefill
    python tools/bench.py --kernel mla_decode --quick   # issue 11: MLA decode at page 1 and 64
    python tools/bench.py --kernel gqa_paged_decode_h32_kv8_d128_ps1   # any definition name: its representative
    python tools/bench.py --plan-only           # planner timing only (runs on CPU)
    python tools/bench.py --cpu --json out.json # what a machine without a GPU does (tools/bench_no_gpu.py)

Each (workload, implementation) is checked against the float32 reference before it is timed;
a failing implementation is still timed and marked. Timing follows FlashInfer-Bench: cold L2,
CUPTI span of the call's kernels, plus CUDA-event wall time; medians of --iters runs.
Without a GPU only the CPU parts run: compile times of the kernels the selected workloads launch
(``--arch``, default sm_90a) and planner timings; ``--json`` then writes one object with ``"gpu": null``
(the GPU run writes the list of records) and the exit code is 0 unless a kernel fails to compile.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Dict, List

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TOOLS)  # sibling helper modules
sys.path.insert(0, os.path.dirname(_TOOLS))  # the repo root, for cute_attn without installing

import bench_no_gpu  # noqa: E402
import bench_targets  # noqa: E402
import bench_timing  # noqa: E402
import bench_workloads as bw  # noqa: E402
from bench_no_gpu import run_planner_timing  # noqa: E402

# Measured H200 peaks the percentages refer to (dense bf16 MMA, HBM3e read bandwidth).
PEAK_TFLOPS = 790.0
PEAK_TBPS = 4.3
RECORD_KEYS = ("kernel", "workload", "impl", "gpu_us", "wall_us", "tflops", "tbps", "passed")
#: the bench kernels: one chart panel each (x = workload); other definitions share a panel per op
SHORT = {bw.PREFILL: "prefill", bw.DECODE: "decode", bw.MLA: "mla", bw.MTP_DECODE: "mtp",
         bw.MLA_DECODE: "mla_decode:h16/ps1", bw.MLA_DECODE_PS64: "mla_decode:h16/ps64"}
#: what each definition op's chart shows: compute-bound ops in TFLOP/s, bandwidth-bound ones in TB/s
METRIC = {"prefill": ("tflops", "TFLOP/s"), "mla": ("tflops", "TFLOP/s"), "decode": ("tbps", "TB/s"),
          "mtp": ("tbps", "TB/s"), "mla_decode": ("tbps", "TB/s")}


def make_record(kernel: str, workload: str, impl: str, *, gpu_us=None, wall_us=None,
                flops: int = 0, nbytes: int = 0, passed: bool = False, **extra) -> Dict:
    """One JSON row. The 8 schema keys always exist; rates derive from the GPU span."""
    r = bench_timing.rates(flops, nbytes, gpu_us)
    rec = {"kernel": kernel, "workload": workload, "impl": impl, "gpu_us": gpu_us,
           "wall_us": wall_us, "tflops": r["tflops"], "tbps": r["tbps"], "passed": bool(passed)}
    rec.update({k: v for k, v in extra.items() if v is not None and v != ""})
    return rec


def add_peer_ratios(records: List[Dict]) -> None:
    """vs_best_peer = best peer GPU time / this GPU time (> 1: faster than every peer).
    Best = fastest peer that passed; if none passed, the fastest timed peer."""
    groups: Dict[tuple, List[Dict]] = {}
    for r in records:
        groups.setdefault((r["kernel"], r["workload"]), []).append(r)
    for rows in groups.values():
        peers = [r for r in rows if not r["impl"].startswith("cute_attn") and r.get("gpu_us")]
        good = [r for r in peers if r["passed"]] or peers
        if not good:
            continue
        best = min(r["gpu_us"] for r in good)
        for r in rows:
            if r.get("gpu_us"):
                r["vs_best_peer"] = best / r["gpu_us"]


# ----------------------------------------------------------------------------- GPU bench


def bench_workload(w: bw.Workload, args, flush) -> List[Dict]:
    import torch

    import bench_peers as bp

    flops, nbytes = bw.workload_flops(w), bw.workload_bytes(w)
    rows: List[Dict] = []

    def row(impl, **kw):
        rec = make_record(w.kernel, w.label, impl, flops=flops, nbytes=nbytes, **kw)
        rec["flops"], rec["bytes"] = flops, nbytes
        rows.append(rec)
        print(f"  {impl:22s} {_brief(rec)}", flush=True)

    try:
        case = w.build_case("cuda", seed=args.seed)
    except Exception as exc:
        row("*", status="error", note=f"case build failed: {type(exc).__name__}: {exc}")
        return rows
    if args.warm_only:  # a --compile-jobs worker: one call of each cute_attn impl fills the compile cache
        for impl, setup in bp.runners_for(w.kernel):
            if impl.startswith("cute_attn") and (not args.impls or impl in args.impls):
                try:
                    setup(case)()
                    torch.cuda.synchronize()
                except Exception as exc:  # the timed run reports it
                    print(f"  warm {impl}: {type(exc).__name__}: {exc}", flush=True)
        return rows
    try:
        ref = bp.reference(w.kernel, case)
        torch.cuda.synchronize()
        ref_note = ""
    except Exception as exc:  # e.g. out of memory on the 16K-token MLA case
        ref, ref_note = None, f"no reference: {type(exc).__name__}: {exc}"
    for impl, setup in bp.runners_for(w.kernel):
        if args.impls and impl not in args.impls:
            continue
        try:
            prep = setup(case)
            result = prep()
            torch.cuda.synchronize()
        except bp.Unavailable as exc:
            row(impl, status="skipped", note=str(exc))
            continue
        except NotImplementedError as exc:
            row(impl, status="not available", note=f"not available: {exc}")
            continue
        except Exception as exc:
            row(impl, status="error", note=f"{type(exc).__name__}: {exc}")
            if args.verbose:
                traceback.print_exc()
            continue
        if ref is not None:
            try:
                passed, why = bp.check(prep.normalize(result), ref)
            except Exception as exc:
                passed, why = False, f"check crashed: {type(exc).__name__}: {exc}"
        else:
            passed, why = False, ref_note
        try:
            t = bench_timing.measure(prep, flush, iters=args.iters, warmup=args.warmup)
        except Exception as exc:
            row(impl, passed=passed, status="error", note=f"timing: {type(exc).__name__}: {exc}")
            continue
        note = "; ".join(x for x in (why, prep.note,
                                     "" if t.status == "ok" else t.status) if x)
        row(impl, gpu_us=t.gpu_us, wall_us=t.wall_us, passed=passed, status="ok", note=note,
            gpu_sum_us=t.gpu_sum_us, n_kernels=t.n_kernels)
    del case, ref
    torch.cuda.empty_cache()
    return rows


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and x is not None else "-"


def _brief(r: Dict) -> str:
    if r.get("status") not in (None, "ok"):
        return f"{r.get('status')}: {r.get('note', '')}"
    return (f"gpu {_fmt(r['gpu_us'], '.1f')} us  wall {_fmt(r['wall_us'], '.1f')} us  "
            f"{_fmt(r['tflops'], '.1f')} TFLOP/s  {_fmt(r['tbps'], '.2f')} TB/s  "
            f"{'PASS' if r['passed'] else 'FAIL'}  {r.get('note', '')}")


def _row_note(r: Dict) -> str:
    status, note = r.get("status", "ok"), r.get("note", "")
    if status == "ok" or note.startswith(status):
        return note
    return f"{status}: {note}" if note else status


def print_table(records: List[Dict]) -> None:
    hdr = (f"{'kernel':20s} {'workload':22s} {'impl':22s} {'gpu_us':>9s} {'wall_us':>9s} {'TFLOP/s':>8s} "
           f"{'TB/s':>6s} {'%peakF':>6s} {'%peakB':>6s} {'x best':>6s} {'pass':>5s}  note")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in records:
        tf, tb = r.get("tflops"), r.get("tbps")
        print(f"{bw.short_name(r['kernel']):20s} {r['workload']:22s} {r['impl']:22s} "
              f"{_fmt(r.get('gpu_us'), '9.1f'):>9s} {_fmt(r.get('wall_us'), '9.1f'):>9s} "
              f"{_fmt(tf, '8.1f'):>8s} {_fmt(tb, '6.2f'):>6s} "
              f"{_fmt(tf and 100 * tf / PEAK_TFLOPS, '6.1f'):>6s} {_fmt(tb and 100 * tb / PEAK_TBPS, '6.1f'):>6s} "
              f"{_fmt(r.get('vs_best_peer'), '6.2f'):>6s} {('yes' if r['passed'] else 'no'):>5s}  "
              f"{_row_note(r)}".rstrip())
    print("x best = best peer GPU time / this GPU time (> 1: faster than every peer); "
          f"peaks: {PEAK_TFLOPS} TFLOP/s, {PEAK_TBPS} TB/s (H200, measured)")


def chart_caption(label: str) -> str:
    """'tools/bench.py, <date>, <GPU>, <label>' for the chart (the JSON records stay plain rows)."""
    import datetime

    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # the caption must never stop the chart
        pass
    parts = ["tools/bench.py", datetime.date.today().isoformat(), gpu] + ([label] if label else [])
    return ", ".join(parts) + "; GPU span, cold L2, median"


def _chart_panels(records: List[Dict]) -> List[tuple]:
    """(title, (metric key, unit), rows, x label of a row): one panel per bench kernel (x = workload), then one
    per op for the other family definitions (x = short definition name + workload)."""
    def op(k):
        try:
            return bw.op_of(k)
        except ValueError:
            return None

    panels = []
    for k in SHORT:
        rows = [r for r in records if r["kernel"] == k]
        metric = METRIC[op(k)]
        if any(r.get(metric[0]) for r in rows):
            panels.append((k, metric, rows, lambda r: r["workload"]))
    family = [r for r in records if r["kernel"] not in SHORT and op(r["kernel"]) in METRIC]
    for o in dict.fromkeys(op(r["kernel"]) for r in family):
        rows = [r for r in family if op(r["kernel"]) == o]
        metric = METRIC[o]
        if any(r.get(metric[0]) for r in rows):
            panels.append((f"family: {o}", metric, rows,
                           lambda r: f"{bw.short_name(r['kernel']).split(':', 1)[-1]} {r['workload']}"))
    return panels


def write_png(records: List[Dict], path: str, caption: str = "") -> None:
    """Grouped bars per workload, one panel per kernel: TFLOP/s for prefill (compute bound),
    TB/s for decode (bandwidth bound), with ``caption`` (date, GPU, commit) at the foot. Kept < 100 KB."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[png] matplotlib not installed: no chart")
        return
    panels = _chart_panels(records)
    if not panels:
        print("[png] nothing timed: no chart")
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.8 * len(panels)), squeeze=False)
    for ax, (title, (key, unit), rows, xkey) in zip(axes[:, 0], panels):
        wls = list(dict.fromkeys(xkey(r) for r in rows))
        impls = list(dict.fromkeys(r["impl"] for r in rows if r.get(key)))
        width = 0.8 / max(len(impls), 1)
        for i, impl in enumerate(impls):
            vals = [next((r[key] or 0 for r in rows if xkey(r) == wl and r["impl"] == impl), 0)
                    for wl in wls]
            hatch = None if all(r["passed"] for r in rows if r["impl"] == impl and r.get(key)) else "//"
            ax.bar([x + i * width for x in range(len(wls))], vals, width, label=impl, hatch=hatch)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(wls))])
        dense = len(wls) > 6 or any(len(x) > 22 for x in wls)
        ax.set_xticklabels(wls, fontsize=5 if dense else 7, rotation=40 if dense else 0,
                           ha="right" if dense else "center")
        ax.set_ylabel(unit, fontsize=8)
        ax.set_title(f"{title}  (hatched: failed the check)", fontsize=9)
        ax.legend(fontsize=6, ncol=len(impls), loc="lower center", bbox_to_anchor=(0.5, 1.08), frameon=False)
    fig.tight_layout(rect=(0, 0.03 if caption else 0, 1, 1))
    if caption:
        fig.text(0.01, 0.005, caption, fontsize=7)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for dpi in (80, 60, 45):  # step down until the file is small enough for the repo
        fig.savefig(path, dpi=dpi)
        if os.path.getsize(path) < 100 * 1024:
            break
    plt.close(fig)
    print(f"[png] wrote {path} ({os.path.getsize(path) // 1024} KB)")


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", nargs="+", default=["all"], metavar="KERNEL",
                   help="all (default), family (issue 10's page sizes and FIB head layouts), prefill, decode, mla, "
                        "mtp, mla_decode (h16 at page 1 and 64), or any definition name, e.g. gqa_paged_decode_h20_kv4_d128_ps16 (its representative "
                        "workload when none is listed); several are merged")
    p.add_argument("--workloads", nargs="+", help="labels (or substrings), e.g. n1_kv3232")
    p.add_argument("--impls", nargs="+", help="only these implementations, e.g. cute_attn fa4")
    p.add_argument("--quick", action="store_true", help="small subset (2 workloads per kernel; family: 4)")
    p.add_argument("--iters", type=int, default=50, help="timed runs (median), >= 50 recommended")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    p.add_argument("--png", metavar="PATH", default="docs/perf/bench.png", help="bar chart ('' = none)")
    p.add_argument("--label", default="", help="what ran, for the chart's caption (e.g. the commit: the GPU "
                   "machine has no .git); the date and GPU name are added")
    p.add_argument("--plan-only", action="store_true", help="only the planner timing")
    p.add_argument("--no-compile", action="store_true", help="no-GPU path: skip compiling kernels")
    p.add_argument("--arch", default=os.environ.get("CUTE_ATTN_ARCH") or "sm_90a",
                   help="no-GPU path: compile for this arch (default $CUTE_ATTN_ARCH, else sm_90a)")
    p.add_argument("--cpu", action="store_true", help="behave as if there were no GPU")
    p.add_argument("--compile-jobs", type=int, default=0, metavar="N",
                   help="GPU path: first call every cute_attn impl once in N processes at a time (each compiles "
                        "into the file-locked disk cache), then time in this one: a fresh machine compiles N kernels "
                        "at once instead of one")
    p.add_argument("--policy", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a spec policy for this run, e.g. gqa_decode.GATHER_WARPS_PAGE_SIZES=(1,2) (a module "
                        "of cute_attn.ops, a Python literal); every record carries the policies it ran under")
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help="print the selected workloads and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks for errors")
    return p.parse_args(argv)


def _write_json(records, path: str, quiet: bool = False) -> None:
    """The GPU run's list of records, or the no-GPU run's report object."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(records, f, indent=1)
    os.replace(path + ".tmp", path)
    if not quiet:
        what = f"{len(records)} records" if isinstance(records, list) else "the no-GPU report"
        print(f"[json] wrote {what} to {path}")


def _warm_in_parallel(workloads, args) -> None:
    """``--compile-jobs N``: the workloads dealt over N ``--warm-only`` processes of this script, run at once."""
    import subprocess
    import time

    start = time.perf_counter()
    groups = [workloads[i::args.compile_jobs] for i in range(args.compile_jobs)]
    procs = []
    for group in filter(None, groups):
        cmd = [sys.executable, os.path.abspath(__file__), "--warm-only", "--png=", "--seed", str(args.seed),
               "--kernel", *dict.fromkeys(w.kernel for w in group), "--workloads", *(w.label for w in group)]
        if args.impls:
            cmd += ["--impls", *args.impls]
        for setting in args.policy:
            cmd += ["--policy", setting]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    for proc in procs:
        proc.wait()
    print(f"[compile-jobs] {len(procs)} warm-up processes over {len(workloads)} workloads: "
          f"{time.perf_counter() - start:.0f} s", flush=True)


def apply_policies(settings) -> dict:
    """``--policy MODULE.NAME=VALUE``: each a global of ``cute_attn.ops.MODULE`` (or of ``cute_attn.config``, where
    the planner's policies live: ``config.RANK_DEAL_MAX_Q_TILES=4096``) that exists (a typo is an error, not a
    silently default run), set for the whole process before anything is planned or compiled."""
    import ast
    import importlib

    applied = {}
    for setting in settings:
        target, sep, literal = setting.partition("=")
        module_name, dot, name = target.strip().rpartition(".")
        if not sep or not dot:
            raise ValueError(f"--policy {setting!r}: expected MODULE.NAME=VALUE, e.g. "
                             f"gqa_decode.GATHER_WARPS_PAGE_SIZES=(1,2)")
        qualified = "cute_attn.config" if module_name == "config" else f"cute_attn.ops.{module_name}"
        module = importlib.import_module(qualified)
        if not hasattr(module, name):
            raise ValueError(f"--policy {setting!r}: {qualified} has no {name}")
        value = ast.literal_eval(literal.strip())
        setattr(module, name, value)
        applied[target.strip()] = value
    return applied


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        policies = apply_policies(args.policy)
    except (ValueError, ImportError, SyntaxError) as exc:
        print(exc)
        return 2
    try:
        workloads = bw.select_workloads(args.kernel, args.workloads, args.quick)
    except ValueError as exc:
        print(f"--kernel: {exc}")
        return 2
    if args.list:
        for w in workloads:
            print(f"{bw.short_name(w.kernel):20s} {w.label:22s} flops={bw.workload_flops(w):.3e} "
                  f"bytes={bw.workload_bytes(w):.3e}")
        return 0
    if args.plan_only:
        run_planner_timing()
        return 0
    try:
        import torch

        has_gpu = torch.cuda.is_available() and not args.cpu
    except ImportError:
        has_gpu = False
    if not has_gpu:
        print(f"No CUDA GPU available (torch.cuda.is_available() is False or --cpu): no kernel can be timed or "
              f"checked here, so only the CPU parts run: compile-only ({args.arch}, the kernels the selected "
              f"workloads launch) and the planner timings. The JSON says \"gpu\": null.", flush=True)
        report = bench_no_gpu.no_gpu_report(workloads, args.arch, compile_kernels_too=not args.no_compile)
        if args.json:
            _write_json(report, args.json)
        failed = [r["config"] for r in report["compile"] if r["status"] == "error"]
        if failed:
            print(f"[compile] {len(failed)} config(s) FAILED to compile")
        return 1 if failed else 0
    if not workloads:
        print("no workload matches the filters (see --list)")
        return 0
    if args.compile_jobs > 1 and not args.warm_only:
        _warm_in_parallel(workloads, args)
    print(f"GPU: {torch.cuda.get_device_name()}  iters={args.iters} warmup={args.warmup}")
    flush = bench_timing.make_l2_flusher()
    records: List[Dict] = []
    for w in workloads:
        print(f"\n== {bw.short_name(w.kernel)} {w.label}  (batch {w.batch}, total q {sum(w.q_lens)}, "
              f"total kv {sum(w.kv_lens)})", flush=True)
        rows = bench_workload(w, args, flush)
        for row in rows if policies else ():
            row["policies"] = {k: repr(v) for k, v in policies.items()}
        records.extend(rows)
        if args.json:  # after every workload, so a run cut short by a time limit still leaves its rows
            _write_json(records, args.json, quiet=True)
    add_peer_ratios(records)
    print_table(records)
    bench_targets.print_targets(records)
    run_planner_timing()
    if args.json:
        _write_json(records, args.json)
    if args.png:
        write_png(records, args.png, caption=chart_caption(args.label))
    return 0


if __name__ == "__main__":
    sys.exit(main())

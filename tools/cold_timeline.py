"""The timeline of one cold call (new index tensors, device planner) on a GPU: when the host launched each kernel
and when each ran, relative to the call's start, median over calls (one call on the H200).

    python tools/cold_timeline.py [--iters 30] [--batch 1 --kv 3232]
    python tools/cold_timeline.py --prefill 992 --batch 8 --kv 992 --device-planned

It tells a slow planner from a host that submits the attention kernel late: the bench's GPU span counts idle
GPU time between the two kernels, which is host time when the second launch arrives after the first kernel ended.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--kv", type=int, nargs="+", default=[3232, 2048])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device-planned", action="store_true",
                   help="also the call with a plan made once on the device (plan=...(on_device=True)): the attention "
                        "kernel's span without the planner before it")
    p.add_argument("--prefill", type=int, default=0, metavar="Q",
                   help="GQA prefill (h32/kv4, page 64) with Q queries a request instead of decode: the batches are "
                        "--batch requests of Q queries over --kv keys")
    p.add_argument("--late-scan", action="store_true",
                   help="planners built with late_scan_policy(scan_last=True): the planning CTA ends at once, its "
                        "scan CTAs arrive 50 us later, so the attention kernel waits ~50 us longer for the grid")
    args = p.parse_args(argv)
    if args.late_scan:
        from cute_attn.kernels.common.device_planner import late_scan_policy

        with late_scan_policy(scan_last=True):
            return _run(args)
    return _run(args)


def _run(args) -> int:
    import cute_attn
    from cute_attn import testing, timing

    flush = timing.make_l2_flusher()
    report = {}
    for batch, kv in zip(args.batch, args.kv):
        if args.prefill:
            case = testing.make_gqa_prefill_case([args.prefill] * batch, [kv] * batch, num_qo_heads=32, num_kv_heads=4,
                                                 head_dim=128, page_size=64, device="cuda", seed=batch)
            index = (case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
            entry = cute_attn.gqa_paged_prefill
        else:
            case = testing.make_gqa_decode_case([kv] * batch, device="cuda", seed=batch)
            index = (case.kv_indptr, case.kv_indices, case.kv_last_page_len)
            entry = cute_attn.gqa_paged_decode
        out, lse = case.new_outputs()
        inputs = case.inputs()
        ring = [tuple(a.clone() if any(a is t for t in index) else a for a in inputs) for _ in range(8)]
        turn = [0]

        def cold():
            turn[0] = (turn[0] + 1) % len(ring)
            entry(*ring[turn[0]], out, lse)

        calls = [("", cold)]
        if args.device_planned:
            plan_entry = cute_attn.plan_gqa_paged_prefill if args.prefill else cute_attn.plan_gqa_paged_decode
            device_plan = plan_entry(*inputs, on_device=True)

            def planned():
                entry(*inputs, out, lse, plan=device_plan)

            calls.append((", device-planned", planned))
        for suffix, call in calls:
            label = (f"prefill {batch} x {args.prefill} / {kv}" if args.prefill else f"decode {batch} x {kv}") + suffix
            label += ", late scan" if args.late_scan and not suffix else ""
            report[label] = _timeline(label, call, flush, args.iters)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _timeline(label, run, flush, iters):
    """Median launch and kernel times of ``run``'s kernels, relative to each call's start."""
    from cute_attn import timing

    events = timing.profile_events(run, flush, iters, warmup=10)
    iters = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith(timing.ITER_PREFIX)), key=lambda e: float(e["ts"]))
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "aunch" in str(e.get("name", ""))]
    kernels = {e.get("args", {}).get("correlation"): e for e in events if e.get("cat") == "kernel"}
    rows = []
    for it in iters:
        t0, t1 = float(it["ts"]), float(it["ts"]) + float(it["dur"])
        mine = sorted((e for e in launches if t0 <= float(e["ts"]) <= t1), key=lambda e: float(e["ts"]))
        row = []
        for e in mine:
            k = kernels.get(e.get("args", {}).get("correlation"))
            if k is None:
                continue
            row.append((str(k["name"])[:40], float(e["ts"]) - t0, float(e["dur"]), float(k["ts"]) - t0,
                        float(k["ts"]) + float(k["dur"]) - t0))
        rows.append(row)
    n = statistics.mode(len(r) for r in rows)
    rows = [r for r in rows if len(r) == n]
    print(f"{label}: {len(rows)} calls, {n} kernels (us from the call's start: host launch call start + its "
          f"duration; kernel start - end)")
    summary = []
    for i in range(n):
        med = [statistics.median(r[i][j] for r in rows) for j in range(1, 5)]
        print(f"    {rows[0][i][0]:40s} launch {med[0]:7.2f} (+{med[1]:5.2f})   kernel {med[2]:7.2f} - {med[3]:7.2f}")
        summary.append(dict(kernel=rows[0][i][0], launch_us=med[0], launch_call_us=med[1], start_us=med[2],
                            end_us=med[3]))
    return summary


if __name__ == "__main__":
    sys.exit(main())

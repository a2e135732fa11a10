"""The timeline of one cold call (new index tensors, device planner) on a GPU: when the host launched each kernel
and when each ran, relative to the call's start, median over calls (one call on the H200).

    python tools/cold_timeline.py [--iters 30] [--batch 1 --kv 3232]

It tells a slow planner from a host that submits the attention kernel late: the bench's GPU span counts idle
GPU time between the two kernels, which is host time when the second launch arrives after the first kernel ended.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import torch

    import cute_attn
    from cute_attn import testing, timing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--kv", type=int, nargs="+", default=[3232, 2048])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    flush = timing.make_l2_flusher()
    report = {}
    for batch, kv in zip(args.batch, args.kv):
        case = testing.make_gqa_decode_case([kv] * batch, device="cuda", seed=batch)
        out, lse = case.new_outputs()
        inputs = case.inputs()
        ring = [tuple(a.clone() if a is case.kv_indptr or a is case.kv_indices or a is case.kv_last_page_len else a
                      for a in inputs) for _ in range(8)]
        turn = [0]

        def cold():
            turn[0] = (turn[0] + 1) % len(ring)
            cute_attn.gqa_paged_decode(*ring[turn[0]], out, lse)

        prof = timing.profile_calls(cold, flush, args.iters, warmup=10)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
        os.unlink(path)
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
        label = f"decode {batch} x {kv}"
        print(f"{label}: {len(rows)} calls, {n} kernels (us from the call's start: host launch call start + its "
              f"duration; kernel start - end)")
        summary = []
        for i in range(n):
            med = [statistics.median(r[i][j] for r in rows) for j in range(1, 5)]
            print(f"    {rows[0][i][0]:40s} launch {med[0]:7.2f} (+{med[1]:5.2f})   kernel {med[2]:7.2f} - {med[3]:7.2f}")
            summary.append(dict(kernel=rows[0][i][0], launch_us=med[0], launch_call_us=med[1], start_us=med[2],
                                end_us=med[3]))
        report[label] = summary
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

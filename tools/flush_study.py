"""What the benchmark's L2 flush costs a memory-bound call: decode timed after a dirty, a clean and no flush.

    python tools/flush_study.py [--json OUT.json] [--peer fa4] [--only LABEL ...]
    ncu --clock-control none --cache-control none -k regex:<kernel> \\
        python tools/flush_study.py --once LABEL --flush dirty      # DRAM bytes of one flushed call

The bench (like FlashInfer's and Triton's timers) zeroes a buffer of twice the L2 before each call, so
the call starts with L2 full of dirty lines: every miss it takes evicts one, and the write-back shares
HBM with the call's own reads. This tool times the same decode calls (CUPTI span, median of 50) after
that flush ("dirty"), after a read of the same buffer ("clean": L2 full of clean lines) and with no
flush ("warm"), next to a contiguous read of the same K/V bytes (``torch.sum``: a generic streaming
kernel with no paging, plan or merge, for scale; not a floor, ours is faster), so the flush's share of
each figure can be read off.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_timing  # noqa: E402
from kernel_breakdown import WORKLOADS, build  # noqa: E402

DECODE_LABELS = [w for w in WORKLOADS if w.startswith("decode")]
FLUSHES = ("dirty", "clean", "warm")


def kv_bytes(case) -> int:
    """K and V bytes the call must read: every key of every request, for every KV head."""
    return 2 * sum(case.kv_lens) * case.k_cache.shape[2] * case.k_cache.shape[3] * case.k_cache.element_size()


def main(argv=None) -> int:
    import torch

    from cute_attn import testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", nargs="*", choices=DECODE_LABELS)
    ap.add_argument("--peer", choices=["fa4"], help="also time FA4 on the same cases")
    ap.add_argument("--once", choices=DECODE_LABELS, help="3 flushed calls of one workload (for ncu)")
    ap.add_argument("--flush", choices=FLUSHES, default="dirty", help="with --once")
    args = ap.parse_args(argv)
    flushers = {m: bench_timing.make_l2_flusher(mode=m) for m in ("dirty", "clean")}
    flushers["warm"] = lambda: None
    if args.once:
        _, _, _, run = build(args.once)
        run()
        for _ in range(3):
            flushers[args.flush]()
            torch.cuda.synchronize()
            run()
            torch.cuda.synchronize()
        return 0

    rows = []
    for label in args.only or DECODE_LABELS:
        case, out, lse, run = build(label)
        run()
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, "output")
        testing.assert_close_benchmark(lse, ref_lse, "lse")
        nbytes = kv_bytes(case)
        contiguous = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        impls = {"cute_attn": run, "contiguous_read": lambda: contiguous.sum(dtype=torch.float32)}
        if args.peer == "fa4":
            import bench_peers
            from bench_workloads import DECODE

            impls["fa4"] = bench_peers.setup_fa4_gqa(case, DECODE).run
        for impl, fn in impls.items():
            for mode in FLUSHES:
                t = bench_timing.measure(fn, flushers[mode], iters=50, warmup=10)
                row = dict(workload=label, impl=impl, flush=mode, span_us=t.gpu_us, kv_bytes=nbytes,
                           kv_tbps=(nbytes / t.gpu_us * 1e-6) if t.gpu_us else None, status=t.status)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Merge a tools/bench.py JSON into the committed record (docs/perf/h200-latest.json), newest row winning.

    python tools/merge_bench.py RUN.json [RUN2.json ...] --commit SHA --date 2026-12-01 [--into docs/perf/h200-latest.json]

Rows are keyed by (kernel, workload, impl); a merged row carries the run's commit, date and GPU, so a record that
mixes runs still says where each number came from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def merge(existing: list[dict], runs: list[list[dict]], *, commit: str, date: str, gpu: str) -> list[dict]:
    rows = {(r["kernel"], r["workload"], r["impl"]): r for r in existing}
    for run in runs:
        for r in run:
            rows[(r["kernel"], r["workload"], r["impl"])] = {**r, "commit": commit, "date": date, "gpu": gpu}
    return sorted(rows.values(), key=lambda r: (r["kernel"], r["workload"], r["impl"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--into", type=Path, default=Path("docs/perf/h200-latest.json"))
    p.add_argument("--commit", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--gpu", default="NVIDIA H200")
    args = p.parse_args(argv)
    existing = json.loads(args.into.read_text()) if args.into.exists() else []
    merged = merge(existing, [json.loads(r.read_text()) for r in args.runs], commit=args.commit, date=args.date,
                   gpu=args.gpu)
    args.into.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{args.into}: {len(existing)} -> {len(merged)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())

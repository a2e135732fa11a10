"""The standing of each benchmarked workload in one markdown table, from a bench JSON (default: the committed one).

    python tools/perf_summary.py [docs/perf/h200-latest.json] [--kernels SUBSTR ...]

One row per (definition, workload) that has a cute_attn row: the plan-once call (``cute_attn_planned``), the default
call (``cute_attn``: planned and checked on the GPU at every call) and the cold call (``cute_attn_cold``: new index
tensors every call), in GPU-span µs; the fastest FlashInfer backend that passed and FA4, each with the plan-once
call's speed-up over it (peer µs / our µs: above 1 means ours is faster); and the plan-once call's rate against the
H200 ceilings measured here (bandwidth-bound decode: TB/s as % of 4.3 TB/s copy; compute-bound prefill: TFLOP/s as %
of 790 dense bf16). Each record keeps its own run's commit and date, so a table over merged runs says where each
number came from. CPU only: it reads JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

COPY_TBPS = 4.3
BF16_TFLOPS = 790.0
OURS = ("cute_attn_planned", "cute_attn", "cute_attn_cold")
DEFAULT_JSON = Path(__file__).resolve().parent.parent / "docs" / "perf" / "h200-latest.json"


def _us(record: Optional[Dict]) -> Optional[float]:
    return None if record is None or not record.get("passed") or not record.get("gpu_us") else record["gpu_us"]


def _cell(value: Optional[float], digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _peak(record: Dict) -> str:
    """The plan-once call's rate as a share of the ceiling that bounds its kind."""
    if "decode" in record["kernel"]:
        tbps = record.get("tbps")
        return "—" if not tbps else f"{tbps:.2f} TB/s ({100 * tbps / COPY_TBPS:.0f}%)"
    tflops = record.get("tflops")
    return "—" if not tflops else f"{tflops:.0f} TFLOP/s ({100 * tflops / BF16_TFLOPS:.0f}%)"


def summary_rows(records: List[Dict], kernels: Optional[List[str]] = None) -> List[Dict]:
    """One dict per (kernel, workload) with a plan-once cute_attn row, in the records' order."""
    by_case: Dict[tuple, Dict[str, Dict]] = defaultdict(dict)
    for r in records:
        if kernels and not any(k in r["kernel"] for k in kernels):
            continue
        by_case[(r["kernel"], r["workload"])][r["impl"]] = r
    out = []
    for (kernel, workload), impls in by_case.items():
        planned = impls.get("cute_attn_planned")
        if _us(planned) is None:
            continue
        flashinfer = [(name, _us(r)) for name, r in impls.items() if name.startswith("flashinfer") and _us(r)]
        best = min(flashinfer, key=lambda item: item[1]) if flashinfer else (None, None)
        row = dict(kernel=kernel, workload=workload, **{impl: _us(impls.get(impl)) for impl in OURS},
                   flashinfer=best[1], flashinfer_backend=best[0], fa4=_us(impls.get("fa4")),
                   peak=_peak(planned), commit=planned.get("commit"), date=planned.get("date"))
        out.append(row)
    return out


def markdown(rows: List[Dict]) -> str:
    lines = ["| definition | workload | plan-once µs | default µs | cold µs | best FlashInfer µs (ours ×) "
             "| FA4 µs (ours ×) | plan-once rate | run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        planned = r["cute_attn_planned"]
        peers = []
        for key in ("flashinfer", "fa4"):
            value = r[key]
            backend = f" {r['flashinfer_backend'].removeprefix('flashinfer_')}" if key == "flashinfer" and value else ""
            peers.append("—" if value is None else f"{value:.1f}{backend} ({value / planned:.2f}×)")
        lines.append(f"| `{r['kernel']}` | {r['workload']} | {_cell(planned)} | {_cell(r['cute_attn'])} "
                     f"| {_cell(r['cute_attn_cold'])} | {peers[0]} | {peers[1]} | {r['peak']} "
                     f"| {r['commit']} {r['date']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", default=str(DEFAULT_JSON))
    ap.add_argument("--kernels", nargs="*", help="keep definitions whose name contains one of these")
    args = ap.parse_args(argv)
    records = json.loads(Path(args.json).read_text())
    print(markdown(summary_rows(records, args.kernels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

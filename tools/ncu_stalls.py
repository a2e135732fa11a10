"""Where a kernel's warps wait, from one Nsight Compute report: the warp-state totals and the SASS instructions
with the most stall samples (the report needs the SourceCounters section, e.g. ``--set full``).

    ncu --clock-control none --set full -k regex:Mla -c 1 -o seed python tools/kernel_breakdown.py --once mla_seed
    python tools/ncu_stalls.py seed.ncu-rep --top 40 > stalls.txt

Runs where ``ncu`` runs (the device machine); plain text out, small enough to commit beside the report's summary.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess


def _csv(report: str, *page_args: str) -> list[list[str]]:
    text = subprocess.run(["ncu", "-i", report, "--csv", *page_args], check=True, capture_output=True,
                          text=True).stdout
    return [row for row in csv.reader(io.StringIO(text)) if row]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def warp_states(report: str) -> list[tuple[str, float]]:
    """``smsp__pcsamp_warps_issue_stalled_*`` totals (the sampled warp states), largest first."""
    rows = _csv(report, "--page", "raw")
    header, values = rows[0], rows[-1]
    states = [(name.replace("smsp__pcsamp_warps_issue_stalled_", ""), _number(value))
              for name, value in zip(header, values) if name.startswith("smsp__pcsamp_warps_issue_stalled_")
              and not name.endswith("_not_issued")]
    return sorted(states, key=lambda kv: -kv[1])


def top_instructions(report: str, top: int) -> tuple[list[str], list[list[str]]]:
    """The SASS rows with the most warp-stall samples, and the columns kept for each."""
    rows = _csv(report, "--page", "source", "--print-source", "sass")
    header_index = next(i for i, row in enumerate(rows) if "Source" in row)
    header, body = rows[header_index], rows[header_index + 1:]
    samples = next(i for i, name in enumerate(header) if name.startswith("Warp Stall Sampling (All"))
    keep = [i for i, name in enumerate(header) if name in ("Address", "Source") or name.startswith("Warp Stall")]
    body = sorted(body, key=lambda row: -_number(row[samples]) if len(row) > samples else 0)[:top]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in body]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    states = warp_states(args.report)
    total = sum(v for _, v in states) or 1.0
    print("# sampled warp states (share of all stalled samples)")
    for name, value in states:
        if value:
            print(f"{name:40s} {value:10.0f} {100 * value / total:6.1f}%")
    columns, rows = top_instructions(args.report, args.top)
    print(f"\n# top {args.top} SASS instructions by stall samples\n" + " | ".join(columns))
    for row in rows:
        print(" | ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a kernel's warps wait, from one Nsight Compute report: the warp-state totals and the SASS instructions
with the most stall samples (the report needs the SourceCounters section, e.g. ``--set full``).

    ncu --clock-control none --set full -k regex:Mla -c 1 -o seed python tools/kernel_breakdown.py --once mla_seed
    python tools/ncu_stalls.py seed.ncu-rep --top 40 > stalls.txt
    ncu -i seed.ncu-rep --csv --page source --print-source sass > sass.csv    # where ncu runs
    python tools/ncu_stalls.py --blocks 12 sass.csv                           # anywhere: no ncu needed
    python tools/ncu_stalls.py --prologue UTMALDG sass.csv                    # the code before the first TMA load

``--blocks``: where the executed instructions go, by basic block (runs of SASS lines with the same execution count),
largest share first. Session 22 found the GQA prefill's element-wise V zeroing this way (30% of the instructions).
The source page comes from an instrumented replay: its counts of spin-wait loops (``try_wait`` / ``NANOSLEEP``) are
not the plain kernel's (page-1 decode: 29.9 M there, 8.8 M in the metric pass), so read those as waiting, and compare
totals with ``smsp__inst_executed.sum``.

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


def hot_blocks(sass_csv_text: str, top: int) -> tuple[float, list[dict]]:
    """(executed warp instructions in all, the ``top`` basic blocks by executed instructions) of an exported source
    page (``ncu -i R --csv --page source --print-source sass``). A block is a run of consecutive SASS lines with the
    same ``Instructions Executed``: each has its count, its lines, its share, its stall samples and its first lines."""
    rows = [row for row in csv.reader(io.StringIO(sass_csv_text)) if row]
    header_index = next(i for i, row in enumerate(rows) if "Source" in row and "Instructions Executed" in row)
    header, body = rows[header_index], [row for row in rows[header_index + 1:] if len(row) == len(rows[header_index])]
    executed, source = header.index("Instructions Executed"), header.index("Source")
    samples = next((i for i, name in enumerate(header) if name.startswith("Warp Stall Sampling (All")), None)
    blocks: list[dict] = []
    for line, row in enumerate(body):
        count = _number(row[executed])
        if blocks and blocks[-1]["executed"] == count and blocks[-1]["last"] == line - 1:
            block = blocks[-1]
        else:
            block = dict(executed=count, first=line, lines=0, samples=0.0, source=[])
            blocks.append(block)
        block["last"] = line
        block["lines"] += 1
        block["samples"] += _number(row[samples]) if samples is not None else 0.0
        if len(block["source"]) < 3:
            block["source"].append(row[source].strip())
    total = sum(b["executed"] * b["lines"] for b in blocks) or 1.0
    for block in blocks:
        block["share"] = block["executed"] * block["lines"] / total
    return total, sorted(blocks, key=lambda b: -b["share"])[:top]


def prologue_stalls(sass_csv_text: str, marker: str = "UTMALDG", loop_count: float | None = None) -> dict:
    """Where a kernel's code before its first ``marker`` instruction (a TMA load: the prologue) waits, from an exported
    source page: its stall samples by reason, its share of all samples and its executed instructions a warp. Lines
    run ``loop_count`` times (the main loop's blocks that the compiler placed before the marker) are left out; by
    default the count of the most-executed line before it."""
    rows = [row for row in csv.reader(io.StringIO(sass_csv_text)) if row]
    header_index = next(i for i, row in enumerate(rows) if "Source" in row and "Instructions Executed" in row)
    header, body = rows[header_index], [row for row in rows[header_index + 1:] if len(row) == len(rows[header_index])]
    executed, source = header.index("Instructions Executed"), header.index("Source")
    samples = next(i for i, name in enumerate(header) if name.startswith("Warp Stall Sampling (All"))
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    end = next(i for i, row in enumerate(body) if marker in row[source])
    head = body[:end]
    if loop_count is None:
        loop_count = max(_number(row[executed]) for row in head)
    kept = [row for row in head if _number(row[executed]) != loop_count]
    warps = _number(body[0][executed]) or 1.0  # the entry's first line runs once a warp
    by_reason = {header[i][len("stall_"):]: sum(_number(row[i]) for row in kept) for i in reasons}
    return dict(samples=sum(_number(row[samples]) for row in kept),
                all_samples=sum(_number(row[samples]) for row in body),
                instructions_per_warp=sum(_number(row[executed]) for row in kept) / warps,
                lines=len(kept), by_reason=dict(sorted(by_reason.items(), key=lambda kv: -kv[1])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="an .ncu-rep (needs ncu), or with --blocks an exported source-page CSV")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=0, help="print the N basic blocks with the most executed "
                                                           "instructions (REPORT: the exported source-page CSV)")
    ap.add_argument("--prologue", metavar="MARKER", help="the stalls of the code before the first MARKER instruction "
                                                           "(e.g. UTMALDG; REPORT: the exported source-page CSV)")
    args = ap.parse_args(argv)
    if args.prologue:
        with open(args.report) as f:
            p = prologue_stalls(f.read(), args.prologue)
        print(f"# before the first {args.prologue}: {p['lines']} SASS lines, {p['instructions_per_warp']:.0f} executed "
              f"a warp, {p['samples']:.0f} of {p['all_samples']:.0f} stall samples "
              f"({100 * p['samples'] / (p['all_samples'] or 1):.1f}%)")
        for name, value in p["by_reason"].items():
            if value:
                print(f"{name:24s} {value:8.0f} {100 * value / (p['samples'] or 1):6.1f}%")
        return 0
    if args.blocks:
        with open(args.report) as f:
            total, blocks = hot_blocks(f.read(), args.blocks)
        print(f"# {total:,.0f} warp instructions executed; basic blocks by share")
        for b in blocks:
            print(f"{100 * b['share']:5.1f}%  {b['executed']:>10,.0f} x {b['lines']:3d} lines  samples {b['samples']:6.0f}"
                  f"  line {b['first']}: {' / '.join(b['source'])}")
        return 0
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

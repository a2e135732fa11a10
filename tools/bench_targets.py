"""The open issues' performance targets, checked against one bench run's records.

Targets (issues "GQA paged prefill" and "GQA paged decode"):
- prefill: GPU span <= FA4's / 1.25 on each seed workload (n1..n32 x 992/992), same run;
- decode: n1_kv3232 <= 8 us, n16_kv2048 <= 25 us, >= 4.1 TB/s at n64_kv2048 and n128_kv4096;
- both: host overhead (CUDA-event wall time - GPU span, plan cached) <= 15 us per call;
- multi-token decode (issue 10): q_len 4 at 64 x 2048 costs <= 1.3x q_len 1 (same run, same kernel).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import bench_workloads as bw

PREFILL_SEEDS = [bw.prefill_label(n, 992, 992) for n in (1, 4, 8, 16, 32)]
DECODE_LATENCY_US = {bw.decode_label(1, 3232): 8.0, bw.decode_label(16, 2048): 25.0}
DECODE_MIN_TBPS = {bw.decode_label(64, 2048): 4.1, bw.decode_label(128, 4096): 4.1}
HOST_OVERHEAD_US = 15.0
FA4_SPEEDUP = 1.25
MTP_PAIR = (bw.mtp_label(64, 1, 2048), bw.mtp_label(64, 4, 2048))
MTP_MAX_RATIO = 1.3


def _find(records: List[Dict], kernel: str, workload: str, impl: str) -> Optional[Dict]:
    for r in records:
        if (r["kernel"], r["workload"], r["impl"]) == (kernel, workload, impl) and r.get("gpu_us"):
            return r
    return None


def target_rows(records: List[Dict]) -> List[Dict]:
    """One row per target: what it asks, what was measured, met or not (None when not measurable)."""
    rows = []

    def add(name, want, got, met):
        rows.append(dict(target=name, want=want, got=got, met=met))

    for label in PREFILL_SEEDS:
        ours, fa4 = _find(records, bw.PREFILL, label, "cute_attn"), _find(records, bw.PREFILL, label, "fa4")
        ratio = fa4["gpu_us"] / ours["gpu_us"] if ours and fa4 and ours["passed"] else None
        add(f"prefill {label} vs FA4", f">= {FA4_SPEEDUP:.2f}x", None if ratio is None else f"{ratio:.2f}x",
            None if ratio is None else ratio >= FA4_SPEEDUP)
    for label, limit in DECODE_LATENCY_US.items():
        ours = _find(records, bw.DECODE, label, "cute_attn")
        got = ours["gpu_us"] if ours and ours["passed"] else None
        add(f"decode {label}", f"<= {limit:g} us", None if got is None else f"{got:.1f} us",
            None if got is None else got <= limit)
    for label, floor in DECODE_MIN_TBPS.items():
        ours = _find(records, bw.DECODE, label, "cute_attn")
        got = ours["tbps"] if ours and ours["passed"] else None
        add(f"decode {label}", f">= {floor:g} TB/s", None if got is None else f"{got:.2f} TB/s",
            None if got is None else got >= floor)
    one, four = (_find(records, bw.MTP_DECODE, label, "cute_attn") for label in MTP_PAIR)
    ratio = four["gpu_us"] / one["gpu_us"] if one and four and one["passed"] and four["passed"] else None
    add(f"mtp {MTP_PAIR[1]} / {MTP_PAIR[0]}", f"<= {MTP_MAX_RATIO:g}x", None if ratio is None else f"{ratio:.2f}x",
        None if ratio is None else ratio <= MTP_MAX_RATIO)
    ours = [r for r in records if r["impl"] == "cute_attn" and r.get("gpu_us") and r.get("wall_us")
            and r["kernel"] in (bw.PREFILL, bw.DECODE)]
    if ours:
        worst = max(r["wall_us"] - r["gpu_us"] for r in ours)
        add("host overhead (wall - span), worst GQA case", f"<= {HOST_OVERHEAD_US:g} us", f"{worst:.1f} us",
            worst <= HOST_OVERHEAD_US)
    return rows


def print_targets(records: List[Dict]) -> None:
    rows = target_rows(records)
    print("\nissue targets:")
    for r in rows:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[r["met"]]
        print(f"  {r['target']:45s} want {r['want']:>10s}  got {str(r['got']):>10s}  {verdict}")

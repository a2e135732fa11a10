"""tools/merge_bench.py: the committed bench record keeps one row per (kernel, workload, impl), the newest."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import merge_bench  # noqa: E402


def _row(impl, us, workload="n1"):
    return dict(kernel="k", workload=workload, impl=impl, gpu_us=us)


def test_newest_row_wins_and_carries_its_run():
    old = [_row("cute_attn", 10.0), _row("flashinfer", 11.0)]
    merged = merge_bench.merge(old, [[_row("cute_attn", 9.0), _row("cute_attn", 7.0, workload="n64")]],
                               commit="abc1234", date="2026-12-01", gpu="NVIDIA H200")
    by_key = {(r["workload"], r["impl"]): r for r in merged}
    assert len(merged) == 3
    assert by_key["n1", "cute_attn"]["gpu_us"] == 9.0 and by_key["n1", "cute_attn"]["commit"] == "abc1234"
    assert by_key["n1", "flashinfer"]["gpu_us"] == 11.0 and "commit" not in by_key["n1", "flashinfer"]
    assert by_key["n64", "cute_attn"]["date"] == "2026-12-01"

"""``tools/perf_summary.py``: the perf notes' standing table from a bench JSON (CPU; it reads records only)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import perf_summary  # noqa: E402


def _record(impl, gpu_us, passed=True, kernel="gqa_paged_decode_h20_kv4_d128_ps64", **extra):
    return dict(kernel=kernel, workload="n64_kv2048", impl=impl, gpu_us=gpu_us, passed=passed, commit="abc1234",
                date="2026-12-05", **extra)


def test_best_flashinfer_backend_that_passed_and_the_ratio_against_the_plan_once_call():
    records = [_record("cute_attn_planned", 75.0, tbps=3.57), _record("cute_attn", 83.0),
               _record("cute_attn_cold", 84.0), _record("flashinfer_tc", 70.0, passed=False),
               _record("flashinfer_cuda_cores", 80.0), _record("flashinfer_fa2", 90.0), _record("fa4", 82.5)]
    (row,) = perf_summary.summary_rows(records)
    assert row["flashinfer"] == 80.0 and row["flashinfer_backend"] == "flashinfer_cuda_cores"  # the failed one is out
    assert row["cute_attn"] == 83.0 and row["cute_attn_cold"] == 84.0
    assert row["peak"] == "3.57 TB/s (83%)"
    text = perf_summary.markdown([row])
    assert "| 75.0 | 83.0 | 84.0 | 80.0 cuda_cores (1.07×) | 82.5 (1.10×) |" in text


def test_prefill_rates_against_the_mma_ceiling_and_rows_without_a_plan_once_call_are_left_out():
    kernel = "gqa_paged_prefill_causal_h32_kv4_d128_ps64"
    records = [_record("cute_attn_planned", 142.4, kernel=kernel, tflops=453.0),
               _record("cute_attn", 150.0, kernel="other_kernel")]
    (row,) = perf_summary.summary_rows(records)
    assert row["peak"] == "453 TFLOP/s (57%)" and row["fa4"] is None and row["cute_attn"] is None
    assert "| — | — | — | — |" in perf_summary.markdown([row])


def test_the_committed_bench_json_renders():
    rows = perf_summary.summary_rows(perf_summary.json.loads(perf_summary.DEFAULT_JSON.read_text()), ["ckv512"])
    assert rows and all(r["kernel"].startswith("mla_") and r["cute_attn_planned"] > 0 for r in rows)


def test_the_perf_notes_standing_table_is_the_committed_json_rendered():
    """docs/perf-notes.md's standing table is ``perf_summary``'s output for the committed bench JSON (the command
    above the table): a merged bench run without a re-rendered table fails here."""
    notes = (perf_summary.DEFAULT_JSON.parent.parent / "perf-notes.md").read_text()
    records = perf_summary.json.loads(perf_summary.DEFAULT_JSON.read_text())
    kernels = ["h32_kv4_d128_ps64", "h20_kv4_d128_ps64", "ckv512", "multi_token"]
    assert f"`python tools/perf_summary.py --kernels {' '.join(kernels)}`" in notes
    assert perf_summary.markdown(perf_summary.summary_rows(records, kernels)) in notes

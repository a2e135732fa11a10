"""CPU tier for tools/bench*.py: labels, counting formulas, record schema, check/normalise helpers,
trace parsing and the no-GPU path of the CLI. Nothing here needs a GPU or a peer library."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)

import bench  # noqa: E402
import bench_peers as bp  # noqa: E402
import bench_timing as bt  # noqa: E402
import bench_workloads as bw  # noqa: E402


# ----------------------------------------------------------------------------- workloads


def test_labels_unique_and_stable():
    wl = bw.all_workloads()
    keys = [(w.kernel, w.label) for w in wl]
    assert len(keys) == len(set(keys))
    labels = {w.label for w in wl}
    # The spec's names: seeds and the larger points must keep these exact spellings.
    for name in ("n1_q992_kv992", "n4_q992_kv992", "n8_q992_kv992", "n16_q992_kv992", "n32_q992_kv992",
                 "n4_q512_kv4096", "n8_q128_kv2048", "n1_kv3232", "n16_kv2048", "n64_kv2048",
                 "n128_kv4096", "n1_q1028_kv1038", "n28_q1954_kv2044", "n20_q3842_kv3916",
                 "n1_q16384_kv16387"):
        assert name in labels, name
    # A second build gives the same lists (MLA splits come from crc32 of the label, not hash()).
    assert [(w.label, w.q_lens, w.kv_lens) for w in bw.all_workloads()] == \
           [(w.label, w.q_lens, w.kv_lens) for w in wl]


def test_labels_match_lengths():
    for w in bw.all_workloads():
        if w.kernel == bw.PREFILL:
            assert w.label == bw.prefill_label(w.batch, w.q_lens[0], w.kv_lens[0])
        elif w.kernel == bw.DECODE:
            assert set(w.q_lens) == {1}
            assert w.label == bw.decode_label(w.batch, w.kv_lens[0])
        elif w.kernel == bw.MTP_DECODE:
            assert 1 <= w.q_lens[0] <= 8 and len(set(w.q_lens)) == len(set(w.kv_lens)) == 1
            assert w.label == bw.mtp_label(w.batch, w.q_lens[0], w.kv_lens[0])
        elif w.definition.op == "mla_decode":
            assert set(w.q_lens) == {1}
            uniform = len(set(w.kv_lens)) == 1
            assert w.label == (bw.decode_label(w.batch, w.kv_lens[0]) if uniform else
                               bw.ragged_decode_label(w.batch, bw.MLA_DECODE_RAGGED[1]))
        else:
            assert w.label == bw.mla_label(w.batch, sum(w.q_lens), sum(w.kv_lens))
            assert all(kv >= q >= 1 for q, kv in zip(w.q_lens, w.kv_lens))


def test_decode_seed_is_51_pages():
    (w,) = bw.select_workloads("decode", ["n1_kv3232"])
    assert bw.pages_of(w.kv_lens[0], 64) == 51 and w.kv_lens[0] - 50 * 64 == 32


def test_select_filters():
    assert {w.kernel for w in bw.select_workloads("mla")} == {bw.MLA}
    assert [w.label for w in bw.select_workloads("decode", ["n64_kv2048"])] == ["n64_kv2048"]
    quick = bw.select_workloads("all", quick=True)
    assert quick and all(w.quick for w in quick)
    assert {w.kernel for w in quick} == {bw.PREFILL, bw.DECODE, bw.MLA, bw.MTP_DECODE, bw.MLA_DECODE, bw.MLA_DECODE_PS64}
    mtp = bw.select_workloads("mtp")
    assert [w.label for w in mtp] == ["n64_q1_kv2048", "n64_q4_kv2048"]  # q_len 4 beside q_len 1
    assert bw.workload_bytes(mtp[1]) - bw.workload_bytes(mtp[0]) < 0.01 * bw.workload_bytes(mtp[0])


@pytest.mark.parametrize("b,tq,tkv", [(1, 43, 46), (28, 1954, 2044), (22, 22, 17759), (5, 5, 5)])
def test_mla_split(b, tq, tkv):
    q, kv = bw.split_mla_lengths(b, tq, tkv, seed=7)
    assert len(q) == len(kv) == b and sum(q) == tq and sum(kv) == tkv
    assert all(k >= x >= 1 for x, k in zip(q, kv))
    assert (q, kv) == bw.split_mla_lengths(b, tq, tkv, seed=7)


# ----------------------------------------------------------------------------- counting


def test_visible_pairs_by_hand():
    assert bw.visible_pairs(2, 3) == 2 + 3  # row 0 sees keys 0..1, row 1 sees 0..2
    assert bw.visible_pairs(3, 1) == 0 + 0 + 1  # bottom-right: only the last row sees the key
    assert bw.visible_pairs(4, 4) == 1 + 2 + 3 + 4
    assert bw.visible_pairs(1, 5) == 5
    assert bw.visible_pairs(0, 5) == 0
    assert bw.visible_pairs(2, 3, causal=False) == 6


def test_prefill_flops_bytes_by_hand():
    w = bw.Workload(bw.PREFILL, "t", (2,), (3,))
    assert bw.workload_flops(w) == 2 * 32 * (128 + 128) * 5
    q = out = 2 * 32 * 128 * 2
    lse = 2 * 32 * 4
    kv = 3 * 4 * 128 * 2 * 2
    idx = (2 + 1 + 1 + 2) * 4  # kv_indptr, 1 page, last_page_len, qo_indptr
    assert bw.workload_bytes(w) == q + out + lse + kv + idx == 39192


def test_decode_flops_bytes_by_hand():
    w = bw.Workload(bw.DECODE, "t", (1,), (3,))
    assert bw.workload_flops(w) == 2 * 20 * 256 * 3
    assert bw.workload_bytes(w) == 5120 + 5120 + 80 + 3 * 4 * 128 * 4 + (2 + 1 + 1) * 4 == 16480


def test_mla_flops_bytes_by_hand():
    w = bw.Workload(bw.MLA, "t", (2,), (3,))
    assert bw.workload_flops(w) == 2 * 16 * (576 + 512) * 5
    q = 2 * 16 * 576 * 2
    out = 2 * 16 * 512 * 2
    lse = 2 * 16 * 4
    kv = 3 * 576 * 2
    idx = (2 + 2 + 3) * 4
    assert bw.workload_bytes(w) == q + out + lse + kv + idx == 73244


def test_rates():
    r = bt.rates(2_000_000, 4_000_000, 1.0)  # per µs -> per s
    assert math.isclose(r["tflops"], 2.0) and math.isclose(r["tbps"], 4.0)
    assert bt.rates(1, 1, None) == {"tflops": None, "tbps": None}


# ----------------------------------------------------------------------------- records


def test_record_schema_and_ratios():
    recs = [
        bench.make_record(bw.DECODE, "n1_kv3232", "cute_attn", gpu_us=10.0, wall_us=15.0,
                          flops=10**7, nbytes=10**7, passed=True),
        bench.make_record(bw.DECODE, "n1_kv3232", "flashinfer_tc", gpu_us=20.0, wall_us=30.0,
                          flops=10**7, nbytes=10**7, passed=True),
        bench.make_record(bw.DECODE, "n1_kv3232", "fa4", gpu_us=5.0, wall_us=9.0,
                          flops=10**7, nbytes=10**7, passed=False),  # fastest but wrong
        bench.make_record(bw.DECODE, "n1_kv3232", "flashinfer_cuda_cores", status="skipped",
                          note="skipped: group size 5"),
    ]
    bench.add_peer_ratios(recs)
    back = json.loads(json.dumps(recs))
    for r in back:
        assert set(bench.RECORD_KEYS) <= set(r)
        assert isinstance(r["passed"], bool)
        assert r["kernel"] == bw.DECODE and r["workload"] == "n1_kv3232"
    assert math.isclose(back[0]["tflops"], 1.0)  # 1e7 FLOP in 10 µs
    assert math.isclose(back[0]["vs_best_peer"], 2.0)  # best *passing* peer is flashinfer_tc
    assert back[3]["gpu_us"] is None and "vs_best_peer" not in back[3]
    assert back[3]["note"].startswith("skipped")


# ----------------------------------------------------------------------------- check / normalise


def _prefill_case():
    from cute_attn.testing import make_gqa_prefill_case

    return make_gqa_prefill_case([3, 5], [70, 5], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                                 page_size=64, device="cpu", seed=1)


def test_check_accepts_reference_and_rejects_nan():
    case = _prefill_case()
    ref = bp.reference(bw.PREFILL, case)
    assert bp.check(ref, ref) == (True, "")
    out = ref[0].clone()
    out[0, 0, 0] = float("nan")
    ok, why = bp.check((out, ref[1]), ref)
    assert not ok and "non-finite" in why
    lse = ref[1].clone() + 0.5
    ok, why = bp.check((ref[0], lse), ref)
    assert not ok and why.startswith("lse")
    small = ref[1].clone() + 1e-3  # inside the absolute tolerance
    assert bp.check((ref[0], small), ref)[0]


def test_page_table_and_finite_tails():
    case = _prefill_case()
    table, counts = bp._page_table(case.kv_indptr, case.kv_indices)
    assert table.dtype == torch.int32 and counts.tolist() == [2, 1]
    assert table[0].tolist() == case.kv_indices[:2].tolist()
    assert table[1, 0].item() == case.kv_indices[2].item()
    k = bp._finite_tails(case.k_cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    for b in range(2):
        last = case.kv_indices[case.kv_indptr[b + 1] - 1].item()
        n = case.kv_last_page_len[b].item()
        assert torch.isfinite(k[last]).all()
        assert (k[last, n:] == 0).all()
        assert torch.equal(k[last, :n], case.k_cache[last, :n])
    assert torch.isnan(case.k_cache).any()  # the case itself is untouched


def test_fa4_lse_normalisation():
    lse_ln = torch.tensor([[0.0, math.log(2.0), 1.0], [math.log(4.0), 1.0, 0.0]])  # [H=2, T=3], natural
    conv = bp.fa4_lse_to_base2(lse_ln, heads_first=True)
    assert conv.shape == (3, 2)
    assert torch.allclose(conv, torch.tensor([[0.0, 2.0], [1.0, 1 / math.log(2.0)], [1 / math.log(2.0), 0.0]]))
    assert torch.allclose(bp.fa4_lse_to_base2(lse_ln, heads_first=False), lse_ln / math.log(2.0))


def test_bench_workload_rows_with_fake_runners(monkeypatch):
    """The per-workload loop on CPU: a correct runner, a wrong one, a skipped one, a crashing one."""
    w = bw.Workload(bw.PREFILL, "n2_tiny", (3, 5), (70, 5))
    monkeypatch.setattr(bw.Workload, "build_case", lambda self, device, seed=0: _prefill_case())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(bt, "measure", lambda prep, flush, iters, warmup: bt.Timing(10.0, 9.0, 12.0, 1, "ok"))

    def good(case):
        ref = case.reference()
        return bp.Prepared(lambda: ref)

    def wrong(case):
        out, lse = case.reference()
        return bp.Prepared(lambda: (out + 1, lse))

    def skipped(case):
        raise bp.Unavailable("skipped: not installed")

    def broken(case):
        raise RuntimeError("boom")

    monkeypatch.setattr(bp, "runners_for", lambda k: [("cute_attn", good), ("peer_a", wrong),
                                                      ("peer_b", skipped), ("peer_c", broken)])
    args = bench.parse_args(["--iters", "1", "--warmup", "0"])
    rows = {r["impl"]: r for r in bench.bench_workload(w, args, flush=lambda: None)}
    assert rows["cute_attn"]["passed"] is True and rows["cute_attn"]["gpu_us"] == 10.0
    assert rows["peer_a"]["passed"] is False and rows["peer_a"]["note"].startswith("out:")
    assert rows["peer_b"]["status"] == "skipped" and rows["peer_b"]["gpu_us"] is None
    assert rows["peer_c"]["status"] == "error" and "boom" in rows["peer_c"]["note"]
    for r in rows.values():
        assert set(bench.RECORD_KEYS) <= set(r) and r["flops"] == bw.workload_flops(w)


# ----------------------------------------------------------------------------- trace parsing


def test_iteration_spans_exclude_flush():
    ev = [
        {"cat": "user_annotation", "name": "bench_iter_0", "ts": 100.0, "dur": 50.0},
        {"cat": "user_annotation", "name": "bench_iter_1", "ts": 300.0, "dur": 50.0},
        # flush before each iteration: launched outside the ranges
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 90.0, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "fill", "ts": 91.0, "dur": 8.0, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 101.0, "args": {"correlation": 2}},
        {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 102.0, "args": {"correlation": 3}},
        {"cat": "kernel", "name": "attn", "ts": 110.0, "dur": 20.0, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "merge", "ts": 132.0, "dur": 5.0, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 290.0, "args": {"correlation": 4}},
        {"cat": "kernel", "name": "fill", "ts": 291.0, "dur": 8.0, "args": {"correlation": 4}},
        # iteration 1: no launch record (fallback: GPU records inside the range)
        {"cat": "kernel", "name": "attn", "ts": 305.0, "dur": 21.0, "args": {"correlation": 9}},
    ]
    spans = bt._iteration_spans(ev)
    assert spans[0] == {"span": 27.0, "sum": 25.0, "n": 2}
    assert spans[1] == {"span": 21.0, "sum": 21.0, "n": 1}


# ----------------------------------------------------------------------------- CLI, no GPU


def _run_cli(*args, timeout=180):
    return subprocess.run([sys.executable, os.path.join(TOOLS, "bench.py"), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_cli_no_gpu_path_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    p = _run_cli("--cpu", "--no-compile", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "No CUDA GPU" in p.stdout and "compile-only" in p.stdout
    report = json.loads(out.read_text())
    assert "gpu" in report and report["gpu"] is None and report["arch"] == "sm_90a" and report["records"] == []
    assert [r["status"] for r in report["compile"]] == ["skipped"] * len(report["compile"]) != []
    planned = {(r["kernel"], r["workload"]) for r in report["planner"]["workloads"]}
    assert planned == {(w.kernel, w.label) for w in bw.all_workloads()}
    assert report["planner"]["decode_batch"]["batch"] == 4096


def test_no_gpu_compiles_what_the_workloads_launch():
    """Attention configs as the API builds them; a combine only where a plan splits and the kernel does not
    fold its own merges (decode does: no combine even though its small batches split)."""
    import bench_no_gpu as ng
    from cute_attn.compile import registered_configs

    workloads = bw.all_workloads()
    plans = [ng.plan_workload(w, "sm_90a", iters=1) for w in workloads]
    kernels = ng.kernels_to_compile(workloads, plans, "sm_90a")
    roles = [(role, getattr(c, "kind", "combine")) for role, c in kernels]
    assert roles == [("attention", "gqa_paged_prefill"), ("attention", "gqa_paged_decode"),
                     ("attention", "mla_paged_prefill"),  # MLA prefill, short items: score_wg_sepi
                     ("attention", "mla_paged_prefill"),  # long items (1 / 16384, 22 / 22 / 17759): score_wg
                     ("combine", "combine"),
                     ("attention", "gqa_paged_multi_token_decode"),  # fused merge: no combine of its own
                     ("attention", "mla_paged_prefill"), ("combine", "combine"),  # MLA decode page 1: one-token tiles
                     ("attention", "mla_paged_prefill")]  # MLA decode page 64
    assert [c.smem_epilogue for _, c in kernels[2:4]] == [True, False]
    assert [c.tile_q_rows for _, c in kernels[6:]] == [16, 16, 16]
    assert any(p["num_merges"] for p in plans if p["kernel"] == bw.DECODE)
    assert kernels[4][1].head_dim_v == 512  # the MLA combine: n22_q22_kv17759 splits
    assert {c for _, c in kernels} <= set(registered_configs("sm_90a"))  # compile_all builds the same ones
    seed = bw.select_workloads("decode", ["n1_kv3232"])
    decode_only = ng.kernels_to_compile(seed, [ng.plan_workload(seed[0], "sm_100a", iters=1)], "sm_100a")
    assert [(role, c.arch) for role, c in decode_only] == [("attention", "sm_100a")]
    with pytest.raises(ValueError, match="kernel must be one of"):
        ng.attention_config("gqa_ragged_prefill", "sm_90a")


def test_no_gpu_run_compiles_for_the_given_arch(tmp_path, isolated_compile_cache, monkeypatch):
    """The no-GPU main path end to end for one decode workload: one real compile, for sm_90a (the DSL
    alone would pick sm_100a on a machine without a GPU)."""
    import bench_no_gpu as ng
    from cute_attn.compile import compile_kernel_with_info

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # pin_dsl_arch sets it only when unset; keep it scoped
    out = tmp_path / "bench.json"
    assert bench.main(["--cpu", "--kernel", "decode", "--workloads", "n1_kv3232", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["gpu"] is None and report["arch"] == "sm_90a"
    (row,) = report["compile"]
    config = ng.attention_config(bw.DECODE, "sm_90a")
    assert row["role"] == "attention" and row["config"] == config.cache_key()
    assert row["status"] == "compiled" and row["seconds"] > 0
    (plan,) = report["planner"]["workloads"]
    assert plan["workload"] == "n1_kv3232" and plan["num_ctas"] == 132 and plan["num_merges"] == 4
    assert report["planner"]["decode_batch"]["plan_ms"] > 0
    ptx = compile_kernel_with_info(config).ptx_path.read_text()
    assert ".target sm_90a" in ptx


def test_cli_plan_only_and_list():
    p = _run_cli("--plan-only")
    assert p.returncode == 0, p.stderr
    assert "[plan]" in p.stdout
    p = _run_cli("--list", "--kernel", "decode")
    assert p.returncode == 0 and "n1_kv3232" in p.stdout and "n1_q992_kv992" not in p.stdout


def test_plan_inspect_cli_runs():
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "plan_inspect.py"
    out = subprocess.run([sys.executable, str(tool), "decode", "--kv", "3232", "--items", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "merges 4" in out.stdout and "partial_slot" in out.stdout


def test_issue_targets_from_records():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_targets
    import bench_workloads as bw

    def rec(kernel, workload, impl, gpu_us, wall_us=None, tbps=None, passed=True):
        return dict(kernel=kernel, workload=workload, impl=impl, gpu_us=gpu_us, wall_us=wall_us or gpu_us + 10,
                    tbps=tbps, passed=passed)

    records = [
        rec(bw.PREFILL, "n1_q992_kv992", "cute_attn", 20.0), rec(bw.PREFILL, "n1_q992_kv992", "fa4", 27.0),
        rec(bw.PREFILL, "n4_q992_kv992", "cute_attn", 90.0), rec(bw.PREFILL, "n4_q992_kv992", "fa4", 95.0),
        rec(bw.PREFILL, "n8_q992_kv992", "cute_attn", 10.0, passed=False), rec(bw.PREFILL, "n8_q992_kv992", "fa4", 95.0),
        rec(bw.DECODE, "n1_kv3232", "cute_attn", 7.5, wall_us=30.0),
        rec(bw.DECODE, "n64_kv2048", "cute_attn", 70.0, tbps=4.0),
        rec(bw.MTP_DECODE, "n64_q1_kv2048", "cute_attn", 40.0), rec(bw.MTP_DECODE, "n64_q4_kv2048", "cute_attn", 44.0),
    ]
    rows = {r["target"]: r for r in bench_targets.target_rows(records)}
    assert rows["mtp n64_q4_kv2048 / n64_q1_kv2048"]["met"] is True  # 1.10x
    assert rows["prefill n1_q992_kv992 vs FA4"]["met"] is True  # 1.35x
    assert rows["prefill n4_q992_kv992 vs FA4"]["met"] is False  # 1.06x
    assert rows["prefill n8_q992_kv992 vs FA4"]["met"] is None  # a failing kernel is not a measurement
    assert rows["prefill n16_q992_kv992 vs FA4"]["met"] is None
    assert rows["decode n1_kv3232"]["met"] is True and rows["decode n64_kv2048"]["met"] is False
    assert rows["host overhead (wall - span), worst GQA case"]["met"] is False  # 22.5 us on decode n1


# ----------------------------------------------------------------------------- the kernel family (issue 10)


def test_definition_names_parse():
    d = bw.parse_definition("gqa_paged_decode_h20_kv4_d128_ps1")
    assert (d.op, d.num_qo_heads, d.num_kv_heads, d.head_dim, d.page_size, d.causal, d.is_fib) == \
        ("decode", 20, 4, 128, 1, False, True)
    d = bw.parse_definition("gqa_paged_prefill_causal_h32_kv8_d128_ps1")
    assert (d.op, d.num_qo_heads, d.num_kv_heads, d.page_size, d.causal, d.group) == ("prefill", 32, 8, 1, True, 4)
    d = bw.parse_definition("gqa_paged_decode_h20_kv4_d128_ps16")  # ours, for the page-16 target
    assert d.page_size == 16 and not d.is_fib
    d = bw.parse_definition(bw.MLA)
    assert (d.op, d.num_qo_heads, d.head_dim, d.kpe_dim, d.page_size) == ("mla", 16, 512, 64, 1)
    assert bw.parse_definition(bw.MTP_DECODE).op == "mtp"
    for name in bw.FIB_DEFINITIONS:  # every FIB name parses and spells back
        d = bw.parse_definition(name)
        if not d.op.startswith("mla"):
            assert bw.gqa_name(d.op, d.num_qo_heads, d.num_kv_heads, d.page_size, d.head_dim) == name
    assert len(bw.FIB_DEFINITIONS) == len(set(bw.FIB_DEFINITIONS)) == 43
    for bad in ("gqa_ragged_prefill", "gqa_paged_decode_h20_kv3_d128_ps1", "gqa_paged_decode_h20_kv4_d128",
                "decode", "gqa_paged_decode_h20_kv4_d128_ps1x"):
        with pytest.raises(ValueError):
            bw.parse_definition(bad)
    # The four bench kernels keep their short labels; family members get a compact one.
    assert [bw.short_name(k) for k in (bw.PREFILL, bw.DECODE, bw.MLA, bw.MTP_DECODE)] == \
        ["prefill", "decode", "mla", "mtp"]
    assert bw.short_name("gqa_paged_decode_h20_kv4_d128_ps16") == "decode:h20/kv4/ps16"


def test_fib_definition_list_matches_the_spec_folder():
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "spec",
                          "fib-definitions")
    if not os.path.isdir(folder):
        pytest.skip("no ../shared/spec/fib-definitions here")
    names = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".json"))
    assert names == sorted(bw.FIB_DEFINITIONS)


def test_family_selection():
    fam = bw.select_workloads("family")
    keys = [(w.kernel, w.label) for w in fam]
    assert len(keys) == len(set(keys))
    for ps in (1, 16, 64):
        assert (bw.gqa_name("decode", 20, 4, ps), "n64_kv2048") in keys
    assert (bw.gqa_name("decode", 20, 4, 1), "n128_kv4096") in keys
    assert (bw.gqa_name("prefill", 32, 4, 1), "n8_q992_kv992") in keys
    assert (bw.DECODE, "n64_kv2048") in keys  # the page-64 decode is the bench's own decode definition
    for name in bw.FIB_DEFINITIONS:  # every FIB GQA definition has its representative workload
        d = bw.parse_definition(name)
        if d.op == "decode":
            assert (name, "n64_kv2048") in keys, name
        elif d.op == "prefill":
            assert (name, "n8_q992_kv992") in keys, name
    for h, hk in bw.FIB_DECODE_LAYOUTS:  # and every head layout at page 1 and 64
        assert {d.page_size for k, _ in keys for d in [bw.parse_definition(k)]
                if d.op == "decode" and (d.num_qo_heads, d.num_kv_heads) == (h, hk)} >= {1, 64}
    quick = bw.select_workloads("family", quick=True)
    assert [(bw.short_name(w.kernel), w.label) for w in quick] == [
        ("decode:h20/kv4/ps1", "n64_kv2048"), ("decode:h20/kv4/ps16", "n64_kv2048"), ("decode", "n64_kv2048"),
        ("prefill:h32/kv4/ps1", "n8_q992_kv992")]
    # all stays the bench kernels' lists; several --kernel values merge without duplicates
    assert {w.kernel for w in bw.select_workloads("all")} == {bw.PREFILL, bw.DECODE, bw.MLA, bw.MTP_DECODE,
                                                              bw.MLA_DECODE, bw.MLA_DECODE_PS64}
    both = bw.select_workloads(["decode", "family"])
    assert len(both) == len({(w.kernel, w.label) for w in both}) == len(bw.select_workloads("decode")) + len(fam) - 1
    # a definition name: its listed workloads, or its representative one when none is listed
    assert [w.label for w in bw.select_workloads("gqa_paged_decode_h20_kv4_d128_ps1")] == ["n64_kv2048", "n128_kv4096"]
    (w,) = bw.select_workloads("gqa_paged_decode_h32_kv8_d128_ps16", quick=True)
    assert w.label == "n64_kv2048" and w.batch == 64 and w.definition.page_size == 16
    assert [w.label for w in bw.select_workloads("gqa_paged_multi_token_decode_h32_kv8_d128_ps1")] == \
        ["n64_q1_kv2048", "n64_q4_kv2048"]
    with pytest.raises(ValueError):
        bw.select_workloads("gqa_ragged_prefill")
    with pytest.raises(ValueError, match="MLA"):  # MLA prefill's workloads are the engine's recorded ones
        bw.select_workloads("mla_paged_prefill_causal_h16_ckv512_kpe64_ps64")


def test_family_counting_by_hand():
    w = bw.Workload("gqa_paged_decode_h5_kv1_d128_ps1", "t", (1, 1), (3, 2))
    assert bw.workload_flops(w) == 2 * 5 * 256 * 5
    act = 2 * 2 * 5 * 128 * 2 + 2 * 5 * 4
    kv = 5 * 1 * 128 * 2 * 2
    idx = (3 + 5 + 2) * 4  # kv_indptr, 5 one-key pages, last_page_len
    assert bw.workload_bytes(w) == act + kv + idx
    w16 = bw.Workload("gqa_paged_decode_h5_kv1_d128_ps16", "t", (1, 1), (3, 2))
    assert bw.workload_bytes(w) - bw.workload_bytes(w16) == 3 * 4  # 5 pages against 2


@pytest.mark.parametrize("kernel,q_lens,kv_lens", [
    ("gqa_paged_decode_h5_kv1_d128_ps1", (1, 1), (3, 70)),
    ("gqa_paged_decode_h20_kv4_d128_ps16", (1, 1), (17, 5)),
    ("gqa_paged_prefill_causal_h6_kv1_d128_ps1", (3, 5), (4, 5)),
    ("gqa_paged_prefill_causal_h16_kv2_d128_ps64", (3, 5), (70, 5)),
    ("gqa_paged_multi_token_decode_h24_kv8_d128_ps16", (2, 4), (20, 9)),
])
def test_family_case_on_cpu_has_the_definitions_shapes(kernel, q_lens, kv_lens):
    w = bw.Workload(kernel, "tiny", q_lens, kv_lens)
    d = w.definition
    case = w.build_case("cpu")
    assert tuple(case.q.shape) == (sum(q_lens), d.num_qo_heads, d.head_dim)
    assert tuple(case.k_cache.shape[1:]) == (d.page_size, d.num_kv_heads, d.head_dim) == tuple(case.v_cache.shape[1:])
    assert bp._dims(case) == dict(num_qo_heads=d.num_qo_heads, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                                  page_size=d.page_size)  # what FlashInfer's plan() is given
    pages = [bw.pages_of(n, d.page_size) for n in kv_lens]
    assert (case.kv_indptr[1:] - case.kv_indptr[:-1]).tolist() == pages
    ref = bp.reference(kernel, case)
    assert ref[0].shape == case.q.shape and bp.check(ref, ref) == (True, "")
    names = [impl for impl, setup in bp.runners_for(kernel)]  # (name, setup) pairs, ours first
    ours = len(bp.CUTE_ATTN_MODES)
    assert names[:ours] == list(bp.CUTE_ATTN_MODES) and len(names) > ours
    assert ("fa4" in names) == (d.op != "mtp")


def test_family_configs_for_the_no_gpu_path():
    import bench_no_gpu as ng

    c = ng.attention_config("gqa_paged_decode_h20_kv4_d128_ps1", "sm_90a")
    assert (c.kind, c.num_qo_heads, c.num_kv_heads, c.page_size, c.causal) == ("gqa_paged_decode", 20, 4, 1, False)
    c = ng.attention_config("gqa_paged_prefill_causal_h40_kv10_d128_ps1", "sm_90a")
    assert (c.kind, c.num_qo_heads, c.num_kv_heads, c.page_size, c.causal) == ("gqa_paged_prefill", 40, 10, 1, True)
    assert ng.attention_config(bw.DECODE, "sm_90a") == ng.attention_config("gqa_paged_decode_h20_kv4_d128_ps64",
                                                                           "sm_90a")
    quick = bw.select_workloads("family", quick=True)
    plans = [ng.plan_workload(w, "sm_90a", iters=1) for w in quick]
    assert all(p["num_items"] > 0 for p in plans)
    kernels = ng.kernels_to_compile(quick, plans, "sm_90a")
    assert [(c.kind, c.page_size) for role, c in kernels if role == "attention"] == [
        ("gqa_paged_decode", 1), ("gqa_paged_decode", 16), ("gqa_paged_decode", 64), ("gqa_paged_prefill", 1)]


def test_family_targets_from_records():
    import bench_targets

    def rec(kernel, workload, impl, gpu_us, tbps=None, passed=True):
        return dict(kernel=kernel, workload=workload, impl=impl, gpu_us=gpu_us, wall_us=gpu_us + 10, tbps=tbps,
                    passed=passed)

    ps16, ps1 = bw.gqa_name("decode", 20, 4, 16), bw.gqa_name("decode", 20, 4, 1)
    pre1 = bw.gqa_name("prefill", 32, 4, 1)
    records = [
        rec(bw.DECODE, "n64_kv2048", "cute_attn", 70.0, tbps=4.0), rec(bw.DECODE, "n64_kv2048", "flashinfer_tc", 80.0),
        rec(ps16, "n64_kv2048", "cute_attn", 75.0, tbps=3.7), rec(ps16, "n64_kv2048", "flashinfer_tc", 70.0),
        rec(ps1, "n64_kv2048", "cute_attn", 100.0, tbps=2.8), rec(ps1, "n64_kv2048", "fa4", 90.0, passed=False),
        rec(pre1, "n8_q992_kv992", "cute_attn", 100.0), rec(pre1, "n8_q992_kv992", "flashinfer_fa3", 150.0),
    ]
    rows = {r["target"]: r for r in bench_targets.target_rows(records)}
    assert rows["decode ps16 n64_kv2048 vs ps64 bandwidth"]["met"] is True  # 92%
    assert rows["decode ps1 n64_kv2048 vs ps64 bandwidth"]["met"] is False  # 70%
    assert rows["decode n64_kv2048 vs best peer"]["met"] is True  # 80 / 70
    assert rows["decode:h20/kv4/ps16 n64_kv2048 vs best peer"]["met"] is False  # 70 / 75
    assert rows["decode:h20/kv4/ps1 n64_kv2048 vs best peer"]["met"] is None  # the only peer failed its check
    assert rows["prefill:h32/kv4/ps1 n8_q992_kv992 vs best peer"]["got"] == "1.50x"
    fib = rows["FIB GQA definitions, representative vs best peer"]
    # ps16 is no FIB definition, ps1's only peer failed: 2 of the 37 measured, so the row is not measured
    assert fib["met"] is None and fib["got"] == "2/2 met" and fib["want"] == "37/37"
    rows = {r["target"]: r for r in bench_targets.target_rows(records[:2])}
    assert rows["decode ps16 n64_kv2048 vs ps64 bandwidth"]["met"] is None  # not measured
    assert rows["decode ps1 n64_kv2048 vs ps64 bandwidth"]["got"] is None


def test_cli_list_family():
    p = _run_cli("--list", "--kernel", "family", "--quick")
    assert p.returncode == 0, p.stderr
    assert "decode:h20/kv4/ps16" in p.stdout and "prefill:h32/kv4/ps1" in p.stdout
    assert len(p.stdout.strip().splitlines()) == 4
    p = _run_cli("--list", "--kernel", "gqa_paged_nonsense")
    assert p.returncode == 2 and "not a definition name" in p.stdout


def test_cold_span_targets_from_records():
    import bench_targets as bt

    def row(workload, impl, us, passed=True):
        return dict(kernel=bw.DECODE, workload=workload, impl=impl, gpu_us=us, passed=passed)

    records = [row("n1_kv3232", "cute_attn_planned", 10.3), row("n1_kv3232", "cute_attn_cold", 19.1),
               row("n64_kv2048", "cute_attn_planned", 75.3), row("n64_kv2048", "cute_attn_cold", 87.5),
               row("n16_kv2048", "cute_attn_cold", 30.0),  # no warm row: no verdict
               row("n128_kv4096", "cute_attn_planned", 250.0), row("n128_kv4096", "cute_attn_cold", 255.0, False)]
    rows = {r["target"]: r for r in bt._cold_rows(records)}
    assert set(rows) == {"decode n1_kv3232 cold - warm span", "decode n64_kv2048 cold - warm span"}
    assert rows["decode n1_kv3232 cold - warm span"]["met"] is True
    assert rows["decode n1_kv3232 cold - warm span"]["got"] == "+8.8 us"
    assert rows["decode n64_kv2048 cold - warm span"]["met"] is False
    assert any(r["target"].endswith("cold - warm span") for r in bt.target_rows(records))


def test_plan_quality_models_the_planners_costs():
    """tools/plan_quality.py: its tile costs add up to the host plan's total (a merge-free plan costs exactly its
    tiles), and on the MLA seed the serpentine deal matches LPT where the device cuts leave 21 merges."""
    import numpy as np
    import plan_quality as tool

    seed = next(w for w in bw._mla_workloads() if w.label == "n28_q1954_kv2044")
    row = tool.compare("mla_paged_prefill", seed.q_lens, seed.kv_lens)
    assert row["lpt_merges"] == 0 and row["cuts_merges"] > 0
    assert row["serpentine"] <= row["lpt"] + 0.01 < row["cuts"]
    config = tool.default_paged_config("mla_paged_prefill", arch="sm_90a", causal=True,
                                       **tool.LAYOUTS["mla_paged_prefill"]).plan_config(132)
    lpt = tool.plan_work(config, np.asarray(seed.q_lens), np.asarray(seed.kv_lens))
    assert tool.tile_costs(config, seed.q_lens, seed.kv_lens).sum() == lpt.cta_cost.sum()
    loads = tool.serpentine_loads(np.array([5, 4, 3, 2, 1]), 2)  # 5 | 4, 3 | 2, 1 dealt 0, 1, 1, 0, 0
    assert loads.tolist() == [8, 7]


def test_grid_study_plans_one_item_a_cta_longest_first():
    """tools/grid_study.py: the item-grid plan gives every CTA exactly one whole tile, in non-increasing modelled cost
    along the CTAs (the order the hardware dispatches them), and covers every causal key of every row once."""
    import numpy as np
    import grid_study as tool
    from cute_attn.config import default_paged_config
    from cute_attn.plan_executor import plan_coverage

    config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                  head_dim_v=128, page_size=64, causal=True)
    q_lens, kv_lens = [300, 1, 77, 992], [300, 9, 700, 992]
    device_plan, num_items = tool.item_grid_plan(config, q_lens, kv_lens, torch.device("cpu"))
    plan = device_plan.plan
    assert plan.num_items == num_items == plan.config.num_ctas and plan.num_merges == 0
    assert (np.diff(plan.work_indptr) == 1).all()
    assert (np.diff(plan.cta_cost) <= 0).all()
    for b, hits in enumerate(plan_coverage(plan, q_lens, kv_lens)):
        assert hits.max() == 1 and hits.sum() == sum(
            kv_lens[b] - q_lens[b] + t + 1 for t in range(q_lens[b])) * config.num_qo_heads


def test_item_cost_study_plans_n_whole_items_of_k_tiles_a_cta_and_fits_them():
    """tools/item_cost_study.py: each grid point's host plan gives all 132 CTAs exactly n whole items of k key tiles
    (no merges), and the fit recovers a known fixed and per-tile cost."""
    import numpy as np
    import item_cost_study as tool
    from cute_attn.config import default_paged_config
    from cute_attn.plan import ItemField as F
    from cute_attn.plan import plan_work

    config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=tool.HEADS,
                                  num_kv_heads=tool.KV_HEADS, head_dim_qk=128, head_dim_v=128, page_size=64,
                                  causal=True).plan_config(tool.CTAS)
    for n in (1, 4):
        for k in (1, 8):
            q_lens, kv_lens = tool.batch(n, k)
            plan = plan_work(config, np.array(q_lens), np.array(kv_lens))
            items = plan.valid_items()
            assert plan.num_merges == 0 and (np.diff(plan.work_indptr) == n).all()
            assert ((items[:, F.KV_END] - items[:, F.KV_START] + 127) // 128 == k).all()
    rows = [dict(n=n, k=k, span_us=3.0 + n * (2.0 + 1.5 * k)) for n in (1, 2, 4) for k in (1, 2, 4)]
    assert tool.fit(rows) == dict(launch_us=3.0, item_fixed_us=2.0, per_tile_us=1.5, fixed_in_tiles=1.33)


def test_compile_jobs_deal_the_workloads_over_warm_only_processes(monkeypatch):
    """``--compile-jobs N``: N processes of bench.py --warm-only, each over its share of the selected workloads
    (every workload in exactly one share), started together and all waited for."""
    started = []

    class FakeProcess:
        def __init__(self, cmd, **kw):
            started.append(cmd)
            self.waited = False

        def wait(self):
            self.waited = True

    monkeypatch.setattr(subprocess, "Popen", FakeProcess)
    workloads = bw.select_workloads("mla")
    args = bench.parse_args(["--kernel", "mla", "--compile-jobs", "3", "--impls", "cute_attn", "flashinfer_fa3"])
    bench._warm_in_parallel(workloads, args)
    assert len(started) == 3
    labels = []
    for cmd in started:
        assert "--warm-only" in cmd and cmd[cmd.index("--kernel") + 1] == bw.MLA
        labels += cmd[cmd.index("--workloads") + 1:cmd.index("--impls")]
        assert cmd[cmd.index("--impls") + 1:] == ["cute_attn", "flashinfer_fa3"]
    assert sorted(labels) == sorted(w.label for w in workloads)
    assert bench.parse_args(["--warm-only"]).warm_only and not bench.parse_args([]).compile_jobs


# ----------------------------------------------------------------------------- ncu source pages
def test_ncu_hot_blocks_groups_runs_of_equal_execution_counts(tmp_path):
    """``tools/ncu_stalls.py --blocks``: a basic block is a run of SASS lines with one execution count; blocks are
    ranked by executed instructions (count x lines), each with its stall samples and first lines."""
    import ncu_stalls

    header = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"'
    lines = [("0x10", "LDC R1", 1, 100), ("0x20", "MOV R2", 0, 100),  # a block of 2 x 100
             ("0x30", "STS.U16 [R3], RZ", 7, 1000), ("0x40", "@!P0 BRA 0x30", 3, 1000),  # a loop: 2 x 1000
             ("0x50", "EXIT", 0, 100)]  # same count as the first block, but not next to it
    text = '"Kernel Name","k"\n' + header + "\n" + "\n".join(
        f'"{a}","      {src}","{s}","{e:,}"' for a, src, s, e in lines) + "\n"
    total, blocks = ncu_stalls.hot_blocks(text, 2)
    assert total == 2300
    assert [(b["executed"], b["lines"], b["samples"]) for b in blocks] == [(1000, 2, 10), (100, 2, 1)]
    assert blocks[0]["source"] == ["STS.U16 [R3], RZ", "@!P0 BRA 0x30"] and abs(blocks[0]["share"] - 2000 / 2300) < 1e-12
    path = tmp_path / "sass.csv"
    path.write_text(text)
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "ncu_stalls.py"), "--blocks", "3", str(path)],
                         check=True, capture_output=True, text=True).stdout
    assert "2,300 warp instructions executed" in out and "87.0%" in out and "STS.U16" in out


def test_ncu_prologue_stalls_sum_the_code_before_the_first_marker(tmp_path):
    """``tools/ncu_stalls.py --prologue UTMALDG``: the stall reasons of the lines before the first TMA load, leaving out
    the main loop's lines placed there (the most-executed count), per warp from the entry line's count."""
    import ncu_stalls

    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier",'
              '"stall_wait","stall_barrier (Not Issued)"')
    lines = [("0x10", "LDC R1", 4, 10, 0, 4), ("0x20", "BAR.SYNC 0x0", 6, 10, 6, 0),  # the prologue: 10 warps
             ("0x30", "LDS R2, [R3]", 9, 80, 0, 9),  # a loop body before the marker: left out
             ("0x40", "@P0 BRA 0x30", 2, 5, 0, 2),  # half the warps
             ("0x50", "UTMALDG.4D [UR8]", 50, 80, 50, 0), ("0x60", "EXIT", 1, 10, 0, 1)]
    text = '"Kernel Name","k"\n' + header + "\n" + "\n".join(
        f'"{a}","      {src}","{s}","{e}","{b}","{w}","0"' for a, src, s, e, b, w in lines) + "\n"
    p = ncu_stalls.prologue_stalls(text, "UTMALDG")
    assert p["lines"] == 3 and p["samples"] == 12 and p["all_samples"] == 72
    assert p["instructions_per_warp"] == 2.5 and p["by_reason"] == {"wait": 6, "barrier": 6}
    path = tmp_path / "sass.csv"
    path.write_text(text)
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "ncu_stalls.py"), "--prologue", "UTMALDG", str(path)],
                         check=True, capture_output=True, text=True).stdout
    assert "3 SASS lines, 2 executed a warp, 12 of 72 stall samples (16.7%)" in out and "50.0%" in out


# ----------------------------------------------------------------------------- --policy


def test_policy_sets_a_spec_global_for_the_run():
    from cute_attn.ops import gqa_decode

    saved = gqa_decode.GATHER_WARPS_PAGE_SIZES
    try:
        applied = bench.apply_policies(["gqa_decode.GATHER_WARPS_PAGE_SIZES=(2,)"])
        assert applied == {"gqa_decode.GATHER_WARPS_PAGE_SIZES": (2,)}
        assert gqa_decode.GATHER_WARPS_PAGE_SIZES == (2,)
        tiles = gqa_decode.default_tiles("sm_90a", 20, 4, 128, 128, 1)
        assert "gather_warps" not in tiles  # page 1 is no longer listed: the one producer warp
    finally:
        gqa_decode.GATHER_WARPS_PAGE_SIZES = saved


def test_policy_sets_a_planner_global_of_config():
    from cute_attn import config

    saved = config.RANK_DEAL_MAX_Q_TILES
    try:
        assert bench.apply_policies(["config.RANK_DEAL_MAX_Q_TILES=4096"]) == {"config.RANK_DEAL_MAX_Q_TILES": 4096}
        assert config.RANK_DEAL_MAX_Q_TILES == 4096
    finally:
        config.RANK_DEAL_MAX_Q_TILES = saved


@pytest.mark.parametrize("setting, words", [
    ("GATHER_WARPS_PAGE_SIZES=(1,)", "MODULE.NAME=VALUE"),
    ("config.NO_SUCH_POLICY=1", "cute_attn.config has no NO_SUCH_POLICY"),
    ("gqa_decode.NO_SUCH_POLICY=1", "has no NO_SUCH_POLICY"),
])
def test_policy_typos_are_errors_not_a_default_run(setting, words):
    with pytest.raises(ValueError, match=words):
        bench.apply_policies([setting])
    assert bench.main(["--policy", setting, "--cpu", "--list"]) == 2


# ----------------------------------------------------------------------------- parity probes


def test_head_split_indices_give_each_half_of_the_heads_its_request_pages():
    """``tools/parity_probes.py mla-head-split``: request b becomes requests 2b and 2b+1, both over b's pages (and
    b's last-page length), so the h8 view of the queries reads each key twice and nothing else."""
    import parity_probes
    from cute_attn import testing

    case = testing.make_mla_decode_case([5, 0, 130], num_heads=16, page_size=64, device="cpu", seed=3)
    indptr, indices, last = parity_probes._head_split_indices(case)
    ptr = case.kv_indptr.tolist()
    assert indptr.tolist()[0] == 0 and len(indptr) == 2 * len(ptr) - 1
    for b in range(len(ptr) - 1):
        pages = case.kv_indices[ptr[b]:ptr[b + 1]].tolist()
        for half in (2 * b, 2 * b + 1):
            assert indices[indptr[half]:indptr[half + 1]].tolist() == pages
            assert int(last[half]) == int(case.kv_last_page_len[b])


def test_cta_timeline_reads_wrapped_stamps_from_the_earliest_release():
    """``tools/cta_timeline.py``: globaltimer_lo words wrap every 2**32 ns; times come out in us from the earliest
    release, and the last CTA to end is named with its entry and items."""
    import numpy as np

    import cta_timeline

    base = 2**32 - 1500  # the low word wraps between the stamps
    stamps = np.array([[base, base + 1000, base + 151_000, 15],
                       [base + 200, base + 1200, base + 154_000, 16],
                       [base - 50, base + 900, base + 149_000, 15]], dtype=np.int64)
    words = ((stamps + 2**31) % 2**32 - 2**31).astype(np.int32)
    got = cta_timeline.summarize(words)
    assert got["release_last"] == pytest.approx(0.3) and got["entry_first"] == pytest.approx(-0.95)
    assert got["end_last"] == pytest.approx(153.1) and got["end_first"] == pytest.approx(148.1)
    assert got["last_cta"] == 1 and got["last_cta_items"] == 16 and got["last_cta_entry"] == pytest.approx(-0.7)


def test_cta_timeline_item_times_fit_and_greedy_deal():
    """``tools/cta_timeline.py``: item times come from each CTA's release and item-end stamps; the fit recovers a
    known ``fixed + per_tile * tiles`` with the first items' extra; the greedy deal hands each position to the least
    loaded CTA."""
    import numpy as np

    import cta_timeline
    from cute_attn.kernels.sm90.gqa_prefill import CTA_STAMPS

    tiles = [np.array([8, 5, 2, 1]), np.array([7, 6, 3]), np.array([8, 4, 4, 2])]
    fixed, per_tile, fill = 1.5, 2.0, 3.0
    rows = np.zeros((3, CTA_STAMPS + 6), dtype=np.int64)
    for cta, k in enumerate(tiles):
        release = 10_000 * cta + 2**32 - 700  # wraps inside the call
        times = fixed + per_tile * k + np.where(np.arange(k.size) == 0, fill, 0.0)
        rows[cta, 1] = release
        rows[cta, CTA_STAMPS:CTA_STAMPS + k.size] = release + np.round(np.cumsum(times) * 1000).astype(np.int64)
    words = ((rows + 2**31) % 2**32 - 2**31).astype(np.int32)
    got = cta_timeline.item_times(words, np.array([k.size for k in tiles]))
    for t, k in zip(got, tiles):
        assert np.allclose(t, fixed + per_tile * k + np.where(np.arange(k.size) == 0, fill, 0.0), atol=1e-3)
    fit = cta_timeline.fit_item_cost(got, tiles)
    assert fit["fixed_us"] == pytest.approx(fixed, abs=1e-3) and fit["per_tile_us"] == pytest.approx(per_tile, abs=1e-3)
    assert fit["first_item_excess_us"] == pytest.approx(fill, abs=1e-3) and fit["items"] == 8
    tile, cta = cta_timeline.greedy_deal(np.array([3, 9, 5]), heads=2, num_ctas=3)
    assert tile.tolist() == [1, 1, 2, 2, 0, 0] and cta.tolist() == [0, 1, 2, 2, 0, 1]


def test_sweep_many_specs_parse_every_knob_value_kind():
    """``tools/sweep_many.py`` specs: bools, None and ints keep their types, any other word is a string knob value
    (``probe=compute_only``), and a spec without its four parts or a workload without ``N x Q / KV`` is refused."""
    import sweep_many

    kind, layout, workload, space = sweep_many.parse_spec(
        "mla_paged_prefill;page_size=64;16x1/4096;early_page_ids=False,None&probe=compute_only,&kv_tile=64")
    assert (kind, layout, workload) == ("mla_paged_prefill", {"page_size": 64}, (16, 1, 4096))
    assert space == {"early_page_ids": [False, None], "probe": ["compute_only", ""], "kv_tile": [64]}
    for bad, words in (("gqa_paged_decode;;8x992", "kind;layout;workload;space"), ("gqa_paged_decode;;8x;", "N x Q")):
        with pytest.raises(ValueError, match=words):
            sweep_many.parse_spec(bad)

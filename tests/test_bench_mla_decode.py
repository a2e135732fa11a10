"""CPU tier for the MLA decode rows of tools/bench.py (issue 11): workloads and the ``mla_decode`` alias, the
byte count behind TB/s, the targets, the runner registry (ours and FlashInfer's MLA wrapper, driven through
stand-ins that record what they are given) and the no-GPU path's configs. Nothing here needs a GPU."""

import os
import sys
import types

import pytest
import torch

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)

import bench_no_gpu as ng  # noqa: E402
import bench_peers as bp  # noqa: E402
import bench_targets  # noqa: E402
import bench_workloads as bw  # noqa: E402

from cute_attn import reference  # noqa: E402

LABELS = ["n1_kv4096", "n16_kv4096", "n64_kv8192", "n128_kv4096", "n64_kv1to32768"]


# ----------------------------------------------------------------------------- workloads


def test_mla_decode_alias_selects_both_page_sizes():
    wl = bw.select_workloads("mla_decode")
    assert [(w.kernel, w.label) for w in wl] == [(k, label) for k in (bw.MLA_DECODE, bw.MLA_DECODE_PS64)
                                                 for label in LABELS]
    assert [w.definition.page_size for w in wl] == [1] * 5 + [64] * 5
    for w in wl:
        assert w.definition.op == "mla_decode" and set(w.q_lens) == {1}
    by_label = {w.label: w for w in wl}
    assert (by_label["n64_kv8192"].batch, set(by_label["n64_kv8192"].kv_lens)) == (64, {8192})
    assert (by_label["n128_kv4096"].batch, set(by_label["n128_kv4096"].kv_lens)) == (128, {4096})
    quick = bw.select_workloads("mla_decode", quick=True)
    assert [(bw.short_name(w.kernel), w.label) for w in quick] == [
        ("mla_decode:h16/ps1", "n1_kv4096"), ("mla_decode:h16/ps1", "n128_kv4096"),
        ("mla_decode:h16/ps64", "n1_kv4096"), ("mla_decode:h16/ps64", "n128_kv4096")]
    assert {(w.kernel, w.label) for w in wl} <= {(w.kernel, w.label) for w in bw.all_workloads()}


def test_ragged_batch_is_deterministic_and_in_range():
    (ps1,) = bw.select_workloads(bw.MLA_DECODE, ["n64_kv1to32768"])
    (ps64,) = bw.select_workloads(bw.MLA_DECODE_PS64, ["n64_kv1to32768"])
    assert ps1.batch == 64 and ps1.kv_lens == ps64.kv_lens  # one draw, both page sizes
    assert 1 <= min(ps1.kv_lens) and max(ps1.kv_lens) <= 32768 and len(set(ps1.kv_lens)) > 32
    seed = bw.stable_seed("n64_kv1to32768")
    assert list(ps1.kv_lens) == bw.ragged_decode_lengths(64, 32768, seed)
    assert ps1.kv_lens[:3] == (18638, 19051, 8220) and sum(ps1.kv_lens) == 1042171  # crc32 seed, numpy PCG64


def test_h8_runs_through_its_definition_name():
    wl = bw.select_workloads(bw.MLA_DECODE_H8)
    assert [w.label for w in wl] == LABELS and {w.kernel for w in wl} == {bw.MLA_DECODE_H8}
    assert [w.label for w in bw.select_workloads(bw.MLA_DECODE_H8, quick=True)] == ["n1_kv4096", "n128_kv4096"]
    assert bw.MLA_DECODE_H8 not in {w.kernel for w in bw.all_workloads()}
    with pytest.raises(ValueError, match="no MLA decode definition"):
        bw.mla_decode_workloads(bw.MLA)


def test_mla_decode_bytes_and_flops_by_hand():
    w = bw.Workload(bw.MLA_DECODE_PS64, "t", (1, 1, 1), (3, 70, 0))
    q = 3 * 16 * 576 * 2
    out = 3 * 16 * 512 * 2
    lse = 3 * 16 * 4
    kv = 73 * 1152  # every key's 512 ckv + 64 kpe bf16, once per request
    idx = (4 + 3 + 3) * 4  # kv_indptr, pages 1 + 2 + 0, kv_last_page_len
    assert bw.workload_bytes(w) == q + out + lse + kv + idx == 188776
    w1 = bw.Workload(bw.MLA_DECODE, "t", (1, 1, 1), (3, 70, 0))
    assert bw.workload_bytes(w1) == q + out + lse + kv + (4 + 73) * 4  # one page per key, no last_page_len
    assert bw.workload_flops(w) == 2 * 16 * (576 + 512) * 73
    (big,) = bw.select_workloads(bw.MLA_DECODE_PS64, ["n128_kv4096"])
    assert 128 * 4096 * 1152 < bw.workload_bytes(big) < 1.01 * 128 * 4096 * 1152  # the cache is the traffic


# ----------------------------------------------------------------------------- cases and the reference


@pytest.mark.parametrize("kernel", [bw.MLA_DECODE, bw.MLA_DECODE_PS64, bw.MLA_DECODE_H8])
def test_case_has_the_decode_argument_order(kernel):
    d = bw.parse_definition(kernel)
    case = bw.Workload(kernel, "tiny", (1, 1, 1), (70, 0, 5)).build_case("cpu", seed=3)
    args = case.inputs()
    assert len(args) == (7 if d.page_size == 1 else 8)  # FIB's ps1 order has no kv_last_page_len
    assert tuple(args[0].shape) == (3, d.num_qo_heads, 512) and tuple(args[2].shape[1:]) == (d.page_size, 512)
    assert case.qo_indptr.tolist() == [0, 1, 2, 3] and case.kv_lens == [70, 0, 5]
    out, lse = bp.reference(kernel, case)
    assert bp.check((out, lse), (out, lse)) == (True, "")
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all() and torch.isfinite(lse[[0, 2]]).all()
    # one query sees every key: the same as the non-causal prefill reference
    prefill = reference.mla_paged_prefill_ref(*args[:4], case.qo_indptr, *args[4:], causal=False)
    assert torch.equal(out, prefill[0]) and torch.equal(lse, prefill[1])


def test_decode_reference_with_queries_is_bottom_right_causal():
    from cute_attn import testing

    case = testing.make_mla_prefill_case([2, 1], [5, 3], page_size=1, seed=2)
    decode_args = (*case.inputs()[:4], *case.inputs()[5:])  # drop qo_indptr: the decode order
    out, lse = reference.mla_paged_decode_ref(*decode_args, qo_indptr=case.qo_indptr)
    ref_out, ref_lse = case.reference()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    full = reference.mla_paged_prefill_ref(*case.inputs()[:4], case.qo_indptr, *case.inputs()[5:], causal=False)
    assert not torch.equal(lse[0], full[1][0])  # the first query of request 0 sees 4 of its 5 keys


# ----------------------------------------------------------------------------- runners


def test_runner_registry():
    for kernel in (bw.MLA_DECODE, bw.MLA_DECODE_PS64, bw.MLA_DECODE_H8):
        assert [impl for impl, _ in bp.runners_for(kernel)] == [*bp.CUTE_ATTN_MODES, "cute_attn_wrapper",
                                                                 "flashinfer_fa2", "flashinfer_fa3"]  # no FA4 there
    assert bp._OUR_ENTRY["mla_decode"] == ("mla_paged_decode",)


@pytest.mark.parametrize("impl", list(bp.CUTE_ATTN_MODES))
def test_ours_calls_the_decode_entry_in_the_definition_order(monkeypatch, impl):
    import cute_attn

    kernel = bw.MLA_DECODE_PS64
    case = bw.Workload(kernel, "tiny", (1, 1), (70, 5)).build_case("cpu", seed=1)
    calls = []

    def fake_decode(*args, **kw):
        calls.append((args, kw))
        out, lse = reference.mla_paged_decode_ref(*args[:8])
        args[8].copy_(out)
        args[9].copy_(lse)

    fake_decode.__name__ = "mla_paged_decode"  # the planned mode finds plan_<entry name>
    monkeypatch.setattr(cute_attn, "mla_paged_decode", fake_decode)
    monkeypatch.setattr(cute_attn, "plan_mla_paged_decode",
                        lambda *a, on_device=False: ("device plan of" if on_device else "plan of", len(a)))
    setup = dict(bp.runners_for(kernel))[impl]
    prep = setup(case)
    result = prep()
    assert bp.check(prep.normalize(result), bp.reference(kernel, case)) == (True, "")
    args, kw = calls[-1]
    assert len(args) == 10 and args[7] == case.sm_scale and args[0] is case.q_nope
    mode = bp.CUTE_ATTN_MODES[impl]
    assert kw == {"planned": dict(plan=("plan of", 8)), "device_planned": dict(plan=("device plan of", 8)),
                  "host_cold": dict(check_indices=True)}.get(mode, {})
    fresh = mode in ("cold", "host_cold")  # new index tensors every call, same values
    for i, name in ((4, "kv_indptr"), (5, "kv_indices"), (6, "kv_last_page_len")):
        assert (args[i] is not getattr(case, name)) == fresh and torch.equal(args[i], getattr(case, name))


class _FakeMlaWrapper:
    """Records FlashInfer 0.7.2's flat plan()/run() arguments; run returns the reference."""

    made = []

    def __init__(self, workspace, backend="auto"):
        self.backend, self.plan_args, self.plan_kw = backend, None, None
        _FakeMlaWrapper.made.append(self)

    def plan(self, *args, **kw):
        self.plan_args, self.plan_kw = args, kw

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        ref_out, ref_lse = self.reference
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        return out, lse


@pytest.mark.parametrize("kernel", [bw.MLA_DECODE, bw.MLA_DECODE_PS64])
def test_flashinfer_runner_plans_one_query_per_request(monkeypatch, kernel):
    fi = types.ModuleType("flashinfer")
    fi.mla = types.ModuleType("flashinfer.mla")  # no MLAPlanMetadata: the 0.7.2 flat plan(...)
    fi.mla.BatchMLAPagedAttentionWrapper = _FakeMlaWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", fi.mla)
    monkeypatch.setattr(bp, "_workspace", lambda device: torch.zeros(8, dtype=torch.uint8))
    case = bw.Workload(kernel, "tiny", (1, 1, 1), (70, 1, 129)).build_case("cpu", seed=5)
    _FakeMlaWrapper.reference = bp.reference(kernel, case)
    prep = dict(bp.runners_for(kernel))["flashinfer_fa3"](case)
    w = _FakeMlaWrapper.made[-1]
    qo, kv_indptr, kv_indices, kv_len_arr = w.plan_args
    assert w.backend == "fa3" and qo.tolist() == [0, 1, 2, 3]
    assert kv_indptr is case.kv_indptr and kv_indices is case.kv_indices
    assert kv_len_arr.dtype == torch.int32 and kv_len_arr.tolist() == [70, 1, 129]  # keys, not pages
    page_size = bw.parse_definition(kernel).page_size
    assert w.plan_kw["causal"] is False and w.plan_kw["page_size"] == page_size
    assert (w.plan_kw["num_heads"], w.plan_kw["head_dim_ckv"], w.plan_kw["head_dim_kpe"]) == (16, 512, 64)
    assert w.plan_kw["sm_scale"] == case.sm_scale
    assert bp.check(prep.normalize(prep()), _FakeMlaWrapper.reference) == (True, "")


# ----------------------------------------------------------------------------- targets


def _rec(kernel, workload, impl, gpu_us, tbps=None, passed=True):
    return dict(kernel=kernel, workload=workload, impl=impl, gpu_us=gpu_us, wall_us=gpu_us + 10, tbps=tbps,
                passed=passed)


def test_mla_decode_targets_from_records():
    ps1, ps64, h8 = bw.MLA_DECODE, bw.MLA_DECODE_PS64, bw.MLA_DECODE_H8
    records = [
        _rec(ps64, "n128_kv4096", "cute_attn", 150.0, tbps=4.0), _rec(ps64, "n128_kv4096", "flashinfer_fa3", 160.0),
        _rec(ps64, "n128_kv4096", "flashinfer_fa2", 140.0, passed=False),  # faster but wrong: not the best
        _rec(ps1, "n128_kv4096", "cute_attn", 180.0, tbps=3.4), _rec(ps1, "n128_kv4096", "flashinfer_fa2", 170.0),
        _rec(ps1, "n1_kv4096", "cute_attn", 20.0, passed=False), _rec(ps1, "n1_kv4096", "flashinfer_fa3", 25.0),
        _rec(h8, "n16_kv4096", "cute_attn", 30.0), _rec(h8, "n16_kv4096", "flashinfer_fa2", 33.0),
    ]
    rows = {r["target"]: r for r in bench_targets.target_rows(records)}
    assert rows["mla_decode:h16/ps64 n128_kv4096 vs best FlashInfer"]["got"] == "1.07x"
    assert rows["mla_decode:h16/ps64 n128_kv4096 vs best FlashInfer"]["met"] is True
    assert rows["mla_decode:h16/ps1 n128_kv4096 vs best FlashInfer"]["met"] is False  # 170 / 180
    assert rows["mla_decode:h16/ps1 n1_kv4096 vs best FlashInfer"]["met"] is None  # ours failed its check
    assert rows["mla_decode:h16/ps64 n64_kv1to32768 vs best FlashInfer"]["got"] is None
    assert rows["mla_decode:h8/ps1 n16_kv4096 vs best FlashInfer"]["met"] is True  # h8 rows when it ran
    assert rows["mla_decode:h16/ps64 n128_kv4096"] == dict(target="mla_decode:h16/ps64 n128_kv4096",
                                                           want=">= 3.9 TB/s", got="4.00 TB/s", met=True)
    assert rows["mla_decode:h16/ps1 n128_kv4096"]["want"] == ">= 3.5 TB/s"
    assert rows["mla_decode:h16/ps1 n128_kv4096"]["met"] is False
    every = rows["MLA decode h16, each workload vs best FlashInfer"]
    assert (every["want"], every["got"], every["met"]) == ("10/10", "1/2 met", None)
    rows = {r["target"]: r for r in bench_targets.target_rows([])}  # reported even when nothing ran
    assert rows["mla_decode:h16/ps64 n128_kv4096"]["met"] is None
    assert not any(t.startswith("mla_decode:h8") for t in rows)


def test_mla_decode_every_workload_row_is_met_when_all_beat_flashinfer():
    records = [r for k in bw.KERNEL_GROUPS["mla_decode"] for label in LABELS
               for r in (_rec(k, label, "cute_attn", 10.0), _rec(k, label, "flashinfer_fa2", 10.5))]
    rows = {r["target"]: r for r in bench_targets.target_rows(records)}
    assert rows["MLA decode h16, each workload vs best FlashInfer"]["met"] is True
    records[-1]["gpu_us"] = 9.0  # one workload lost
    rows = {r["target"]: r for r in bench_targets.target_rows(records)}
    assert rows["MLA decode h16, each workload vs best FlashInfer"]["got"] == "9/10 met"
    assert rows["MLA decode h16, each workload vs best FlashInfer"]["met"] is False


# ----------------------------------------------------------------------------- the no-GPU path


def test_no_gpu_configs_are_the_kernels_the_decode_entry_launches():
    for kernel, page_size, heads in ((bw.MLA_DECODE, 1, 16), (bw.MLA_DECODE_PS64, 64, 16), (bw.MLA_DECODE_H8, 1, 8)):
        c = ng.attention_config(kernel, "sm_90a")
        # the MLA prefill kind, bottom-right causal, as cute_attn.mla_paged_decode builds it
        assert (c.kind, c.num_qo_heads, c.head_dim_qk, c.head_dim_v, c.page_size, c.causal) == \
            ("mla_paged_prefill", heads, 576, 512, page_size, True)
    assert ng.attention_config(bw.MLA_DECODE, "sm_90a") == ng.attention_config(bw.MLA, "sm_90a")
    quick = bw.select_workloads("mla_decode", quick=True)
    plans = [ng.plan_workload(w, "sm_90a", iters=1) for w in quick]
    assert [(p["workload"], p["num_merges"] > 0) for p in plans] == [
        ("n1_kv4096", True), ("n128_kv4096", False), ("n1_kv4096", True), ("n128_kv4096", False)]
    kernels = ng.kernels_to_compile(quick, plans, "sm_90a")
    # with a workload, the decode entry's own config: one query a request, the 16 heads as the MMA's N
    assert [(role, getattr(c, "page_size", None), c.tile_q_rows) for role, c in kernels] == [
        ("attention", 1, 16), ("combine", None, 16), ("attention", 64, 16)]  # a split batch needs the combine
    from cute_attn.compile import registered_configs

    assert {c for _, c in kernels} <= set(registered_configs("sm_90a"))  # compile_all builds the same ones


def test_the_wrapper_row_runs_our_flashinfer_wrapper_planned_once(monkeypatch):
    """``cute_attn_wrapper``: cute_attn.flashinfer's MLA wrapper set up as FlashInfer's rows are (one plan, timed
    runs), on a one-query batch: the decode kernel's spec, with the plan the first run made (planner and entry stood
    in)."""
    import types

    import cute_attn

    kernel = bw.MLA_DECODE_PS64
    case = bw.Workload(kernel, "tiny", (1, 1), (70, 5)).build_case("cpu", seed=1)
    calls, plans = [], []
    monkeypatch.setattr(cute_attn.api, "plan_for",
                        lambda spec, args, **kw: plans.append(spec) or types.SimpleNamespace())
    monkeypatch.setattr(cute_attn.ops.mla_prefill, "run_mla",
                        lambda *args, spec=None: calls.append(dict(plan=args[11], spec=spec)) or (args[9], args[10]))
    setup = dict(bp.runners_for(kernel))["cute_attn_wrapper"]
    prepared = setup(case)
    prepared()
    prepared()
    from cute_attn.ops import mla_decode

    assert len(plans) == 1 and len(calls) == 2 and calls[0]["plan"] is calls[1]["plan"]
    assert plans[0] is calls[0]["spec"] is mla_decode.ONE_TOKEN_SPEC

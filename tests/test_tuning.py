"""cute_attn.tuning on CPU: refusals with their reasons, smoke rows (compile seconds, plan balance), the
config line's round trip, and the GPU half's check/timing logic driven by stand-in launchers on CPU
tensors. The last test sweeps for real on a GPU (gpu marker)."""

import dataclasses
import os
import sys

import pytest
import torch

from cute_attn import timing, tuning
from cute_attn.compile import CACHE_DIR_ENV, clear_memory_cache, registered_configs
from cute_attn.config import PAGED_KINDS, PagedAttentionConfig, default_paged_config
from cute_attn.plan import plan_work

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import bench_workloads as bw  # noqa: E402

ARCH = "sm_90a"
DECODE = "gqa_paged_decode"
SMOKE_SPACE = {"min_chunk_keys": [0, 256], "tile_q_rows": [64, 128]}  # 2 compiles, 2 kernel refusals


def decode_default(**knobs):
    layout = tuning.DEFINITION_LAYOUTS[DECODE]
    base = default_paged_config(DECODE, arch=ARCH, causal=False, **layout)
    return dataclasses.replace(base, **knobs)


@pytest.fixture(scope="module")
def smoke_rows(module_compile_cache):
    """One smoke sweep for the module (each variant compiles once, from an empty cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, str(module_compile_cache))
        clear_memory_cache()
        try:
            yield tuning.sweep(DECODE, tuning.Workload.for_kind(DECODE, [3232]), SMOKE_SPACE, arch=ARCH,
                               num_sms=132, smoke=True)
        finally:
            clear_memory_cache()


def test_smoke_rows_report_refusals_with_the_kernels_reason(smoke_rows):
    assert [r.knobs for r in smoke_rows] == [dict(min_chunk_keys=m, tile_q_rows=t) for m in (0, 256) for t in (64, 128)]
    refused = [r for r in smoke_rows if r.status == "refused"]
    assert [r.knobs["tile_q_rows"] for r in refused] == [128, 128]
    for r in refused:  # the kind's shape rules accept tile_q_rows=128; the sm_90a decode kernel's rules do not
        assert r.config.shape_reason() is None and r.config.can_implement() == r.reason
        assert "tile_q_rows=128" in r.reason and r.compile_s is None and r.items is None


def test_smoke_rows_have_compile_times_and_the_variants_own_plan(smoke_rows):
    ran = [r for r in smoke_rows if r.status == "ok"]
    assert len(ran) == 2
    for r in ran:
        assert r.compile_source == "compiled" and r.compile_s > 0  # the module's cache started empty
        assert r.time_us is None and r.passed is None  # smoke mode: nothing launched
        plan = plan_work(r.config.plan_config(132), [1], [3232])
        assert (r.items, r.splits, r.partials, r.busy_ctas) == \
               (plan.num_items, plan.num_merges, plan.num_partials, plan.num_ctas)
        assert r.cta_cost_max == plan.cta_cost.max() and r.balance == pytest.approx(plan.cta_cost.max() /
                                                                                     plan.cta_cost.mean())
    no_min, min_256 = ran
    # the knob reached the planner: 256-key chunks cut the 3232 keys into fewer, longer items
    assert min_256.items < no_min.items and min_256.balance > no_min.balance
    assert [r.is_default for r in ran] == [False, True]  # min_chunk_keys=256 is today's default
    dicts = smoke_rows.to_dicts()
    assert dicts[0]["min_chunk_keys"] == 0 and dicts[0]["status"] == "ok" and dicts[0]["time_us"] is None
    assert "refused" in smoke_rows.table() and smoke_rows.config_line() is None  # nothing timed: no choice


def test_can_implement_refusal_needs_no_compile(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    rows = tuning.sweep(DECODE, tuning.Workload.for_kind(DECODE, [64]), {"kv_tile": [512]}, arch=ARCH, smoke=True)
    (row,) = rows
    assert row.status == "refused" and "kv_tile=512" in row.reason
    assert not list(tmp_path.rglob("*.o"))


def test_a_misspelt_or_problem_field_is_not_a_knob():
    wl = tuning.Workload.for_kind(DECODE, [64])
    with pytest.raises(ValueError, match="not tuning knobs"):
        tuning.sweep(DECODE, wl, {"tile_rows": [64]}, arch=ARCH, smoke=True)
    with pytest.raises(ValueError, match="not tuning knobs"):
        tuning.sweep(DECODE, wl, {"page_size": [16]}, arch=ARCH, smoke=True)  # the problem, not a knob
    with pytest.raises(ValueError, match="non-empty list"):
        tuning.sweep(DECODE, wl, {"kv_tile": 64}, arch=ARCH, smoke=True)
    assert "page_size" not in tuning.TUNING_KNOBS and {"min_chunk_keys", "ctas_per_sm"} <= set(tuning.TUNING_KNOBS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_timing_without_a_gpu_is_refused():
    with pytest.raises(RuntimeError, match="smoke=True"):
        tuning.sweep(DECODE, tuning.Workload.for_kind(DECODE, [64]), {}, arch=ARCH, smoke=False)


@pytest.mark.parametrize("knobs", [{}, dict(min_chunk_keys=512, ctas_per_sm=2)])
def test_config_line_round_trips(knobs):
    config = decode_default(**knobs)
    line = tuning.config_line(config, note="sm_90a n1_kv3232: 10.3 us")
    entry = eval("{" + line + "\n}")  # as pasted into default_paged_config's table
    assert list(entry) == [DECODE]
    assert dataclasses.replace(decode_default(), **entry[DECODE]) == config
    if knobs:
        assert dataclasses.replace(decode_default(), **entry[DECODE]) != decode_default()


def test_prefill_config_line_round_trips_its_flags():
    layout = tuning.DEFINITION_LAYOUTS["gqa_paged_prefill"]
    base = default_paged_config("gqa_paged_prefill", arch=ARCH, causal=True, **layout)
    config = dataclasses.replace(base, intra_wg_overlap=not base.intra_wg_overlap, kv_tile=64)
    entry = eval("{" + tuning.config_line(config) + "\n}")["gqa_paged_prefill"]
    assert dataclasses.replace(base, **entry) == config


def test_best_is_the_fastest_passing_timed_variant(capsys):
    wl = tuning.Workload.for_kind(DECODE, [3232])

    def row(time_us, status="ok", **knobs):
        return tuning.VariantResult(knobs=knobs, config=decode_default(**knobs), status=status, time_us=time_us,
                                    passed=status == "ok", is_default=not knobs)

    rows = tuning.Sweep([row(12.0), row(9.0, status="wrong", ctas_per_sm=2), row(10.5, min_chunk_keys=128),
                         row(None, min_chunk_keys=512)], kind=DECODE, workload=wl, arch=ARCH, num_sms=132,
                        smoke=False)
    assert rows.best().knobs == {"min_chunk_keys": 128}  # the wrong one was faster: it must never win
    line = rows.print_config_line()
    assert capsys.readouterr().out.strip() == line
    assert "min_chunk_keys=128" in line and "10.5 us" in line and "default knobs 12.0" in line
    assert dataclasses.replace(decode_default(), **eval("{" + line + "\n}")[DECODE]) == rows.best().config


def test_every_registered_kernel_config_is_implementable():
    """Refusals come from can_implement, which asks the kernel registered for (kind, arch)."""
    configs = [c for arch in (ARCH, "sm_100a") for c in registered_configs(arch) if isinstance(c, PagedAttentionConfig)]
    assert {(c.kind, c.arch) for c in configs} == {(k, a) for k in PAGED_KINDS for a in (ARCH, "sm_100a")}
    for config in configs:
        assert config.can_implement() is None, config

def test_workloads_from_the_bench_keep_lengths_and_labels():
    for w in bw.all_workloads():
        t = tuning.Workload.from_bench(w)
        assert (t.q_lens, t.kv_lens, t.label) == (w.q_lens, w.kv_lens, w.label)
    decode = tuning.Workload.for_kind(DECODE, [2048] * 16)
    assert decode.label == "n16_kv2048" and decode.q_lens == (1,) * 16 and decode.num_qo_heads == 20
    with pytest.raises(ValueError, match="one query per request"):
        tuning.Workload.for_kind(DECODE, [64], q_lens=[2])
    with pytest.raises(ValueError, match="needs q_lens"):
        tuning.Workload.for_kind("gqa_paged_prefill", [64])


def test_cold_l2_timer_refuses_a_short_median():
    with pytest.raises(ValueError, match="fewer than 50"):
        timing.ColdL2Timer(iters=10)
    assert timing.ColdL2Timer().iters >= timing.MIN_ITERS == 50


# --------------------------------------------------------------------------------------------- GPU half, on CPU
def _bench_on_cpu(monkeypatch, launcher, timer):
    """The GPU half of a sweep with CPU tensors and a stand-in for the kernel's launcher."""
    import cute_attn.kernels

    monkeypatch.setattr(cute_attn.kernels, "find_launcher", lambda config: launcher)
    wl = tuning.Workload.for_kind(DECODE, [70, 5, 130])
    bench = tuning._GpuBench(DECODE, wl, check=True, timer=timer, device="cpu")
    config = decode_default()
    row = tuning.VariantResult(knobs={}, config=config)
    plan = plan_work(config.plan_config(132), wl.q_lens, wl.kv_lens)
    bench.run(row, plan)
    return row


def _writes_reference(shift=0.0, counter=0):
    def launch(device_plan, *args):
        *inputs, out, lse = args
        ref_out, ref_lse = tuning.Workload.for_kind(DECODE, [70, 5, 130]).build_case(DECODE, "cpu").reference()
        out.copy_(ref_out + shift)
        lse.copy_(ref_lse)
        device_plan.merge_counters[0] = counter

    return launch


def test_a_correct_variant_is_timed(monkeypatch):
    calls = []
    row = _bench_on_cpu(monkeypatch, _writes_reference(),
                        lambda run: calls.append(run()) or timing.Timing(7.5, 7.0, 11.0, 1, "ok"))
    assert (row.status, row.passed, row.time_us, row.wall_us, row.n_kernels) == ("ok", True, 7.5, 11.0, 1)
    assert len(calls) == 1  # the timer got the launch itself


def test_a_timer_without_cupti_falls_back_to_wall_time(monkeypatch):
    row = _bench_on_cpu(monkeypatch, _writes_reference(),
                        lambda run: timing.Timing(None, None, 11.0, None, "no_cupti:RuntimeError"))
    assert row.time_us == 11.0 and row.timing_status.startswith("no_cupti")


@pytest.mark.parametrize("launcher,why", [(_writes_reference(shift=0.5), "output:"),
                                          (_writes_reference(counter=1), "merge counters")])
def test_a_wrong_variant_is_reported_and_never_timed(monkeypatch, launcher, why):
    def timer(run):
        raise AssertionError("a wrong variant must not be timed")

    row = _bench_on_cpu(monkeypatch, launcher, timer)
    assert row.status == "wrong" and row.passed is False and row.time_us is None and why in row.reason


def test_a_crashing_launch_is_an_error_row(monkeypatch):
    def launcher(*args):
        raise RuntimeError("illegal address")

    row = _bench_on_cpu(monkeypatch, launcher, lambda run: 1.0)
    assert row.status == "error" and "illegal address" in row.reason and row.time_us is None


# --------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_sweep_on_the_gpu_checks_and_times_each_variant(isolated_compile_cache, capsys):
    wl = tuning.Workload.for_kind(DECODE, [3232])
    rows = tuning.sweep(DECODE, wl, {"min_chunk_keys": [0, 256], "tile_q_rows": [64, 128]})
    assert [r.status for r in rows] == ["ok", "refused", "ok", "refused"], rows.table()
    for r in rows[::2]:
        assert r.passed is True and r.time_us > 0 and r.n_kernels == 1 and r.timing_status == "ok"
    line = rows.print_config_line()
    assert line is not None and capsys.readouterr().out.strip() == line


@pytest.mark.parametrize("kind", ["gqa_paged_decode", "gqa_paged_prefill", "mla_paged_prefill"])
def test_a_workload_case_has_the_workloads_page_size(kind):
    # the MLA case once ignored page_size: a page-64 sweep then called a page-64 kernel on page-1 caches
    workload = tuning.Workload.for_kind(kind, [70, 5], None if kind == "gqa_paged_decode" else [3, 5],
                                        page_size=16)
    case = workload.build_case(kind, "cpu")
    cache = case.ckv_cache if kind == "mla_paged_prefill" else case.k_cache
    assert cache.shape[1] == 16

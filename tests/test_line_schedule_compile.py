"""The planner-free decode's ``line_schedule`` build on the CPU: which configs build it, when the default call takes it,
its scratch, and its PTX (compiled for sm_90a here; the GPU tiers ran it on the H200 in session 39)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_attn import validate
from cute_attn.compile import compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels.common.line_schedule import MAX_LINE_REQUESTS, table_bytes, table_requests
from cute_attn.kernels.sm90 import gqa_decode as kernel
from cute_attn.ops import gqa_decode
from cute_attn.ops import policy as cute_attn_policy

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


def _config(heads=20, kv_heads=4, page_size=64, head_dim=128, arch="sm_90a", kind="gqa_paged_decode"):
    return default_paged_config(kind, arch=arch, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim_qk=head_dim,
                                head_dim_v=head_dim, page_size=page_size, causal=kind != "gqa_paged_decode")


def _line(config):
    return dataclasses.replace(config, line_schedule=True)


def _problem(batch, heads=20, kv_heads=4, page_size=64):
    return validate.PagedProblem.for_lengths([1] * batch, [100] * batch, num_qo_heads=heads, num_kv_heads=kv_heads,
                                             head_dim_qk=128, head_dim_v=128, page_size=page_size)


def test_the_decode_kernels_build_it():
    assert _line(_config()).can_implement() is None
    assert _line(_config(arch="sm_100a")).can_implement() is None
    for config, words in ((_config(kind="gqa_paged_prefill", heads=32), "line_schedule"),
                          (_config(kind="gqa_paged_multi_token_decode"), "decode")):
        reason = _line(config).can_implement()
        assert reason is not None and "line_schedule" in reason and words in reason, reason


@pytest.mark.parametrize("page_size", [1, 2])
def test_row_gathers_build_it(page_size):
    """Pages 1 and 2 gather rows (a producer warpgroup), which zero-fill a row whose id is outside the pool
    (``row_gather``'s own check: no plan vetted the ids); the table is sized for the warpgroup's 384 threads."""
    config = _line(_config(page_size=page_size))
    assert config.can_implement() is None and config.gather_warps == 4
    assert kernel.line_table_requests(config) > 0
    ptx = compile_to_ptx(config)
    assert "_Line" in ptx and "cp.async.cg.shared.global" in ptx and "wgmma.mma_async" in ptx
    assert not re.search(r"\.local\b", ptx)
    assert "prefetch.global.L2" not in ptx  # the config's own scan: one id a pass (the default call: line_scan_ids)


def test_configs_whose_device_plan_differs_are_refused():
    """A line build makes the device plan of its config under the landed plan policies (the line deal from 8 KV heads
    included): refused while a policy says otherwise, rather than cutting unlike the device planner."""
    from cute_attn.config import even_pieces_policy

    assert _line(_config(32, 8)).can_implement() is None
    with even_pieces_policy(False):
        reason = _line(_config()).can_implement()
        assert reason is not None and "even_pieces" in reason, reason
    with gqa_decode.line_deal_policy((64,)):
        reason = _line(_config()).can_implement()
        assert reason is not None and "line_deal" in reason, reason
    assert _line(_config()).can_implement() is None


@pytest.mark.parametrize("enabled", [False, True])
def test_the_policy_takes_it_where_the_plan_takes_no_deal(enabled):
    """On: the seed's h20/kv4 page 64, page 16, page 1 (row gathers), and from 8 KV heads (the line deal); never on
    sm_100a, nor past the table or the threads. Off: never."""
    with gqa_decode.line_schedule_policy(enabled):
        assert gqa_decode.self_schedule(_config(), _problem(64), 132) is enabled
        assert gqa_decode.self_schedule(_config(page_size=16), _problem(64, page_size=16), 132) is enabled
        assert gqa_decode.self_schedule(_config(32, 8), _problem(64, 32, 8), 132) is enabled
        assert gqa_decode.self_schedule(_config(page_size=1), _problem(64, page_size=1), 132) is enabled
        assert gqa_decode.self_schedule(_config(arch="sm_100a"), _problem(64), 148) is False  # never run there
        fits = kernel.line_table_requests(_line(_config()))
        assert gqa_decode.self_schedule(_config(), _problem(fits), 132) is enabled
        assert gqa_decode.self_schedule(_config(), _problem(fits + 1), 132) is False
        assert gqa_decode.self_schedule(_config(), _problem(64), 288) is False  # 289 edges, 288 threads
        from cute_attn.kernels.sm100 import decode_config  # the sm_100a twin's own table and threads, when taken
        with cute_attn_policy(vars(gqa_decode), LINE_SCHEDULE_ARCHS=("sm_90a", "sm_100a")):
            sm100 = _config(arch="sm_100a")
            held, threads = decode_config.line_capacity(_line(sm100))
            assert threads == 192 and held < fits
            assert gqa_decode.self_schedule(sm100, _problem(held), 148) is enabled
            assert gqa_decode.self_schedule(sm100, _problem(held + 1), 148) is False
            assert gqa_decode.self_schedule(sm100, _problem(64), 192) is False


def test_the_default_call_builds_the_line_config():
    from cute_attn import api

    config = api._self_schedule_config(gqa_decode.SPEC, _config())
    assert config.line_schedule and not config.dynamic_schedule and not config.late_claim


def test_the_table_fits_the_k_ring():
    config = _line(_config())
    ring = kernel.num_stages(config) * config.kv_tile * config.head_dim_qk * 2
    requests = kernel.line_table_requests(config)
    assert 0 < requests <= MAX_LINE_REQUESTS
    assert table_bytes(kernel.NUM_CONSUMER_THREADS + 32, requests) <= ring
    assert table_requests(288, table_bytes(288, 0) + 12 * 5) == 5


def test_the_scratch_holds_every_merge_and_slot():
    """At most num_ctas - 1 merges of 2 (num_ctas - 1) partials (``plan_partition``'s bound)."""
    from cute_attn.unit_schedule_route import UnitScratch

    config = _line(_config())
    scratch = UnitScratch.allocate(64, "cpu", config, 132)
    assert scratch.merge_counters.shape == (132,) and not scratch.merge_counters.any()
    assert scratch.partial_out.shape == (264, config.tile_q_rows, 128) and scratch.partial_lse.shape == (264, 64)
    assert UnitScratch.allocate(64, "cpu").merge_counters is None


@pytest.mark.parametrize("heads, kv_heads, page_size", [(20, 4, 64), (20, 4, 16), (20, 4, 128), (32, 8, 64)])
def test_compiles_with_wgmma_tma_and_the_fold(heads, kv_heads, page_size):
    """The seed's page 64 (one box a stage), page 16 (four boxes a stage), 128, and h32/kv8 (the line deal's vote):
    wgmma, TMA boxes, the in-kernel fold's atomics and fences, the count-out, no local memory (the stretch stays in
    registers)."""
    ptx = compile_to_ptx(_line(_config(heads, kv_heads, page_size=page_size)))
    assert ".target sm_90a" in ptx and "_Line" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert len(re.findall(r"\batom\.(?:\w+\.)*add", ptx)) >= 2  # merge arrivals and the count-out
    assert "fence.acq_rel.gpu" in ptx
    assert "fence.proxy.async" in ptx  # generic smem writes fenced before TMA (the table's, zero_v_tail's)
    assert "griddepcontrol.wait" in ptx
    assert not re.search(r"\.local\b", ptx)


# ----------------------------------------------------------------------------------------------------- MLA decode
def _mla(page_size=1, heads=16, arch="sm_90a"):
    from cute_attn.ops.mla_decode import ONE_TOKEN_SPEC

    return default_paged_config("mla_paged_prefill", arch=arch, num_qo_heads=heads, num_kv_heads=1,
                                head_dim_qk=576, head_dim_v=512, page_size=page_size, causal=True,
                                spec=ONE_TOKEN_SPEC)


def test_the_mla_decode_kernel_builds_it_one_token_a_tile():
    """The swapped one-token kernel builds it (its merges folded in the kernel); the 64-row prefill kernel, cluster
    folds and the units' build do not."""
    assert _line(_mla()).can_implement() is None
    prefill = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                   head_dim_qk=576, head_dim_v=512, page_size=1, causal=True)
    for config, words in ((prefill, "tile_q_rows"), (dataclasses.replace(_mla(), cluster_merge=2), "cluster_merge"),
                          (dataclasses.replace(_mla(), fused_merge=True), "fused_merge"),
                          (dataclasses.replace(_mla(), bf16_partials=True), "bf16_partials")):
        reason = _line(config).can_implement()
        assert reason is not None and words in reason, reason


@pytest.mark.parametrize("enabled", [False, True])
def test_the_mla_policy_takes_it_for_one_token_batches(enabled):
    from cute_attn.kernels.sm90 import mla_prefill as mla_kernel
    from cute_attn.ops import mla_decode

    def problem(batch):
        return validate.PagedProblem.for_lengths([1] * batch, [100] * batch, num_qo_heads=16, num_kv_heads=1,
                                                 head_dim_qk=576, head_dim_v=512, page_size=1)

    with mla_decode.line_schedule_policy(enabled):
        assert mla_decode.line_schedule(_mla(), problem(64), 132) is enabled
        fits = mla_kernel.line_table_requests(_line(_mla()))
        assert mla_decode.line_schedule(_mla(), problem(fits + 1), 132) is False
        assert mla_decode.line_schedule(_mla(), problem(64), mla_kernel.NUM_THREADS) is False


@pytest.mark.parametrize("page_size", [1, 64])
def test_the_mla_build_compiles_with_its_fold(page_size):
    """Pages 1 (cp.async rows) and 64 (TMA boxes): the swapped kernel's wgmma, the wide fold's arrivals and the
    count-out, no local memory."""
    ptx = compile_to_ptx(_line(_mla(page_size)))
    assert ".target sm_90a" in ptx and "_Line" in ptx and "wgmma.mma_async" in ptx
    assert ("cp.async.cg.shared.global" if page_size == 1 else "cp.async.bulk.tensor") in ptx
    assert len(re.findall(r"\batom\.(?:\w+\.)*add", ptx)) >= 2 and "fence.acq_rel.gpu" in ptx
    assert not re.search(r"\.local\b", ptx)
    assert "prefetch.global.L2" not in ptx  # the config's own scan: one id a pass (the default call: line_scan_ids)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_the_batched_scan_builds_and_the_policy_sets_it(kind):
    """``scan_ids_per_thread`` 8 (``config.line_scan_ids``, session 41): the page-1 line builds compile with the
    CTA's later chunks prefetched to L2, eight id loads a pass issued before any check, and no local memory; the knob
    is refused off the line builds and at a count that is not a power of two up to 16; the default call's route takes
    8 from 512 page ids a CTA (``len(kv_indices)``, a shape), else 1, and the override inside ``line_scan_policy``."""
    from cute_attn import api
    from cute_attn.config import LINE_SCAN_IDS_PER_THREAD, line_scan_ids, line_scan_policy
    from cute_attn.ops import mla_decode

    config, spec = (_config(page_size=1), gqa_decode.SPEC) if kind == "gqa" else (_mla(1), mla_decode.ONE_TOKEN_SPEC)
    batched = dataclasses.replace(_line(config), scan_ids_per_thread=8)
    assert batched.can_implement() is None
    ptx = compile_to_ptx(batched)
    assert "_Line" in ptx and "prefetch.global.L2" in ptx and not re.search(r"\.local\b", ptx)
    for bad in (dataclasses.replace(_line(config), scan_ids_per_thread=3),
                dataclasses.replace(config, scan_ids_per_thread=8)):
        reason = bad.can_implement()
        assert reason is not None and "scan_ids_per_thread" in reason, reason
    assert LINE_SCAN_IDS_PER_THREAD is None
    assert (line_scan_ids(512 * 132, 132), line_scan_ids(512 * 132 - 1, 132), line_scan_ids(0, 132)) == (8, 1, 1)
    heads = dict(num_qo_heads=20, num_kv_heads=4, head_dim_qk=128, head_dim_v=128) if kind == "gqa" else dict(
        num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_v=512)

    def scan_ids(batch, keys, page_size, cfg=config):
        problem = validate.PagedProblem.for_lengths([1] * batch, [keys] * batch, page_size=page_size, **heads)
        return api._self_schedule_config(spec, cfg, problem, 132).scan_ids_per_thread

    page_64 = _config(page_size=64) if kind == "gqa" else _mla(64)
    # 64 x 2048 at page 1: 993 ids a CTA (measured -0.6 us at 8); 16 x 4096: 496 (+0.1); 128 x 4096 page 64: 62 (+0.7)
    assert (scan_ids(64, 2048, 1), scan_ids(16, 4096, 1), scan_ids(128, 4096, 64, page_64)) == (8, 1, 1)
    assert api._self_schedule_config(spec, config).scan_ids_per_thread == 1  # no problem: no ids known
    with line_scan_policy(1):
        assert scan_ids(64, 2048, 1) == 1
    with line_scan_policy(8):
        assert scan_ids(128, 4096, 64, page_64) == 8


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_the_entries_checks_give_the_scan_rule_its_ids(kind):
    """The shape the batched-scan rule reads (``problem.num_kv_slots // page_size``: ``len(kv_indices)``) is what
    each decode entry's own check reports, so the default call's rule sees the batch it launches on (zero would keep
    every batch at one id a pass)."""
    from cute_attn import testing
    from cute_attn.ops import mla_decode

    if kind == "gqa":
        case = testing.make_gqa_decode_case([130, 0, 70], page_size=16)
        problem, _ = gqa_decode.SPEC.check(*case.inputs(), check_indices=False)
    else:  # the one-token spec is the prefill's, with qo_indptr (the entry adds it)
        case = testing.make_mla_decode_case([130, 0, 70], num_heads=16)
        problem, _ = mla_decode.ONE_TOKEN_SPEC.check(*testing.MlaPrefillCase.inputs(case), check_indices=False)
    assert problem.num_kv_slots // problem.page_size == case.kv_indices.shape[0] > 0


def test_the_mla_scratch_holds_512_column_partials():
    from cute_attn.unit_schedule_route import UnitScratch

    scratch = UnitScratch.allocate(64, "cpu", _line(_mla()), 132)
    assert scratch.partial_out.shape == (264, 16, 512) and scratch.merge_counters.shape == (132,)


@pytest.mark.parametrize("heads, kv_heads, page_size", [(20, 4, 64), (32, 8, 64), (20, 4, 1), (20, 4, 8)])
def test_the_sm100_twin_compiles(heads, kv_heads, page_size):
    """The sm_100a twin (compiled only: no Blackwell GPU here): the same prologue and fold around the tcgen05 roles,
    items read through the stretch (``LineStretch[it, field]``); page 1 by TMA gather4, page 8 by page boxes."""
    ptx = compile_to_ptx(_line(_config(heads, kv_heads, page_size=page_size, arch="sm_100a")))
    assert ".target sm_100a" in ptx and "_Line" in ptx and "tcgen05.mma" in ptx and "cp.async.bulk.tensor" in ptx
    assert len(re.findall(r"\batom\.(?:\w+\.)*add", ptx)) >= 2 and "fence.acq_rel.gpu" in ptx
    assert not re.search(r"\.local\b", ptx)


@pytest.mark.parametrize("heads, page_size", [(16, 1), (16, 64), (8, 1)])
def test_the_sm100_mla_twin_compiles(heads, page_size):
    """The sm_100a MLA twin (the one-token decode's 64-row tile; compiled only): the same prologue, items read through
    the stretch by every role, K stages by TMA gather4, the wide fold's arrivals and the count-out; it refuses what
    the sm_90a build refuses."""
    config = _line(_mla(page_size, heads, arch="sm_100a"))
    assert config.tile_q_rows == 64 and config.can_implement() is None
    ptx = compile_to_ptx(config)
    assert ".target sm_100a" in ptx and "MlaPagedPrefillSm100" in ptx and "_Line" in ptx and "tcgen05.mma" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4" in ptx
    assert len(re.findall(r"\batom\.(?:\w+\.)*add", ptx)) >= 2 and "fence.acq_rel.gpu" in ptx
    assert not re.search(r"\.local\b", ptx)
    for knob in ("fused_merge", "bf16_partials"):
        reason = dataclasses.replace(config, **{knob: True}).can_implement()
        assert reason is not None and knob in reason, reason


def test_with_the_policy_off_no_config_is_made_for_the_route_question():
    """``api.self_schedules`` (asked by the FlashInfer-compatible wrappers once per batch) answers False from the
    policy alone while it is off: no rules run, no config is made (CPU inputs would be refused if they were). The
    wrappers ask with ``reused=True``, which the decode kinds answer False with the policy on as well: their line
    builds derive the work at every call, so one plan a step serves the layers for less."""
    from cute_attn import api, testing
    from cute_attn.ops import mla_decode

    gqa = testing.make_gqa_decode_case([70, 5])
    mla = testing.make_mla_decode_case([70, 5])
    mla_args = (*mla.inputs()[:4], mla.qo_indptr, *mla.inputs()[4:])
    for spec, args, policy in ((gqa_decode.SPEC, gqa.inputs(), gqa_decode.line_schedule_policy),
                               (mla_decode.ONE_TOKEN_SPEC, mla_args, mla_decode.line_schedule_policy)):
        with policy(False):
            assert api.self_schedules(spec, args) is False
        with policy(True), pytest.raises(ValueError, match="CUDA"):
            api.self_schedules(spec, args)
        with policy(True):  # a batch run once a layer (the wrappers) keeps its plan: answered before any rule runs
            assert spec.self_schedule_when_reused is False
            assert api.self_schedules(spec, args, reused=True) is False


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_the_default_call_launches_the_line_build_with_its_entrys_arguments(monkeypatch, kind):
    """With the policy on, a default call (no plan) resolves the line build's route and calls the compiled entry
    with ``call_line``'s arguments in its order: the call's index tensors, the stream's scratch (merge counters,
    marks, state, partials of ``2 * num_ctas`` slots), the outputs, the scales, the pool and the grid (the compiled
    kernel and CUDA stood in: this checks the host side the GPU tier cannot isolate)."""
    import inspect
    import math

    import cute_attn
    from cute_attn import api, testing, unit_schedule_route
    from cute_attn.kernels.common.mla import MlaEntries
    from cute_attn.ops import mla_decode

    calls = []
    monkeypatch.setattr(api, "_require_cuda", lambda device: None)
    monkeypatch.setattr(api, "_current_stream", lambda device: 0)
    monkeypatch.setattr(unit_schedule_route, "compile_kernel", lambda config: lambda *args: calls.append((config,
                                                                                                          args)))
    monkeypatch.setattr(unit_schedule_route, "error_word", lambda device: "error_word")
    cute_attn.clear_plan_cache()
    if kind == "gqa":
        case = testing.make_gqa_decode_case([700, 5, 3000])
        entry, policy, names = cute_attn.gqa_paged_decode, gqa_decode.line_schedule_policy, kernel.GqaDecodeSm90
        expected = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, kv_last_page_len=case.kv_last_page_len)
        pool = case.k_cache.shape[0]
    else:
        case = testing.make_mla_decode_case([700, 5, 3000], page_size=64)
        entry, policy, names = cute_attn.mla_paged_decode, mla_decode.line_schedule_policy, MlaEntries
        expected = dict(q_nope=case.q_nope, ckv_cache=case.ckv_cache, kv_last_page_len=case.kv_last_page_len)
        pool = case.ckv_cache.shape[0]
    out, lse = case.new_outputs()
    with policy(True):
        entry(*case.inputs(), out, lse, arch="sm_90a", num_sms=7)
    cute_attn.clear_plan_cache()
    assert len(calls) == 1
    config, args = calls[0]
    params = [p for p in inspect.signature(names.call_line).parameters if p not in ("self", "stream")]
    assert config.line_schedule and len(args) == len(params)
    got = dict(zip(params, args))
    for name, tensor in dict(expected, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices, output=out,
                             lse=lse).items():
        assert got[name] is tensor, name
    assert got["error_word"] == "error_word" and (got["num_pages"], got["num_ctas"]) == (pool, 7)
    assert math.isclose(got["scale_log2"], case.sm_scale * math.log2(math.e)) and got["lse_out_scale"] == 1.0
    assert got["merge_counters"].shape == (7,) and got["partial_out"].shape == (14, config.tile_q_rows,
                                                                                  config.head_dim_v)
    assert got["request_faults"].shape == (3,) and not got["unit_state"].any()
    if kind == "mla":
        assert got["qo_indptr"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("kind, page_size, arch", [("gqa", 64, "sm_90a"), ("gqa", 1, "sm_90a"), ("mla", 1, "sm_90a"),
                                                   ("mla", 64, "sm_90a"), ("gqa", 64, "sm_100a")])
def test_the_uniform_closed_form_builds_and_the_policy_sets_it(kind, page_size, arch):
    """``uniform_line`` (``kernels/common/line_uniform.py``, session 42): the line builds compile with it, its own
    code beside the table's (a closed form's 64-bit tile division of each edge, so more PTX than without), no local
    memory; the knob is refused off the line builds; the default call's route takes it for ``config.LINE_UNIFORM_KINDS``
    (GQA decode since session 42's A/B)."""
    from cute_attn import api
    from cute_attn.config import LINE_UNIFORM_KINDS, line_uniform_policy
    from cute_attn.ops import mla_decode

    if kind == "gqa":
        config, spec = _config(page_size=page_size, arch=arch), gqa_decode.SPEC
    else:
        config, spec = _mla(page_size, arch=arch), mla_decode.ONE_TOKEN_SPEC
    uniform = dataclasses.replace(_line(config), uniform_line=True)
    assert uniform.can_implement() is None
    ptx, table_only = compile_to_ptx(uniform), compile_to_ptx(_line(config))
    assert "_Line" in ptx and not re.search(r"\.local\b", ptx)
    assert ptx.count("bar.sync") > table_only.count("bar.sync")  # the closed form's reductions beside the table's
    assert ("tcgen05.mma" if arch == "sm_100a" else "wgmma.mma_async") in ptx
    reason = dataclasses.replace(config, uniform_line=True).can_implement()
    assert reason is not None and "uniform_line" in reason, reason
    assert LINE_UNIFORM_KINDS == ("gqa_paged_decode",)  # session 42's A/B: GQA decode faster, MLA decode mixed
    assert api._self_schedule_config(spec, config).uniform_line == (kind == "gqa")
    with line_uniform_policy(True):
        assert api._self_schedule_config(spec, config).uniform_line
    with line_uniform_policy(False):
        assert not api._self_schedule_config(spec, config).uniform_line

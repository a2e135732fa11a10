"""The planner-free MLA prefill (``dynamic_schedule`` on the sm_90a score-warpgroup kernel) on the CPU: when the
default call takes it, which configs build it, and what its PTX must hold (no GPU needed)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_attn import validate
from cute_attn.compile import compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels.common.mla import CKV_DIM, QK_DIM
from cute_attn.kernels.sm90 import mla_prefill
from cute_attn.ops import mla_decode, mla_prefill as mla_prefill_ops, policy
from cute_attn.ops.mla_prefill import CONSUMER_KNOBS, SM90_CONSUMER_SPLITS

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")
SMEM_LIMIT = 227 * 1024


def _config(page_size=1, split="score_wg_sepi", arch="sm_90a", **knobs):
    base = default_paged_config("mla_paged_prefill", arch=arch, num_qo_heads=16, num_kv_heads=1, head_dim_qk=QK_DIM,
                                head_dim_v=CKV_DIM, page_size=page_size, causal=True)
    return dataclasses.replace(base, **{**CONSUMER_KNOBS, **SM90_CONSUMER_SPLITS[split], **knobs})


def _problem(q_lens, kv_lens, page_size=1):
    return validate.PagedProblem.for_lengths(q_lens, kv_lens, num_qo_heads=16, num_kv_heads=1, head_dim_qk=QK_DIM,
                                             head_dim_v=CKV_DIM, page_size=page_size)


@pytest.mark.parametrize("enabled", [False, True])
def test_the_policy_keeps_batches_of_few_units_on_the_planner(enabled):
    """On: one unit a CTA or more take the self-scheduling build (56 x 8987 q: 2247 units; 1 x 16384: 4096; the
    seed's 28 requests, 1954 q: 489; 1 x 1028 q: 257, since session 37's late claim), and so does a tiny batch (1 x 43
    q over 46 keys); 1 x 300 q over 310 keys (75 units) and 22 one-token requests over 800 keys each stay on the
    device planner's splits; off: never."""
    config = _config()
    with mla_prefill_ops.dynamic_schedule_policy(enabled):
        assert mla_prefill_ops.self_schedule(config, _problem([160] * 56, [256] * 56), 132) is enabled
        assert mla_prefill_ops.self_schedule(config, _problem([16384], [16387]), 132) is enabled
        assert mla_prefill_ops.self_schedule(config, _problem([70] * 27 + [64], [73] * 27 + [73]), 132) is enabled
        assert mla_prefill_ops.self_schedule(config, _problem([43], [46]), 132) is enabled
        assert mla_prefill_ops.self_schedule(config, _problem([1028], [1038]), 132) is enabled
        assert mla_prefill_ops.self_schedule(config, _problem([300], [310]), 132) is False
        assert mla_prefill_ops.self_schedule(config, _problem([1] * 22, [800] * 22), 132) is False
        assert mla_prefill_ops.self_schedule(_config(arch="sm_100a"), _problem([16384], [16387]), 132) is False
        with policy(vars(mla_prefill_ops), DYNAMIC_MIN_UNITS_PER_CTA=0):
            assert mla_prefill_ops.self_schedule(config, _problem([1] * 22, [800] * 22), 132) is enabled
        with policy(vars(mla_prefill_ops), DYNAMIC_TINY_KEY_SLOTS=0):
            assert mla_prefill_ops.self_schedule(config, _problem([43], [46]), 132) is False


def test_the_decode_entry_never_takes_the_units():
    """One query token a tile is the swapped decode kernel: its spec's planner-free route is the line build
    (``line_schedule``, off by default), never the units of ``dynamic_schedule``."""
    assert mla_decode.ONE_TOKEN_SPEC.self_schedule is mla_decode.line_schedule
    assert mla_decode.ONE_TOKEN_SPEC.self_schedule_knobs == {"line_schedule": True}
    assert mla_prefill_ops.SPEC.self_schedule is mla_prefill_ops.self_schedule


@pytest.mark.parametrize("knobs, words", [
    (dict(split="full_s"), "score_warpgroup"),
    (dict(split="shared_s"), "score_warpgroup"),
    (dict(split="score_wg", probe="loads_only"), "probe"),
    (dict(fused_merge=True), "fused_merge"),
    (dict(eager_combine=True), "eager_combine"),
])
def test_the_kernel_refuses_it_off_the_score_warpgroup_split(knobs, words):
    config = _config(**{k: v for k, v in knobs.items() if k == "split"},
                     **{k: v for k, v in knobs.items() if k != "split"}, dynamic_schedule=True)
    reason = mla_prefill.check_config(config)
    assert reason is not None and "dynamic_schedule" in reason and words in reason


def test_sm100_builds_the_twin_but_its_default_call_stays_on_the_planner():
    """The sm_100a twin exists (compiled, never run: no Blackwell GPU here); the default call there keeps the device
    planner unless the arch is in ``DYNAMIC_SCHEDULE_ARCHS``."""
    config = default_paged_config("mla_paged_prefill", arch="sm_100a", num_qo_heads=16, num_kv_heads=1,
                                  head_dim_qk=QK_DIM, head_dim_v=CKV_DIM, page_size=1, causal=True)
    assert dataclasses.replace(config, dynamic_schedule=True).can_implement() is None
    with mla_prefill_ops.dynamic_schedule_policy(True):
        assert mla_prefill_ops.self_schedule(config, _problem([16384], [16387]), 148) is False
        with policy(vars(mla_prefill_ops), DYNAMIC_SCHEDULE_ARCHS=("sm_90a", "sm_100a")):
            assert mla_prefill_ops.self_schedule(config, _problem([16384], [16387]), 148) is True


def _dynamic_configs():
    return [c for c in mla_prefill.configs("sm_90a") if c.dynamic_schedule]


def test_registered_builds_are_the_definitions_and_the_long_item_split():
    built = {(c.page_size, c.smem_epilogue) for c in _dynamic_configs()}
    assert built == {(1, True), (64, True), (1, False)}
    for config in _dynamic_configs():
        assert config.score_warpgroup and mla_prefill.check_config(config) is None
        assert mla_prefill.smem_bytes(config) <= SMEM_LIMIT
        assert mla_prefill.num_stages(config) == mla_prefill.num_stages(
            dataclasses.replace(config, dynamic_schedule=False)), "the unit ring must not cost a K stage"


@pytest.mark.parametrize("index", range(3))
def test_self_scheduling_builds_take_units_from_a_counter(index):
    """One relaxed atomic add a unit on the counter, the CTA's count out with acquire-release, the score warpgroup's
    GEMMs as in the planned build, K stages by TMA boxes at page 64 and by bounds-checked cp.async rows at page 1,
    and no partial (split) store: a unit is never split."""
    config = _dynamic_configs()[index]
    ptx = compile_to_ptx(config)
    planned = compile_to_ptx(dataclasses.replace(config, dynamic_schedule=False))
    assert "_Dyn" in ptx and "ScoreWg" in ptx
    assert "atom.global.add.u32" in ptx, "no unit counter"
    assert "atom.global.acq_rel.add.u32" in ptx, "no acquire-release count out"
    for gemm in ("m64n64k16", "m64n256k16"):  # S (36 k-steps, the score warpgroup), P V (both warpgroups' sites)
        sites = ptx.count(f"wgmma.mma_async.sync.aligned.{gemm}.f32.bf16.bf16")
        assert sites > 0 and sites == planned.count(f"wgmma.mma_async.sync.aligned.{gemm}.f32.bf16.bf16"), gemm
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == QK_DIM // 16
    if config.page_size >= 8:
        assert "cp.async.bulk.tensor" in ptx
    else:
        assert "cp.async.bulk.tensor" not in ptx
        assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[g\], 16, %r\d+;", ptx), "no zero-fill row copy"
    # split items' fp32 partials leave as st.global.v2.b32 pairs in the planned build; a unit is never split
    assert "st.global.v2.b32" in planned and "st.global.v2.b32" not in ptx



@pytest.mark.parametrize("with_last", [False, True])
def test_the_route_passes_the_kernel_its_arguments_in_order(with_last):
    """The route's one launch (``unit_schedule_route``): the four MLA data tensors, the index tensors, ``ones`` for a
    ps1 call without ``kv_last_page_len``, this stream's scratch, the error word, the outputs, the base-2 scale, the
    pool and the grid (a stand-in kernel records them; CPU tensors)."""
    import math

    from cute_attn import testing
    from cute_attn.device_errors import error_word
    from cute_attn.unit_schedule_route import UnitScheduleRoute

    case = testing.make_mla_prefill_case([3, 9], [20, 9], with_last_page_len=with_last)
    args = mla_prefill_ops.canonical_inputs(case.inputs())
    problem, _ = mla_prefill_ops.check(*args)
    config = dataclasses.replace(_config(), dynamic_schedule=True)
    route = UnitScheduleRoute.resolve(mla_prefill_ops.SPEC, config, problem, num_ctas=7)
    seen = []
    route.kernel = lambda *a: seen.append(a)
    out, lse = case.new_outputs()
    route.launch(args, out, lse, natural_lse=False, stream=0, device="cpu")
    (got,) = seen
    scratch = route.scratch[0]
    assert got[:7] == (case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, case.qo_indptr, case.kv_indptr,
                       case.kv_indices)
    assert got[7] is (case.kv_last_page_len if with_last else scratch.ones)
    assert scratch.ones.tolist() == [1, 1]
    assert got[8:13] == (scratch.request_faults, scratch.unit_state, error_word("cpu"), out, lse)
    assert math.isclose(got[13], case.sm_scale / math.log(2)) and got[14] == 1.0
    assert got[15:] == (case.ckv_cache.shape[0], 7)


def _self_scheduling_builds():
    from cute_attn.compile import registered_configs

    return [c for arch in ("sm_90a", "sm_100a") for c in registered_configs(arch)
            if getattr(c, "dynamic_schedule", False)]


@pytest.mark.parametrize("config", _self_scheduling_builds(), ids=lambda c: f"{c.kind}-{c.arch}-p{c.page_size}")
def test_self_scheduling_builds_do_not_spill(capfd, config):
    """ptxas (which the DSL runs on the CPU for both arches) reports at most the planned builds' few bytes of spills
    (a small local array: 4-12 bytes on sm_100a, 4 on the sm_90a GQA row gathers) for every self-scheduling build: the
    sm_100a MLA twin's first build spilled 180 bytes over the batch rules' loop at its 512 threads' 128 registers."""
    import tempfile

    import cutlass.cute as cute

    from cute_attn.arch import dsl_arch_options
    from cute_attn.kernels import _paged_kernel

    fn, args = _paged_kernel(config).build(config)
    with tempfile.TemporaryDirectory() as dump:
        cute.compile(fn, *args, no_jit_engine=True,
                     options=f"{dsl_arch_options(config.arch)} --keep-ptx --dump-dir {dump} remarks{{ptx}}")
    log = "".join(capfd.readouterr())
    assert "Used" in log and "registers" in log  # the ptxas report was captured
    stores = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert stores and max(stores) <= 16, log[-2000:]

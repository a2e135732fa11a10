"""``PagedAttentionConfig.late_claim`` (session 36; on since session 37's GPU run): the self-scheduling builds' load
role takes its next unit once the current unit's last K tile is issued instead of as its loads begin.

CPU only: the config rule, the policy reaching the default call's route, and every self-scheduling build of both
arches compiled with the knob: ptxas reports no more spills than the early-claim build's, the PTX differs from the
early-claim build's (the knob reaches the kernel) while it holds the same atomics (one claim a unit moved, none
added)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_attn.config import PagedAttentionConfig
from cute_attn.ops import gqa_prefill, mla_prefill


def _self_scheduling_builds():
    from cute_attn.compile import registered_configs

    return [c for arch in ("sm_90a", "sm_100a") for c in registered_configs(arch)
            if getattr(c, "dynamic_schedule", False)]


def test_the_knob_needs_a_self_scheduling_build():
    config = next(c for c in _self_scheduling_builds() if c.arch == "sm_90a")
    assert dataclasses.replace(config, late_claim=True).can_implement() is None
    reason = dataclasses.replace(config, dynamic_schedule=False, late_claim=True).can_implement()
    assert reason is not None and "late_claim" in reason and "dynamic_schedule" in reason
    assert PagedAttentionConfig.__dataclass_fields__["late_claim"].default is False


def test_the_policy_names_both_prefill_kinds():
    from cute_attn import config as policies

    landed = policies.LATE_CLAIM_KINDS
    assert set(landed) == {gqa_prefill.SPEC.name, mla_prefill.SPEC.name}  # on since session 37's GPU tier and A/B
    with policies.late_claim_policy(False):
        assert policies.LATE_CLAIM_KINDS == ()
        with policies.late_claim_policy(True):
            assert set(policies.LATE_CLAIM_KINDS) == {gqa_prefill.SPEC.name, mla_prefill.SPEC.name}
        assert policies.LATE_CLAIM_KINDS == ()
    assert policies.LATE_CLAIM_KINDS == landed


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("ops", [gqa_prefill, mla_prefill], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_default_calls_route_carries_the_policys_knob(monkeypatch, ops, late):
    """The default call's planner-free route (``api._device_route``, launches stood in for) is resolved with the
    kind's place in ``config.LATE_CLAIM_KINDS``: the config its launcher and scratch are made for carries it."""
    from cute_attn import api, testing
    from cute_attn.config import late_claim_policy
    from cute_attn.ops import policy

    monkeypatch.setattr(api, "_require_cuda", lambda device: None)  # CPU inputs stand in for a CUDA device
    monkeypatch.setattr(api, "find_launcher", lambda config: object())
    make = testing.make_mla_prefill_case if ops is mla_prefill else testing.make_gqa_prefill_case
    case = make([600, 300], [700, 900], page_size=16, seed=3)
    out, lse = case.new_outputs()
    with ops.dynamic_schedule_policy(True), late_claim_policy(late), \
            policy(vars(ops), DYNAMIC_MIN_UNITS_PER_CTA=0):
        assert api.self_schedules(ops.SPEC, case.inputs(), arch="sm_90a", num_sms=132)
        assert api.self_schedules(ops.SPEC, case.inputs(), arch="sm_90a", num_sms=132, reused=True)  # the wrappers'
        hit = api._device_route(ops.SPEC, case.inputs(), out, lse, False, "sm_90a", 132)
    assert hit.config.dynamic_schedule and hit.config.late_claim is late
    assert hit.route.config is hit.config


def _atomics(ptx: str) -> list[str]:
    return sorted(re.findall(r"\batom\.[\w.]+", ptx))


@pytest.mark.parametrize("config", _self_scheduling_builds(), ids=lambda c: f"{c.kind}-{c.arch}-p{c.page_size}")
def test_late_claim_builds_compile_without_spills(capfd, config):
    import tempfile
    from pathlib import Path

    import cutlass.cute as cute

    from cute_attn.arch import dsl_arch_options
    from cute_attn.compile import compile_to_ptx
    from cute_attn.kernels import _paged_kernel

    late = dataclasses.replace(config, late_claim=True)
    fn, args = _paged_kernel(late).build(late)
    with tempfile.TemporaryDirectory() as dump:
        cute.compile(fn, *args, no_jit_engine=True,
                     options=f"{dsl_arch_options(late.arch)} --keep-ptx --dump-dir {dump} remarks{{ptx}}")
        (ptx_path,) = Path(dump).glob("*.ptx")
        late_ptx = ptx_path.read_text()
    log = "".join(capfd.readouterr())
    assert "Used" in log and "registers" in log  # the ptxas report was captured
    stores = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert stores, log[-2000:]
    fn, args = _paged_kernel(config).build(config)
    with tempfile.TemporaryDirectory() as dump:
        cute.compile(fn, *args, no_jit_engine=True,
                     options=f"{dsl_arch_options(config.arch)} --keep-ptx --dump-dir {dump} remarks{{ptx}}")
    early_log = "".join(capfd.readouterr())
    early_stores = [int(n) for n in re.findall(r"(\d+) bytes spill stores", early_log)]
    assert early_stores and max(stores) <= max(early_stores), (stores, early_stores, log[-2000:])
    early_ptx = compile_to_ptx(config)
    assert "_Late" in late_ptx and "_Late" not in early_ptx
    assert _atomics(late_ptx) == _atomics(early_ptx)
    assert late_ptx.replace("_Late", "") != early_ptx

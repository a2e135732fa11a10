"""The planner-free GQA prefill's host side on the CPU: when the default call takes it, which configs build it."""

from __future__ import annotations

import dataclasses

import pytest

from cute_attn import validate
from cute_attn.config import default_paged_config
from cute_attn.ops import gqa_prefill, policy


def _config(arch="sm_90a", heads=32, kv_heads=4, page_size=64, kind="gqa_paged_prefill", causal=True):
    return default_paged_config(kind, arch=arch, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim_qk=128,
                                head_dim_v=128, page_size=page_size, causal=causal)


def _problem(q_lens, kv_lens, heads=32, kv_heads=4, page_size=64):
    return validate.PagedProblem.for_lengths(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads,
                                             head_dim_qk=128, head_dim_v=128, page_size=page_size)


@pytest.mark.parametrize("enabled", [False, True])
def test_the_policy_decides_by_shapes_alone(enabled):
    """On: a batch promising a unit a CTA (``ceil(total_q * group / rows) * kv_heads >= num_ctas``) takes it, a smaller
    one the device planner; off: never. Only causal sm_90a GQA prefill builds it."""
    with gqa_prefill.dynamic_schedule_policy(enabled):
        big = _problem([992] * 8, [992] * 8)  # 62 q tiles a request x 4 KV heads x 8 = 1984 units
        small = _problem([16] * 8, [4096] * 8)  # 8 q tiles x 4 = 32 units on 132 CTAs: the planner splits
        assert gqa_prefill.self_schedule(_config(), big, 132) is enabled
        assert gqa_prefill.self_schedule(_config(), small, 132) is False
        assert gqa_prefill.self_schedule(_config(arch="sm_100a"), big, 132) is False
        with policy(vars(gqa_prefill), DYNAMIC_MIN_UNITS_PER_CTA=0):
            assert gqa_prefill.self_schedule(_config(), small, 132) is enabled


def test_the_floor_counts_whole_tokens_a_tile():
    """Group 5 packs 25 tokens (125 rows) a tile: 8 x 992 has 8 x 40 q tiles, one KV head; the shapes alone promise
    ceil(7936 * 5 / 125) = 318 of them (the floor is a lower bound of the batch's units)."""
    with gqa_prefill.dynamic_schedule_policy(True):
        problem = _problem([992] * 8, [992] * 8, heads=5, kv_heads=1)
        config = _config(heads=5, kv_heads=1)
        assert gqa_prefill.self_schedule(config, problem, 318) is True
        assert gqa_prefill.self_schedule(config, problem, 319) is False


@pytest.mark.parametrize("kind, arch, causal", [("gqa_paged_decode", "sm_90a", False),
                                                ("gqa_paged_decode", "sm_100a", False)])
def test_other_kernels_refuse_it_with_a_reason(kind, arch, causal):
    config = dataclasses.replace(_config(arch=arch, kind=kind, causal=causal, heads=20), dynamic_schedule=True)
    reason = config.can_implement()
    assert reason is not None and "dynamic_schedule" in reason and "GQA and MLA prefill kernels (sm_90a, sm_100a)" in reason


def test_sm100_builds_it_but_its_default_call_stays_on_the_planner():
    """The sm_100a twin exists (compiled, never run: no Blackwell GPU here), so the config is accepted; the default
    call there keeps the device planner unless the arch is in ``DYNAMIC_SCHEDULE_ARCHS``."""
    config = _config(arch="sm_100a")
    assert dataclasses.replace(config, dynamic_schedule=True).can_implement() is None
    big = _problem([992] * 8, [992] * 8)
    with gqa_prefill.dynamic_schedule_policy(True):
        assert gqa_prefill.self_schedule(config, big, 148) is False
        with policy(vars(gqa_prefill), DYNAMIC_SCHEDULE_ARCHS=("sm_90a", "sm_100a")):
            assert gqa_prefill.self_schedule(config, big, 148) is True


def test_the_sm90_kernel_refuses_it_beside_splits_or_probes():
    from cute_attn.kernels.sm90 import gqa_prefill as kernel

    base = dataclasses.replace(_config(), dynamic_schedule=True)
    assert kernel.check_config(base) is None
    for knob in (dict(fused_merge=True), dict(probe="cta_stamps")):
        reason = kernel.check_config(dataclasses.replace(base, **knob))
        assert reason is not None and "dynamic_schedule" in reason


@pytest.mark.parametrize("part,prefix", [("gqa", ""), ("mla", "mla-")])
def test_the_validation_script_names_sanitizer_cases_that_exist(part, prefix):
    """``tools/validate_planner_free.sh`` (the next GPU session's calls) runs the planner-free builds' sanitizer
    cases by name: each name it builds is one ``tools/sanitize.py`` defines, so no device call is spent on a typo."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parent.parent / "tools"
    sys.path.insert(0, str(tools))
    import sanitize

    script = (tools / "validate_planner_free.sh").read_text()
    suffixes = re.findall(r"\$\{prefix\}(dynamic-schedule-[\w-]+)", script)
    names = [prefix + s for s in suffixes]
    assert len(names) == 4 and set(names) <= set(sanitize._cases("sm_90a")), names
    bad = subprocess.run(["bash", str(tools / "validate_planner_free.sh"), "/tmp/cute_attn_validate_x", "nope"],
                         capture_output=True, text=True)
    parts = ("gqa, mla, ab, late, route, line, mla-line, mla-short, rank-major, scan, uniform, mla-default, "
             "line-peers, peers or fib")
    assert bad.returncode == 2 and parts in bad.stderr
    uniform = re.search(r"cases=(line-uniform[\w,-]+)", script).group(1).split(",")
    assert len(uniform) == 4 and set(uniform) <= set(sanitize._cases("sm_90a")), uniform
    late = re.search(r"cases=(late-claim[\w,-]+)", script).group(1).split(",")
    assert len(late) == 4 and set(late) <= set(sanitize._cases("sm_90a")), late
    line = re.search(r"cases=(line-schedule[\w,-]+)", script).group(1).split(",")
    line += re.search(r"cases\+=,(mla-line-schedule[\w,-]+)", script).group(1).split(",")
    assert len(line) == 6 and set(line) <= set(sanitize._cases("sm_90a")), line
    short = re.search(r"cases=(mla-short-stages[\w,-]+)", script).group(1).split(",")
    assert len(short) == 2 and set(short) <= set(sanitize._cases("sm_90a")), short
    rank = re.search(r"cases=(rank-major[\w,-]+)", script).group(1).split(",")
    assert len(rank) == 5 and set(rank) <= set(sanitize._cases("sm_90a")), rank
    scan = re.search(r"cases=(line-scan[\w,-]+)", script).group(1).split(",")
    assert len(scan) == 2 and set(scan) <= set(sanitize._cases("sm_90a")), scan

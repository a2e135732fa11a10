"""Compile-only tests of ``bf16_partials`` (sm_90a MLA and GQA prefill kernels): split items store their partial rows
as bf16 (the LSEs stay fp32) and the combine loads 8 bytes a slot and widens them; elsewhere the knob is refused with
its reason, and the policy leaves configs it cannot build alone (no GPU needed)."""

from __future__ import annotations

import dataclasses

import pytest

from cute_attn.compile import compile_to_ptx
from cute_attn.config import bf16_partials_policy, default_paged_config
from cute_attn.kernels.common.combine import CombineConfig
from cute_attn.ops.mla_decode import ONE_TOKEN_SPEC

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


def _config(which: str, on: bool, arch: str = "sm_90a"):
    with bf16_partials_policy(on):
        if which == "gqa_decode":
            return default_paged_config("gqa_paged_decode", arch=arch, num_qo_heads=20, num_kv_heads=4,
                                        head_dim_qk=128, head_dim_v=128, page_size=64, causal=False)
        if which == "gqa_prefill":
            return default_paged_config("gqa_paged_prefill", arch=arch, num_qo_heads=32, num_kv_heads=4,
                                        head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)
        return default_paged_config("mla_paged_prefill", arch=arch, num_qo_heads=16, num_kv_heads=1, head_dim_qk=576,
                                    head_dim_v=512, page_size=64 if which == "mla_decode" else 1, causal=True,
                                    spec=ONE_TOKEN_SPEC if which == "mla_decode" else None)


def _count(ptx: str, op: str) -> int:
    return ptx.count(op + " ") + ptx.count(op + "\t")


def test_the_swapped_mla_decode_stores_its_partials_as_bf16():
    off, on = _config("mla_decode", False), _config("mla_decode", True)
    assert on.bf16_partials and not off.bf16_partials and on.can_implement() is None
    ptx_off, ptx_on = compile_to_ptx(off), compile_to_ptx(on)
    # one scalar store an (column, head) element: the partial rows' 4-byte stores become 2-byte ones
    assert _count(ptx_on, "st.global.b16") == 2 * _count(ptx_off, "st.global.b16") > 0
    assert _count(ptx_on, "st.global.b32") < _count(ptx_off, "st.global.b32")


@pytest.mark.parametrize("which", ["mla_prefill", "gqa_prefill"])
def test_the_prefill_epilogue_packs_partial_column_pairs_into_one_bf16x2_store(which):
    off, on = _config(which, False), _config(which, True)
    assert on.bf16_partials and on.can_implement() is None
    ptx_off, ptx_on = compile_to_ptx(off), compile_to_ptx(on)
    # fp32 partials: a column pair is one 8-byte store; bf16: one 4-byte store of a cvt.rn.bf16x2 pair
    assert _count(ptx_off, "st.global.v2.b32") > 0 and _count(ptx_on, "st.global.v2.b32") == 0
    assert _count(ptx_on, "st.global.b32") > _count(ptx_off, "st.global.b32")
    assert ptx_on.count("cvt.rn.bf16x2.f32") > ptx_off.count("cvt.rn.bf16x2.f32")


@pytest.mark.parametrize("which", ["mla_decode", "gqa_prefill"])
def test_the_combine_reads_eight_bytes_a_slot_and_widens_them(which):
    off, on = CombineConfig.for_paged(_config(which, False)), CombineConfig.for_paged(_config(which, True))
    assert on.bf16_partials and not off.bf16_partials
    ptx_off, ptx_on = compile_to_ptx(off), compile_to_ptx(on)
    assert ptx_off.count("ld.global.v4.b32") > 0 and "cvt.f32.bf16" not in ptx_off
    assert ptx_on.count("ld.global.v4.b32") == 0 and ptx_on.count("cvt.f32.bf16") > 0
    wide_loads = ptx_on.count("ld.global.v2.b32") + ptx_on.count("ld.global.v4.b16")
    assert wide_loads == ptx_off.count("ld.global.v4.b32")  # the same loads, half the bytes


def test_the_policy_leaves_configs_no_kernel_builds_with_it_alone():
    assert not _config("gqa_decode", True).bf16_partials  # the GQA decode folds fp32 partials in-kernel
    assert not _config("mla_decode", True, arch="sm_100a").bf16_partials
    assert not _config("gqa_prefill", True, arch="sm_100a").bf16_partials


@pytest.mark.parametrize("which, arch, extra, words", [
    ("gqa_decode", "sm_90a", {}, "sm_90a MLA and GQA prefill"),
    ("gqa_prefill", "sm_100a", {}, "sm_90a MLA and GQA prefill"),
    ("mla_prefill", "sm_90a", {"fused_merge": True}, "fp32 partials"),
    ("mla_decode", "sm_90a", {"eager_combine": True}, "fp32 partials"),
])
def test_bf16_partials_is_refused_where_no_kernel_builds_it(which, arch, extra, words):
    config = dataclasses.replace(_config(which, False, arch=arch), bf16_partials=True, **extra)
    reason = config.can_implement()
    assert reason is not None and "bf16_partials" in reason and words in reason

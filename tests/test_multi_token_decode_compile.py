"""Compile-only tests of the multi-token decode kernels (the decode kernels built for gqa_paged_multi_token_decode),
both arches, with PTX checks (no GPU needed)."""

from __future__ import annotations

import re

import pytest

from cute_attn.compile import compile_kernel, compile_to_ptx
from cute_attn.kernels import find_launcher
from cute_attn.kernels.sm90 import gqa_decode as sm90
from cute_attn.kernels.sm100 import gqa_decode as sm100

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")

KIND = "gqa_paged_multi_token_decode"


def _params(ptx: str) -> int:
    """Parameters of the (one) kernel entry."""
    entry = ptx[ptx.index(".entry"):]
    return entry[: entry.index(")")].count(".param")


def _decode_twin(config):
    import dataclasses

    return dataclasses.replace(config, kind="gqa_paged_decode", causal=False)


def test_both_arches_register_the_kind_with_the_definitions_heads():
    for module, arch in ((sm90, "sm_90a"), (sm100, "sm_100a")):
        configs = module.multi_token_configs(arch)
        assert configs and all(c.kind == KIND and c.causal for c in configs)
        assert (configs[0].num_qo_heads, configs[0].num_kv_heads, configs[0].page_size) == (20, 4, 64)
        assert all(module.check_config(c) is None for c in configs)
        assert find_launcher(configs[0]) is module.multi_token_launch
        assert module.multi_token_configs("sm_90a" if arch == "sm_100a" else "sm_100a") == []


@pytest.mark.parametrize("index", range(len(sm90.multi_token_configs("sm_90a"))))
def test_sm90_compiles_with_qo_indptr_and_the_decode_pipeline(index):
    config = sm90.multi_token_configs("sm_90a")[index]
    assert callable(compile_kernel(config))
    ptx = compile_to_ptx(config)
    assert ".target sm_90a" in ptx and "GqaMultiTokenDecodeSm90" in ptx
    assert "wgmma.mma_async" in ptx and "mbarrier.try_wait.parity" in ptx
    assert "ld.global.v4" in ptx and "st.shared.v4" in ptx  # Q rows: the consumers' 16-byte loads
    assert re.search(r"\b(atom|red)\.global\S*\.add", ptx) and "fence.acq_rel.gpu" in ptx  # fused merge
    decode = compile_to_ptx(_decode_twin(config))
    assert ptx.count("cp.async.bulk.tensor") == decode.count("cp.async.bulk.tensor")  # the same K/V page loads
    assert _params(ptx) == _params(decode) + 1  # qo_indptr
    # every live row half runs the softmax: more exp2 than decode, whose group fits half 0 of warp 0
    assert len(re.findall(r"ex2\.approx", ptx)) > len(re.findall(r"ex2\.approx", decode))
    assert sm90.smem_bytes(config) <= 227 * 1024 and sm90.num_stages(config) >= 2
    assert sm90.num_stages(config) % 2 == 0


@pytest.mark.parametrize("index", range(len(sm100.multi_token_configs("sm_100a"))))
def test_sm100_compiles_with_load_warp_q_rows(index):
    config = sm100.multi_token_configs("sm_100a")[index]
    assert callable(compile_kernel(config))
    ptx = compile_to_ptx(config)
    assert ".target sm_100a" in ptx and "GqaMultiTokenDecodeSm100" in ptx
    for needle in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.alloc", "tcgen05.ld.sync.aligned.32x32b",
                   "fence.proxy.async.shared::cta", "fence.acq_rel.gpu", "mbarrier.try_wait.parity"):
        assert needle in ptx, needle
    boxes = sm100.tma_boxes_per_tile(config.head_dim_v)
    assert ptx.count("cp.async.bulk.tensor") == 2 * boxes  # K and V pages by TMA; Q rows by 16-byte loads
    vecs = config.head_dim_qk // 8
    assert len(re.findall(r"ld\.global\.v4", ptx)) == config.tile_q_rows * vecs // 32  # Q rows, per lane
    # Q rows and the zeroed padding rows (once per CTA), per lane: 16-byte shared stores
    assert len(re.findall(r"st\.shared\.v4", ptx)) == 128 * vecs // 32
    assert len(re.findall(r"\batom\.global\S*\.add", ptx)) == 1
    decode = compile_to_ptx(_decode_twin(config))
    assert _params(ptx) == _params(decode) + 2  # q itself and qo_indptr
    assert sm100.smem_bytes(config) <= 227 * 1024


def test_decode_kernels_stay_single_token():
    """The multi-token code is compile-time only: decode PTX has no qo_indptr and (sm_100a) no Q vector loads."""
    decode90 = compile_to_ptx(_decode_twin(sm90.multi_token_configs("sm_90a")[0]))
    decode100 = compile_to_ptx(_decode_twin(sm100.multi_token_configs("sm_100a")[0]))
    assert "GqaMultiTokenDecode" not in decode90 + decode100
    assert "ld.global.v4" not in decode100
    assert decode100.count("cp.async.bulk.tensor") == 3 * sm100.tma_boxes_per_tile(128)


def test_live_rows_bound_the_exchange_buffer():
    config = sm90.multi_token_configs("sm_90a")[0]  # group 5: 8 tokens = 40 rows, 3 warps of 16
    assert sm90.live_rows(config) == 40
    assert sm90.exchange_shape(config)[0] == 3 * 32
    assert sm90.live_rows(_decode_twin(config)) == 5 and sm90.exchange_shape(_decode_twin(config))[0] == 32

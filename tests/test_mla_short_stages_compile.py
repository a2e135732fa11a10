"""The swapped MLA decode kernel's short K stages (``ops/mla_decode.SM90_SHORT_STAGES``, off): the policy, the shared
memory budget and the sm_90a PTX, on the CPU."""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("cutlass")

from cute_attn import api  # noqa: E402
from cute_attn.compile import compile_to_ptx  # noqa: E402
from cute_attn.kernels.sm90 import mla_decode as swapped_kernel  # noqa: E402
from cute_attn.kernels.sm90 import mla_prefill  # noqa: E402
from cute_attn.ops import mla_decode  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


def _one_token(page_size, heads=16, arch="sm_90a"):
    return api._config_for(mla_decode.ONE_TOKEN_SPEC, heads, 1, 576, 512, page_size, arch)


def test_the_policy_flips_the_one_token_configs_only_and_restores():
    default = mla_decode.SM90_SHORT_STAGES
    assert default is False  # off until the GPU tier and the A/B have run
    assert _one_token(64).kv_tile == 64
    with mla_decode.short_stages_policy(True):
        for page_size, heads in ((1, 16), (64, 16), (1, 8)):
            config = _one_token(page_size, heads)
            assert config.kv_tile == 32 and config.tile_q_rows == heads and config.can_implement() is None
            assert mla_prefill.num_stages(config) == 4
        assert _one_token(64, arch="sm_100a").kv_tile == 64  # the sm_100a path (64-row prefill tile) keeps its own
        assert api._config_for(mla_decode.mla_prefill.SPEC, 16, 1, 576, 512, 1, "sm_90a").kv_tile == 64
    assert mla_decode.SM90_SHORT_STAGES is default


def test_short_stages_budget():
    """Four stages of 32 keys, each with the 4 KiB its S^T view reads past the last column block, where 64-key stages
    fit two: 144 KiB of keys either way, 16 KiB of pads, inside the 227 KiB limit."""
    long = _one_token(64)
    short = dataclasses.replace(long, kv_tile=32)
    assert swapped_kernel.score_pad_bytes(32) == 4096 and swapped_kernel.score_pad_bytes(64) == 0
    assert mla_prefill.num_stages(long) == 2 and mla_prefill.num_stages(short) == 4
    # the row-id table shrinks by 2 x 32 ids and the mbarriers grow by 2 stages of 2 x 8 bytes
    assert mla_prefill.smem_bytes(short) - mla_prefill.smem_bytes(long) == 4 * 4096 - 2 * 32 * 4 + 2 * 2 * 8
    assert mla_prefill.smem_bytes(short) <= 227 * 1024
    assert "kv_tile=16" in mla_prefill.check_config(dataclasses.replace(long, kv_tile=16))
    # a cluster build keeps its piece beside the ring (h16: 33 KiB): three short stages there, two loading while the
    # consumers hold one, the 72 KiB in flight of the 64-key kernel (host plans of 64 x 8192 take clusters of 2)
    assert mla_prefill.num_stages(dataclasses.replace(short, cluster_merge=2)) == 3
    assert mla_prefill.num_stages(dataclasses.replace(long, cluster_merge=2)) == 2


@pytest.mark.parametrize("heads, page_size", [(16, 1), (16, 64), (8, 1)])
def test_short_stages_compile(heads, page_size):
    """S^T: the 36 k-steps of one 64-row tile (K-major A); O^T: 4 M-tiles x 2 k-steps of 16 keys (MN-major V^T);
    page 64 by TMA boxes (8-row and 1-row, 9 a row group), page 1 by cp.async rows; no local memory."""
    config = dataclasses.replace(_one_token(page_size, heads), kv_tile=32, page_boxes=False)
    ptx = compile_to_ptx(config)
    assert "MlaPagedDecodeSwappedSm90" in ptx and "_N32_S4" in ptx
    mmas = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{heads}k16\.f32\.bf16\.bf16 [^;]*p, 1,  1, ([01]), 0;",
                      ptx)
    assert mmas.count("0") == 576 // 16 and mmas.count("1") == 4 * 32 // 16
    tma = ptx.count("cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes")
    if page_size >= 8:
        assert tma == 9 + 8 * 9 and "cp.async.mbarrier.arrive.noinc.shared" not in ptx
    else:
        assert tma == 0 and ptx.count("cp.async.mbarrier.arrive.noinc.shared") == 1
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("page_size", [1, 64])
def test_short_stage_addresses_step_over_the_pads(page_size):
    """The loads' stage address steps by the ring's stage stride (36 KiB + 4 KiB = 40960 bytes), not by a stage's
    keys (36864): the load role reads it off the layout (TMA boxes at page 64, cp.async rows at page 1); so do the
    wgmma descriptors' start addresses (16-byte units: 2560 a stage)."""
    config = dataclasses.replace(_one_token(page_size), kv_tile=32, page_boxes=False)
    ptx = compile_to_ptx(config)
    assert re.search(r"(mad|mul)\.lo\.s32\s+%r\d+, %r\d+, 40960[,;]", ptx)  # base + stage * 40960
    assert not re.search(r"(mad|mul)\.lo\.s32\s+%r\d+, %r\d+, 36864", ptx)
    assert re.search(r"(mad|mul)\.lo\.s32\s+%r\d+, %r\d+, 2560[,;]", ptx)  # the descriptors' stage step
    if page_size == 64:
        assert re.search(r"mov\.b32\s+%r\d+, 36864;", ptx)  # the bytes a stage's TMA boxes bring (its expect_tx)


def test_short_stages_cluster_build_compiles():
    config = dataclasses.replace(_one_token(64), kv_tile=32, cluster_merge=2)
    assert config.can_implement() is None
    ptx = compile_to_ptx(config)
    assert "_N32_S3" in ptx and "_Cluster2" in ptx and "ld.local" not in ptx


def test_the_score_view_reads_its_stage_then_the_next_block_then_the_pad():
    """S^T's 64-row view of the short-stage ring (element offsets before the swizzle, which acts by address within
    each 1 KiB atom): rows 0..31 are the stage's keys as loaded; row 32 + r of 64-column block j is row r of block
    j + 1 of the same stage, and of the last block the stage's pad; no row reaches another stage."""
    import cutlass
    import cutlass.cute as cute

    config = dataclasses.replace(_one_token(64), kv_tile=32)
    kernel = swapped_kernel.MlaPagedDecodeSwappedSm90(config)
    keys = config.kv_tile * 576  # a stage's elements as loaded; its pad follows
    stride = keys + swapped_kernel.score_pad_bytes(config.kv_tile) // 2
    dims = (0, 15, 63, 81, 511, 512, 575)
    got = {}

    @cute.jit
    def offsets():
        ring, view = kernel.stage_ring(config.kv_tile), kernel.stage_ring(64)
        got["cosize"] = cute.cosize(view)
        for s in cutlass.range_constexpr(kernel.num_stages):  # trace-time loops: static offsets
            for r in cutlass.range_constexpr(64):
                for d in dims:
                    got[r, d, s] = cute.crd2idx((r, d, s), view)
                    if r < config.kv_tile:
                        got["ring", r, d, s] = cute.crd2idx((r, d, s), ring)
                    elif d + 64 < 576:
                        got["next", r, d, s] = cute.crd2idx((r - config.kv_tile, d + 64, s), ring)

    offsets()
    assert got["cosize"] == kernel.num_stages * stride  # the last stage's pad is allocated too
    for s in range(kernel.num_stages):
        for r in range(64):
            for d in dims:
                offset = got[r, d, s]
                assert s * stride <= offset < (s + 1) * stride, (r, d, s)
                if r < config.kv_tile:
                    assert offset == got["ring", r, d, s]
                elif d + 64 < 576:
                    assert offset == got["next", r, d, s]
                else:
                    assert s * stride + keys <= offset, (r, d, s)  # the pad

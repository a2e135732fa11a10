"""Compile-only tests of the sm_90a GQA decode kernel (no GPU needed)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_attn.compile import compile_kernel, compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels import find_launcher
from cute_attn.kernels.sm90 import gqa_decode
from cute_attn.ops import gqa_decode as gqa_decode_spec
from ptx_boxes import raw_box_offsets

SMEM_LIMIT = 227 * 1024


pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


def _definition_config():
    return default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4,
                                head_dim_qk=128, head_dim_v=128, page_size=64, causal=False)


def test_registered_configs_include_the_definition():
    configs = gqa_decode.configs("sm_90a")
    assert _definition_config() in configs
    assert gqa_decode.configs("sm_100a") == []
    for config in configs:
        assert gqa_decode.check_config(config) is None


@pytest.mark.parametrize("index", range(len(gqa_decode.configs("sm_90a"))))
def test_compiles_with_wgmma_and_tma(index):
    config = gqa_decode.configs("sm_90a")[index]
    assert callable(compile_kernel(config))
    ptx = compile_to_ptx(config)
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    # K/V pages by TMA; page 1 by 16-byte cp.async rows (test_page_1_rows_are_gathered_by_cp_async_...)
    assert ("cp.async.cg.shared.global" if config.page_size == 1 else "cp.async.bulk.tensor") in ptx
    assert "mbarrier.try_wait.parity" in ptx
    assert "GqaDecodeSm90" in ptx  # readable kernel symbol
    # fused split-KV merge: the arrival counter (atomic, gpu scope) and the release/acquire fences
    assert re.search(r"\b(atom|red)\.global\S*\.add", ptx)
    assert "fence.acq_rel.gpu" in ptx
    assert "ld.global.v4" in ptx and "st.shared.v4" in ptx  # Q tile in 16-byte vectors
    # the last tile's V rows that may hold pool garbage are zeroed 16 bytes a store (kernels/common/kv_tail.py)
    assert not re.search(r"st\.shared\.(?:b|u)16", ptx)
    assert gqa_decode.smem_bytes(config) <= SMEM_LIMIT
    assert gqa_decode.num_stages(config) >= 2


def test_public_api_finds_the_launcher():
    assert find_launcher(_definition_config()) is gqa_decode.launch


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(kv_tile=32), "kv_tile"),  # half a page per tile
        (dict(page_size=16, kv_tile=32), "kv_tile"),  # several pages per stage: 64- or 128-key stages only
        (dict(page_size=128, kv_tile=64), "whole pages"),  # half a page per stage
        (dict(num_qo_heads=128, num_kv_heads=1), "group"),  # 128 heads do not fit one 64-row tile
        (dict(kind="gqa_paged_prefill"), "gqa_paged_decode"),
    ],
)
def test_bad_configs_are_rejected(change, fragment):
    config = dataclasses.replace(_definition_config(), **change)
    reason = gqa_decode.check_config(config)
    assert reason is not None and fragment in reason
    with pytest.raises(ValueError):
        gqa_decode.build(config)


def test_config_rules_of_the_base_class_apply():
    config = dataclasses.replace(_definition_config(), tile_q_rows=32)
    assert config.can_implement() is not None
    assert gqa_decode.check_config(config) is not None
    with pytest.raises(ValueError):
        compile_kernel(config)


def test_ring_stage_counts_are_even_for_every_family_shape():
    """The two consumer warpgroups split the ring by tile parity: an odd stage count lets a warpgroup's parity
    wait see a phase two loads old (ABA; 3 stages failed on the H200). Every buildable shape gets an even count."""
    from cute_attn.config import default_paged_config

    for head_dim in (64, 128, 256):
        for page_size in (1, 2, 4, 8, 16, 32, 64, 128):
            for heads, kv_heads in ((20, 4), (8, 8), (16, 1), (32, 8)):
                config = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=heads,
                                              num_kv_heads=kv_heads, head_dim_qk=head_dim, head_dim_v=head_dim,
                                              page_size=page_size, causal=False)
                if gqa_decode.check_config(config) is None:
                    stages = gqa_decode.num_stages(config)
                    assert stages >= 2 and stages % 2 == 0, (config, stages)


@pytest.mark.parametrize("page_size", [1, 2, 4, 8])
def test_small_pages_fill_a_64_key_stage_with_page_boxes(page_size):
    """Pages of 1..8 keys keep the ring of page 64 (kv_tile 64 keys a stage, same stage count), each stage built
    from 64 / page_size page boxes; nothing below 16 keys a page is refused for lack of a loader."""
    config = dataclasses.replace(_definition_config(), page_size=page_size)
    # pages 1, 2 also gather with the producer warpgroup by default (ops/gqa_decode.GATHER_WARPS_PAGE_SIZES)
    gather_warps = 4 if page_size in gqa_decode_spec.GATHER_WARPS_PAGE_SIZES else 1
    assert dataclasses.replace(config, gather_warps=gather_warps) == default_paged_config(
        "gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128, head_dim_v=128,
        page_size=page_size, causal=False)
    assert config.kv_tile == 64 and gqa_decode.check_config(config) is None
    assert gqa_decode.num_stages(config) == gqa_decode.num_stages(_definition_config())


@pytest.mark.parametrize("page_size", [1, 2])
def test_page_1_rows_are_gathered_by_cp_async_from_the_producer_warp(page_size):
    """Page 1: 16-byte cp.async rows (the TMA unit's rate for 128-byte boxes held page 1 to 43% of page 64 on the
    H200), branch-free: an out-of-pool id is a zero-fill (src-size 0), every chunk placed by the 128B swizzle, the
    copies completing on the stage's full mbarrier, the consumers fencing them into the async proxy. The chunk-column
    deal (``row_segments=False``; the default deals 128-byte segments: tests/test_row_gather_segments_compile.py)."""
    config = dataclasses.replace(_definition_config(), page_size=page_size, kv_tile=64, row_segments=False)
    ptx = compile_to_ptx(config)
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[g\], 16, (%r\d+);", ptx)
    # K and V: 64 rows x 16 chunks each per stage over 32 lanes
    assert len(copies) == 2 * config.kv_tile * (config.head_dim_qk // 8) // 32
    assert "selp.b32" in ptx and len(set(copies)) == len(copies) // 2  # one src-size per row, K and V share it
    assert ptx.count("and.b32") and len(re.findall(r"and\.b32\s+%r\d+, %r\d+, 112;", ptx)) >= len(copies)
    assert "cp.async.mbarrier.arrive.noinc.shared" in ptx
    assert "fence.proxy.async" in ptx
    assert "cp.async.bulk.tensor" not in ptx  # Q by vector loads, K/V by rows
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("kind, page_size, rank", [("gqa_paged_decode", 4, 3), ("gqa_paged_prefill", 4, 3)])
def test_raw_page_boxes_follow_the_descriptors_rank_with_one_kv_head(kind, page_size, rank):
    """One KV head: the DSL leaves the size-1 head mode (and the row mode at page 1) out of the tensor map, so the
    raw boxes must too. 4-D boxes on its 3-D map faulted the H200 at head_dim 256, h16/kv1, page 4."""
    decode = kind == "gqa_paged_decode"
    config = default_paged_config(kind, arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                  head_dim_qk=256 if decode else 128, head_dim_v=256 if decode else 128,
                                  page_size=page_size, causal=not decode)
    if not decode:  # prefill gathers rows at page 4 by default; its page boxes stay buildable (row_gather=False)
        config = dataclasses.replace(config, row_gather=False)
    ptx = compile_to_ptx(config)
    boxes = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes "
                       r"\[%r\d+\], \[%rd\d+, \{([^}]*)\}\]", ptx)
    assert boxes and {int(d) for d, _ in boxes} == {rank}
    assert all(len(coords.split(",")) == rank for _, coords in boxes)


@pytest.mark.parametrize("page_size", [8, 16])
def test_small_page_ptx_issues_one_box_per_page(page_size):
    config = next(c for c in gqa_decode.configs("sm_90a") if c.page_size == page_size)
    ptx = compile_to_ptx(config)
    pages = config.kv_tile // page_size
    # K and V, one TMA per page per 64-column half of the 128B swizzle (Q is loaded with vector loads)
    assert ptx.count("cp.async.bulk.tensor") == 2 * pages * config.head_dim_qk // 64
    # one elected lane issues them (common/tma_issue.py): addresses are the first box's stage base plus offsets
    offsets = sorted(set(raw_box_offsets(ptx)))
    assert min(o for o in offsets if o > 0) == 128 * page_size  # page i at row i * page_size
    assert ptx.count("elect.sync") < 8  # one election per stage, not per box
    assert "shfl.sync.idx.b32" in ptx  # ids one per lane, shuffled to the issuing lane
    assert "wgmma.mma_async" in ptx


@pytest.mark.parametrize("page_size, kv_tile", [(16, 64), (32, 128), (64, 128)])
def test_pages_of_16_and_more_may_take_several_per_stage(page_size, kv_tile):
    """A 64- or 128-key stage of several pages of 16+ keys: the sm_90a default at page 16 (64 keys, measured faster
    than one page per stage), opt-in for larger pages, which keep one page per stage by default."""
    base = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                head_dim_v=128, page_size=page_size, causal=False)
    assert base.kv_tile == (64 if page_size == 16 else page_size)
    config = dataclasses.replace(base, kv_tile=kv_tile)
    assert gqa_decode.check_config(config) is None
    assert gqa_decode.num_stages(config) % 2 == 0


@pytest.mark.parametrize("kind", ["gqa_paged_decode", "gqa_paged_multi_token_decode"])
@pytest.mark.parametrize("page_size", [1, 2])
def test_four_gathering_warps_split_each_stage(kind, page_size):
    """``gather_warps`` 4 (``ops/gqa_decode.GATHER_WARPS_PAGE_SIZES``, the sm_90a default at pages 1 and 2 since
    session 23): a producer warpgroup (384 threads, not 288) copies each stage's rows, a quarter a warp: a lane issues
    16 cp.async a stage instead of 64, each warp arrives on the full mbarrier for its own copies, nothing spills to
    local memory; the one-warp kernel stays buildable (``gather_warps`` 1)."""
    config = dataclasses.replace(_definition_config(), kind=kind, causal=kind != "gqa_paged_decode",
                                 page_size=page_size, kv_tile=64)
    wide = dataclasses.replace(config, gather_warps=4)
    assert config.gather_warps == 1 and wide.can_implement() is None and gqa_decode.check_config(wide) is None
    one, four = compile_to_ptx(config), compile_to_ptx(wide)
    copies = [len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) for ptx in (one, four)]
    assert copies == [2 * 64 * 16 // 32, 2 * 64 * 16 // 32 // 4]
    assert ".reqntid 288, 1, 1" in one and ".reqntid 384, 1, 1" in four
    assert "cp.async.mbarrier.arrive.noinc.shared" in four
    assert "ld.local" not in four and "st.local" not in four
    default = default_paged_config(kind, arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                   head_dim_v=128, page_size=page_size, causal=kind != "gqa_paged_decode")
    assert default.gather_warps == 4


@pytest.mark.parametrize("change, fragment", [
    (dict(gather_warps=3), "1 (the producer warp) or 4"),
    (dict(gather_warps=4, page_size=64, kv_tile=64), "TMA page boxes"),
    (dict(gather_warps=4, arch="sm_100a"), "sm_90a GQA decode"),
])
def test_gather_warps_where_no_kernel_builds_them_are_refused(change, fragment):
    config = dataclasses.replace(_definition_config(), page_size=1, kv_tile=64)
    config = dataclasses.replace(config, **change)
    reason = config.can_implement() or gqa_decode.check_config(config)
    assert reason is not None and fragment in reason

"""Compile-only tests of the sm_90a causal GQA paged prefill kernel (no GPU needed)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_attn.compile import compile_kernel, compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels import find_launcher
from cute_attn.kernels.sm90 import gqa_prefill

SMEM_LIMIT = 227 * 1024
# compile-time variants (PagedAttentionConfig fields, all off by default = the measured kernel)
VARIANTS = {
    "baseline": dict(intra_wg_overlap=False, smem_epilogue=False),
    "overlap": dict(intra_wg_overlap=True, smem_epilogue=False),
    "smem_epilogue": dict(intra_wg_overlap=False, smem_epilogue=True),
    "both": dict(intra_wg_overlap=True, smem_epilogue=True),
}


pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


def _config(**overrides):
    base = dict(arch="sm_90a", num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128, page_size=64,
                causal=True)
    base.update(overrides)
    return default_paged_config("gqa_paged_prefill", **base)


def test_registered_configs_include_the_definition_and_family():
    configs = gqa_prefill.configs("sm_90a")
    assert _config() in configs
    assert len(configs) >= 2
    assert any(c.page_size != 64 or c.group_size != 8 for c in configs)
    assert gqa_prefill.configs("sm_100a") == []
    for config in configs:
        assert gqa_prefill.check_config(config) is None


@pytest.mark.parametrize("index", range(len(gqa_prefill.configs("sm_90a"))))
def test_compiles_with_wgmma_and_tma(index):
    config = gqa_prefill.configs("sm_90a")[index]
    assert callable(compile_kernel(config))
    ptx = compile_to_ptx(config)
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "mbarrier.try_wait.parity" in ptx
    assert "setmaxnreg" in ptx
    assert "GqaPagedPrefillSm90" in ptx  # readable kernel symbol
    # one Q box (d / 64 swizzle-width copies) + one box per page per 64 columns for K and V; page 1: K/V rows by
    # cp.async instead (test_page_1_tiles_gather_rows_by_cp_async)
    pages = 0 if config.page_size in gqa_prefill.ROW_GATHER_PAGE_SIZES else config.kv_tile // config.page_size
    halves = config.head_dim_qk // 64
    # a self-scheduling row-gather build issues Q from two sites (its first hand-off and the loop's)
    q_sites = 2 if config.dynamic_schedule and not pages else 1
    assert ptx.count("cp.async.bulk.tensor") == q_sites * halves + 2 * halves * pages
    assert gqa_prefill.smem_bytes(config) <= SMEM_LIMIT
    # V rows that may hold pool garbage are zeroed 16 bytes a store (kernels/common/kv_tail.py), never element by
    # element (that loop was 30% of the kernel's instructions); pages of one key have no tail, so no zeroing at all
    assert not re.search(r"st\.shared\.(?:b|u)16", ptx)
    if not config.dynamic_schedule:  # (self-scheduling builds also store unit slots 16 bytes at a time)
        assert ptx.count("st.shared.v4.b32") == (0 if config.page_size == 1 else 1)


def test_self_scheduling_builds_take_units_from_a_counter():
    """The default call's planner-free builds (page 64 by TMA boxes, page 1 by row gathers): one atomic add a unit on
    the counter, the CTA's count out with acquire-release, no plan read (no work_indptr / items arguments)."""
    dynamic = [c for c in gqa_prefill.configs("sm_90a") if c.dynamic_schedule]
    assert sorted(c.page_size for c in dynamic) == [1, 64]
    for config in dynamic:
        ptx = compile_to_ptx(config)
        assert "_Dyn" in ptx
        assert "atom.global.add.u32" in ptx, "no unit counter"
        assert "atom.global.acq_rel.add.u32" in ptx, "no acquire-release count out"
        assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(page_size=256), "page_size"),
        (dict(num_qo_heads=160, num_kv_heads=1), "group size 160"),
        (dict(head_dim_qk=64, head_dim_v=128), "head_dim"),
        (dict(head_dim_qk=256, head_dim_v=256, page_size=128), "page_size=128 is not built at head_dim 256"),
        (dict(causal=False), "causal"),
    ],
)
def test_unsupported_configs_are_rejected_with_a_reason(overrides, words):
    config = _config(**overrides)
    reason = gqa_prefill.check_config(config)
    assert reason is not None and words in reason
    with pytest.raises(ValueError, match="page_size|group|head_dim|causal"):
        gqa_prefill.build(config)


def test_other_tiles_are_rejected():
    config = dataclasses.replace(_config(), tile_q_rows=64)
    assert "tile_q_rows" in gqa_prefill.check_config(config)


def test_public_api_finds_the_launcher():
    assert find_launcher(_config()) is gqa_prefill.launch


def test_measured_variants_are_the_default():
    # both flags on: n32 852 -> 707 us on the H200 (docs/perf-history.md, h200-prefill-variants.json)
    config = _config()
    assert config.intra_wg_overlap is True and config.smem_epilogue is True
    keys = {dataclasses.replace(config, **variant).cache_key() for variant in VARIANTS.values()}
    assert len(keys) == len(VARIANTS) and config.cache_key() in keys


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("index", range(len(gqa_prefill.configs("sm_90a"))))
def test_variants_compile_with_wgmma_and_tma(index, variant):
    config = dataclasses.replace(gqa_prefill.configs("sm_90a")[index], **VARIANTS[variant])
    assert gqa_prefill.check_config(config) is None
    assert callable(compile_kernel(config))
    ptx = compile_to_ptx(config)
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "setmaxnreg" in ptx
    assert gqa_prefill.smem_bytes(config) <= SMEM_LIMIT
    if config.intra_wg_overlap:
        assert "wgmma.wait_group.sync.aligned \t1;" in ptx  # the P V GEMM stays in flight during softmax
        assert "_OVL" in ptx
    if config.smem_epilogue:
        assert "stmatrix.sync.aligned" in ptx
        assert "st.global.v4.b32" in ptx  # 16-byte output stores
        assert "_SEPI" in ptx


@pytest.mark.parametrize("config", [
    dataclasses.replace(_config(), **VARIANTS["both"]),
    _config(num_qo_heads=16, num_kv_heads=2, head_dim_qk=256, head_dim_v=256),  # its default: overlap only
], ids=["d128_both", "d256_default"])
def test_overlap_wgmma_is_not_serialized(capfd, config):
    """ptxas serialises wgmma (warning C7512) when the overlapped loop needs more than 240 registers,
    e.g. when LLVM carries the fp32 scores instead of bf16 P across the loop; that would undo the overlap.
    At head_dim 256 the 64 x 256 fp32 O alone is 128 registers per consumer thread."""
    import tempfile

    import cutlass.cute as cute

    from cute_attn.arch import dsl_arch_options

    fn, args = gqa_prefill.build(config)
    with tempfile.TemporaryDirectory() as dump:
        cute.compile(fn, *args, no_jit_engine=True,
                     options=f"{dsl_arch_options(config.arch)} --keep-ptx --dump-dir {dump} remarks{{ptx}}")
    log = "".join(capfd.readouterr())
    assert "Used" in log and "registers" in log  # the ptxas report was captured
    assert "C7512" not in log and "serialized" not in log
    assert "0 bytes spill stores" in log


def test_a_group_of_five_loads_whole_tokens_in_125_q_rows():
    """Group 5 does not divide the 128-row tile: the Q box is 25 tokens x 5 heads, and its mbarrier expects
    exactly those bytes (125 x 128 x 2 = 32000; 32768 would never complete)."""
    config = _config(num_qo_heads=20, num_kv_heads=4)
    assert config.packed_rows_per_tile == 125 and gqa_prefill.check_config(config) is None
    ptx = compile_to_ptx(config)
    assert "32000" in ptx and "cp.async.bulk.tensor" in ptx


# ------------------------------------------------------------------------------------------ head_dim 256
def _d256(**overrides):
    return _config(num_qo_heads=16, num_kv_heads=2, head_dim_qk=256, head_dim_v=256, **overrides)


def test_head_dim_256_default_tiles_fit_one_sm():
    """128 rows x 64 keys, one Q stage: 64 KB Q + 2 stages x (K + V) x 32 KB = 192 KB (+ barriers, slack)."""
    config = _d256()
    assert (config.tile_q_rows, config.kv_tile) == (128, 64)
    assert config.intra_wg_overlap is True and config.smem_epilogue is False
    assert gqa_prefill.q_stages(256) == 1 and gqa_prefill.q_stages(128) == 2
    assert gqa_prefill.check_config(config) is None
    assert 192 * 1024 < gqa_prefill.smem_bytes(config) <= SMEM_LIMIT
    assert config in gqa_prefill.configs("sm_90a")
    assert find_launcher(config) is gqa_prefill.launch


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16, 32, 64])
def test_head_dim_256_pages_up_to_the_key_tile_are_accepted(page_size):
    assert _d256(page_size=page_size).can_implement() is None


@pytest.mark.parametrize("overrides, words", [
    (dict(page_size=128), "page_size=128 is not built at head_dim 256"),
    (dict(kv_tile=128), "kv_tile=128 must be one of (64,) at head_dim 256"),
    (dict(kv_tile=32), "kv_tile=32 must be one of (64,)"),
    (dict(tile_q_rows=64), "tile_q_rows=64"),
], ids=["page128", "kv128", "kv32", "m64"])
def test_head_dim_256_unbuildable_tiles_are_refused_with_a_reason(overrides, words):
    config = dataclasses.replace(_d256(), **overrides)
    assert words in (config.can_implement() or "")
    with pytest.raises(ValueError, match="page_size|kv_tile|tile_q_rows"):
        gqa_prefill.build(config)


def test_head_dim_256_ptx_uses_64_key_tiles():
    """S = Q K^T: 256 / 16 k-steps of m64n64k16, O += P V: 64 / 16 k-steps of m64n256k16, each at two sites
    (the overlap's first tile and its steady state); Q: 4 copies of 64 columns, K and V: 4 per page."""
    ptx = compile_to_ptx(_d256())
    assert ".target sm_90a" in ptx and "_D256_" in ptx and "_N64_" in ptx
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == 2 * 16
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == 2 * 4
    assert ptx.count("cp.async.bulk.tensor") == 4 + 2 * 4
    assert "wgmma.wait_group.sync.aligned \t1;" in ptx
    # one Q stage: the Q box's mbarrier expects 128 rows x 256 x 2 bytes
    assert "65536" in ptx


@pytest.mark.parametrize("row_segments", [None, False], ids=["segments", "chunk_columns"])
@pytest.mark.parametrize("page_size", gqa_prefill.ROW_GATHER_PAGE_SIZES)
def test_page_1_tiles_gather_rows_by_cp_async(page_size, row_segments):
    """Page 1: each 128-key K or V tile is 16 branch-free 16-byte cp.async per lane of the four producer warps (128
    one-row TMA boxes a tile held decode page 1 to 43% of page 64; one warp gathering it all, 442 us), swizzled, completing on the tile's mbarrier (one noinc arrive
    each), fenced by the consumers before every wgmma that reads them. Both deals of the rows: 128-byte segments
    (the default: a lane's chunks of one row at constant offsets) and chunk columns (one swizzled address each)."""
    config = dataclasses.replace(next(c for c in gqa_prefill.configs("sm_90a") if c.page_size == 1
                                      and c.head_dim_qk == 128), page_size=page_size, row_segments=row_segments)
    ptx = compile_to_ptx(config)
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+(?:\+\d+)?\], \[g\], 16, %r\d+;", ptx)
    # each of the producer warpgroup's four warps copies a quarter of the K and V tiles' rows
    assert len(copies) == 2 * (config.kv_tile // 4) * (config.head_dim_qk // 8) // 32
    if row_segments is False:
        assert len(re.findall(r"and\.b32\s+%r\d+, %r\d+, 112;", ptx)) >= len(copies)  # the 128B swizzle
    else:
        assert "_RowSeg" in ptx
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared") == 2  # K, V
    # 4 K / V waits of the overlapped main loop, the epilogue, and (pages of 2+ keys) the V tail's zeroing
    assert ptx.count("fence.proxy.async") >= (5 if page_size == 1 else 6)
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("page_size,row_gather", [(4, True), (1, False)])
def test_row_gather_knob_chooses_rows_or_page_boxes(page_size, row_gather):
    """``row_gather`` overrides the page-size policy (a tuning.sweep A/B in one process): rows issue no K/V box,
    boxes no row copy."""
    base = next(c for c in gqa_prefill.configs("sm_90a") if c.page_size == 1 and c.head_dim_qk == 128)
    config = dataclasses.replace(base, page_size=page_size, row_gather=row_gather)
    assert gqa_prefill.check_config(config) is None
    ptx = compile_to_ptx(config)
    halves = config.head_dim_qk // 64
    pages = 0 if row_gather else config.kv_tile // page_size
    # a self-scheduling row-gather build issues Q from two sites (its first hand-off and the loop's)
    q_sites = 2 if config.dynamic_schedule and not pages else 1
    assert ptx.count("cp.async.bulk.tensor") == q_sites * halves + 2 * halves * pages
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[g\], 16, %r\d+;", ptx)
    assert len(copies) == (2 * (config.kv_tile // 4) * (config.head_dim_qk // 8) // 32 if row_gather else 0)


def test_row_gather_is_refused_where_no_kernel_gathers_rows():
    from cute_attn.config import PagedAttentionConfig

    base = next(c for c in gqa_prefill.configs("sm_90a") if c.page_size == 1 and c.head_dim_qk == 128)
    assert "at most 8 keys" in gqa_prefill.check_config(dataclasses.replace(base, page_size=16, row_gather=True))
    assert "sm_90a kernels only" in dataclasses.replace(base, arch="sm_100a", row_gather=True).can_implement()
    mla = PagedAttentionConfig(arch="sm_90a", kind="mla_paged_prefill", num_qo_heads=16, num_kv_heads=1,
                               head_dim_qk=576, head_dim_v=512, page_size=1, tile_q_rows=64, kv_tile=64,
                               row_gather=False)
    assert "TMA boxes are 8-key groups" in mla.can_implement()
    assert "sm_90a kernels only" in dataclasses.replace(mla, arch="sm_100a", row_gather=True).can_implement()

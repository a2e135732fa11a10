"""sm_100a GQA paged decode: compile-only checks (CPU; there is no Blackwell GPU to run it on).

Compiles the registered configs through the one compile path and inspects the PTX for the tcgen05 /
TMEM / TMA instructions the design relies on, and that their counts and widths follow the config (page
size, head_dim), plus the kernel's own shared-memory and TMEM budgets and the configs it refuses.
"""

import dataclasses
import re

import pytest
from ptx_boxes import raw_box_offsets

from cute_attn.compile import compile_kernel, compile_kernel_with_info, compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels import find_launcher
from cute_attn.kernels.common.tma_issue import GATHER4_PAGE_SIZES
from cute_attn.kernels.sm100 import gqa_decode

ARCH = "sm_100a"
CONFIGS = gqa_decode.configs(ARCH)
FAMILY_SHAPES = {(16, 128), (128, 128), (64, 64), (64, 256), (1, 128), (8, 128)}  # (page_size, head_dim) CI compiles


def _config_id(c):
    return f"h{c.num_qo_heads}_kv{c.num_kv_heads}_p{c.page_size}_d{c.head_dim_v}"


def _decode(page_size, head_dim):
    return default_paged_config("gqa_paged_decode", arch=ARCH, num_qo_heads=32, num_kv_heads=8,
                                head_dim_qk=head_dim, head_dim_v=head_dim, page_size=page_size, causal=False)


pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


def test_definition_config_is_registered():
    definition = default_paged_config("gqa_paged_decode", arch=ARCH, num_qo_heads=20, num_kv_heads=4,
                                      head_dim_qk=128, head_dim_v=128, page_size=64, causal=False)
    assert definition in CONFIGS
    assert find_launcher(definition) is gqa_decode.launch
    assert gqa_decode.configs("sm_90a") == []
    assert FAMILY_SHAPES <= {(c.page_size, c.head_dim_v) for c in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_compiles_with_tcgen05_tmem_and_tma(config):
    assert gqa_decode.check_config(config) is None
    info = compile_kernel_with_info(config)
    assert callable(info.fn) and info.object_path.suffix == ".o"
    assert compile_kernel(config) is info.fn  # memoised
    ptx = compile_to_ptx(config)
    assert f".target {ARCH}" in ptx
    for needle in (
        "tcgen05.mma.cta_group::1.kind::f16",  # S = Q.K^T (smem x smem) and O += P.V (P from TMEM)
        "tcgen05.alloc",
        "tcgen05.dealloc",
        "tcgen05.ld.sync.aligned.32x32b",  # S and O rows out of TMEM
        "tcgen05.st.sync.aligned.32x32b",  # P and the rescaled O back into TMEM
        "tcgen05.commit",
        "cp.async.bulk.tensor",  # TMA: Q tile, K/V pages
        "mbarrier.try_wait.parity",
        "ex2.approx",
        "fence.proxy.async.shared::cta",  # V tail zeroed in smem before the P.V MMA reads it
        "fence.acq_rel.gpu",  # fused merge: partials released before the arrival, acquired before the fold
    ):
        assert needle in ptx, needle
    assert re.search(r"\b(atom|red)\.global\S*\.add", ptx)  # the fused merge's arrival counter
    # P.V reads its A operand (P) from TMEM: "tcgen05.mma... [d_tmem], [a_tmem], b_desc, ..."
    assert re.search(r"tcgen05\.mma\S*\s+\[[^\]]+\],\s*\[", ptx)

    page, head_dim = gqa_decode.step_keys(config), config.head_dim_v  # keys per step: the page, or kv_tile
    pages_per_step = page // config.page_size
    # unrolled MMAs: K = 16 per instruction, head_dim / 16 for S = Q.K^T and page / 16 for O += P.V
    assert len(re.findall(r"\btcgen05\.mma\.", ptx)) == head_dim // 16 + page // 16
    # S rows out in one load of page_size columns, P back in one store of page_size / 2 (bf16 pairs)
    assert f"tcgen05.ld.sync.aligned.32x32b.x{page}.b32" in ptx
    assert f"tcgen05.st.sync.aligned.32x32b.x{page // 2}.b32" in ptx
    # the plan's column count reaches tcgen05.alloc ([holder], ncols) and tcgen05.dealloc (taddr, ncols)
    _, allocated = gqa_decode.tmem_columns(config)
    for op in ("alloc", "dealloc"):
        m = re.search(rf"mov\.b32\s+(%r\d+),\s*(\d+);\s*tcgen05\.{op}\S*\s+[^;]*,\s*\1;", ptx)
        assert m is not None and int(m.group(2)) == allocated, op
    # one TMA per 64-column box of the Q tile and of each K page and V page of a step (page 1: one gather4 per
    # four pages)
    boxes = gqa_decode.tma_boxes_per_tile(head_dim)
    assert boxes == head_dim // 64
    page_loads = pages_per_step // 4 if config.page_size in GATHER4_PAGE_SIZES else pages_per_step
    assert ptx.count("cp.async.bulk.tensor") == (1 + 2 * page_loads) * boxes
    assert len(re.findall(r"\batom\.global\S*\.add", ptx)) == 1  # one arrival per split item


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_shared_memory_and_tmem_budgets(config):
    assert gqa_decode.smem_bytes(config) <= 227 * 1024
    used, allocated = gqa_decode.tmem_columns(config)
    assert used <= allocated <= 512
    assert allocated & (allocated - 1) == 0  # tcgen05.alloc takes a power of two >= 32


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_tmem_plan_regions_are_aligned_and_disjoint(config):
    plan = gqa_decode.tmem_plan(config)
    page, head_dim = gqa_decode.step_keys(config), config.head_dim_v
    regions = [(plan.s_col[0], page), (plan.s_col[1], page), (plan.p_col, page // 2), (plan.o_col, head_dim)]
    assert all(start % 32 == 0 for start, _ in regions)
    ends = [start + width for start, width in regions]
    assert all(end <= next_start for end, (next_start, _) in zip(ends, regions[1:]))
    assert plan.end == ends[-1] <= plan.alloc <= 512
    assert gqa_decode.kv_stages(config) >= 2


def test_definition_plan_is_unchanged():
    definition = CONFIGS[0]
    assert gqa_decode.tmem_plan(definition) == ((0, 64), 128, 256, 384, 512)
    assert gqa_decode.kv_stages(definition) == 4


@pytest.mark.parametrize("page_size,head_dim,stages,allocated", [
    (16, 128, 16, 256),  # 8 KiB stages: 16 fill the 128 KiB ring; S/P/O end at column 256
    (128, 128, 2, 512),  # 64 KiB stages: 2 in the ring; O [384, 512)
    (64, 256, 2, 512),  # 64 KiB Q + 2 x 64 KiB stages under 227 KiB; O [256, 512)
    (128, 64, 4, 512),  # O [320, 384)
])
def test_plan_follows_the_config(page_size, head_dim, stages, allocated):
    config = _decode(page_size, head_dim)
    assert gqa_decode.check_config(config) is None
    assert gqa_decode.kv_stages(config) == stages
    assert gqa_decode.tmem_columns(config)[1] == allocated
    assert gqa_decode.smem_bytes(config) <= 227 * 1024


@pytest.mark.parametrize("change,words", [
    (dict(page_size=8, kv_tile=16), "page_size=8"),  # a step of small pages is 32..128 keys
    (dict(page_size=1, kv_tile=128), "at most 64 pages"),
    (dict(page_size=256, kv_tile=256), "page_size=256"),  # the GQA shape rules refuse it first
    (dict(head_dim_qk=96, head_dim_v=96), "head_dim"),  # the GQA shape rules refuse it first
    (dict(head_dim_qk=128, head_dim_v=64), "head_dim"),
    (dict(page_size=128, kv_tile=128, head_dim_qk=256, head_dim_v=256), "TMEM"),
    (dict(ctas_per_sm=2), "TMEM"),
    (dict(arch="sm_90a"), "sm_100a"),
    (dict(causal=True), "causal"),
])
def test_rejects_what_it_does_not_implement(change, words):
    config = dataclasses.replace(CONFIGS[0], **change)
    reason = gqa_decode.check_config(config)
    assert reason is not None and words in reason
    with pytest.raises(ValueError):
        gqa_decode.build(config)


@pytest.mark.parametrize("page_size", [1, 2, 4, 8])
def test_small_pages_step_over_kv_tile_keys(page_size):
    """Pages of 1..8 keys: a step (ring stage, S MMA N) is kv_tile = 64 keys of 64 / page_size page boxes, so the
    TMEM plan and ring are those of page 64."""
    config = _decode(page_size, 128)
    assert config.kv_tile == 64 and gqa_decode.check_config(config) is None
    assert gqa_decode.step_keys(config) == 64
    assert gqa_decode.tmem_plan(config) == gqa_decode.tmem_plan(_decode(64, 128))
    assert gqa_decode.kv_stages(config) == gqa_decode.kv_stages(_decode(64, 128))


def test_page_two_boxes_are_two_rows_apart():
    config = next(c for c in CONFIGS if c.page_size == 1)
    ptx = compile_to_ptx(dataclasses.replace(config, page_size=2))
    # one elected lane issues the stage's boxes (common/tma_issue.py): addresses are the first box's plus offsets
    offsets = raw_box_offsets(ptx, rank="4")
    assert [o for o in offsets if 0 < o < 8192][:2] == [256, 512]  # page i at row 2 i: 256 bytes
    assert ptx.count("elect.sync") < 100  # not one election per box (64+ per stage)


def test_page_one_steps_are_tma_gather4_boxes():
    """Page 1: a 64-key step's K and V are tile::gather4 boxes, four pages an instruction (16 quads x 2 column
    blocks each at head_dim 128) over two 2-D tensor maps (the caches as rows of pages), from one elected lane;
    no one-row boxes are left (Q's box is the only other TMA load)."""
    config = next(c for c in CONFIGS if c.page_size == 1)
    ptx = compile_to_ptx(config)
    gathers = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4\.mbarrier::"
                         r"complete_tx::bytes \[%r\d+\], \[%rd(\d+), \{%r\d+, %r\d+, %r\d+, %r\d+, %r\d+\}\], ", ptx)
    assert len(gathers) == 2 * (config.kv_tile // 4) * (config.head_dim_qk // 64)
    assert len(set(gathers)) == 2  # K's and V's maps
    others = [line for line in ptx.splitlines() if "cp.async.bulk.tensor" in line and "gather4" not in line]
    assert len(others) <= 2, others  # Q
    assert ptx.count("elect.sync") < 40  # one election per step's boxes, not one per box
    assert "shfl.sync.idx.b32" in ptx  # ids one per lane, shuffled to the issuing lane


def test_page_128_head_dim_256_names_the_tmem_columns():
    reason = gqa_decode.check_config(_decode(128, 256))
    assert reason is not None and "768 of 512 columns" in reason

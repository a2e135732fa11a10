"""Compile-only tests of the sm_100a causal GQA paged prefill kernel (CPU; no Blackwell GPU anywhere).

These prove the kernel traces, lowers and emits the Blackwell instructions it is built from; they say
nothing about its numerics, which have never been run.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest

from cute_attn.compile import compile_kernel, compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels import find_launcher
from cute_attn.kernels.common.tma_issue import GATHER4_PAGE_SIZES
from cute_attn.kernels.sm100 import gqa_prefill
from ptx_boxes import raw_box_offsets

SMEM_LIMIT = 227 * 1024
TMEM_LIMIT = 512


pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


def _config(dynamic_schedule=False, **overrides):
    base = dict(arch="sm_100a", num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128, page_size=64,
                causal=True)
    base.update(overrides)
    return dataclasses.replace(default_paged_config("gqa_paged_prefill", **base), dynamic_schedule=dynamic_schedule)


def _d256(**overrides):
    base = dict(num_qo_heads=16, num_kv_heads=2, head_dim_qk=256, head_dim_v=256)
    base.update(overrides)
    return _config(**base)


def test_registered_configs_are_the_definition_group_five_and_page_one():
    configs = gqa_prefill.configs("sm_100a")
    assert configs == [_config(), _config(num_qo_heads=20, num_kv_heads=4), _config(page_size=1),
                       _d256(), _d256(num_kv_heads=8, page_size=16), _d256(page_size=1),
                       _config(dynamic_schedule=True), _config(page_size=1, dynamic_schedule=True)]
    assert gqa_prefill.configs("sm_90a") == []
    assert find_launcher(_config()) is gqa_prefill.launch


@pytest.mark.parametrize("config", gqa_prefill.configs("sm_100a"), ids=str)
def test_resources_fit_one_sm(config):
    assert gqa_prefill.check_config(config) is None
    assert gqa_prefill.smem_bytes(config) <= SMEM_LIMIT
    assert gqa_prefill.tmem_columns(config) <= gqa_prefill.TMEM_COLUMNS <= TMEM_LIMIT


def _check_ptx(config, ptx: str):
    assert ".target sm_100a" in ptx
    for instr in ("tcgen05.mma", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.st",
                  "tcgen05.commit", "cp.async.bulk.tensor", "mbarrier.try_wait.parity", "setmaxnreg"):
        assert instr in ptx, instr
    assert "GqaPagedPrefillSm100" in ptx  # readable kernel symbol
    # S = Q K^T (d / 16 k-blocks) and O += P V (kv_tile / 16 k-blocks), issued at two sites each (first tile /
    # steady state): 8 + 8 at head_dim 128, 16 + 4 at head_dim 256 (64-key tiles)
    qk_blocks, pv_blocks = config.head_dim_qk // 16, config.kv_tile // 16
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16[^;]*;", ptx)
    assert len(mmas) == 2 * qk_blocks + 2 * pv_blocks
    assert sum("], [" in m for m in mmas) == 2 * pv_blocks  # P V: A operand (P) read from TMEM
    # Q: one box per 64-column swizzle half; K and V: one box per page per half (page 1: one gather4 per four
    # pages), 4 load sites
    pages = config.kv_tile // config.page_size
    page_loads = pages // 4 if config.page_size in GATHER4_PAGE_SIZES else pages
    halves = config.head_dim_qk // 64
    assert ptx.count("cp.async.bulk.tensor") == halves + 4 * page_loads * halves
    # the MMA warp zeroes V rows that may hold pool garbage 16 bytes a store (kernels/common/kv_tail.py); page 1
    # has no page tails, so no zeroing
    assert not re.search(r"st\.shared\.(?:b|u)16", ptx)
    if not config.dynamic_schedule:  # (self-scheduling builds also write their unit ring 16 bytes at a time)
        assert ("st.shared.v4" in ptx) == (config.page_size > 1)


@pytest.mark.parametrize("config", gqa_prefill.configs("sm_100a"), ids=str)
def test_registered_config_compiles_with_tcgen05(config):
    assert callable(compile_kernel(config))
    _check_ptx(config, compile_to_ptx(config))


@pytest.mark.parametrize("overrides", [dict(page_size=16), dict(num_kv_heads=8)], ids=["ps16", "group4"])
def test_family_members_compile(overrides):
    config = _config(**overrides)
    assert gqa_prefill.check_config(config) is None
    _check_ptx(config, compile_to_ptx(config))


def test_unsupported_configs_are_refused_with_a_reason():
    assert "sm_100a" in gqa_prefill.check_config(_config(arch="sm_90a"))
    assert "head_dim" in gqa_prefill.check_config(_config(head_dim_qk=64, head_dim_v=64))
    assert "group size 160" in gqa_prefill.check_config(_config(num_qo_heads=160, num_kv_heads=1))
    assert "tile_q_rows and kv_tile must be 128" in gqa_prefill.check_config(
        dataclasses.replace(_config(), kv_tile=64))
    with pytest.raises(ValueError):
        gqa_prefill.GqaPagedPrefillSm100(_config(head_dim_qk=64, head_dim_v=64))


def test_head_dim_256_budgets():
    """128 x 64 tiles: one 64 KB Q stage + a 4-stage ring of 32 KB K/V tiles; TMEM 2 x 64 S + 256 O columns."""
    config = _d256()
    assert (config.tile_q_rows, config.kv_tile) == (128, 64)
    assert gqa_prefill.stages(256) == (1, 4) and gqa_prefill.stages(128) == (2, 4)
    assert gqa_prefill.check_config(config) is None
    assert 192 * 1024 < gqa_prefill.smem_bytes(config) <= SMEM_LIMIT
    assert gqa_prefill.tmem_columns(config) == 384
    assert find_launcher(config) is gqa_prefill.launch


@pytest.mark.parametrize("overrides, words", [
    (dict(page_size=128), "page_size=128 is not built at head_dim 256"),
    (dict(kv_tile=128), "at head_dim 256 tile_q_rows must be 128 and kv_tile 64"),
], ids=["page128", "kv128"])
def test_head_dim_256_unbuildable_tiles_are_refused_with_a_reason(overrides, words):
    config = dataclasses.replace(_d256(), **overrides)
    assert words in (config.can_implement() or "")
    with pytest.raises(ValueError, match="head_dim 256"):
        gqa_prefill.build(config)


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16, 32, 64])
def test_head_dim_256_pages_up_to_the_key_tile_are_accepted(page_size):
    assert _d256(page_size=page_size).can_implement() is None


def test_head_dim_256_mma_shapes():
    """S is a 128 x 64 tcgen05 tile (N = 64 in the instruction descriptor), O a 128 x 256 one; the MMA warp runs
    at setmaxnreg 112 (16 QK k-blocks per tile)."""
    ptx = compile_to_ptx(_d256())
    assert "_D256_" in ptx and "_N64_" in ptx
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+112;", ptx)
    assert not re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+64;", ptx)  # no warp left at 64
    assert "tcgen05.alloc" in ptx and "cp.async.bulk.tensor" in ptx


@pytest.mark.parametrize("page_size", [1, 2, 4, 8])
def test_small_pages_are_accepted(page_size):
    """Pages below the 8-row swizzle atom are one TMA box each at a row offset of the 128B-swizzled stage."""
    assert gqa_prefill.check_config(_config(page_size=page_size)) is None


def test_page_two_boxes_are_two_rows_apart_and_take_lane_ids():
    ptx = compile_to_ptx(_config(page_size=2))
    # one elected lane issues the stage's boxes (common/tma_issue.py): addresses are the first box's plus offsets
    offsets = raw_box_offsets(ptx, rank="4")
    assert [o for o in offsets if 0 < o < 8192][:2] == [256, 512]  # page i at row 2 i: 256 bytes
    assert ptx.count("elect.sync") < 100  # not one election per box (128+ per stage)
    assert "shfl.sync.idx.b32" in ptx  # ids loaded one per lane, shuffled to the issuing lane


def test_page_one_tiles_are_tma_gather4_boxes():
    """Page 1: a 128-key K or V tile is 32 tile::gather4 boxes (four pages an instruction, 2 column blocks at
    head_dim 128) over 2-D tensor maps of the caches as rows of pages; no one-row boxes (Q's box only)."""
    config = _config(page_size=1)
    ptx = compile_to_ptx(config)
    gathers = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4\.mbarrier::"
                         r"complete_tx::bytes \[%r\d+\], \[%rd(\d+), \{%r\d+, %r\d+, %r\d+, %r\d+, %r\d+\}\], ", ptx)
    per_tile = (config.kv_tile // 4) * (config.head_dim_qk // 64)
    assert len(gathers) == 4 * per_tile  # the load role's four sites (K0, Kj, V(j-1), the last V)
    others = [line for line in ptx.splitlines() if "cp.async.bulk.tensor" in line and "gather4" not in line]
    assert len(others) <= 2, others  # Q
    assert "shfl.sync.idx.b32" in ptx


def _ptxas_13():
    path = shutil.which("ptxas")
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release (\d+)\.", out)
    return path if match and int(match.group(1)) >= 13 else None


@pytest.mark.skipif(_ptxas_13() is None, reason="needs a CUDA 13 ptxas (sm_100a)")
@pytest.mark.parametrize("variant", ["d128", "d256", "d128_page1"])
def test_ptxas_assembles_without_real_spills(tmp_path, variant):
    """ptxas accepts the PTX for sm_100a and the setmaxnreg budget leaves no real spills (page 1: the gather4
    issue keeps 16 page ids live; all 128 of a tile spilled 1.4 KB at the load warps' 64 registers).

    The DSL emits PTX ISA 9.4; a CUDA 13.0 ptxas reads 9.0, so the header is lowered for this check.
    """
    ptx = compile_to_ptx({"d128": _config(), "d256": _d256(), "d128_page1": _config(page_size=1)}[variant])
    src = tmp_path / "k.ptx"
    src.write_text(re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx, count=1, flags=re.M))
    out = subprocess.run([_ptxas_13(), "-arch=sm_100a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    if "Unsupported .version" in out.stderr:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0, out.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.stderr)]
    assert spills and max(spills) <= (32 if variant == "d128_page1" else 16), out.stderr


def test_a_group_of_five_loads_whole_tokens_in_125_q_rows():
    """Group 5 does not divide the 128-row tile: the Q box is 25 tokens x 5 heads, and its mbarrier expects
    exactly those bytes (125 x 128 x 2 = 32000; 32768 would never complete)."""
    config = _config(num_qo_heads=20, num_kv_heads=4)
    assert config.packed_rows_per_tile == 125 and gqa_prefill.check_config(config) is None
    ptx = compile_to_ptx(config)
    assert "32000" in ptx and "cp.async.bulk.tensor" in ptx


@pytest.mark.parametrize("page_size", [64, 1])
def test_self_scheduling_twin_sends_units_to_every_role(page_size):
    """The sm_90a self-scheduling build's twin: one relaxed atomic add a unit on the counter, the correction warps'
    count out with acquire-release, the unit pipeline's mbarriers (a ring of 4 entries: 2 x 4 inits beyond the planned
    build's), the planned build's MMAs and loads exactly, and no partial (split) store."""
    config = _config(page_size=page_size, dynamic_schedule=True)
    ptx = compile_to_ptx(config)
    planned = compile_to_ptx(dataclasses.replace(config, dynamic_schedule=False))
    assert "_Dyn" in ptx and "GqaPagedPrefillSm100" in ptx
    assert "atom.global.add.u32" in ptx, "no unit counter"
    assert "atom.global.acq_rel.add.u32" in ptx, "no acquire-release count out"
    assert ptx.count("mbarrier.init") == planned.count("mbarrier.init") + 2 * 4
    for instr in ("tcgen05.mma", "cp.async.bulk.tensor"):
        assert ptx.count(instr) == planned.count(instr), instr
    # split items' fp32 partial rows leave as st.global.v2.b64 in the planned build; a unit is never split
    assert "st.global.v2.b64" in planned and "st.global.v2.b64" not in ptx

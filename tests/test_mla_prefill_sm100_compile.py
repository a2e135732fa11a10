"""Compile-only tests of the sm_100a causal absorbed-MLA paged prefill kernel (CPU; no Blackwell GPU anywhere).

These prove the kernel traces, lowers and emits the Blackwell instructions it is built from; they say
nothing about its numerics, which have never been run.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

import pytest
from ptx_ids import BOUNDS_CHECK, prefetched_bounds_checks

from cute_attn.compile import compile_kernel, compile_to_ptx
from cute_attn.kernels import find_launcher
from cute_attn.kernels.sm100 import mla_prefill

SMEM_LIMIT = 227 * 1024
TMEM_LIMIT = 512

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")

# the page id just loaded from kv_indices is compared with -1 (>= 0) and with num_pages (a kernel parameter)
# before it becomes a row id; otherwise the id is -1 (a zero-filled row, never gathered)


def _config(**overrides):
    return dataclasses.replace(mla_prefill.definition_config("sm_100a"), **overrides)


def _idesc(value: int) -> dict:
    """Fields of a tcgen05 kind::f16 instruction descriptor."""
    return dict(m=((value >> 24) & 0x1F) << 4, n=((value >> 17) & 0x3F) << 3, a_mn_major=bool(value >> 15 & 1),
                b_mn_major=bool(value >> 16 & 1), d_f32=(value >> 4 & 3) == 1, a_bf16=(value >> 7 & 7) == 1,
                b_bf16=(value >> 10 & 7) == 1)


def test_registered_configs_are_the_definition():
    configs = mla_prefill.configs("sm_100a")
    # the ps1 and ps64 definitions, then their self-scheduling builds
    assert configs == [_config(), _config(page_size=64), _config(dynamic_schedule=True),
                       _config(page_size=64, dynamic_schedule=True)]
    assert all((c.tile_q_rows, c.kv_tile) == (64, 64) for c in configs)
    assert mla_prefill.configs("sm_90a") == []
    assert find_launcher(_config()) is mla_prefill.launch


@pytest.mark.parametrize("config", mla_prefill.configs("sm_100a"), ids=str)
def test_resources_fit_one_sm(config):
    assert mla_prefill.check_config(config) is None
    assert mla_prefill.smem_bytes(config) <= SMEM_LIMIT
    # O^T: 4 chunks x 64 query rows; S: 2 stages x 64 keys
    assert mla_prefill.tmem_columns(config) == 4 * 64 + 2 * 64 <= TMEM_LIMIT


@pytest.mark.parametrize("config", mla_prefill.configs("sm_100a"), ids=str)
def test_registered_config_compiles_with_tcgen05(config):
    assert callable(compile_kernel(config))
    ptx = compile_to_ptx(config)
    assert ".target sm_100a" in ptx
    for instr in ("tcgen05.mma", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.st", "tcgen05.commit",
                  "cp.async.cg.shared.global", "cp.async.wait_group", "fence.proxy.async.shared::cta",
                  "mbarrier.try_wait.parity", "setmaxnreg"):
        assert instr in ptx, instr
    assert "MlaPagedPrefillSm100" in ptx  # readable kernel symbol
    # S = Q K^T: 36 k-blocks (576 / 16); O^T += V^T P^T: 4 chunks x 4 k-blocks; each at two issue sites
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16[^;]*;", ptx)
    assert len(mmas) == 2 * 36 + 2 * 16
    descs = {int(v) for v in re.findall(r"mov\.b32\s+%r\d+, (\d+);\s*\n\s*tcgen05\.mma", ptx)}
    fields = sorted((_idesc(v) for v in descs), key=lambda f: f["m"])
    assert [(f["m"], f["n"], f["a_mn_major"], f["b_mn_major"]) for f in fields] == [
        (64, 64, False, False),  # S: M=64 query rows, N=64 keys, Q and K K-major
        (128, 64, True, False),  # O^T: M=128 V columns (V^T MN-major view of ckv), N=64 query rows
    ]
    assert all(f["d_f32"] and f["a_bf16"] and f["b_bf16"] for f in fields)
    # S read with one 32x32b.x64 load per stage; O^T rescaled / read out in 32-column pieces
    assert "tcgen05.ld.sync.aligned.32x32b.x64" in ptx
    assert "tcgen05.st.sync.aligned.32x32b.x32" in ptx


@pytest.mark.parametrize("overrides, words", [
    (dict(arch="sm_90a"), "sm_100a"),
    (dict(tile_q_rows=128), "tile_q_rows"),
    (dict(kv_tile=32), "kv_tile"),
    (dict(causal=False), "causal"),
    (dict(ctas_per_sm=2), "ctas_per_sm"),
    (dict(num_qo_heads=24), "group size"),
    (dict(page_size=48), "page_size=48 must be a power of two"),
    (dict(page_size=256), "page_size=256 must be a power of two in 1..128"),
], ids=["arch", "m128", "n32", "noncausal", "2ctas", "group24", "ps48", "ps256"])
def test_unsupported_configs_are_refused_with_a_reason(overrides, words):
    reason = mla_prefill.check_config(_config(**overrides))
    assert reason is not None and words in reason
    with pytest.raises(ValueError):
        mla_prefill.MlaPagedPrefillSm100(_config(**overrides))


@pytest.mark.parametrize("page_size", [1, 64, 128])
def test_paged_latent_rows_compile_with_bounds_checked_ids(page_size):
    """Key j's row is page * page_size + j % page_size (shift + mask), and its page id is range-checked."""
    config = _config(page_size=page_size)
    assert mla_prefill.check_config(config) is None
    ptx = compile_to_ptx(config)
    assert ".target sm_100a" in ptx and "cp.async.cg.shared.global" in ptx
    assert len(BOUNDS_CHECK.findall(ptx)) == 1 and prefetched_bounds_checks(ptx) == 1
    if page_size > 1:
        shift = page_size.bit_length() - 1
        assert re.search(rf"shr\.s32\s+%r\d+, %r\d+, {shift};", ptx)  # page position j // page_size
        assert re.search(rf"shl\.b32\s+%r\d+, %r\d+, {shift};", ptx)  # page * page_size
        assert re.search(rf"and\.b32\s+%r\d+, %r\d+, {page_size - 1};", ptx)  # slot j % page_size


@pytest.mark.parametrize("page_size", [1, 64])
def test_key_stages_are_tma_gather4_boxes(page_size):
    """A K stage is 16 row quads x (8 ckv + 1 kpe) 64-column ``tile::gather4`` boxes from one thread (latent row
    ids four at a time, -1 zero-filled as out of the map), completing on the stage's mbarrier by its 64 x 576 x 2
    bytes; only Q's rows are 16-byte cp.async."""
    config = _config(page_size=page_size)
    ptx = compile_to_ptx(config)
    gathers = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4\.mbarrier::"
                         r"complete_tx::bytes \[%r\d+\], \[%rd(\d+), \{(\d+), %r\d+, %r\d+, %r\d+, %r\d+\}\], "
                         r"\[%r\d+\];", ptx)
    assert len(gathers) == config.kv_tile // 4 * 9
    columns = sorted({int(col) for _, col in gathers})
    assert columns == [64 * c for c in range(8)]  # ckv blocks; kpe's block is column 0 of its own map
    assert len({desc for desc, _ in gathers}) == 2  # the ckv and kpe tensor maps
    assert str(config.kv_tile * 576 * 2) in ptx  # the stage's transaction bytes
    assert ptx.count("cp.async.cg.shared.global") == 4  # Q: nope (two unrolled passes) and pe rows


def test_shares_the_load_role_without_importing_the_sm90_kernel():
    """The load role lives in ``kernels/common``; an arch's kernel module never imports the other arch's."""
    tree = ast.parse(inspect.getsource(mla_prefill))
    modules = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any("sm90" in module for module in modules), modules
    assert "common.mla" in modules


@pytest.mark.parametrize("page_size", [1, 64])
def test_self_scheduling_twin_sends_units_to_every_role(page_size):
    """The sm_90a self-scheduling MLA build's twin: one relaxed atomic add a unit on the counter (two sites: the first
    unit and the one fetched under each unit's loads), the correction warps' count out with acquire-release, the unit
    pipeline's mbarriers (4 entries: 2 x 4 inits beyond the planned build's), the planned build's MMAs and gather4
    boxes exactly, and no partial rows: the planned build stores split items' fp32 partials one word at a time (256
    st.global.b32 sites), the self-scheduling one only lse, the error word and the state's reset."""
    config = _config(page_size=page_size, dynamic_schedule=True)
    assert mla_prefill.check_config(config) is None and mla_prefill.smem_bytes(config) <= SMEM_LIMIT
    ptx = compile_to_ptx(config)
    planned = compile_to_ptx(_config(page_size=page_size))
    assert "_Dyn" in ptx and "MlaPagedPrefillSm100" in ptx
    assert ptx.count("atom.global.add.u32") == 2, "no unit counter"
    assert "atom.global.acq_rel.add.u32" in ptx, "no acquire-release count out"
    assert ptx.count("mbarrier.init") == planned.count("mbarrier.init") + 2 * 4
    for instr in ("tcgen05.mma", "tile::gather4"):
        assert ptx.count(instr) == planned.count(instr) > 0, instr
    assert planned.count("st.global.b32") >= 256 > 64 > ptx.count("st.global.b32")


def test_self_scheduling_twin_refuses_fused_merge():
    reason = mla_prefill.check_config(_config(dynamic_schedule=True, fused_merge=True))
    assert reason is not None and "dynamic_schedule" in reason and "fused_merge" in reason

"""Compile-only tests of the sm_90a absorbed-MLA paged prefill kernel (no GPU needed)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from ptx_ids import BOUNDS_CHECK, prefetched_bounds_checks

from cute_attn.compile import compile_kernel, compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels import find_launcher
from cute_attn.kernels.sm90 import mla_prefill
from cute_attn.kernels.sm90 import mla_prefill_score_wg as score_wg
from cute_attn.kernels.sm90.mla_prefill_shared_s import (EXCHANGE_BYTES, MAX_BARRIER, P_BARRIER, SUM_BARRIER,
                                                         MlaPagedPrefillSharedSSm90)
from cute_attn.ops import mla_prefill as mla_prefill_ops
from cute_attn.ops.mla_prefill import CONSUMER_KNOBS, SM90_CONSUMER_SPLITS

SMEM_LIMIT = 227 * 1024


pytestmark = pytest.mark.usefixtures("isolated_compile_cache")

# the page id just loaded from kv_indices is compared with -1 (>= 0) and with num_pages (a kernel parameter)
# before it becomes a row id; otherwise the id is -1 (a zero-filled row, never gathered)
# a K-stage row copy (common/row_gather.cp_async_chunk): its src-size is a register (16, or 0 to zero-fill)
K_ROW_COPY = re.compile(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[g\], 16, %r\d+;")
Q_ROW_COPY = re.compile(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+(\+\d+)?\], 16, 16;")
# a 64-row Q tile by 128-byte segments (row_segments, the default): 4 rows a thread, 8 nope segments + 1 pe each,
# every copy in K_ROW_COPY's form (zero fill past Q_ROW_COUNT by src-size)
Q_SEGMENT_COPIES = 4 * (8 + 1)


def _definition(**overrides):
    """The definition's default config; tile knobs (``row_gather``, ``share_scores``...) among ``overrides`` are
    applied on top of the default policy."""
    base = dict(arch="sm_90a", num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_v=512, page_size=1,
                causal=True)
    knobs = {k: overrides.pop(k) for k in list(overrides) if k not in base}
    if any(k in knobs for k in CONSUMER_KNOBS):  # a consumer split named in full, whatever the default split is
        knobs = {**CONSUMER_KNOBS, **knobs}
    base.update(overrides)
    return dataclasses.replace(default_paged_config("mla_paged_prefill", **base), **knobs)


def test_registered_config_is_the_definition():
    configs = mla_prefill.configs("sm_90a")
    definitions = [_definition(), _definition(page_size=64)]  # the ps1 and ps64 definitions
    # then the same two with each other consumer split: compile_all builds the variants the default is A/B'd against;
    # then the MLA decode definitions' one-token configs (h16 at pages 1 and 64, h8 at page 1), then the default
    # call's self-scheduling builds (test_self_scheduling_builds_take_units_from_a_counter)
    dynamic = [c for c in configs if c.dynamic_schedule]
    configs = [c for c in configs if not c.dynamic_schedule]
    assert len(dynamic) == 3
    prefill, decode = configs[:-3], configs[-3:]
    assert prefill[:2] == definitions and len(prefill) == 2 * len(SM90_CONSUMER_SPLITS)
    splits = {tuple(getattr(c, k) for k in CONSUMER_KNOBS) for c in prefill}
    assert splits == {tuple({**CONSUMER_KNOBS, **knobs}.values()) for knobs in SM90_CONSUMER_SPLITS.values()}
    assert [(c.num_qo_heads, c.page_size, c.tile_q_rows) for c in decode] == [(16, 1, 16), (16, 64, 16), (8, 1, 8)]
    assert all(mla_prefill.check_config(c) is None for c in configs + dynamic)
    assert mla_prefill.configs("sm_100a") == []
    config = configs[0]
    assert (config.tile_q_rows, config.group_size) == (64, 16)  # 4 tokens x 16 heads per tile
    assert mla_prefill.check_config(config) is None


def test_public_api_finds_the_launcher():
    assert find_launcher(_definition()) is mla_prefill.launch


@pytest.mark.parametrize("kv_tile", [64, 32])
def test_compiles_with_wgmma_and_cp_async_gather(kv_tile):
    config = _full_s(kv_tile=kv_tile)  # the full-S kernel
    assert mla_prefill.check_config(config) is None
    assert callable(compile_kernel(config))
    ptx = compile_to_ptx(config)
    assert ".target sm_90a" in ptx
    assert "MlaPagedPrefillSm90" in ptx  # readable kernel symbol
    # S = Q K^T: 576 / 16 k-steps of m64 n<kv_tile>; O = P V: kv_tile / 16 k-steps of m64n256 per warpgroup
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{kv_tile}k16.f32.bf16.bf16") == 576 // 16
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == kv_tile // 16
    assert "cp.async.wait_group" in ptx  # Q's commit waits for its rows
    assert "fence.proxy.async.shared::cta" in ptx  # gathered rows made visible to wgmma
    assert "mbarrier.try_wait.parity" in ptx
    # K stages: every row one unrolled cp.async (zero-fill by src-size), completing on the full barrier by itself;
    # Q's rows take the same form
    assert len(K_ROW_COPY.findall(ptx)) == kv_tile * (512 + 64) // 8 // 128 + Q_SEGMENT_COPIES
    assert len(Q_ROW_COPY.findall(ptx)) == 0
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared") == 1
    assert "setmaxnreg.dec.sync.aligned.u32 \t40" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t232" in ptx
    assert mla_prefill.smem_bytes(config) <= SMEM_LIMIT
    assert mla_prefill.num_stages(config) == {64: 2, 32: 4}[kv_tile]


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_paged_latent_rows_compile_with_bounds_checked_ids(page_size):
    """Key j is slot j % page_size of page kv_indices[kv_indptr[b] + j // page_size] (shift and mask of a
    power of two), and a page id outside [0, num_pages) becomes -1 (zero-filled) before any gather reads it. Pages
    of 8+ keys take TMA boxes by default (test_long_pages_load_k_stages_as_tma_boxes): ``row_gather=True`` here."""
    config = _definition(page_size=page_size, **({"row_gather": True} if page_size >= 8 else {}))
    assert mla_prefill.check_config(config) is None
    ptx = compile_to_ptx(config)
    # the same gathers as at page size 1: Q's and the K stage's 36 row copies a thread
    assert ptx.count("cp.async.cg.shared.global") == len(K_ROW_COPY.findall(ptx)) == 36 + Q_SEGMENT_COPIES
    assert len(BOUNDS_CHECK.findall(ptx)) == 1 and prefetched_bounds_checks(ptx) == 1
    if page_size > 1:
        shift = page_size.bit_length() - 1
        assert re.search(rf"shr\.s32\s+%r\d+, %r\d+, {shift};", ptx)
        assert re.search(rf"shl\.b32\s+%r\d+, %r\d+, {shift};", ptx)
        assert re.search(rf"and\.b32\s+%r\d+, %r\d+, {page_size - 1};", ptx)


# one K stage by boxes (common/mla.box_latent_tile): a whole 8-key group is 8 ckv + 1 kpe 8-row boxes, a partial
# one 8 x 9 one-row boxes; the group loop is not unrolled
BOXES_PER_STAGE = 9 + 8 * 9


@pytest.mark.parametrize("page_size", [8, 16, 64, 128])
@pytest.mark.parametrize("split", ["full_s", "shared_s", "score_wg"])
def test_long_pages_load_k_stages_as_tma_boxes(page_size, split):
    """Pages of 8+ keys: each K stage is TMA tile boxes over the caches as latent rows from one elected thread
    (the stage's bytes expected once), no K-stage cp.async row; ids and their bounds check unchanged (a bad page
    gets a row outside the map: zero-filled, never read); ``row_gather=True`` restores the rows."""
    config = _definition(page_size=page_size, **{**CONSUMER_KNOBS, **SM90_CONSUMER_SPLITS[split]})
    assert mla_prefill.uses_kv_boxes(config) and mla_prefill.check_config(config) is None
    ptx = compile_to_ptx(config)
    page = 9 if config.page_boxes else 0  # ops/mla_prefill.PAGE_BOXES at pages of >= 64 keys: whole-page boxes too
    assert config.page_boxes == (page_size >= 64 and mla_prefill_ops.PAGE_BOXES)
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes") == \
        BOXES_PER_STAGE + page
    assert len(K_ROW_COPY.findall(ptx)) == Q_SEGMENT_COPIES and "cp.async.mbarrier.arrive.noinc.shared" not in ptx
    assert ptx.count("mbarrier.arrive.expect_tx") == 1  # the K stage's bytes, by warp 0's elected thread
    # the four maps: ckv and kpe, 8-row and 1-row boxes (and the two kv_tile-row ones with page_boxes)
    assert ptx.count("prefetch.tensormap") == 4 + 2 * (page > 0)
    assert len(BOUNDS_CHECK.findall(ptx)) == 1 and prefetched_bounds_checks(ptx) == 1
    assert "ld.local" not in ptx and "st.local" not in ptx
    rows = compile_to_ptx(dataclasses.replace(config, row_gather=True))
    assert "cp.async.bulk.tensor" not in rows and len(K_ROW_COPY.findall(rows)) == 36 + Q_SEGMENT_COPIES


@pytest.mark.parametrize("decode_heads, page_size", [(0, 64), (0, 128), (16, 64), (8, 128)])
def test_page_boxes_load_whole_page_stages_as_kv_tile_row_boxes(decode_heads, page_size):
    """``page_boxes``: a K stage of one page's rows is 8 ckv + 1 kpe boxes of kv_tile rows (two more maps, prefetched
    like the others), the 8-row and 1-row boxes stay for the other stages; the stage's bytes are the same."""
    config = _definition(page_size=page_size, page_boxes=True)
    if decode_heads:  # the swapped one-token kernel
        config = dataclasses.replace(config, num_qo_heads=decode_heads, tile_q_rows=decode_heads, **CONSUMER_KNOBS)
    assert mla_prefill.check_config(config) is None and config.can_implement() is None
    ptx = compile_to_ptx(config)
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes") == \
        BOXES_PER_STAGE + 9
    assert ptx.count("prefetch.tensormap") == 6 and ptx.count("mbarrier.arrive.expect_tx") == 1
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("overrides, words", [
    (dict(page_size=16), "pages of >= kv_tile keys"),
    (dict(arch="sm_100a"), "sm_90a MLA kernels"),
])
def test_page_boxes_refused_where_a_stage_is_not_one_page(overrides, words):
    config = _definition(**{"page_size": 64, "page_boxes": True, **overrides})
    reason = config.can_implement()
    assert reason is not None and words in reason


def test_k_stage_boxes_need_pages_of_8_keys():
    assert not mla_prefill.uses_kv_boxes(_definition(page_size=4))
    assert "8-key groups of one page" in mla_prefill.check_config(_definition(page_size=4, row_gather=False))


def test_smem_budget():
    config = _definition()
    q = 64 * 576 * 2
    stage = config.kv_tile * 576 * 2
    assert mla_prefill.smem_bytes(config) >= q + 2 * stage
    assert mla_prefill.smem_bytes(config) <= SMEM_LIMIT


@pytest.mark.parametrize(
    "config, words",
    [
        (dataclasses.replace(_definition(), tile_q_rows=128), "tile_q_rows"),
        (dataclasses.replace(_definition(), kv_tile=128), "kv_tile"),
        (dataclasses.replace(_definition(), kv_tile=16), "kv_tile"),
        (dataclasses.replace(_definition(), causal=False), "causal"),
        (dataclasses.replace(_definition(), ctas_per_sm=2), "ctas_per_sm"),
        (dataclasses.replace(_definition(), num_qo_heads=24), "group size 24"),
        (dataclasses.replace(_definition(), page_size=48), "page_size=48 must be a power of two"),
        (dataclasses.replace(_definition(), page_size=256), "page_size=256"),
        (dataclasses.replace(_definition(), head_dim_qk=128, head_dim_v=128), "head dims"),
        (dataclasses.replace(_definition(), arch="sm_100a"), "sm_90a"),
        (dataclasses.replace(_definition(), kind="gqa_paged_prefill"), "mla_paged_prefill"),
        (_definition(kv_tile=32, share_scores=True), "share_scores needs kv_tile"),
        (_definition(kv_tile=32, score_warpgroup=True), "score_warpgroup needs kv_tile"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_unsupported_configs_are_rejected_with_a_reason(config, words):
    reason = mla_prefill.check_config(config)
    assert reason is not None and words in reason, reason
    with pytest.raises(ValueError):
        mla_prefill.build(config)


@pytest.mark.parametrize("split", list(SM90_CONSUMER_SPLITS))
def test_no_register_spills(capfd, split):
    """The consumers hold a 64 x 256 fp32 O slice (128 registers) plus S and P: they must not spill (any kernel)."""
    import tempfile

    import cutlass.cute as cute

    from cute_attn.arch import dsl_arch_options

    config = dataclasses.replace(_definition(), **{**CONSUMER_KNOBS, **SM90_CONSUMER_SPLITS[split]})
    fn, args = mla_prefill.build(config)
    with tempfile.TemporaryDirectory() as dump:
        cute.compile(fn, *args, no_jit_engine=True,
                     options=f"{dsl_arch_options(config.arch)} --keep-ptx --dump-dir {dump} remarks{{ptx}}")
    log = "".join(capfd.readouterr())
    assert "Used" in log and "registers" in log  # the ptxas report was captured
    assert "0 bytes spill stores" in log and "0 bytes spill loads" in log
    assert "C7512" not in log and "serialized" not in log


# ------------------------------------------------------------------------- share_scores: S computed once
def _shared_s(**overrides):
    return _definition(share_scores=True, **overrides)


def _full_s(**overrides):
    return _definition(**CONSUMER_KNOBS, **overrides)


def _score_wg(pv_in_flight=False, **overrides):
    return _definition(score_warpgroup=True, intra_wg_overlap=pv_in_flight, **overrides)


def test_share_scores_is_the_sm90_default_knob_of_the_public_config():
    from cute_attn.ops import mla_prefill as op

    knobs = {**CONSUMER_KNOBS, **op.SM90_CONSUMER_SPLITS[op.SM90_CONSUMERS]}  # the one line the A/B flips
    assert {k: getattr(_definition(), k) for k in CONSUMER_KNOBS} == knobs
    assert mla_prefill.check_config(_shared_s()) is None
    assert find_launcher(_shared_s()) is mla_prefill.launch  # same registration, rules and launcher
    assert isinstance(mla_prefill.build(_shared_s())[0], MlaPagedPrefillSharedSSm90)
    assert not isinstance(mla_prefill.build(_full_s())[0], MlaPagedPrefillSharedSSm90)


@pytest.mark.parametrize("page_size", [1, 64])
def test_share_scores_compiles_s_once_with_p_through_smem(page_size):
    """Each warpgroup: S over its 32 keys (36 k-steps of m64n32k16), P half stored with stmatrix, PV as SS
    wgmma (4 k-steps of m64n256k16); row max / P / row sum named barriers over the 256 consumer threads."""
    config = _shared_s(page_size=page_size)
    ptx = compile_to_ptx(config)
    assert "MlaPagedPrefillSm90_H16_M64_N64_S2_SharedS" in ptx
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 576 // 16
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == 64 // 16
    assert "wgmma.mma_async.sync.aligned.m64n64k16" not in ptx  # no full-width (redundant) S GEMM left
    # PV is SS: both operands are descriptors (the RS form passes A as registers in braces)
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16\s*\{[^}]*\},\s*(\S+)", ptx)
    assert len(pv) == 4 and all(not a.startswith("{") for a in pv), pv
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == 2  # 64 x 32 bf16 P half per warpgroup
    for barrier in (MAX_BARRIER, P_BARRIER, SUM_BARRIER):
        assert re.search(rf"bar\.sync\s+{barrier}, 256;", ptx), barrier
    assert re.search(r"bar\.sync\s+1, 128;", ptx)  # the unchanged load role's row-id barrier
    assert ptx.count("fence.proxy.async.shared::cta") >= 2  # load role + P stores before the PV wgmma
    assert "setmaxnreg.dec.sync.aligned.u32 \t40" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t232" in ptx
    assert len(BOUNDS_CHECK.findall(ptx)) == 1 and prefetched_bounds_checks(ptx) == 1  # the same load role
    assert mla_prefill.num_stages(config) == 2
    full_s = _full_s(page_size=page_size)
    assert mla_prefill.smem_bytes(config) == mla_prefill.smem_bytes(full_s) + EXCHANGE_BYTES
    assert mla_prefill.smem_bytes(config) <= SMEM_LIMIT


def test_share_scores_smem_budget():
    """Q 72 KiB + 2 x 72 KiB stages + row ids + mbarriers + 1 KiB exchange + 1 KiB slack; P lives in a stage."""
    config = _shared_s()
    assert mla_prefill.smem_bytes(config) == 64 * 576 * 2 * 3 + 2 * 64 * 4 + 8 * 2 * 3 + 1024 + 1024
    assert SMEM_LIMIT - mla_prefill.smem_bytes(config) < 64 * 576 * 2  # no third stage
    # P (64 q rows x 64 keys bf16) fits exactly in the stage's kpe block (64 key rows x 64 columns)
    assert 64 * 64 * 2 == config.kv_tile * 64 * 2


def test_share_scores_refused_off_its_kernel():
    from cute_attn.kernels.sm100 import mla_prefill as mla_sm100

    gqa = dataclasses.replace(default_paged_config(
        "gqa_paged_prefill", arch="sm_90a", num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128,
        page_size=64, causal=True), share_scores=True)
    assert "share_scores" in gqa.can_implement()
    assert "share_scores" in mla_sm100.check_config(dataclasses.replace(_shared_s(), arch="sm_100a"))


def test_conftest_fixture_flips_the_public_config(mla_consumers):
    """The GPU tier's ``mla_consumers`` fixture makes every public MLA entry build the variant under test."""
    from cute_attn import api
    from cute_attn.ops import get_spec

    config = api._config_for(get_spec("mla_paged_prefill"), 16, 1, 576, 512, 1, "sm_90a")
    knobs = {**CONSUMER_KNOBS, **SM90_CONSUMER_SPLITS[mla_consumers]}
    assert {k: getattr(config, k) for k in CONSUMER_KNOBS} == knobs
    assert mla_prefill.check_config(config) is None


def test_ab_tool_knows_the_variants_and_workloads():
    """tools/mla_prefill_variants.py (GPU): its variants are buildable configs and its default workloads exist."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import mla_prefill_variants as tool

    known = tool.mla_workloads()
    assert set(tool.DEFAULT_WORKLOADS) <= set(known)
    assert {"n1_q1028_kv1038", "n28_q1954_kv2044", "n1_q16384_kv16387"} == set(tool.DEFAULT_WORKLOADS)
    for overrides in tool.VARIANTS.values():
        assert mla_prefill.check_config(dataclasses.replace(_definition(), **overrides)) is None
    assert set(SM90_CONSUMER_SPLITS) <= set(tool.VARIANTS)


@pytest.mark.parametrize("heads, page_size", [(16, 1), (16, 64), (8, 1)])
def test_one_token_decode_builds_the_swapped_product(heads, page_size):
    """MLA decode with one query per request: S^T = K Q^T with the heads as wgmma N (36 m64n<heads>k16 over the
    576 dims), O^T = V^T P^T (V^T MN-major from the stage: 4 M-tiles x 4 k-steps per warpgroup), no padding rows."""
    from cute_attn.ops import mla_decode

    config = dataclasses.replace(_definition(page_size=page_size), num_qo_heads=heads, tile_q_rows=heads,
                                 **CONSUMER_KNOBS)
    assert mla_decode.one_token_tiles("sm_90a", heads, 1, 576, 512, page_size) == dict(
        tile_q_rows=heads, kv_tile=64, share_scores=True, min_chunk_keys=mla_decode.ONE_TOKEN_MIN_CHUNK_KEYS,
        page_boxes=mla_decode.mla_prefill.page_boxes(page_size, 64),
        fused_merge=False,  # ops/mla_prefill.FUSED_MERGE: off (slower on the H200)
        eager_combine=mla_decode.mla_prefill.EAGER_COMBINE)
    assert mla_prefill.check_config(config) is None and config.can_implement() is None
    ptx = compile_to_ptx(config)
    assert "MlaPagedDecodeSwappedSm90" in ptx
    mmas = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{heads}k16\.f32\.bf16\.bf16 [^;]*p, 1,  1, ([01]), 0;",
                      ptx)
    assert mmas.count("0") == 576 // 16 and mmas.count("1") == 4 * 4  # S^T (K-major A), O^T (MN-major V^T)
    assert "wgmma.mma_async.sync.aligned.m64n64" not in ptx  # no 64-row query tile
    # Q: h16's 16 rows are one pass of segments (8 nope + 1 pe copies a thread); h8's 8 rows fill half a pass, so
    # they keep chunk columns: the nope part (a loop unrolled twice) and the pe part (one pass, its 8 rows half a
    # pass: the case whose copies were once left out, caught on the H200 as S^T without the pe dims)
    q_segment_copies = 8 + 1 if heads == 16 else 0
    assert len(Q_ROW_COPY.findall(ptx)) == (0 if heads == 16 else 3)
    if page_size >= 8:  # K stages by TMA boxes (test_long_pages_load_k_stages_as_tma_boxes)
        assert len(K_ROW_COPY.findall(ptx)) == q_segment_copies
        assert ptx.count("cp.async.bulk.tensor.2d") == BOXES_PER_STAGE + (9 if config.page_boxes else 0)
    else:
        assert len(K_ROW_COPY.findall(ptx)) == 36 + q_segment_copies
        assert "cp.async.mbarrier.arrive.noinc.shared" in ptx
    assert "ld.local" not in ptx and mla_prefill.num_stages(config) == 2


@pytest.mark.parametrize("num_rows, chunks, num_threads", [(8, 8, 128), (16, 8, 128), (8, 64, 128), (64, 72, 128),
                                                           (64, 8, 128), (3, 64, 128), (5, 16, 256)])
def test_row_passes_cover_every_row_once(num_rows, chunks, num_threads):
    """The row-gather pass count: every (row, chunk) of the tile is one thread's copy in one pass, none twice, none
    outside the tile (``guarded``: the threads past the last row in the last pass copy nothing)."""
    from cute_attn.kernels.common.row_gather import row_passes

    if num_threads % chunks:
        with pytest.raises(ValueError, match="threads cannot share rows"):
            row_passes(num_rows, chunks, num_threads)
        return
    rows_per_pass, passes, guarded = row_passes(num_rows, chunks, num_threads)
    copies = [(p * rows_per_pass + tid // chunks, tid % chunks) for p in range(passes) for tid in range(num_threads)]
    inside = [c for c in copies if c[0] < num_rows]
    assert sorted(inside) == [(r, c) for r in range(num_rows) for c in range(chunks)]
    assert guarded == (len(inside) != len(copies))


@pytest.mark.parametrize("heads, page_size", [(16, 64), (8, 1)])
def test_swapped_decode_splits_scores_over_the_dims(heads, page_size):
    """``share_scores`` in the swapped kernel: each consumer warpgroup issues its half of S^T's 36 k-steps (one
    branch a warpgroup: 18 + 18 in the PTX), exchanges its partial through 2 x 2 x 64 x heads fp32 of shared
    memory and meets the other at one barrier of both (id 4, 256 threads); O^T unchanged, no spills, 2 stages."""
    from cute_attn.kernels.sm90 import mla_decode as swapped_kernel
    from cute_attn.ops import mla_decode

    default = mla_decode.SM90_SPLIT_SCORES
    with mla_decode.split_scores_policy(not default):
        assert mla_decode.one_token_tiles("sm_90a", heads, 1, 576, 512, page_size)["share_scores"] is (not default)
    assert mla_decode.SM90_SPLIT_SCORES is default  # restored on the way out
    with mla_decode.split_scores_policy(True):
        tiles = mla_decode.one_token_tiles("sm_90a", heads, 1, 576, 512, page_size)
    assert tiles["share_scores"] is True
    config = dataclasses.replace(_definition(page_size=page_size), num_qo_heads=heads, **{**CONSUMER_KNOBS, **tiles})
    assert mla_prefill.check_config(config) is None and mla_prefill.num_stages(config) == 2
    plain = dataclasses.replace(config, share_scores=False)
    assert mla_prefill.smem_bytes(config) - mla_prefill.smem_bytes(plain) == 2 * 2 * 64 * heads * 4
    assert swapped_kernel.exchange_bytes(heads, True) - swapped_kernel.exchange_bytes(heads) == 2 * 2 * 64 * heads * 4
    ptx = compile_to_ptx(config)
    assert "MlaPagedDecodeSwappedSm90" in ptx and "_SplitK" in ptx
    mmas = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{heads}k16\.f32\.bf16\.bf16 [^;]*p, 1,  1, ([01]), 0;",
                      ptx)
    assert mmas.count("0") == 576 // 16 and mmas.count("1") == 4 * 4  # 18 a branch, each warpgroup runs one
    assert len(re.findall(r"bar\.sync\s+4,\s*256;", ptx)) == 1
    assert "ld.local" not in ptx
    assert "_SplitK" not in compile_to_ptx(plain)


def test_swapped_decode_refuses_what_it_does_not_build():
    base = dataclasses.replace(_definition(), tile_q_rows=16, **CONSUMER_KNOBS)
    assert mla_prefill.check_config(dataclasses.replace(base, kv_tile=32)) is None  # short stages (session 39)
    assert "kv_tile=128" in mla_prefill.check_config(dataclasses.replace(base, kv_tile=128))
    assert "score_warpgroup" in mla_prefill.check_config(dataclasses.replace(base, score_warpgroup=True))
    assert "head count" in mla_prefill.check_config(dataclasses.replace(base, tile_q_rows=8))
    from cute_attn.ops import mla_decode

    assert mla_decode.one_token_tiles("sm_90a", 32, 1, 576, 512, 1)["tile_q_rows"] == 64  # 32 heads: not built
    assert mla_decode.one_token_tiles("sm_100a", 16, 1, 576, 512, 1)["tile_q_rows"] == 64  # sm_100a: the twin


# ------------------------------------------------------------------------- score_warpgroup: one S warpgroup
@pytest.mark.parametrize("pv_in_flight", [False, True], ids=["in_order", "ovl"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_score_warpgroup_computes_s_at_full_width_in_one_warpgroup(page_size, pv_in_flight):
    """WG1 alone: S over all 64 keys (36 k-steps of m64n64k16), all of P stored with stmatrix; both warpgroups: PV as
    SS wgmma (4 k-steps of m64n256k16 each, one code path per role); P and final-factor barriers over the 256
    consumer threads (immediate ids); the load role unchanged."""
    config = _score_wg(page_size=page_size, pv_in_flight=pv_in_flight)
    assert mla_prefill.check_config(config) is None
    assert isinstance(mla_prefill.build(config)[0], score_wg.MlaPagedPrefillScoreWgSm90)
    ptx = compile_to_ptx(config)
    assert "MlaPagedPrefillSm90_H16_M64_N64_S2_ScoreWg" + ("_OVL" if pv_in_flight else "") in ptx
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == 576 // 16
    # PV: one chain in each role; ovl: WG1's deferred PV in the loop and the item's last one after it
    pv_chains = 3 if pv_in_flight else 2
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == pv_chains * 64 // 16
    assert "wgmma.mma_async.sync.aligned.m64n32k16" not in ptx  # no key-split S
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16\s*\{[^}]*\},\s*(\S+)", ptx)
    assert len(pv) == pv_chains * 4 and all(not a.startswith("{") for a in pv), pv  # A = P from shared memory
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    assert ("1" in waits) is pv_in_flight  # ovl: S waited for behind the PV GEMM
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == 4  # 64 x 64 bf16 P, 32 values a thread
    for barrier in (score_wg.P_BARRIER, score_wg.FINAL_BARRIER):
        assert len(re.findall(rf"bar\.sync\s+{barrier}, 256;", ptx)) == 2, barrier  # one in each role
    assert not re.search(r"bar\.(sync|arrive)\s+%r", ptx)  # ids are immediates (racecheck follows them)
    assert re.search(r"bar\.sync\s+1, 128;", ptx)  # the unchanged load role's row-id barrier
    assert "setmaxnreg.dec.sync.aligned.u32 \t40" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t232" in ptx
    assert len(BOUNDS_CHECK.findall(ptx)) == 1 and prefetched_bounds_checks(ptx) == 1  # the same load role
    assert mla_prefill.num_stages(config) == 2
    assert mla_prefill.smem_bytes(config) == mla_prefill.smem_bytes(_full_s(page_size=page_size)) + \
        score_wg.EXCHANGE_BYTES
    assert mla_prefill.smem_bytes(config) <= SMEM_LIMIT


@pytest.mark.parametrize("probe", ["loads_only", "compute_only"])
def test_probes_keep_one_half_of_the_kernel(probe):
    """Measurement builds: ``loads_only`` keeps the gathers and drops every GEMM; ``compute_only`` keeps the GEMMs
    and drops the K stages' row copies (Q's stay); the default build's PTX does not change with the knob."""
    config = dataclasses.replace(_score_wg(), probe=probe)
    assert mla_prefill.check_config(config) is None
    ptx = compile_to_ptx(config)
    assert "_ProbeLoadsOnly" in ptx if probe == "loads_only" else "_ProbeComputeOnly" in ptx
    gemms = ptx.count("wgmma.mma_async.sync.aligned.m64n64k16") + ptx.count("wgmma.mma_async.sync.aligned.m64n256k16")
    if probe == "loads_only":
        assert gemms == 0 and len(K_ROW_COPY.findall(ptx)) == 36 + Q_SEGMENT_COPIES
    else:
        assert gemms == 36 + 8 and len(K_ROW_COPY.findall(ptx)) == Q_SEGMENT_COPIES
        assert "cp.async.mbarrier.arrive.noinc.shared" in ptx  # the stage still completes, empty


def test_probes_are_refused_elsewhere():
    assert "one of" in mla_prefill.check_config(dataclasses.replace(_score_wg(), probe="bogus"))
    assert "score_warpgroup" in mla_prefill.check_config(dataclasses.replace(_shared_s(), probe="loads_only"))
    assert "TMA boxes" in mla_prefill.check_config(dataclasses.replace(_score_wg(page_size=64), probe="loads_only"))
    gqa = dataclasses.replace(default_paged_config(
        "gqa_paged_prefill", arch="sm_90a", num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128,
        page_size=64, causal=True), probe="loads_only")
    assert "must be one of ('cta_stamps',)" in gqa.can_implement()  # the GQA prefill kernel's own probe only
    decode = dataclasses.replace(default_paged_config(
        "gqa_paged_decode", arch="sm_90a", num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128,
        page_size=64, causal=False), probe="loads_only")
    assert "sm_90a MLA and GQA prefill kernels only" in decode.can_implement()


def test_score_warpgroup_refuses_what_it_does_not_build():
    from cute_attn.kernels.sm100 import mla_prefill as mla_sm100

    assert "choose one" in mla_prefill.check_config(dataclasses.replace(_score_wg(), share_scores=True))
    assert "kv_tile" in mla_prefill.check_config(dataclasses.replace(_score_wg(), kv_tile=32))
    assert "intra_wg_overlap" in mla_prefill.check_config(dataclasses.replace(_shared_s(), intra_wg_overlap=True))
    assert "intra_wg_overlap" in mla_prefill.check_config(dataclasses.replace(_full_s(), intra_wg_overlap=True))
    assert "score_warpgroup" in mla_sm100.check_config(dataclasses.replace(_score_wg(), arch="sm_100a"))
    gqa = dataclasses.replace(default_paged_config(
        "gqa_paged_prefill", arch="sm_90a", num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128,
        page_size=64, causal=True), score_warpgroup=True)
    assert "score_warpgroup" in gqa.can_implement()


def _k_stage_gather(ptx: str) -> list[str]:
    """The load role's instructions from the row-id table's named barrier to the K stage's noinc commit."""
    lines = ptx.split("\n")
    end = next(i for i, line in enumerate(lines) if "cp.async.mbarrier.arrive.noinc" in line)
    start = max(i for i in range(end) if re.search(r"\bbar(rier)?\.sync", lines[i]))
    return [line for line in lines[start:end] if line.strip() and not line.strip().startswith(("$", "//"))]


def test_row_segments_resolve_four_row_ids_a_tile():
    """``row_segments`` (the default): 8 lanes a 128-byte segment, so each load thread reads 4 row ids of a 64-key
    stage (one per row it copies) and walks each row's 8 + 1 segments at constant offsets; ``row_segments=False``
    (one chunk column a thread) reads an id and builds an address for each of its 36 copies. Same copy count."""
    segments = _k_stage_gather(compile_to_ptx(_score_wg()))
    columns = _k_stage_gather(compile_to_ptx(_score_wg(row_segments=False)))
    for gather in (segments, columns):
        assert sum("cp.async.cg.shared.global" in line for line in gather) == 36
    assert sum("ld.shared" in line for line in segments) <= 8  # 4 ids (+ the pipeline's own)
    assert sum("ld.shared" in line for line in columns) == 36
    assert len(segments) < len(columns) // 2


def test_row_segments_is_an_sm90_knob():
    """A knob of the sm_90a row gathers (MLA: segments unless False; GQA: chunk columns unless True); the sm_100a
    kernels refuse it by name."""
    sm100 = dataclasses.replace(default_paged_config(
        "gqa_paged_prefill", arch="sm_100a", num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128,
        page_size=1, causal=True), row_segments=False)
    assert "row_segments" in sm100.can_implement()
    assert _definition().row_segments is None and mla_prefill.check_config(_definition(row_segments=False)) is None


@pytest.mark.parametrize("page_size", [1, 64])
def test_smem_epilogue_stages_o_in_the_last_k_stage(page_size):
    """``smem_epilogue`` (score_wg): each consumer warpgroup writes its bf16 O half with stmatrix into the item's
    last K stage (held since its last PV GEMM), meets its own warpgroup at a named barrier (ids 4, 5), and stores
    16-byte vectors: 16 a thread (64 rows x 512 bytes over 128 threads) in each of the two roles."""
    config = _definition(page_size=page_size, score_warpgroup=True, smem_epilogue=True)
    assert mla_prefill.check_config(config) is None
    ptx = compile_to_ptx(config)
    assert "_ScoreWg_SEPI" in ptx
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 2 * 16
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == 2 * 16 + 4  # O halves + P
    assert len(re.findall(r"bar\.sync\s+[45], 128;", ptx)) == 2
    plain = compile_to_ptx(_definition(page_size=page_size, score_warpgroup=True))
    assert "st.global.v4.b32" not in plain


def test_smem_epilogue_is_refused_where_it_is_not_built():
    assert "smem_epilogue" in mla_prefill.check_config(_definition(smem_epilogue=True, score_warpgroup=False))
    assert "smem_epilogue" in mla_prefill.check_config(
        _definition(smem_epilogue=True, score_warpgroup=True, intra_wg_overlap=True))
    assert "smem_epilogue" in mla_prefill.check_config(
        dataclasses.replace(_definition(smem_epilogue=True, score_warpgroup=True), probe="loads_only"))


@pytest.mark.parametrize("decode_heads, page_size", [(16, 64), (0, 1)])
def test_early_page_ids_read_the_item_page_position_not_kv_indptr(decode_heads, page_size):
    """``early_page_ids`` (the default, None): an item's first page ids load from its ``KV_PAGE_START`` (field 9, byte
    36 of the item row) before its Q tile, so the plan-driven build never loads the ``kv_indptr`` parameter; False
    builds the earlier order, which does. Both compile without spills."""
    config = _definition(page_size=page_size)
    if decode_heads:  # the swapped one-token kernel
        config = dataclasses.replace(config, num_qo_heads=decode_heads, tile_q_rows=decode_heads, **CONSUMER_KNOBS)
    early = compile_to_ptx(config)
    late = compile_to_ptx(dataclasses.replace(config, early_page_ids=False))
    assert early != late
    assert late.count("ld.param") - early.count("ld.param") == 1  # the kv_indptr pointer
    assert re.search(r"ld\.global\.b32\s+%r\d+, \[%rd\d+\+36\];", early)
    for ptx in (early, late):
        assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("decode_heads", [16, 0])
def test_early_first_stage_waits_for_q_after_the_first_k_stage(decode_heads):
    """``early_first_stage`` (the default, None) at page 64 (TMA-box K stages): the load role waits for its Q copies
    (``cp.async.wait_group``) after the item's first K stage's ``cp.async.bulk.tensor``, not before, so that stage's
    round trip runs under Q's; False builds the earlier order. Page 1 (row gathers) is the same build either way."""
    config = _definition(page_size=64)
    if decode_heads:  # the swapped one-token kernel
        config = dataclasses.replace(config, num_qo_heads=decode_heads, tile_q_rows=decode_heads, **CONSUMER_KNOBS)
    early = compile_to_ptx(config)
    late = compile_to_ptx(dataclasses.replace(config, early_first_stage=False))
    assert early.find("cp.async.bulk.tensor") < early.find("cp.async.wait_group")
    assert late.find("cp.async.wait_group") < late.find("cp.async.bulk.tensor")
    assert early.count("cp.async.wait_group") == 2  # after the first stage, and for an item without keys
    for ptx in (early, late):
        assert "ld.local" not in ptx and "st.local" not in ptx
    row_gathers = _definition(page_size=1)
    assert compile_to_ptx(row_gathers) == compile_to_ptx(dataclasses.replace(row_gathers, early_first_stage=False))

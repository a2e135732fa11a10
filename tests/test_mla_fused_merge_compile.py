"""Compile-only tests of ``PagedAttentionConfig.fused_merge`` on the MLA kernels of both arches (no GPU needed).

The build folds a split request's partials in the kernel (``common/decode_merge.fold_completed_merges``, with the
16-byte wide-row fold of MLA's 512-column rows on both arches) instead of the combine launch. Built in session 14 and not run on a GPU yet, so it is off by default;
these tests hold its contract: the default builds are untouched, the fused entry takes the merge table and counters,
arrives once a split item with an acq_rel atomic, and syncs both consumer warpgroups on its own named barrier.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_attn.compile import compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels.common import mla
from cute_attn.kernels.sm90 import mla_prefill
from ptx_fold import ARRIVAL, assert_fused_build_folds

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")

FOLD_SYNC_SM100 = re.compile(r"bar\.sync\s+4, 128;")  # sm_100a: the correction warpgroup


def _mla(**knobs):
    base = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                head_dim_qk=576, head_dim_v=512, page_size=knobs.pop("page_size", 1), causal=True)
    return dataclasses.replace(base, **knobs)


def _swapped_decode(**knobs):  # the MLA decode entry's one-token tiles (kernels/sm90/mla_decode.py)
    return _mla(tile_q_rows=16, score_warpgroup=False, smem_epilogue=False, min_chunk_keys=256, **knobs)


@pytest.mark.parametrize("make", [_swapped_decode, _mla], ids=["swapped_decode", "prefill_default_split"])
def test_fused_build_folds_with_one_arrival_and_its_own_barrier(make):
    plain, fused = (compile_to_ptx(make(fused_merge=flag)) for flag in (False, True))
    assert_fused_build_folds(plain, fused)


def test_sm90_mla_fold_reads_wide_rows_with_16_byte_loads():
    """``decode_merge.fold_wide_merge``: a lane's 8 vectors of a 512-column row for ``WIDE_SLOTS`` slots at once, as
    16-byte loads, at the first batch (before the LSE reduction) and in the loop over the rest: 2 x 4 x 8."""
    from cute_attn.kernels.common.decode_merge import WIDE_SLOTS

    plain, fused = (compile_to_ptx(_swapped_decode(fused_merge=flag)) for flag in (False, True))
    wide_loads = re.compile(r"ld\.global\.v4\.b32")
    assert len(wide_loads.findall(fused)) - len(wide_loads.findall(plain)) == 2 * WIDE_SLOTS * 512 // (16 * 4)
    assert "ld.local" not in fused


@pytest.mark.parametrize("page_size", [1, 64])
def test_sm100_twin_folds_in_its_correction_warpgroup(page_size):
    """The Blackwell twin (compiled only, never run): the correction warps, which store the partials, count them
    and fold, on their own named barrier; the default build takes no merge table."""
    config = _mla(arch="sm_100a", page_size=page_size, **{k: False for k in ("score_warpgroup", "smem_epilogue")})
    assert not config.fused_merge and config.can_implement() is None
    plain, fused = (compile_to_ptx(dataclasses.replace(config, fused_merge=flag)) for flag in (False, True))
    assert ".target sm_100a" in fused and "tcgen05.mma" in fused
    assert not ARRIVAL.search(plain) and len(ARRIVAL.findall(fused)) == 1
    assert not FOLD_SYNC_SM100.search(plain) and len(FOLD_SYNC_SM100.findall(fused)) == 2
    wide_loads = re.compile(r"ld\.global\.v4\.b32")  # the wide-row fold, as on sm_90a
    assert len(wide_loads.findall(fused)) - len(wide_loads.findall(plain)) == 2 * 4 * 512 // (16 * 4)


def test_fused_merge_is_not_a_knob_of_the_gqa_decode_kernels():
    gqa = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                               head_dim_v=128, page_size=64, causal=False)
    assert "fused_merge" in dataclasses.replace(gqa, fused_merge=True).can_implement()
    assert _swapped_decode(fused_merge=True).can_implement() is None
    sm100 = _mla(arch="sm_100a", **{k: False for k in ("score_warpgroup", "smem_epilogue")})
    assert dataclasses.replace(sm100, fused_merge=True).can_implement() is None
    assert not _mla().fused_merge  # off by default until its GPU tier has run


def test_fused_entry_takes_the_merge_table_after_items():
    config = _swapped_decode(fused_merge=True)
    plain = mla.fake_args(dataclasses.replace(config, fused_merge=False))
    fused = mla.fake_args(config)
    assert len(fused) == len(plain) + 2
    kernel, _ = mla_prefill.build(config)
    assert kernel.__name__ == "call_fused"
    assert mla_prefill.smem_bytes(config) == mla_prefill.smem_bytes(dataclasses.replace(config, fused_merge=False)) + 16

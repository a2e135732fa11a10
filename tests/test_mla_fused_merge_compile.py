"""Compile-only tests of ``PagedAttentionConfig.fused_merge`` on the sm_90a MLA kernels (no GPU needed).

The build folds a split request's partials in the kernel (``common/decode_merge.fold_completed_merges``, the GQA
decode's fold) instead of the combine launch. Built in session 14 and not run on a GPU yet, so it is off by default;
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

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")

FOLD_SYNC = re.compile(r"bar\.sync\s+6, 256;")
ARRIVAL = re.compile(r"atom\.global\.acq_rel(\.gpu)?\.add\.u32")


def _mla(**knobs):
    base = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=16, num_kv_heads=1,
                                head_dim_qk=576, head_dim_v=512, page_size=knobs.pop("page_size", 1), causal=True)
    return dataclasses.replace(base, **knobs)


def _swapped_decode(**knobs):  # the MLA decode entry's one-token tiles (kernels/sm90/mla_decode.py)
    return _mla(tile_q_rows=16, score_warpgroup=False, smem_epilogue=False, min_chunk_keys=256, **knobs)


@pytest.mark.parametrize("make", [_swapped_decode, _mla], ids=["swapped_decode", "prefill_default_split"])
def test_fused_build_folds_with_one_arrival_and_its_own_barrier(make):
    plain, fused = (compile_to_ptx(make(fused_merge=flag)) for flag in (False, True))
    assert not ARRIVAL.search(plain) and not FOLD_SYNC.search(plain)
    assert len(ARRIVAL.findall(fused)) == 1  # thread 0's arrival, once per split item (in a loop)
    assert len(FOLD_SYNC.findall(fused)) == 2  # fences done / arrival broadcast
    assert fused.count("fence.acq_rel.gpu") >= 2  # before the arrival, and before the last CTA reads the slots
    assert "ld.local" not in fused and "st.local" not in fused
    # the fused entry's parameters: two more tensors (merge_indptr, merge_counters) than the plain entry's
    params = [len(re.findall(r"\.param \.", ptx.split(")")[0])) for ptx in (plain, fused)]
    assert params[1] > params[0]


def test_fused_merge_is_refused_off_the_sm90_mla_kernels():
    gqa = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                               head_dim_v=128, page_size=64, causal=False)
    for config in (dataclasses.replace(gqa, fused_merge=True), _mla(fused_merge=True, arch="sm_100a")):
        assert "fused_merge" in config.can_implement()
    assert _swapped_decode(fused_merge=True).can_implement() is None
    assert not _mla().fused_merge  # off by default until its GPU tier has run


def test_fused_entry_takes_the_merge_table_after_items():
    config = _swapped_decode(fused_merge=True)
    plain = mla.fake_args(dataclasses.replace(config, fused_merge=False))
    fused = mla.fake_args(config)
    assert len(fused) == len(plain) + 2
    kernel, _ = mla_prefill.build(config)
    assert kernel.__name__ == "call_fused"
    assert mla_prefill.smem_bytes(config) == mla_prefill.smem_bytes(dataclasses.replace(config, fused_merge=False)) + 16

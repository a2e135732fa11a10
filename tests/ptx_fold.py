"""PTX reading for the in-kernel merge fold (``common/decode_merge.fold_completed_merges``), shared by the compile
tests of the kernels that build it (``fused_merge``: MLA prefill / decode, sm_90a GQA prefill)."""

import re

FOLD_SYNC = re.compile(r"bar\.sync\s+6, 256;")  # sm_90a: both consumer warpgroups
ARRIVAL = re.compile(r"atom\.global\.acq_rel(\.gpu)?\.add\.u32")


def assert_fused_build_folds(plain: str, fused: str, fold_sync: re.Pattern = FOLD_SYNC) -> None:
    """The plain build has no fold; the fused one arrives once a split item with an acq_rel atomic, syncs on its own
    named barrier twice (fences done / arrival broadcast), fences before the arrival and before the last CTA reads
    the slots, keeps everything in registers, and takes two more parameters (merge_indptr, merge_counters)."""
    assert not ARRIVAL.search(plain) and not fold_sync.search(plain)
    assert len(ARRIVAL.findall(fused)) == 1  # thread 0's arrival, once per split item (in a loop)
    assert len(fold_sync.findall(fused)) == 2
    assert fused.count("fence.acq_rel.gpu") >= 2
    assert "ld.local" not in fused and "st.local" not in fused
    params = [len(re.findall(r"\.param \.", ptx.split(")")[0])) for ptx in (plain, fused)]
    assert params[1] > params[0]

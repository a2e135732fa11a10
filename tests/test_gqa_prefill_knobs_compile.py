"""Compile-only tests of the sm_90a GQA prefill kernel's knobs ``fused_merge`` and ``k_ahead`` (no GPU needed).

The build folds a split item's partials in the kernel (``common/decode_merge.fold_completed_merges``, the GQA
decode's fold) instead of the combine launch that a device plan of prefill otherwise always makes. These tests hold
its contract: the default build is untouched, the fused entry takes the merge table and counters, arrives once a
split item with an acq_rel atomic, and syncs both consumer warpgroups on its own named barrier; the sm_100a twin
refuses the knob with a reason. ``k_ahead`` reorders the row gathers (K_{t+1} before V_t): only page sizes that
gather rows change, without spills, and only this kernel takes the knob.
"""

from __future__ import annotations

import dataclasses

import pytest

from cute_attn.compile import compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels.sm90 import gqa_prefill
from cute_attn.ops import gqa_prefill as gqa_prefill_op
from ptx_fold import assert_fused_build_folds

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")



def _prefill(arch="sm_90a", page_size=64, head_dim=128, heads=32, kv_heads=4, **knobs):
    base = default_paged_config("gqa_paged_prefill", arch=arch, num_qo_heads=heads, num_kv_heads=kv_heads,
                                head_dim_qk=head_dim, head_dim_v=head_dim, page_size=page_size, causal=True)
    return dataclasses.replace(base, **knobs)


@pytest.mark.parametrize("page_size, head_dim, heads, kv_heads", [(64, 128, 32, 4), (1, 128, 20, 4), (64, 256, 16, 2)],
                         ids=["p64_d128_h32kv4", "p1_d128_h20kv4", "p64_d256_h16kv2"])
def test_fused_build_folds_with_one_arrival_and_its_own_barrier(page_size, head_dim, heads, kv_heads):
    config = _prefill(page_size=page_size, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    assert config.fused_merge == gqa_prefill_op.FUSED_MERGE
    plain, fused = (compile_to_ptx(dataclasses.replace(config, fused_merge=flag)) for flag in (False, True))
    assert "wgmma.mma_async" in fused
    assert_fused_build_folds(plain, fused)


def test_fused_merge_costs_the_arrival_word_of_shared_memory_and_names_the_kernel():
    config = _prefill()
    fused = dataclasses.replace(config, fused_merge=True)
    assert gqa_prefill.smem_bytes(fused) == gqa_prefill.smem_bytes(config) + 16
    assert repr(gqa_prefill.GqaPagedPrefillSm90(fused)).endswith("_Fold")
    assert gqa_prefill.check_config(fused) is None


def test_sm100_twin_refuses_the_fused_merge_with_a_reason():
    config = _prefill(arch="sm_100a")
    assert not config.fused_merge and config.can_implement() is None
    reason = dataclasses.replace(config, fused_merge=True).can_implement()
    assert reason is not None and "fused_merge" in reason and "sm_90a" in reason


def test_fused_merge_policy_flips_the_sm90_prefill_config_only_inside_the_block():
    assert not _prefill().fused_merge or gqa_prefill_op.FUSED_MERGE
    with gqa_prefill_op.fused_merge_policy(True):
        assert _prefill().fused_merge and not _prefill(arch="sm_100a").fused_merge
    with gqa_prefill_op.fused_merge_policy(False):
        assert not _prefill().fused_merge
    assert _prefill().fused_merge == gqa_prefill_op.FUSED_MERGE


def _sass_spills(ptx: str) -> str:
    """ptxas's spill line for the PTX (empty when ptxas is not installed: the PTX checks still run)."""
    import os
    import shutil
    import subprocess
    import tempfile

    if shutil.which("ptxas") is None:
        return ""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        err = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True, check=True).stderr
    return next((line for line in err.splitlines() if "spill" in line), "")


@pytest.mark.parametrize("page_size, heads, kv_heads", [(1, 32, 4), (4, 24, 8)], ids=str)
def test_k_ahead_reorders_the_row_gathers_only(page_size, heads, kv_heads):
    config = _prefill(page_size=page_size, heads=heads, kv_heads=kv_heads)
    ahead = dataclasses.replace(config, k_ahead=True)
    assert repr(gqa_prefill.GqaPagedPrefillSm90(ahead)).endswith("_KAhead")
    plain, reordered = compile_to_ptx(config), compile_to_ptx(ahead)
    assert plain != reordered
    # the item's last V is copied after its loop: one more unrolled gather of cp.async rows
    assert reordered.count("cp.async.cg.shared.global") > plain.count("cp.async.cg.shared.global")
    assert "ld.local" not in reordered
    spills = _sass_spills(reordered)
    assert "0 bytes spill stores" in spills or not spills


def test_k_ahead_changes_nothing_where_pages_are_tma_boxes_and_is_refused_elsewhere():
    config = _prefill(page_size=64)
    assert compile_to_ptx(config) == compile_to_ptx(dataclasses.replace(config, k_ahead=True))
    reason = dataclasses.replace(_prefill(arch="sm_100a"), k_ahead=True).can_implement()
    assert reason is not None and "k_ahead" in reason
    decode = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                  head_dim_v=128, page_size=1, causal=False)
    assert "k_ahead" in dataclasses.replace(decode, k_ahead=True).can_implement()


def test_k_ahead_policy_reaches_the_configs_of_its_page_sizes_only():
    assert gqa_prefill_op.K_AHEAD_PAGE_SIZES == ()  # off until an A/B on a GPU
    with gqa_prefill_op.k_ahead_policy((1, 2)):
        assert _prefill(page_size=1).k_ahead and _prefill(page_size=2).k_ahead
        assert not _prefill(page_size=4).k_ahead and not _prefill(arch="sm_100a", page_size=1).k_ahead
    assert not _prefill(page_size=1).k_ahead


def test_cta_stamps_probe_adds_four_timer_reads_and_leaves_the_default_alone():
    """``probe="cta_stamps"`` (``tools/cta_timeline.py``): each CTA reads ``%globaltimer_lo`` at its entry, after its
    wait, after each item and at its consumers' end, reads its SM id, and names itself in the kernel symbol; the
    default build reads neither. Other probes, kinds and arches refuse it with a reason; the policy sets it only
    inside its block."""
    config = _prefill()
    assert config.probe == ""
    probe = dataclasses.replace(config, probe="cta_stamps")
    assert probe.can_implement() is None
    plain, stamped = compile_to_ptx(config), compile_to_ptx(probe)
    assert plain.count("%globaltimer_lo") == 0 and stamped.count("%globaltimer_lo") == 4
    assert plain.count("%smid") == 0 and stamped.count("%smid") == 1
    assert "CtaStamps" in stamped and "CtaStamps" not in plain
    assert "must be one of" in dataclasses.replace(config, probe="loads_only").can_implement()
    assert "sm_90a MLA and GQA prefill" in _prefill(arch="sm_100a", probe="cta_stamps").can_implement()
    with gqa_prefill_op.probe_policy("cta_stamps"):
        assert _prefill().probe == "cta_stamps"
        assert _prefill(arch="sm_100a").probe == ""
    assert _prefill().probe == ""

"""The cluster merge without a GPU: which host plans take it, its config rules, the host plumbing and its PTX.

``plan_clusters.cluster_merge_size`` picks the plans whose merges each fill a thread-block cluster; the sm_90a MLA
decode kernel built with ``cluster_merge = k`` launches whole clusters and folds split requests in distributed
shared memory (``kernels/common/cluster_merge.py``). The GPU tier (``test_mla_cluster_merge_gpu.py``) checks the
outputs; here the shape rules, the config refusals and the instructions the build holds.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from cute_attn import api
from cute_attn.ops import mla_decode
from cute_attn.plan import ItemField, plan_work
from cute_attn.plan_clusters import cluster_merge_size


def _decode_config(heads=16, page_size=64, arch="sm_90a"):
    return api._config_for(mla_decode.ONE_TOKEN_SPEC, heads, 1, 576, 512, page_size, arch)


def _plan(batch, keys, heads=16):
    kv = np.full(batch, keys) if np.isscalar(keys) else np.asarray(keys)
    return plan_work(_decode_config(heads).plan_config(132), np.ones(batch, int), kv)


@pytest.mark.parametrize("batch, keys, k", [(16, 4096, 8), (64, 8192, 2), (32, 4096, 4), (1, 2048, 8)])
def test_even_pieces_fill_clusters(batch, keys, k):
    plan = _plan(batch, keys)
    assert cluster_merge_size(plan) == k
    items = plan.valid_items()
    # what the kernel relies on: CTA c holds slot c, rank c % k of the cluster of merge c // k
    ctas = np.nonzero(np.diff(plan.work_indptr))[0]
    assert (items[plan.work_indptr[ctas], ItemField.PARTIAL_SLOT] == ctas).all()
    assert ctas[-1] < 132 // k * k


@pytest.mark.parametrize("batch, keys", [(128, 4096), (1, 4096), (4, 64)])
def test_plans_without_the_shape(batch, keys):
    """No merges (128 x 4096, 4 x 64), or 16 slots a merge (1 x 4096: past the 8-CTA cluster)."""
    assert cluster_merge_size(_plan(batch, keys)) == 0


def test_ragged_plans_and_moved_items_are_refused():
    assert cluster_merge_size(_plan(16, np.arange(1, 17) * 300)) == 0
    plan = _plan(16, 4096)
    swapped = dataclasses.replace(plan, items=plan.items.copy())
    a, b = swapped.work_indptr[0], swapped.work_indptr[1]  # CTA 0's and CTA 1's items traded: ranks break
    swapped.items[[a, b]] = swapped.items[[b, a]]
    assert cluster_merge_size(swapped) == 0
    crowded = dataclasses.replace(plan, work_indptr=plan.work_indptr.copy())
    crowded.work_indptr[1] = crowded.work_indptr[0]  # CTA 0 empty, CTA 1 with two items
    assert cluster_merge_size(crowded) == 0


def test_config_rules_name_the_knob():
    base = _decode_config()
    assert dataclasses.replace(base, cluster_merge=8).can_implement() is None
    for bad in (dataclasses.replace(base, cluster_merge=3),
                dataclasses.replace(base, cluster_merge=8, fused_merge=True),
                dataclasses.replace(_decode_config(arch="sm_100a"), cluster_merge=2)):
        assert "cluster_merge" in bad.can_implement()
    prefill = api._config_for(mla_decode.mla_prefill.SPEC, 16, 1, 576, 512, 64, "sm_90a")
    assert "cluster_merge" in dataclasses.replace(prefill, cluster_merge=2).can_implement()


def test_host_plans_pick_the_cluster_config_under_the_policy(monkeypatch):
    import torch

    from cute_attn import validate

    config = _decode_config()
    qo = np.arange(17, dtype=np.int64)
    host = validate.HostIndices(qo_indptr=qo, kv_indptr=np.arange(17) * 64, kv_lens=np.full(16, 4096))
    cpu = torch.device("cpu")
    assert api._plan(mla_decode.ONE_TOKEN_SPEC, config, host, cpu, 132).config == config
    with mla_decode.cluster_merge_policy(True):
        # off a CUDA device no cluster fits; on one that holds 15 clusters of 8, sixteen are a second wave
        assert api._plan(mla_decode.ONE_TOKEN_SPEC, config, host, cpu, 132).config == config
        monkeypatch.setattr(mla_decode, "cluster_capacity", lambda config, device: 15)
        assert api._plan(mla_decode.ONE_TOKEN_SPEC, config, host, cpu, 132).config == config
        monkeypatch.setattr(mla_decode, "cluster_capacity", lambda config, device: 16)
        planned = api._plan(mla_decode.ONE_TOKEN_SPEC, config, host, cpu, 132)
    assert planned.config.cluster_merge == 8
    assert api._shapes_config(planned.config) == config  # what plan= compares with the inputs' config
    ragged = plan_work(config.plan_config(132), np.ones(16, int), np.arange(1, 17) * 300,
                       capacity=planned.plan.capacity)
    with pytest.raises(ValueError, match="clusters of 8"):
        planned.refresh(ragged)


@pytest.mark.usefixtures("isolated_compile_cache")
@pytest.mark.parametrize("k", [2, 8])
def test_sm90_build_folds_through_distributed_shared_memory(k):
    """Two cluster barriers, each peer's piece read with ``ld.shared::cluster`` (16-byte vectors for O, one LSE a
    peer) at ``mapa`` addresses, and no fp32 partial store left; the default build has none of it."""
    from cute_attn.compile import compile_to_ptx

    plain = compile_to_ptx(_decode_config())
    built = compile_to_ptx(dataclasses.replace(_decode_config(), cluster_merge=k))
    for ptx, barriers in ((plain, 0), (built, 2)):
        assert len(re.findall(r"barrier\.cluster\.arrive;", ptx)) == barriers
        assert len(re.findall(r"barrier\.cluster\.wait;", ptx)) == barriers
    steps = -(-16 * 512 // k // 4 // 256)  # 16-byte vectors a consumer thread folds
    assert len(re.findall(r"ld\.shared::cluster\.v4\.f32", built)) == k * steps
    assert len(re.findall(r"ld\.shared::cluster\.f32", built)) == k * steps
    assert "mapa.shared::cluster.u32" in built and "mapa" not in plain
    assert "wgmma.mma_async" in built


def test_capacity_is_zero_without_a_gpu():
    """Off a CUDA device (CI) no cluster fits, so host plans there keep the combine whatever their shape."""
    import torch

    from cute_attn.cluster_capacity import max_active_clusters

    config = dataclasses.replace(_decode_config(), cluster_merge=2)
    assert mla_decode.cluster_capacity(config, torch.device("cpu")) == 0
    if not torch.cuda.is_available():
        assert max_active_clusters(0, 2, 384, 200_000) == 0


# ------------------------------------------------------------------------ device plans: clusters checked at run time
def test_held_merges_mirror_the_kernels_check():
    """``merges_held_by_clusters`` (the host mirror of the ``cluster_merge_flags`` kernel's check): every merge of a
    plan of pairs is held by its cluster of 2, none of a plan of 8-slot merges, and an item moved to the wrong CTA
    breaks its own pair only."""
    from cute_attn.plan_clusters import merges_held_by_clusters

    pairs = _plan(64, 8192)
    assert cluster_merge_size(pairs) == 2 and merges_held_by_clusters(pairs, 2).all()
    eights = _plan(16, 4096)
    assert cluster_merge_size(eights) == 8 and not merges_held_by_clusters(eights, 2).any()
    assert merges_held_by_clusters(eights, 8).all()
    moved = dataclasses.replace(pairs, items=pairs.items.copy())
    a, b = moved.work_indptr[0], moved.work_indptr[1]
    moved.items[[a, b]] = moved.items[[b, a]]
    held = merges_held_by_clusters(moved, 2)
    assert not held[moved.items[a, ItemField.MERGE]] and held.sum() == moved.num_merges - 1
    assert merges_held_by_clusters(_plan(128, 4096), 2).size == 0  # no merges


def test_device_plans_take_checked_clusters_where_they_fit(monkeypatch):
    """``OpSpec.device_plan_tiles`` of the one-token spec: clusters of 2 checked at run time on a device that holds
    the whole grid in pairs; never off a GPU, on an odd grid, on sm_100a, or with the policy off."""
    import torch

    config = _decode_config()
    cpu = torch.device("cpu")
    monkeypatch.setattr(mla_decode, "SM90_DEVICE_CLUSTER_MERGE", True)  # the policy's setting (off by default)
    assert mla_decode.device_cluster_tiles(config, cpu, 132) == {}  # no cluster fits off a CUDA device
    monkeypatch.setattr(mla_decode, "cluster_capacity", lambda config, device: 66)
    assert mla_decode.device_cluster_tiles(config, cpu, 132) == {"cluster_merge": 2, "cluster_merge_flags": True}
    assert mla_decode.device_cluster_tiles(config, cpu, 131) == {}
    assert mla_decode.device_cluster_tiles(config, cpu, 134) == {}  # 67 pairs: a second wave
    assert mla_decode.device_cluster_tiles(_decode_config(arch="sm_100a"), cpu, 132) == {}
    with mla_decode.device_cluster_merge_policy(False):
        assert mla_decode.device_cluster_tiles(config, cpu, 132) == {}
    flagged = api._device_plan_config(mla_decode.ONE_TOKEN_SPEC, config, cpu, 132)
    assert (flagged.cluster_merge, flagged.cluster_merge_flags) == (2, True)
    assert api._shapes_config(flagged) == config  # what plan= compares with the inputs' config
    # host plans keep their own choice: the shapes' config, or the unchecked clusters of a plan of that shape
    from cute_attn import validate

    host = validate.HostIndices(qo_indptr=np.arange(65), kv_indptr=np.arange(65) * 128, kv_lens=np.full(64, 8192))
    with mla_decode.cluster_merge_policy(True):
        planned = api._plan(mla_decode.ONE_TOKEN_SPEC, config, host, cpu, 132)
    assert (planned.config.cluster_merge, planned.config.cluster_merge_flags) == (2, False)


def test_checked_cluster_rules_name_the_knob():
    from cute_attn.kernels.common.combine import CombineConfig

    base = _decode_config()
    assert "cluster_merge_flags" in dataclasses.replace(base, cluster_merge_flags=True).can_implement()
    assert dataclasses.replace(base, cluster_merge=2, cluster_merge_flags=True).can_implement() is None
    combine = CombineConfig.for_paged(dataclasses.replace(base, cluster_merge=2, cluster_merge_flags=True))
    assert combine.skip_flagged and combine.can_implement() is None
    assert "skip_flagged" in dataclasses.replace(combine, eager=True).can_implement()


@pytest.mark.usefixtures("isolated_compile_cache")
def test_sm90_checked_build_folds_pairs_and_keeps_global_partials():
    """The device plans' build: the pair fold (two cluster barriers, ``ld.shared::cluster`` at ``mapa`` addresses)
    and, for the clusters that do not hold a whole merge, the fp32 partial stores; its combine reads the flags."""
    from cute_attn.compile import compile_to_ptx
    from cute_attn.kernels.common.combine import CombineConfig

    with mla_decode.device_cluster_merge_policy(True):
        checked = mla_decode.device_cluster_config(_decode_config())
    assert (checked.cluster_merge, checked.cluster_merge_flags) == (2, True)
    assert mla_decode.device_cluster_config(_decode_config()) == _decode_config()  # the default: off
    ptx = compile_to_ptx(checked)
    # each role takes the fold's two barriers at its own end (the producers after their last load)
    assert len(re.findall(r"barrier\.cluster\.arrive;", ptx)) == 4
    assert len(re.findall(r"barrier\.cluster\.wait;", ptx)) == 4
    assert len(re.findall(r"ld\.shared::cluster\.v4\.f32", ptx)) == 2 * -(-16 * 512 // 2 // 4 // 256)
    assert "mapa.shared::cluster.u32" in ptx
    def fp32_stores(text):  # partial_out / partial_lse elements (and lse, flags)
        return len(re.findall(r"st\.global\.b32", text))

    # the partial stores the unchecked cluster build dropped are back, next to the flag stores
    assert fp32_stores(ptx) > fp32_stores(compile_to_ptx(_decode_config())) \
        > fp32_stores(compile_to_ptx(dataclasses.replace(_decode_config(), cluster_merge=2)))
    plain, skipping = (compile_to_ptx(CombineConfig.for_paged(c)) for c in (_decode_config(), checked))
    assert len(re.findall(r"ld\.global", skipping)) > len(re.findall(r"ld\.global", plain))

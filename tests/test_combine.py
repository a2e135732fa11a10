"""LSE combine kernel: compile-only for both arches (CPU) and element-wise vs the reference merge (GPU)."""

import math

import numpy as np
import pytest
import torch

from cute_attn import api, reference, testing
from cute_attn.compile import compile_kernel_with_info, compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels.common import combine
from cute_attn.kernels.common.combine import CombineConfig, default_configs, launch_combine
from cute_attn.plan import plan_work


pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_combine_compiles_for_both_arches(arch):
    for config in default_configs(arch):
        assert compile_kernel_with_info(config).fn is not None
        ptx = compile_to_ptx(config)
        assert f".target {arch}" in ptx and "ex2.approx" in ptx and "lg2.approx" in ptx
        assert "griddepcontrol.wait" in ptx  # launched with PDL behind the attention kernel


@pytest.mark.parametrize("head_dim_v, vector", [(512, "v4"), (128, "v4"), (64, "v2")])
def test_combine_loads_each_slot_row_chunk_in_one_vector_per_lane(head_dim_v, vector):
    """A warp folds 128 columns (64 at head_dim 64) of a row: a lane's columns of a slot are one vector load, and a
    group of slots is loaded before any is accumulated (no branch between a slot's weight and its load)."""
    config = CombineConfig(arch="sm_90a", tile_q_rows=64, head_dim_v=head_dim_v, num_qo_heads=16, group_size=16)
    ptx = compile_to_ptx(config)
    assert ptx.count(f"ld.global.{vector}.b32") == combine.SLOTS_IN_FLIGHT  # slot rows per pass
    assert "ld.local" not in ptx


def test_combine_rejects_a_head_dim_it_cannot_split():
    assert "head_dim_v=100" in CombineConfig(arch="sm_90a", head_dim_v=100).can_implement()


def _split_plan(kind, q_lens, kv_lens, num_qo_heads, num_kv_heads, head_dim, causal, num_ctas=132):
    mla = kind == "mla_paged_prefill"  # (576, 512), one latent head, page 1
    cfg = default_paged_config(kind, arch="sm_90a", num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                               head_dim_qk=head_dim + 64 * mla, head_dim_v=head_dim, page_size=1 if mla else 64,
                               causal=causal)
    plan = plan_work(cfg.plan_config(num_ctas), q_lens, kv_lens)
    assert plan.num_merges > 0
    return cfg, plan


@pytest.mark.gpu
@pytest.mark.parametrize("kind,q_lens,kv_lens,heads,causal,head_dim", [
    ("gqa_paged_decode", [1], [3232], (20, 4), False, 128),
    ("gqa_paged_decode", [1] * 7, [5000, 0, 1, 64, 9000, 130, 2048], (20, 4), False, 128),
    ("gqa_paged_prefill", [3], [40000], (32, 4), True, 128),
    ("gqa_paged_prefill", [3], [40000], (32, 4), True, 64),
    ("mla_paged_prefill", [1, 1], [4096, 70], (16, 1), True, 512),  # batch-1 MLA decode: 64 slots of 512 columns
])
@pytest.mark.parametrize("max_ctas, early_rows", [(0, False), (4, False), (1056, False), (4, True), (1056, True)],
                         ids=["one_cta_a_merge", "grid_of_4", "grid_of_1056", "grid_of_4_early_rows",
                              "grid_of_1056_early_rows"])
def test_combine_matches_reference_merge(kind, q_lens, kv_lens, heads, causal, head_dim, max_ctas, early_rows):
    """``max_ctas`` (``combine.combine_grid_policy``): 0 launches a CTA per merge slot; a cap makes each CTA walk merges
    a grid apart (4: every CTA folds many merges, and stops at the first merge without slots)."""
    with combine.combine_grid_policy(max_ctas), combine.combine_early_rows_policy(early_rows):
        _check_combine(kind, q_lens, kv_lens, heads, causal, head_dim)


def _check_combine(kind, q_lens, kv_lens, heads, causal, head_dim):
    cfg, plan = _split_plan(kind, q_lens, kv_lens, *heads, head_dim, causal)
    dp = api.DevicePlan.upload(cfg, plan, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    dp.partial_out.copy_(torch.randn(dp.partial_out.shape, generator=g, device="cuda"))
    plse = torch.randn(dp.partial_lse.shape, generator=g, device="cuda") * 4
    plse[::3, ::4] = -math.inf  # chunks whose rows saw no key
    dp.partial_lse.copy_(plse)
    dp.partial_out[::3, ::4] = math.nan  # ... and whose o must then be ignored
    total_q = sum(q_lens)
    out = torch.full((total_q, heads[0], head_dim), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((total_q, heads[0]), math.nan, dtype=torch.float32, device="cuda")
    launch_combine(dp, out, lse, 1.0)
    torch.cuda.synchronize()
    group = heads[0] // heads[1]
    written = torch.zeros(total_q, heads[0], dtype=torch.bool)
    for m in range(plan.num_merges):
        b, h, r0, nr, tok0 = (int(x) for x in plan.merges[m])
        slots = range(int(plan.merge_indptr[m]), int(plan.merge_indptr[m + 1]))
        o_parts = [torch.where(plse[s, :nr, None].isneginf(), 0.0, dp.partial_out[s, :nr]).cpu() for s in slots]
        want_o, want_lse = reference.merge_partials(o_parts, [plse[s, :nr].cpu() for s in slots])
        rows = np.arange(r0, r0 + nr)
        tokens, hq = tok0 + rows // group, h * group + rows % group
        testing.assert_close_benchmark(out[tokens, hq].cpu(), want_o.to(torch.bfloat16), "combined output")
        testing.assert_close_benchmark(lse[tokens, hq].cpu(), want_lse, "combined lse")
        written[tokens, hq] = True
    assert torch.isnan(lse.cpu()[~written]).all(), "the combine wrote rows that no merge owns"


def test_capped_combine_grid_walks_merges_and_keeps_the_default_build():
    """``max_ctas=0`` launches a CTA per merge slot (no grid-size read); a capped build (the default since the
    session-17 A/B) reads the grid size and loops over merges."""
    base = CombineConfig(arch="sm_90a", tile_q_rows=64, head_dim_v=512, num_qo_heads=16, group_size=16)
    assert base.max_ctas == 0 and combine.COMBINE_MAX_CTAS == 1056
    capped = CombineConfig(arch="sm_90a", tile_q_rows=64, head_dim_v=512, num_qo_heads=16, group_size=16,
                           max_ctas=1056)
    assert "%nctaid.x" not in compile_to_ptx(base) and "%nctaid.x" in compile_to_ptx(capped)
    assert repr(combine.LseCombine(capped)).endswith("_C66")  # 1056 CTAs / (4 row x 4 column blocks)
    assert "max_ctas" in CombineConfig(arch="sm_90a", max_ctas=-1).can_implement()
    with combine.combine_grid_policy(0):
        config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=32, num_kv_heads=4,
                                      head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)
        assert CombineConfig.for_paged(config).max_ctas == 0
    assert CombineConfig.for_paged(config).max_ctas == 1056


@pytest.mark.parametrize("head_dim_v, vector", [(512, "v4"), (128, "v4"), (64, "v2")])
def test_early_rows_load_the_first_slots_with_the_lses_and_keep_the_default_build(head_dim_v, vector):
    """``early_rows`` (``COMBINE_EARLY_ROWS``, on since its session-19 A/B): one more batch of a lane's slot vectors,
    issued before the LSE reduction (the loop skips reloading it); the plain build is unchanged by the knob."""
    base = CombineConfig(arch="sm_90a", tile_q_rows=64, head_dim_v=head_dim_v, num_qo_heads=16, group_size=16,
                         max_ctas=1056)
    early = CombineConfig(arch="sm_90a", tile_q_rows=64, head_dim_v=head_dim_v, num_qo_heads=16, group_size=16,
                          max_ctas=1056, early_rows=True)
    plain_ptx, early_ptx = compile_to_ptx(base), compile_to_ptx(early)
    assert plain_ptx.count(f"ld.global.{vector}.b32") == combine.SLOTS_IN_FLIGHT
    assert early_ptx.count(f"ld.global.{vector}.b32") == 2 * combine.SLOTS_IN_FLIGHT
    assert early_ptx.index(f"ld.global.{vector}.b32") < early_ptx.index("shfl.sync.bfly")  # before the reduction
    assert "ld.local" not in early_ptx and repr(combine.LseCombine(early)).endswith("_EarlyRows")
    config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=32, num_kv_heads=4,
                                  head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)
    default = combine.COMBINE_EARLY_ROWS
    assert CombineConfig.for_paged(config).early_rows is default
    with combine.combine_early_rows_policy(not default):
        assert CombineConfig.for_paged(config).early_rows is (not default)
    assert CombineConfig.for_paged(config).early_rows is default

"""The line builds' closed form for uniform batches (``PagedAttentionConfig.uniform_line``,
``config.line_uniform_policy``) on a GPU: the GQA and MLA line tiers' tests rerun with every default call's line build
taking it, and uniform batches chosen by the numpy twin to reach each of its branches (even pieces, whole tiles, the
line deal, cuts without an inside edge, and the fallback to the table) at the GPU's CTA count and at small grids. Built
in session 42."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
import test_line_schedule_gpu as gqa_tier  # noqa: E402
import test_mla_line_schedule_gpu as mla_tier  # noqa: E402
import unit_scratch  # noqa: E402
from cute_attn.config import default_paged_config, line_uniform_policy  # noqa: E402
from cute_attn.line_schedule import cuts_only, uniform_line  # noqa: E402
from cute_attn.ops import gqa_decode, mla_decode  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _uniform_line():
    with unit_scratch.both_line_builds(line_uniform_policy(True)):
        yield


# the tiers' tests, collected here under this module's policy (their own modules run them without the closed form)
test_gqa_drawn_batches = gqa_tier.test_drawn_batches_match_the_reference
test_gqa_bench_shapes_and_small_grids = gqa_tier.test_bench_shapes_and_small_grids
test_gqa_line_deal = gqa_tier.test_a_batch_the_line_deal_takes
test_gqa_page_faults = gqa_tier.test_page_faults_empty_their_requests_and_clear
test_gqa_hostile_index_tensors = gqa_tier.test_hostile_index_tensors_are_contained_and_reported
test_gqa_bad_last_page_lengths = gqa_tier.test_bad_last_page_lengths_at_every_request
test_gqa_captured_replays = gqa_tier.test_captured_call_replays_across_batches
test_mla_drawn_batches = mla_tier.test_drawn_batches_match_the_reference
test_mla_bench_rows = mla_tier.test_bench_rows
test_mla_small_grids = mla_tier.test_small_grids
test_mla_page_faults = mla_tier.test_page_faults_empty_their_requests_and_clear
test_mla_hostile_index_tensors = mla_tier.test_hostile_index_tensors_are_contained_and_reported


def _plan_config(kind, heads, kv_heads, page_size, num_ctas):
    if kind == "gqa":
        config = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=heads, num_kv_heads=kv_heads,
                                      head_dim_qk=128, head_dim_v=128, page_size=page_size, causal=False)
        plan = config.plan_config(num_ctas)
        return dataclasses.replace(plan, line_deal=gqa_decode.line_deals(page_size, kv_heads, policy_now=False))
    config = default_paged_config("mla_paged_prefill", arch="sm_90a", num_qo_heads=heads, num_kv_heads=1,
                                  head_dim_qk=576, head_dim_v=512, page_size=page_size, causal=True,
                                  spec=mla_decode.ONE_TOKEN_SPEC)
    return cuts_only(config.plan_config(num_ctas))


def _branch(line) -> str:
    if line.needs_table:
        return "table"
    return "even" if line.pieces else "whole" if line.whole_tiles else "dealt" if line.dealt else "cuts"


#: (kind, heads, KV heads, page size, batch, keys): uniform batches across the closed form's branches at 132 CTAs
CASES = [("gqa", 20, 4, 64, 1, 3232), ("gqa", 20, 4, 64, 16, 2048), ("gqa", 20, 4, 64, 64, 2048),
         ("gqa", 20, 4, 64, 128, 4096), ("gqa", 32, 16, 64, 64, 2048), ("gqa", 32, 8, 1, 64, 2048),
         ("gqa", 20, 4, 16, 37, 5000), ("gqa", 8, 1, 64, 200, 700), ("gqa", 20, 4, 1, 3, 1),
         ("gqa", 20, 4, 1, 26, 700), ("gqa", 32, 8, 1, 11, 300), ("gqa", 20, 4, 64, 2, 64),
         ("gqa", 32, 8, 64, 300, 1100), ("gqa", 20, 4, 64, 45, 3000), ("mla", 16, 1, 1, 16, 4096),
         ("mla", 16, 1, 64, 64, 8192), ("mla", 8, 1, 1, 37, 5000), ("mla", 16, 1, 64, 3, 129),
         ("mla", 16, 1, 1, 5, 64)]


@pytest.mark.parametrize("num_sms", [None, 7])
def test_uniform_batches_through_every_branch(num_sms):
    """Each case against the float32 reference (garbage-prefilled outputs, NaN-poisoned pool); the twin names the
    branch each takes at the grid, and the cases reach every branch at the GPU's CTA count."""
    ctas = num_sms or torch.cuda.get_device_properties(0).multi_processor_count
    reached = set()
    for kind, heads, kv_heads, page_size, batch, keys in CASES:
        branch = _branch(uniform_line(_plan_config(kind, heads, kv_heads, page_size, ctas), keys, batch))
        reached.add(branch)
        what = f"{kind} h{heads}/kv{kv_heads} page {page_size} {batch} x {keys} ({branch}, {ctas} CTAs)"
        if kind == "gqa":
            case = gqa_tier._case([keys] * batch, seed=batch, heads=heads, kv_heads=kv_heads, page_size=page_size)
            gqa_tier._check(case, what, num_sms)
        else:
            case = mla_tier._case([keys] * batch, seed=batch, heads=heads, page_size=page_size)
            mla_tier._check(case, what, num_sms)
    if num_sms is None:
        assert reached == {"even", "whole", "dealt", "cuts", "table"}, reached


def test_the_route_is_built_with_the_closed_form():
    case = gqa_tier._case([2048] * 64, seed=5)
    route = unit_scratch.assert_matches_reference(cute_attn.gqa_paged_decode, case, "gqa 64 x 2048")
    assert route.config.line_schedule and route.config.uniform_line

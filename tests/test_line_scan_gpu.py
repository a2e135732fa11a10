"""The line builds' batched page-id scan (``PagedAttentionConfig.scan_ids_per_thread`` 8, ``config.line_scan_policy``)
on a GPU: the GQA and MLA line tiers' bench rows, small grids, page faults, hostile tables and drawn batches, rerun
with every default call's line build checking eight ids a pass, and the route built with it (the scan's faults are what
a batched pass could lose: a bad id's mark, its request's rows, the clean-up). Built in session 40; 38 passed on the
H200 in session 41, after which the default call takes 8 from 512 page ids a CTA (``config.line_scan_ids``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
import test_line_schedule_gpu as gqa_tier  # noqa: E402
import test_mla_line_schedule_gpu as mla_tier  # noqa: E402
import unit_scratch  # noqa: E402
from cute_attn.config import line_scan_policy  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SCAN_IDS = 8


@pytest.fixture(autouse=True)
def _batched_scan():
    with unit_scratch.both_line_builds(line_scan_policy(SCAN_IDS)):
        yield


# the tiers' tests, collected here under this module's policy (their own modules run them with one id a pass)
test_gqa_drawn_batches = gqa_tier.test_drawn_batches_match_the_reference
test_gqa_bench_shapes_and_small_grids = gqa_tier.test_bench_shapes_and_small_grids
test_gqa_page_faults = gqa_tier.test_page_faults_empty_their_requests_and_clear
test_gqa_hostile_index_tensors = gqa_tier.test_hostile_index_tensors_are_contained_and_reported
test_mla_drawn_batches = mla_tier.test_drawn_batches_match_the_reference
test_mla_bench_rows = mla_tier.test_bench_rows
test_mla_small_grids = mla_tier.test_small_grids
test_mla_page_faults = mla_tier.test_page_faults_empty_their_requests_and_clear
test_mla_hostile_index_tensors = mla_tier.test_hostile_index_tensors_are_contained_and_reported


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_the_route_is_built_with_the_batched_scan(kind):
    """The default call's route carries the policy's ids a pass (and a page-1 pool of 300k ids: many passes)."""
    if kind == "gqa":
        case = gqa_tier._case([9000] * 33, seed=3, page_size=1)
        entry = cute_attn.gqa_paged_decode
    else:
        case = mla_tier._case([9000] * 33, seed=3, page_size=1)
        entry = cute_attn.mla_paged_decode
    route = unit_scratch.assert_matches_reference(entry, case, f"{kind} 33 x 9000 page 1")
    assert route.config.line_schedule and route.config.scan_ids_per_thread == SCAN_IDS

"""The planner-free GQA prefill (``dynamic_schedule``: in-kernel index checks, CTAs taking units from a counter) on a
GPU: drawn batches against the float32 reference, hostile page tables contained, the counter and marks left clean, and a
captured call replayed across batches."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
import unit_scratch  # noqa: E402
from cute_attn import testing  # noqa: E402
from cute_attn.config import late_claim_policy  # noqa: E402
from cute_attn.ops import gqa_prefill  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


@contextlib.contextmanager
def every_batch_self_schedules(late_claim: bool = False):
    """The default call takes the self-scheduling build whatever the batch's units (the policy's floor at 0), claiming
    units late or early (``config.late_claim_policy``)."""
    with gqa_prefill.dynamic_schedule_policy(True), late_claim_policy(late_claim), \
            cute_attn.ops.policy(vars(gqa_prefill), DYNAMIC_MIN_UNITS_PER_CTA=0):
        yield


@pytest.fixture(autouse=True, params=[False, True], ids=["early-claim", "late-claim"])
def _clean(request):
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    with every_batch_self_schedules(request.param):
        yield
    torch.cuda.synchronize()


def _assert_matches_reference(case, what, num_sms=None):
    unit_scratch.assert_matches_reference(cute_attn.gqa_paged_prefill, case, what, num_sms)


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=10, max_q=600, max_kv=3000),
       layout=st.sampled_from([(32, 4, 128), (20, 4, 128), (5, 1, 128), (16, 16, 64), (16, 2, 256), (24, 8, 128)]),
       page_size=st.sampled_from([1, 2, 16, 64]), seed=st.integers(0, 2**16))
def test_drawn_batches_match_the_reference(batch, layout, page_size, seed):
    heads, kv_heads, head_dim = layout
    if head_dim == 256 and page_size > 64:
        page_size = 64
    q_lens, kv_lens = batch
    case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads,
                                         head_dim=head_dim, page_size=page_size, device="cuda", seed=seed)
    _assert_matches_reference(case, f"{layout} page {page_size} {q_lens}/{kv_lens}")


@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize("num_sms", [None, 1, 7])
def test_bench_shapes_and_small_grids(num_sms, page_size):
    """The bench's 8 x 992, a ragged batch and one with fewer keys than queries (rows that see no key), on the whole
    GPU and on grids of 1 and 7 CTAs (each CTA then takes many units, at page 1 through the row warps' alternating
    slots; the same counter, reset by the last CTA, serves each launch)."""
    batches = (([992] * 8, [992] * 8), ([33, 700, 1, 990, 0, 128], [33, 900, 3000, 990, 64, 4096]),
               ([100, 40, 9], [30, 0, 9]))
    for q_lens, kv_lens in batches:
        for seed in range(2):
            case = testing.make_gqa_prefill_case(q_lens, kv_lens, page_size=page_size, device="cuda", seed=seed)
            _assert_matches_reference(case, f"{len(q_lens)} requests page {page_size} seed {seed} grid {num_sms}",
                                      num_sms)


@pytest.mark.parametrize("num_sms", [None, 1, 7])
def test_many_requests_cross_the_search_windows(num_sms):
    """70 requests, some without queries (``unit_scratch.many_requests``): the request search's windows past the
    first 32 requests."""
    q_lens, kv_lens = unit_scratch.many_requests()
    for page_size in (64, 1):
        case = testing.make_gqa_prefill_case(q_lens, kv_lens, page_size=page_size, device="cuda", seed=page_size)
        _assert_matches_reference(case, f"70 requests page {page_size} grid {num_sms}", num_sms)


@pytest.mark.parametrize("page_size", [64, 1])
def test_page_faults_empty_their_requests_and_clear(page_size):
    """A page id outside the pool: the request's rows 0 / lse -inf, the others the reference's, the error names
    kv_indices; the next clean call is right (``unit_scratch.check_page_faults``). Page 1 checks the ids in the
    row gathers, page 64 before each box."""
    case = testing.make_gqa_prefill_case([300, 5, 260, 40], [300, 900, 2000, 40], page_size=page_size, device="cuda",
                                         seed=5)
    unit_scratch.check_page_faults(cute_attn.gqa_paged_prefill, case, case.k_cache.shape[0])


def test_hostile_index_tensors_are_contained_and_reported():
    """Every corruption the hostile module draws is contained and reported (``unit_scratch.check_hostile_calls``)."""
    case = testing.make_gqa_prefill_case([5, 0, 40, 300], [300, 3, 40, 700], device="cuda", seed=22)
    unit_scratch.check_hostile_calls(cute_attn.gqa_paged_prefill, case, max_examples=16)


def test_captured_call_replays_across_batches():
    """A captured call, replayed across refilled batches, equals their references (``unit_scratch.check_replays``)."""
    batch, total_q, page_size = 6, 1200, 16
    case = testing.make_gqa_prefill_case([200] * batch, [1500] * batch, page_size=page_size, device="cuda", seed=3,
                                         extra_pages=400)
    unit_scratch.check_replays(cute_attn.gqa_paged_prefill, case, (case.k_cache, case.v_cache), total_q, page_size,
                               steps=4, max_extra_keys=1200, rng=np.random.default_rng(7))


@pytest.mark.parametrize("page_size", [64, 1])
def test_route_plan_launches_the_build(page_size):
    """A host plan the rule routes (``config.ROUTE_PLAN_KINDS``, built in session 37) launches this build, eager and
    captured (``unit_scratch.check_route_plan``)."""
    case = testing.make_gqa_prefill_case([992] * 8, [992] * 8, page_size=page_size, device="cuda", seed=5)
    unit_scratch.check_route_plan(cute_attn.gqa_paged_prefill, cute_attn.plan_gqa_paged_prefill, case,
                                  f"route plan page {page_size}")

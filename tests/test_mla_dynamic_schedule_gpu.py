"""The planner-free MLA prefill (``dynamic_schedule`` on the sm_90a score-warpgroup kernel: in-kernel index checks,
the load role taking units from a counter and handing them to the consumers in a ring) on a GPU: drawn batches
against the float32 reference, both consumer splits it builds, hostile page tables contained, the counter and marks
left clean, and a captured call replayed across batches."""

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
from cute_attn.ops import mla_prefill  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SETTINGS = settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
SPARE_ROWS = 97  # pool rows no request owns (NaN)


@contextlib.contextmanager
def every_batch_self_schedules(split: str, late_claim: bool = False):
    """The default call takes the self-scheduling build whatever the batch's units (the policy's floor at 0), with
    the consumer split ``split`` for every batch, claiming units late or early (``config.late_claim_policy``)."""
    with mla_prefill.dynamic_schedule_policy(True), mla_prefill.consumer_split(split), \
            late_claim_policy(late_claim), \
            cute_attn.ops.policy(vars(mla_prefill), DYNAMIC_MIN_UNITS_PER_CTA=0):
        yield


#: (consumer split, late claim): both splits the build takes, and the late claim (session 36) with the default split
BUILDS = [("score_wg_sepi", False), ("score_wg", False), ("score_wg_sepi", True)]


@pytest.fixture(autouse=True, params=BUILDS, ids=lambda b: b[0] + ("-late" if b[1] else ""))
def split(request):
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    with every_batch_self_schedules(*request.param):
        yield request.param[0]
    torch.cuda.synchronize()


def _case(q_lens, kv_lens, page_size=1, seed=0, **kw):
    if page_size == 1:
        kw.setdefault("num_pages", sum(kv_lens) + SPARE_ROWS)
    return testing.make_mla_prefill_case(q_lens, kv_lens, page_size=page_size, device="cuda", seed=seed, **kw)


def _assert_matches_reference(case, what, num_sms=None):
    unit_scratch.assert_matches_reference(cute_attn.mla_paged_prefill, case, what, num_sms)


@SETTINGS
@given(batch=testing.ragged_batches(max_batch=8, max_q=300, max_kv=1200), page_size=st.sampled_from([1, 16, 64]),
       seed=st.integers(0, 2**16))
def test_drawn_batches_match_the_reference(batch, page_size, seed):
    q_lens, kv_lens = batch
    _assert_matches_reference(_case(q_lens, kv_lens, page_size, seed), f"page {page_size} {q_lens}/{kv_lens}")


@pytest.mark.parametrize("num_sms", [None, 1, 7])
def test_bench_like_shapes_and_small_grids(num_sms):
    """A batch of long requests, a ragged one with an empty request and one with fewer keys than queries (rows that
    see no key), on the whole GPU and on grids of 1 and 7 CTAs (each CTA then takes many units through the ring; the
    counter, reset by the last CTA, serves each launch)."""
    batches = (([300] * 3, [700] * 3), ([33, 200, 1, 0, 64], [33, 900, 1500, 64, 64]), ([100, 40, 9], [30, 0, 9]))
    for q_lens, kv_lens in batches:
        for page_size in (1, 64):
            case = _case(q_lens, kv_lens, page_size, seed=page_size)
            _assert_matches_reference(case, f"{len(q_lens)} requests page {page_size} grid {num_sms}", num_sms)


@pytest.mark.parametrize("num_sms", [None, 1, 7])
def test_many_requests_cross_the_search_windows(num_sms):
    """70 requests, some without queries (``unit_scratch.many_requests``): the request search's windows past the
    first 32 requests."""
    q_lens, kv_lens = unit_scratch.many_requests()
    for page_size in (1, 64):
        case = _case(q_lens, kv_lens, page_size, seed=page_size)
        _assert_matches_reference(case, f"70 requests page {page_size} grid {num_sms}", num_sms)


def test_ps1_order_without_last_page_len_and_with_it():
    """Page size 1 in FlashInfer-Bench's ps1 order (no ``kv_last_page_len``: the route passes ones) and with one."""
    _assert_matches_reference(_case([40, 90], [300, 90]), "ps1 order")
    _assert_matches_reference(_case([40, 90], [300, 90], with_last_page_len=True), "with kv_last_page_len")


@pytest.mark.parametrize("page_size", [16, 1])
def test_page_faults_empty_their_requests_and_clear(page_size):
    """A page id outside the pool: the request's rows 0 / lse -inf, the others the reference's, the error names
    kv_indices; the next clean call is right (``unit_scratch.check_page_faults``). Page 1 checks the ids in the
    row gathers, page 16 in the TMA boxes' ids."""
    case = _case([100, 5, 80, 40], [300, 900, 200, 40], page_size=page_size, seed=5)
    unit_scratch.check_page_faults(cute_attn.mla_paged_prefill, case, case.ckv_cache.shape[0])


def test_hostile_index_tensors_are_contained_and_reported():
    """Every corruption the hostile module draws is contained and reported (``unit_scratch.check_hostile_calls``)."""
    case = _case([5, 0, 40, 100], [300, 3, 40, 700], page_size=16, seed=22)
    unit_scratch.check_hostile_calls(cute_attn.mla_paged_prefill, case, max_examples=12)


def test_bad_last_page_lens_are_contained_and_reported():
    """``kv_last_page_len`` 0, one past the page and negative, at every request (the empty one included: CTA 0
    reports requests that have no unit): contained and reported (``unit_scratch.check_last_page_lens``)."""
    case = _case([5, 0, 40, 100], [300, 3, 40, 700], page_size=16, seed=23)
    unit_scratch.check_last_page_lens(cute_attn.mla_paged_prefill, case)


def test_captured_call_replays_across_batches():
    """A captured call, replayed across refilled batches, equals their references (``unit_scratch.check_replays``)."""
    batch, total_q, page_size = 5, 600, 16
    case = _case([120] * batch, [700] * batch, page_size=page_size, seed=3, num_pages=400)
    # extra keys below 400: every batch's pages fit in len(kv_indices) (220), which the refill draws from
    unit_scratch.check_replays(cute_attn.mla_paged_prefill, case, (case.ckv_cache, case.kpe_cache), total_q, page_size,
                               steps=3, max_extra_keys=400, rng=np.random.default_rng(7))


@pytest.mark.parametrize("page_size", [1, 64])
def test_route_plan_launches_the_build(page_size):
    """A host plan the rule routes (``config.ROUTE_PLAN_KINDS``, built in session 37) launches this build, eager and
    captured (``unit_scratch.check_route_plan``)."""
    case = _case([512] * 8, [600] * 8, page_size=page_size, seed=5)
    unit_scratch.check_route_plan(cute_attn.mla_paged_prefill, cute_attn.plan_mla_paged_prefill, case,
                                  f"route plan page {page_size}")

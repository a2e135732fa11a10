"""The planner-free prefills' rank-major unit order (``PagedAttentionConfig.rank_major_units``,
``config.RANK_MAJOR_KINDS``: a batch whose requests all have as many q tiles, at most that many units a CTA, taken
longest first across its requests) on a GPU, GQA and MLA, against the float32 reference. Built in session 39; none
of it has run yet.

Each case says which order the kernel takes (the numpy twin ``plan_units.rank_major`` decides as ``check_batch``
does) and asserts the call launched the rank-major build: uniform batches of few units a CTA (rank-major), uniform
batches of many and ragged ones (request-major under the same build), small grids (the rule counts the launch's
CTAs), faults and hostile tables. A unit decoded twice or never shows as a wrong or NaN row: outputs start as NaN,
and pools hold NaN wherever no request owns a slot. Which order a launch took is the twin's word: the kernel keeps no
trace of it (the A/B's h5/kv1 and h6/kv1 rows show it in time)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
import unit_scratch  # noqa: E402
from cute_attn import plan_units, testing  # noqa: E402
from cute_attn.config import RANK_MAJOR_MAX_UNITS_PER_CTA, late_claim_policy, rank_major_policy  # noqa: E402
from cute_attn.ops import gqa_prefill, mla_prefill  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _rank_major():
    """Both kinds' default calls on the route whatever the batch's units, claiming late, rank-major on."""
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    with contextlib.ExitStack() as stack:
        for ops in (gqa_prefill, mla_prefill):
            stack.enter_context(ops.dynamic_schedule_policy(True))
            stack.enter_context(cute_attn.ops.policy(vars(ops), DYNAMIC_MIN_UNITS_PER_CTA=0))
        stack.enter_context(late_claim_policy(True))
        stack.enter_context(rank_major_policy(True))
        yield
    torch.cuda.synchronize()


def _gqa(q_lens, kv_lens, heads=5, kv_heads=1, page_size=64, seed=0):
    return testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                                         page_size=page_size, device="cuda", seed=seed)


def _check(entry, case, rank_major: bool, what: str, num_sms=None):
    """The call matches the reference on the rank-major build, and the twin says the kernel took the order expected."""
    route = unit_scratch.assert_matches_reference(entry, case, what, num_sms)
    config = route.config
    assert config.rank_major_units == RANK_MAJOR_MAX_UNITS_PER_CTA, f"{what}: {config}"
    plan_config = config.plan_config(route.num_ctas)
    q_lens = (case.qo_indptr[1:] - case.qo_indptr[:-1]).tolist()
    assert plan_units.rank_major(plan_config, q_lens, config.rank_major_units) is rank_major, what


@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize("layout", [(5, 1), (6, 1), (32, 4)])
def test_uniform_batches_of_few_units_go_rank_major(layout, page_size):
    heads, kv_heads = layout
    q = 992 if heads < 8 else 300  # h5/kv1 8 x 992: 320 units; h32/kv4 4 x 300: 19 tiles x 4 heads x 4 = 304
    batch = 8 if heads < 8 else 4
    case = _gqa([q] * batch, [q + 37] * batch, heads, kv_heads, page_size, seed=heads + page_size)
    _check(cute_attn.gqa_paged_prefill, case, True, f"h{heads}/kv{kv_heads} {batch} x {q} page {page_size}")


@pytest.mark.parametrize("num_sms", [7, 1])
def test_the_rule_counts_the_launchs_ctas(num_sms):
    """2 x 40 at h32/kv4 is 24 units: rank-major on 7 CTAs (at most 28), request-major on 1 (at most 4)."""
    case = _gqa([40, 40], [300, 700], 32, 4, seed=num_sms)
    _check(cute_attn.gqa_paged_prefill, case, num_sms == 7, f"{num_sms} CTAs", num_sms)


def test_many_units_and_ragged_batches_stay_request_major():
    _check(cute_attn.gqa_paged_prefill, _gqa([992] * 8, [992] * 8, 32, 4), False, "h32/kv4 8 x 992")
    _check(cute_attn.gqa_paged_prefill, _gqa([300, 270, 300], [900, 400, 300], 5, 1, seed=3), False, "ragged")
    _check(cute_attn.gqa_paged_prefill, _gqa([300, 0, 300], [900, 4, 300], 5, 1, seed=4), False, "an empty request")


def test_unequal_queries_of_equal_tile_counts_go_rank_major():
    """h5/kv1's 125-row tiles: 300 and 299 queries are 1500 and 1495 packed rows, 12 tiles each (the last tile of the
    299 one is shorter): uniform units, rank-major, each request's own rows."""
    _check(cute_attn.gqa_paged_prefill, _gqa([300, 299, 300], [900, 400, 300], 5, 1, seed=5), True, "300 / 299")


@SETTINGS
@given(batch=st.integers(1, 12), q_len=st.integers(1, 700), extra=st.lists(st.integers(0, 1500), min_size=12,
       max_size=12), layout=st.sampled_from([(5, 1), (16, 2), (20, 4), (32, 8)]),
       page_size=st.sampled_from([1, 16, 64]), seed=st.integers(0, 2**16))
def test_drawn_uniform_batches(batch, q_len, extra, layout, page_size, seed):
    heads, kv_heads = layout
    case = _gqa([q_len] * batch, [q_len + e for e in extra[:batch]], heads, kv_heads, page_size, seed)
    route = unit_scratch.assert_matches_reference(cute_attn.gqa_paged_prefill, case, f"{batch} x {q_len}", None)
    assert route.config.rank_major_units == RANK_MAJOR_MAX_UNITS_PER_CTA
    plan_config = route.config.plan_config(route.num_ctas)
    few = plan_units.request_units(plan_config, [q_len] * batch).sum() <= RANK_MAJOR_MAX_UNITS_PER_CTA * route.num_ctas
    assert plan_units.rank_major(plan_config, [q_len] * batch, RANK_MAJOR_MAX_UNITS_PER_CTA) is bool(few)


@pytest.mark.parametrize("page_size", [64, 1])
def test_page_faults_and_hostile_tables_on_a_rank_major_batch(page_size):
    case = _gqa([500] * 6, [600] * 6, page_size=page_size, seed=11)
    pool = case.k_cache.shape[0]
    unit_scratch.check_page_faults(cute_attn.gqa_paged_prefill, case, pool)
    unit_scratch.check_hostile_calls(cute_attn.gqa_paged_prefill, _gqa([300] * 5, [400] * 5, seed=12), 10)


@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_uniform_batches(page_size):
    """MLA prefill (16 heads, 64-row tiles): 4 x 200 is 50 units a request, 200 in all: rank-major; 40 x 200 stays
    request-major."""
    for batch, rank_major in ((4, True), (40, False)):
        case = testing.make_mla_prefill_case([200] * batch, [260] * batch, page_size=page_size, device="cuda",
                                             seed=batch, with_last_page_len=page_size > 1,
                                             **({"num_pages": batch * 260 + 97} if page_size == 1 else {}))
        _check(cute_attn.mla_paged_prefill, case, rank_major, f"MLA {batch} x 200 page {page_size}")

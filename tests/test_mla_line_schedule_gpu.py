"""The MLA decode's planner-free build (``line_schedule`` of the swapped one-token kernel: every CTA derives its own
stretch of the cost line, folds its split items in the kernel; no planner, no combine launch) on a GPU: drawn batches
and the bench's rows against the float32 reference at pages 1 and 64, 16 and 8 heads, small grids, page faults,
hostile index tensors, the scratch left clean. Built in session 38; passed on the H200 in session 39."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
import unit_scratch  # noqa: E402
from cute_attn import testing  # noqa: E402
from cute_attn.ops import mla_decode  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _line_schedule():
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    with mla_decode.line_schedule_policy(True):
        yield
    torch.cuda.synchronize()


def _case(kv_lens, seed, heads=16, page_size=1):
    return testing.make_mla_decode_case(kv_lens, num_heads=heads, page_size=page_size, device="cuda", seed=seed)


def _check(case, what, num_sms=None):
    route = unit_scratch.assert_matches_reference(cute_attn.mla_paged_decode, case, what, num_sms)
    assert route.config.line_schedule, f"{what}: the route is not the line build"


@SETTINGS
@given(kv_lens=st.lists(st.one_of(st.just(0), st.integers(1, 130), st.integers(1, 12000)), min_size=1, max_size=40),
       heads=st.sampled_from([16, 8]), page_size=st.sampled_from([1, 64]), seed=st.integers(0, 2**16))
def test_drawn_batches_match_the_reference(kv_lens, heads, page_size, seed):
    _check(_case(kv_lens, seed, heads, page_size), f"h{heads} page {page_size} {kv_lens}")


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kv_lens", [[4096], [4096] * 16, [8192] * 64, [4096] * 128, None],
                         ids=["1x4096", "16x4096", "64x8192", "128x4096", "ragged64"])
def test_bench_rows(kv_lens, page_size):
    """The bench's MLA decode rows (even pieces on the uniform ones; the ragged 64 of 1..32768 keys: cuts)."""
    kv_lens = kv_lens or np.random.default_rng(64).integers(1, 32769, size=64).tolist()
    _check(_case(kv_lens, seed=len(kv_lens), page_size=page_size), f"{len(kv_lens)} requests page {page_size}")


@pytest.mark.parametrize("num_sms", [1, 7])
def test_small_grids(num_sms):
    """Grids of 1 and 7 CTAs: long stretches of many items, runs of inside edges (merges of many slots)."""
    _check(_case([9000, 0, 3, 4096, 700, 130], seed=7), f"grid {num_sms}", num_sms)


@pytest.mark.parametrize("page_size", [1, 64])
def test_page_faults_empty_their_requests_and_clear(page_size):
    """A page id outside the pool in request 2: its rows 0 / lse -inf (every piece of it, whichever CTA folded it),
    the others the reference's, the error names kv_indices, the scratch clean; the next clean call is right."""
    from cute_attn.device_errors import DeviceIndexError

    case = _case([5000, 70, 9000, 300], seed=5, page_size=page_size)
    ref_out, ref_lse = case.reference()
    saved = case.kv_indices.clone()
    ref_out[2], ref_lse[2] = 0, float("-inf")
    case.kv_indices[int(case.kv_indptr[3]) - 1] = case.ckv_cache.shape[0] + 7
    out, lse = case.new_outputs()
    route = unit_scratch.call_self_scheduled(cute_attn.mla_paged_decode, case, out, lse, "faulted call")
    torch.cuda.synchronize()
    testing.assert_close_benchmark(out, ref_out, "faulted output")
    testing.assert_close_benchmark(lse, ref_lse, "faulted lse")
    with pytest.raises(DeviceIndexError, match="kv_indices"):
        cute_attn.raise_on_device_error()
    unit_scratch.assert_scratch_clean(route, "after the faulted call")
    case.kv_indices.copy_(saved)
    unit_scratch.assert_matches_reference(cute_attn.mla_paged_decode, case, "clean again")


def test_hostile_index_tensors_are_contained_and_reported():
    unit_scratch.check_hostile_calls(cute_attn.mla_paged_decode, _case([300, 0, 4000, 70, 2100], seed=22,
                                                                       page_size=64), 12)


def test_bad_last_page_lengths_at_every_request():
    """``kv_last_page_len`` 0, one past the page and negative at every request (the empty one included): contained
    and reported, then a good batch is right (``unit_scratch.check_last_page_lens``)."""
    unit_scratch.check_last_page_lens(cute_attn.mla_paged_decode, _case([300, 0, 4000, 70], seed=23, page_size=64))


def test_captured_call_replays_across_batches():
    """Captured once at a batch of 6, replayed over refilled page tables (1..4000 keys a request: even pieces and
    ragged cuts as they come; one replay with a page id outside the pool): each replay equals the reference of what
    the index tensors then hold, and the merge counters and marks are left zero (``unit_scratch.check_replays``)."""
    batch, page_size = 6, 64
    case = _case([4096] * batch, seed=3, page_size=page_size)  # 384 pages: every refill's fit (6 x 63 at most)
    unit_scratch.check_replays(cute_attn.mla_paged_decode, case, (case.ckv_cache, case.kpe_cache), batch, page_size,
                               steps=4, max_extra_keys=4000, rng=np.random.default_rng(8))

"""The planner-free decode (``line_schedule``: every CTA derives its own stretch of the device plan, no planner launch)
on a GPU: drawn batches against the float32 reference, small grids (many items and merges a CTA), the even-piece and
whole-tile batches, hostile index tensors contained and reported, the scratch left clean, and a captured call replayed
across batches. Built in session 38; passed on the H200 in session 39."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
import unit_scratch  # noqa: E402
from cute_attn import testing  # noqa: E402
from cute_attn.ops import gqa_decode  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _line_schedule():
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    with gqa_decode.line_schedule_policy(True):
        yield
    torch.cuda.synchronize()


def _case(kv_lens, seed, heads=20, kv_heads=4, head_dim=128, page_size=64, extra_pages=None):
    return testing.make_gqa_decode_case(kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                        page_size=page_size, device="cuda", seed=seed, extra_pages=extra_pages)


def _check(case, what, num_sms=None):
    route = unit_scratch.assert_matches_reference(cute_attn.gqa_paged_decode, case, what, num_sms)
    assert route.config.line_schedule, f"{what}: the route is not the line build"


@SETTINGS
@given(kv_lens=testing.decode_batches(max_batch=80, max_kv=9000),
       layout=st.sampled_from([(20, 4, 128), (8, 1, 128), (16, 2, 64), (32, 8, 128), (32, 16, 128), (12, 4, 256)]),
       page_size=st.sampled_from([1, 2, 4, 8, 16, 64, 128]), seed=st.integers(0, 2**16))
def test_drawn_batches_match_the_reference(kv_lens, layout, page_size, seed):
    heads, kv_heads, head_dim = layout
    if head_dim == 256:
        page_size = min(page_size, 64)  # a stage pair of 128 keys at d256 leaves no second stage
    _check(_case(kv_lens, seed, heads, kv_heads, head_dim, page_size), f"{layout} page {page_size} {kv_lens}")


@pytest.mark.parametrize("num_sms", [None, 1, 7])
@pytest.mark.parametrize("kv_lens", [[3232], [2048] * 16, [2048] * 64, [4096] * 128, [0, 9000, 1, 64, 700, 0, 3000]],
                         ids=["1x3232", "16x2048", "64x2048", "128x4096", "ragged"])
def test_bench_shapes_and_small_grids(kv_lens, num_sms):
    """The bench's uniform rows (even pieces: 1 x 3232, 16 x 2048; whole tiles: 64 x 2048, 128 x 4096), a ragged one
    with empty requests; on the whole GPU and on grids of 1 and 7 CTAs (long stretches, runs of inside edges); at
    h20/kv4 (cuts only) and h32/kv8 (the line deal's vote) pages 64 and 1."""
    for heads, kv_heads, page_size in ((20, 4, 64), (32, 8, 64), (20, 4, 1)):
        case = _case(kv_lens, seed=len(kv_lens), heads=heads, kv_heads=kv_heads, page_size=page_size)
        _check(case, f"{len(kv_lens)} requests h{heads}/kv{kv_heads} page {page_size} grid {num_sms}", num_sms)


def test_a_batch_the_line_deal_takes():
    """300 requests of 1000-1200 keys at h32/kv8: the line deal replaces the cuts (``cute_attn/line_schedule.py``'s
    twin says so on the H200's 132 CTAs), whole tiles lap by lap."""
    from cute_attn.config import default_paged_config
    from cute_attn.line_schedule import edge_table

    kv_lens = np.random.default_rng(3).integers(1000, 1200, size=300).tolist()
    pc = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=32, num_kv_heads=8, head_dim_qk=128,
                              head_dim_v=128, page_size=64, causal=False).plan_config(132)
    assert edge_table(pc, kv_lens).dealt
    _check(_case(kv_lens, seed=3, heads=32, kv_heads=8), "the line deal's batch", 132)


def test_more_requests_than_threads():
    """700 requests: each thread of the table's pass takes several (a contiguous share)."""
    rng = np.random.default_rng(700)
    _check(_case([int(n) for n in rng.integers(0, 1500, size=700)], seed=7), "700 requests")


@pytest.mark.parametrize("page_size", [64, 16, 1])
def test_page_faults_empty_their_requests_and_clear(page_size):
    """A page id outside the pool in requests 2 (past the end) and 0 (negative): their rows 0 / lse -inf (every piece
    of them, whichever CTA folded it), the others the reference's, the error names kv_indices, the scratch clean; the
    next clean call is right. Page 1: the row gathers turn the ids into zero-filled rows."""
    from cute_attn.device_errors import DeviceIndexError

    case = _case([5000, 70, 9000, 300], seed=5, page_size=page_size)
    ref_out, ref_lse = case.reference()
    saved = case.kv_indices.clone()
    kvp = case.kv_indptr.tolist()
    for k, b in enumerate((2, 0)):
        ref_out[b], ref_lse[b] = 0, float("-inf")
        case.kv_indices[kvp[b + 1] - 1 - k] = -3 if k else case.k_cache.shape[0] + 7
    out, lse = case.new_outputs()
    route = unit_scratch.call_self_scheduled(cute_attn.gqa_paged_decode, case, out, lse, "faulted call")
    torch.cuda.synchronize()
    testing.assert_close_benchmark(out, ref_out, "faulted output")
    testing.assert_close_benchmark(lse, ref_lse, "faulted lse")
    with pytest.raises(DeviceIndexError, match="kv_indices"):
        cute_attn.raise_on_device_error()
    unit_scratch.assert_scratch_clean(route, "after the faulted call")
    case.kv_indices.copy_(saved)
    unit_scratch.assert_matches_reference(cute_attn.gqa_paged_decode, case, "clean again")


def test_hostile_index_tensors_are_contained_and_reported():
    """Every corruption the hostile module draws for decode (page ids, kv_indptr, last page lengths) is contained and
    reported (``unit_scratch.check_hostile_calls``)."""
    unit_scratch.check_hostile_calls(cute_attn.gqa_paged_decode, _case([300, 0, 4000, 70, 2100], seed=22), 16)


def test_bad_last_page_lengths_at_every_request():
    unit_scratch.check_last_page_lens(cute_attn.gqa_paged_decode, _case([300, 0, 4000, 70], seed=23))


def test_captured_call_replays_across_batches():
    """Captured once at a batch of 24, replayed over refilled page tables (lengths 0..6000: even pieces, ragged cuts,
    whole tiles as they come), one replay with a page id outside the pool: each replay equals the reference of what
    the index tensors then hold, the scratch is left clean."""
    from cute_attn.device_errors import DeviceIndexError

    batch, page_size, pool_pages = 24, 16, 12000
    case = _case([4000] * batch, seed=3, page_size=page_size, extra_pages=pool_pages - batch * 250)
    case.k_cache.normal_()
    case.v_cache.normal_()
    kv_indices = torch.zeros(case.k_cache.shape[0], dtype=torch.int32, device="cuda")
    case.kv_indices = kv_indices
    rng = np.random.default_rng(9)
    testing.refill_page_table([4000] * batch, page_size, case.kv_indptr, kv_indices, case.kv_last_page_len, rng)
    out, lse = case.new_outputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route = unit_scratch.call_self_scheduled(cute_attn.gqa_paged_decode, case, out, lse, "warm-up")
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        cute_attn.gqa_paged_decode(*case.inputs(), out, lse)
    shapes = [[int(n) for n in rng.integers(0, 6000, size=batch)], [5000] * batch, [3000] * 3 + [0] * (batch - 3),
              [int(n) for n in rng.integers(0, 300, size=batch)]]
    for step, kv_lens in enumerate(shapes):
        testing.refill_page_table(kv_lens, page_size, case.kv_indptr, kv_indices, case.kv_last_page_len, rng)
        ref_out, ref_lse = case.reference()
        if step == 1:
            b = int(rng.integers(0, batch))
            ref_out[b], ref_lse[b] = 0, float("-inf")
            kv_indices[int(case.kv_indptr[b + 1]) - 1] = pool_pages + 99
        unit_scratch.replay_matches(graph, route, out, lse, ref_out, ref_lse, f"replay {step}")
        if step == 1:
            with pytest.raises(DeviceIndexError, match="kv_indices"):
                cute_attn.raise_on_device_error()
    cute_attn.raise_on_device_error()

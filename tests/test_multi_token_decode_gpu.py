"""Multi-token (speculative) decode on a GPU (the sm_90a decode kernel), through the public API, against the fp32
reference (prefill's math: 1..8 draft tokens per request, bottom-right causal).

Pools are shuffled and NaN-poisoned (unused pages and each last page's tail), outputs are NaN-prefilled, so a
kernel that reads a wrong slot, masks a wrong key or skips an element fails.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_TOTAL_KV = 250_000  # keeps the fp32 reference and the pools small


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn
    import cute_attn.kernels.sm90.gqa_decode  # noqa: F401  registers the launchers

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    yield


def _case(q_lens, kv_lens, **kw):
    return testing.make_gqa_multi_token_decode_case(q_lens, kv_lens, device="cuda", **kw)


def _run(case, **kw):
    import cute_attn

    out, lse = case.new_outputs()
    cute_attn.gqa_paged_multi_token_decode(*case.inputs(), out, lse, **kw)
    torch.cuda.synchronize()
    return out, lse


def _check(case, **kw):
    out, lse = _run(case, **kw)
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")
    return out, lse


@pytest.mark.parametrize("q_len", range(1, 9))
def test_each_q_len_over_ragged_lengths(q_len):
    # kv == q_len: the first draft token sees key 0 only; 3232 splits (fused merge); page-multiple and +-1 lengths
    kv_lens = [q_len, 3232, 64 * 37, 63 + q_len, 65, 2048]
    _check(_case([q_len] * len(kv_lens), kv_lens, seed=q_len))


def test_mixed_q_lens_in_one_batch():
    q_lens = [1, 8, 3, 5, 2, 7, 4, 6, 1, 8]
    kv_lens = [9, 5000, 64, 130, 2, 4096, 700, 6, 1, 8]
    _check(_case(q_lens, kv_lens, seed=21))


@pytest.mark.parametrize("q_lens,kv_lens", [([8], [32768]), ([4], [3232]), ([8, 1], [32768, 5]), ([4] * 16, [2048] * 16)],
                         ids=lambda v: str(v)[:20])
def test_heavy_splits_fold_in_kernel(q_lens, kv_lens):
    import cute_attn

    case = _case(q_lens, kv_lens, seed=len(kv_lens) + kv_lens[0])
    plan = cute_attn.plan_gqa_paged_multi_token_decode(*case.inputs())
    if len(kv_lens) <= 2:
        assert plan.plan.num_merges >= 4 and plan.plan.num_partials >= 8  # every KV head splits
    _check(case, plan=plan)
    assert (plan.merge_counters == 0).all()  # the last CTA of each merge reset its counter


@pytest.mark.parametrize("num_qo_heads, num_kv_heads", [(8, 8), (16, 8), (32, 8), (32, 4), (20, 4), (16, 1), (64, 4)],
                         ids=str)
def test_group_sizes(num_qo_heads, num_kv_heads):
    # group 16 x 8 tokens = 128 rows: two items of 4 tokens each per request and KV head
    q_lens, kv_lens = [8, 3, 1, 8, 5], [1000, 77, 1, 4100, 64]
    _check(_case(q_lens, kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, seed=num_qo_heads))


@pytest.mark.parametrize("head_dim, page_size", [(128, 16), (128, 32), (128, 128), (64, 64), (256, 64)], ids=str)
def test_family_shapes(head_dim, page_size):
    q_lens, kv_lens = [4, 8, 1, 2], [5000, page_size + 1, page_size, 3 * page_size]
    _check(_case(q_lens, kv_lens, head_dim=head_dim, page_size=page_size, seed=head_dim + page_size))


@pytest.mark.parametrize("page_size", [1, 2])
def test_four_gathering_warps(page_size):
    """``gather_warps`` 4 (``ops/gqa_decode.GATHER_WARPS_PAGE_SIZES``, both decode kinds): the producer warpgroup's
    row gathers under draft tokens, causal among themselves; q_len 1..8, lengths around the quarter-stage slices."""
    from cute_attn.ops.gqa_decode import gather_warps_policy

    with gather_warps_policy((page_size,)):
        _check(_case([1, 4, 8, 2, 3], [5000, 17, 65, 2, 2049], page_size=page_size, seed=40 + page_size))


def test_q_len_one_matches_single_token_decode():
    import cute_attn

    kv_lens = [3232, 70, 1, 2048]
    case = _case([1] * len(kv_lens), kv_lens, seed=5)
    out, lse = _run(case)
    dec_out, dec_lse = case.new_outputs()
    cute_attn.gqa_paged_decode(case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices,
                               case.kv_last_page_len, case.sm_scale, dec_out, dec_lse)
    torch.cuda.synchronize()
    testing.assert_close_benchmark(out, dec_out, "output")
    testing.assert_close_benchmark(lse, dec_lse, "lse")


def test_same_device_plan_three_times():
    import cute_attn

    case = _case([4, 8], [3232, 9000], seed=12)
    plan = cute_attn.plan_gqa_paged_multi_token_decode(*case.inputs())
    assert plan.plan.num_merges
    ref_out, ref_lse = case.reference()
    for call in range(3):
        out, lse = _run(case, plan=plan)
        testing.assert_close_benchmark(out, ref_out, f"output (call {call})")
        testing.assert_close_benchmark(lse, ref_lse, f"lse (call {call})")
        assert (plan.merge_counters == 0).all(), f"call {call} left merge counters set"


def test_cuda_graph_replays():
    import cute_attn

    case = _case([4, 2], [3232, 70], seed=15)
    plan = cute_attn.plan_gqa_paged_multi_token_decode(*case.inputs())
    out, lse = case.new_outputs()
    ref_out, ref_lse = case.reference()

    def run():
        cute_attn.gqa_paged_multi_token_decode(*case.inputs(), out, lse, plan=plan, check_indices=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and warm the launch path outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for replay in range(3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        testing.assert_close_benchmark(out, ref_out, f"output (replay {replay})")
        testing.assert_close_benchmark(lse, ref_lse, f"lse (replay {replay})")
    assert (plan.merge_counters == 0).all()


def test_kv_views_of_one_combined_tensor():
    _check(testing.interleave_kv(_case([4, 8, 1], [3232, 70, 1], seed=11)))


def test_many_items_per_cta():
    # Few CTAs: each runs many items, so the K/V ring wraps across item boundaries (and Q reloads between them).
    _check(_case([1, 4, 8, 2, 3, 1, 7] * 6, [700, 64, 8, 5000, 333, 1, 129] * 6, seed=6), num_sms=3)


def test_natural_lse():
    case = _case([4, 3], [3232, 17], seed=7)
    _, lse = _run(case, natural_lse=True)
    _, ref_lse = case.reference()
    testing.assert_close_benchmark(lse, ref_lse * math.log(2.0), "lse")


GROUPS = [(5, 4), (1, 8), (2, 4), (8, 2), (16, 1), (4, 8)]  # (group, num_kv_heads): one compile each


def test_hypothesis_batches():
    """q_len 1..8 drawn per request, groups 1..16, ragged kv lengths with one long request (splits)."""
    batches = st.integers(1, 64).flatmap(
        lambda b: testing.multi_token_batches(max_batch=b, max_kv=min(32768, MAX_TOTAL_KV // b)))

    @settings(max_examples=30, deadline=None)
    @given(lens=batches, heads=st.sampled_from(GROUPS), seed=st.integers(0, 2**16))
    def check(lens, heads, seed):
        import cute_attn

        cute_attn.clear_plan_cache()
        group, num_kv = heads
        _check(_case(*lens, num_qo_heads=group * num_kv, num_kv_heads=num_kv, seed=seed))

    check()

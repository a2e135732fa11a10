"""MLA decode on a GPU (issue 11's tier): drawn batches against the float32 reference, element by element.

Each batch runs through ``cute_attn.mla_paged_decode`` in the FlashInfer-Bench argument order of its page size (ps1:
no ``kv_last_page_len``; ps64: it before ``sm_scale``), at DeepSeek-V3's 16 heads and Kimi-K2's 8, with one query
per request or 1..4 (``qo_indptr=``, the request's last positions, causal among themselves). Lengths include
empty requests (output 0, lse -inf), one-key requests, requests shorter than their queries and long ones up to
8K keys (split across CTAs, so the partials and their combine run). Pools are shuffled and hold NaN in every slot
no request owns (unused pages, the tail of every last page) and outputs start as NaN, so a key read past a sequence
end, a wrong page, a 0 x NaN in P V or an element never written fails. The plan comes from each route the bench
times: planned on the GPU (the default), on the host (``check_indices=True``) and once for ``plan=``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cute_attn import reference, testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PAGE_SIZES = (1, 64)  # the decode definitions' page sizes
HEADS = (16, 8)  # DeepSeek-V3 at TP8, Kimi-K2
ROUTES = ("device", "host", "plan")
LONG_KV = 8192
MAX_QUERIES = 4  # cute_attn.ops.mla_decode.MAX_QUERIES_PER_REQUEST


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    yield


@st.composite
def decode_batches(draw):
    """``(q_lens, kv_lens, multi_token)``: one query each (``multi_token`` False) or 1..4; kv lengths empty, tiny,
    page-sized or long, now and then one request of 4K..8K keys among them, in a drawn order."""
    batch = draw(st.integers(1, 16))
    multi_token = draw(st.booleans())
    q_lens = draw(st.lists(st.integers(1, MAX_QUERIES), min_size=batch, max_size=batch)) if multi_token \
        else [1] * batch
    kv_len = st.one_of(st.just(0), st.integers(1, 3), st.integers(60, 130), st.integers(1, 2048))
    kv_lens = draw(st.lists(kv_len, min_size=batch, max_size=batch))
    if draw(st.booleans()):
        kv_lens[0] = draw(st.integers(LONG_KV // 2, LONG_KV))
    order = draw(st.permutations(range(batch)))
    return [q_lens[i] for i in order], [kv_lens[i] for i in order], multi_token


def _decode_args(case):
    """The decode entry's positional inputs: FlashInfer-Bench's order for the case's page size."""
    last = () if case.kv_last_page_len is None else (case.kv_last_page_len,)
    return (case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, case.kv_indptr, case.kv_indices, *last,
            case.sm_scale)


def _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, route, seed):
    import cute_attn

    case = testing.make_mla_prefill_case(q_lens, kv_lens, num_heads=num_heads, page_size=page_size, device="cuda",
                                         seed=seed, with_last_page_len=page_size > 1)
    args = _decode_args(case)
    queries = dict(qo_indptr=case.qo_indptr) if multi_token else {}
    out, lse = case.new_outputs()  # NaN: an element the kernel never writes fails
    if route == "plan":
        plan = cute_attn.plan_mla_paged_decode(*args, **queries)
        cute_attn.mla_paged_decode(*args, out, lse, plan=plan, **queries)
    else:
        cute_attn.mla_paged_decode(*args, out, lse, check_indices=route == "host", **queries)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.mla_paged_decode_ref(*args, **queries)
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")


@settings(max_examples=25)
@given(batch=decode_batches(), page_size=st.sampled_from(PAGE_SIZES), num_heads=st.sampled_from(HEADS),
       route=st.sampled_from(ROUTES))
def test_mla_decode_drawn_batches(batch, page_size, num_heads, route):
    q_lens, kv_lens, multi_token = batch
    _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, route, seed=sum(kv_lens) + len(kv_lens))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("multi_token", [False, True], ids=["q1", "q1to4"])
def test_mla_decode_long_empty_and_one_key(page_size, num_heads, multi_token):
    """The extremes every run sees (a drawn batch may miss them): 8K keys, an empty request, one key, a request
    with fewer keys than queries, lengths on and next to a page boundary."""
    kv_lens = [LONG_KV, 0, 1, 2, 64, 65, 4095]
    q_lens = [4, 1, 1, 3, 2, 4, 1] if multi_token else [1] * len(kv_lens)
    _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, "device", seed=page_size + num_heads)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("multi_token", [False, True], ids=["q1", "q1to4"])
@pytest.mark.parametrize("route", ROUTES)
def test_mla_decode_fused_merge(page_size, num_heads, multi_token, route):
    """``fused_merge`` (off by default until this passes on a GPU): the last CTA of each split request folds the
    partials in the kernel instead of the combine launch. Long requests split over many CTAs beside empty and tiny
    ones, on every route (the device planner's lists, the host plan, ``plan=``)."""
    from cute_attn.ops.mla_prefill import fused_merge_policy

    kv_lens = [LONG_KV, 0, 1, 4095, 65, LONG_KV // 2 + 3]
    q_lens = [4, 1, 1, 3, 2, 1] if multi_token else [1] * len(kv_lens)
    with fused_merge_policy(True):
        _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, route, seed=page_size + num_heads + 7)


def _compare_drawn_under(policy, batch, page_size, num_heads, seed_offset):
    """A drawn batch through the default route with ``policy(True)`` (a knob's state the default does not take)."""
    q_lens, kv_lens, multi_token = batch
    with policy(True):
        _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, "device",
                         seed=sum(kv_lens) + len(kv_lens) + seed_offset)


@settings(max_examples=10)
@given(batch=decode_batches(), page_size=st.sampled_from(PAGE_SIZES), num_heads=st.sampled_from(HEADS))
def test_mla_decode_fused_merge_drawn_batches(batch, page_size, num_heads):
    from cute_attn.ops.mla_prefill import fused_merge_policy

    _compare_drawn_under(fused_merge_policy, batch, page_size, num_heads, 1)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("route", ROUTES)
def test_mla_decode_split_scores(page_size, num_heads, route):
    """``share_scores`` in the swapped kernel (``ops/mla_decode.SM90_SPLIT_SCORES``): each consumer warpgroup sums
    half of S^T's dims and adds the other's partial. Long split requests beside empty, one-key and page-edge ones:
    a wrong exchange (the other's buffer, a stale parity) shows in every tile of the long ones."""
    from cute_attn.ops.mla_decode import split_scores_policy

    kv_lens = [LONG_KV, 0, 1, 4095, 65, 64, LONG_KV // 2 + 3]
    with split_scores_policy(True):
        _run_and_compare([1] * len(kv_lens), kv_lens, False, page_size, num_heads, route,
                         seed=page_size + num_heads + 11)


@settings(max_examples=10)
@given(batch=decode_batches(), page_size=st.sampled_from(PAGE_SIZES), num_heads=st.sampled_from(HEADS))
def test_mla_decode_split_scores_drawn_batches(batch, page_size, num_heads):
    from cute_attn.ops.mla_decode import split_scores_policy

    _compare_drawn_under(split_scores_policy, batch, page_size, num_heads, 2)


@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("multi_token", [False, True], ids=["q1", "q1to4"])
@pytest.mark.parametrize("route", ROUTES)
def test_mla_decode_page_boxes(page_size, num_heads, multi_token, route):
    """``page_boxes`` (``ops/mla_prefill.PAGE_BOXES``): a K stage of one page's rows as 64-row TMA boxes. Split long
    requests (chunks that start mid-page at 128), a request ending one key into a page, on a page edge and one short
    of it: the partial stages keep the 8-row and 1-row boxes, whose zero fill must still cover the keys past the end
    (the pool's tail rows hold NaN)."""
    from cute_attn.ops.mla_prefill import page_boxes_policy

    kv_lens = [LONG_KV, 0, 1, 4095, 65, 64, 128, 127, LONG_KV // 2 + 3]
    q_lens = [4, 1, 1, 3, 2, 1, 4, 2, 1] if multi_token else [1] * len(kv_lens)
    with page_boxes_policy(True):
        _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, route,
                         seed=page_size + num_heads + 13)


@settings(max_examples=10)
@given(batch=decode_batches(), page_size=st.sampled_from([64, 128]), num_heads=st.sampled_from(HEADS))
def test_mla_decode_page_boxes_drawn_batches(batch, page_size, num_heads):
    from cute_attn.ops.mla_prefill import page_boxes_policy

    _compare_drawn_under(page_boxes_policy, batch, page_size, num_heads, 3)


@pytest.mark.parametrize("page_size", [64, 128])
def test_mla_prefill_page_boxes(page_size):
    """The MLA prefill kernel (64-row tiles) with ``page_boxes``: ragged causal requests over whole and partial pages."""
    import cute_attn
    from cute_attn.ops.mla_prefill import page_boxes_policy

    with page_boxes_policy(True):
        case = testing.make_mla_prefill_case([300, 1, 0, 77, 64], [1500, 1, 5, 77, 4097], page_size=page_size,
                                             device="cuda", seed=page_size + 17, with_last_page_len=True)
        out, lse = case.new_outputs()
        cute_attn.mla_paged_prefill(*case.inputs(), out, lse)
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, "output")
        testing.assert_close_benchmark(lse, ref_lse, "lse")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("multi_token", [False, True], ids=["q1", "q1to4"])
@pytest.mark.parametrize("route", ROUTES)
def test_mla_decode_eager_combine(page_size, num_heads, multi_token, route):
    """``eager_combine`` (``ops/mla_prefill.EAGER_COMBINE``): the combine folds each merge once its slots are counted
    in, while the attention grid still runs. Long requests split over many CTAs beside empty and tiny ones, on every
    route; three calls in a row, each checked, so a merge counter the combine failed to set back to 0 would let the
    next call fold before its partials are written."""
    from cute_attn.ops.mla_prefill import eager_combine_policy

    kv_lens = [LONG_KV, 0, 1, 4095, 65, LONG_KV // 2 + 3]
    q_lens = [4, 1, 1, 3, 2, 1] if multi_token else [1] * len(kv_lens)
    with eager_combine_policy(True):
        for call in range(3):
            _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, route,
                             seed=page_size + num_heads + 11 + call)


@settings(max_examples=10)
@given(batch=decode_batches(), page_size=st.sampled_from(PAGE_SIZES), num_heads=st.sampled_from(HEADS))
def test_mla_decode_eager_combine_drawn_batches(batch, page_size, num_heads):
    from cute_attn.ops.mla_prefill import eager_combine_policy

    _compare_drawn_under(eager_combine_policy, batch, page_size, num_heads, 5)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("multi_token", [False, True], ids=["q1", "q1to4"])
@pytest.mark.parametrize("route", ROUTES)
def test_mla_decode_bf16_partials(page_size, num_heads, multi_token, route):
    """``bf16_partials`` (``config.BF16_PARTIALS``): split items store their partial rows as bf16 and the combine
    widens them. Long requests split over many CTAs (a 16-slot merge) beside empty and tiny ones, on every route."""
    from cute_attn.config import bf16_partials_policy

    kv_lens = [LONG_KV, 0, 1, 4095, 65, LONG_KV // 2 + 3]
    q_lens = [4, 1, 1, 3, 2, 1] if multi_token else [1] * len(kv_lens)
    with bf16_partials_policy(True):
        _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, route, seed=page_size + num_heads + 23)


@settings(max_examples=10)
@given(batch=decode_batches(), page_size=st.sampled_from(PAGE_SIZES), num_heads=st.sampled_from(HEADS))
def test_mla_decode_bf16_partials_drawn_batches(batch, page_size, num_heads):
    from cute_attn.config import bf16_partials_policy

    _compare_drawn_under(bf16_partials_policy, batch, page_size, num_heads, 7)


def test_mla_eager_combine_leaves_every_counter_at_zero():
    """After eager-combined calls (host plan with real merges, replayed through ``plan=``) the plan's merge counters
    are all 0 again, the state the next launch or graph replay starts from."""
    import cute_attn
    from cute_attn.ops.mla_prefill import eager_combine_policy

    with eager_combine_policy(True):
        case = testing.make_mla_prefill_case([1] * 16, [4096] * 16, page_size=64, device="cuda", seed=23,
                                             with_last_page_len=True)
        args = _decode_args(case)
        plan = cute_attn.plan_mla_paged_decode(*args)
        assert plan.config.eager_combine and plan.plan.num_merges > 0
        ref_out, ref_lse = reference.mla_paged_decode_ref(*args)
        for _ in range(5):
            out, lse = case.new_outputs()
            cute_attn.mla_paged_decode(*args, out, lse, plan=plan)
            torch.cuda.synchronize()
            testing.assert_close_benchmark(out, ref_out, "output")
            testing.assert_close_benchmark(lse, ref_lse, "lse")
        assert int(plan.scratch()[2].abs().sum()) == 0

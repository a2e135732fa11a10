"""The sm_90a causal GQA paged prefill kernel on a GPU, through the public API, against the fp32 reference.

Pools are shuffled and NaN-poisoned (unused pages and each last page's tail), outputs are NaN-prefilled,
so a kernel that reads a wrong slot, multiplies a NaN V row by a masked zero, or skips an element fails.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    yield


def _check(case, natural_lse: bool = False):
    import cute_attn

    out, lse = case.new_outputs()
    cute_attn.gqa_paged_prefill(*case.inputs(), out, lse, natural_lse=natural_lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = case.reference()
    if natural_lse:
        ref_lse = ref_lse * 0.6931471805599453
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")
    return out, lse


def _case(q_lens, kv_lens, **kw):
    return testing.make_gqa_prefill_case(q_lens, kv_lens, device="cuda", **kw)


@pytest.mark.parametrize("n", [1, 4, 8, 16, 32])
def test_seed_workloads(n):
    # the bench's reconstruction of the five real workloads: n requests of 992 queries over 992 keys
    _check(_case([992] * n, [992] * n, seed=n))


@pytest.mark.parametrize("q_lens", [[1], [7], [64], [129], [1000, 3, 250]], ids=str)
def test_kv_len_equals_q_len(q_lens):
    _check(_case(q_lens, q_lens, seed=len(q_lens)))


@pytest.mark.parametrize("q_lens, kv_lens", [([64, 100], [128, 4096]), ([200], [640]), ([1, 17], [64, 64])], ids=str)
def test_kv_len_multiple_of_page(q_lens, kv_lens):
    _check(_case(q_lens, kv_lens, seed=7))


def test_kv_views_of_one_combined_tensor():
    _check(testing.interleave_kv(_case([300, 17], [1000, 17])))


def test_one_token_requests():
    _check(_case([1] * 40, [1, 5, 63, 64, 65, 700, 4000, 8192] * 5, seed=8))


def test_empty_requests():
    out, lse = _check(_case([0, 5, 0, 300, 0], [0, 70, 64, 900, 3], seed=9))


def test_kv_len_below_q_len_rows_see_no_key():
    # rows above the diagonal see no key: output 0, lse -inf
    out, lse = _check(_case([100, 40, 9], [30, 0, 9], seed=10))
    assert torch.isinf(lse[:70]).all() and (out[:70] == 0).all()


def test_natural_lse():
    _check(_case([300, 50], [1000, 50], seed=11), natural_lse=True)


def test_long_request_split_over_ctas():
    # one long request: the planner splits it into KV chunks, the combine kernel merges them
    _check(_case([2048], [8192], seed=12))


@pytest.mark.parametrize("page_size, heads, kv_heads", [(16, 32, 4), (32, 32, 8), (128, 16, 2), (8, 32, 4)], ids=str)
def test_family_members(page_size, heads, kv_heads):
    _check(_case([333, 1, 70], [1200, 1, 70], page_size=page_size, num_qo_heads=heads, num_kv_heads=kv_heads,
                 seed=page_size))


@pytest.mark.parametrize("page_size", [2, 8, 16, 64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(32, 4), (20, 4)], ids=str)
def test_items_ending_in_and_before_the_last_page(page_size, heads, kv_heads):
    """The kernel zeroes only the V rows that can hold pool garbage: the last page's tail past kv_len, when an item
    reads that page (``kernels/common/kv_tail.py``). Here the causal items' KV_END walks through the last page and
    the pages before it (the tail is NaN-poisoned; rows between KV_END and kv_len are real keys, masked), and a long
    request splits (items ending on tile bounds)."""
    P = page_size
    kv_lens = [7 * P + max(1, P // 3), 6 * P - 1, 3 * P + 1, 4096 + P // 2 + 1]
    q_lens = [min(kv_lens[0], 2 * P + 37), min(kv_lens[1], P + 50), 3, 1500]
    _check(_case(q_lens, kv_lens, page_size=P, num_qo_heads=heads, num_kv_heads=kv_heads, seed=300 + P + heads))


# Pages of 1..8 keys (SGLang's page 1): the sm_90a kernel gathers a 128-key tile as 16-byte rows by four warps, a
# quarter each, ids a tile ahead; lengths straddle page, tile, warp-slice and 32-page id-load ends.
@pytest.mark.parametrize("page_size", [1, 2, 4, 8])
@pytest.mark.parametrize("heads, kv_heads", [(32, 4), (20, 4)], ids=str)
def test_small_pages(page_size, heads, kv_heads):
    _check(_case([333, 1, 70, 0, 5, 129], [1200, 1, 70, 9, 33, 257], page_size=page_size, num_qo_heads=heads,
                 num_kv_heads=kv_heads, seed=page_size + heads))


@pytest.mark.parametrize("page_size", [1, 4, 8])
def test_small_pages_split_and_interleaved(page_size):
    # a long request (split items + combine) over kv[:, 0] / kv[:, 1] views of one combined tensor
    _check(testing.interleave_kv(_case([2048, 17], [8192, 17], page_size=page_size, seed=40 + page_size)))


@pytest.mark.parametrize("variant", ["baseline", "both"])
def test_small_page_variants(variant):
    _check_variant(_case([300, 1, 70], [1100, 1, 70], page_size=1, seed=43), variant)


# Groups that do not divide the 128-row tile: the Q box loads (128 // group) whole tokens, the planner packs as
# many rows per tile, the last rows of the tile are stale and never stored (kernels/common/packed_q.py).
@pytest.mark.parametrize("heads, kv_heads", [(20, 4), (24, 8), (6, 1), (28, 4), (24, 4)], ids=str)
def test_groups_that_do_not_divide_the_tile(heads, kv_heads):
    # 333 queries span several tiles (a tile boundary mid-request), 1 and 26 straddle one tile's token count
    _check(_case([333, 1, 26, 0, 70], [1200, 1, 40, 9, 700], num_qo_heads=heads, num_kv_heads=kv_heads,
                 seed=heads * kv_heads))


@settings(max_examples=6)
@given(batch=testing.ragged_batches(max_batch=16, max_q=600, max_kv=2000))
def test_group_five_ragged_batches(batch):
    q_lens, kv_lens = batch
    _check(_case(q_lens, kv_lens, num_qo_heads=20, num_kv_heads=4, seed=sum(kv_lens) % 997))


@settings(max_examples=20)
@given(batch=testing.ragged_batches(max_batch=64, max_q=2048, max_kv=8192))
def test_ragged_batches_match_reference(batch):
    q_lens, kv_lens = batch
    _check(_case(q_lens, kv_lens, seed=sum(q_lens) + len(q_lens)))


# ---------------------------------------------------------------------------------------- variants
VARIANTS = {
    "baseline": dict(intra_wg_overlap=False, smem_epilogue=False),
    "overlap": dict(intra_wg_overlap=True, smem_epilogue=False),
    "smem_epilogue": dict(intra_wg_overlap=False, smem_epilogue=True),
    "both": dict(intra_wg_overlap=True, smem_epilogue=True),
}


def _check_variant(case, variant, natural_lse: bool = False):
    """Plan with the default config, run the same plan with the variant config's kernel."""
    import cute_attn
    from cute_attn.api import DevicePlan
    from cute_attn.kernels import find_launcher

    plan = cute_attn.plan_gqa_paged_prefill(*case.inputs())
    config = dataclasses.replace(plan.config, **VARIANTS[variant])
    device_plan = DevicePlan.upload(config, plan.plan, case.q.device)
    out, lse = case.new_outputs()
    find_launcher(config)(device_plan, *case.inputs(), out, lse, natural_lse=natural_lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = case.reference()
    if natural_lse:
        ref_lse = ref_lse * 0.6931471805599453
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")
    return out, lse


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("q_lens, kv_lens", [
    ([992] * 4, [992] * 4),                 # seed workload shape
    ([1000, 3, 250], [1000, 3, 250]),       # ragged, kv == q
    ([64, 100], [128, 4096]),               # one tile per item / long items
    ([100, 40, 9], [30, 0, 9]),             # rows that see no key, an empty KV range
    ([1] * 40, [1, 5, 63, 64, 65, 700, 4000, 8192] * 5),  # tails inside a page, one-token requests
    ([2048], [8192]),                       # split items: partials + combine
], ids=str)
def test_variants_match_reference(variant, q_lens, kv_lens):
    _check_variant(_case(q_lens, kv_lens, seed=len(q_lens) + 31), variant)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("page_size, heads, kv_heads", [(16, 32, 4), (32, 32, 8)], ids=str)
def test_variants_family_members(variant, page_size, heads, kv_heads):
    _check_variant(_case([333, 1, 70], [1200, 1, 70], page_size=page_size, num_qo_heads=heads,
                         num_kv_heads=kv_heads, seed=page_size), variant, natural_lse=True)


# The tier draws the shape too: group size (including ones that do not divide the tile), page size, head_dim.
PREFILL_SHAPES = [(32, 4, 128, 64), (20, 4, 128, 16), (24, 8, 64, 32), (6, 1, 128, 128), (16, 16, 64, 64),
                  (32, 4, 128, 1), (20, 4, 128, 2), (16, 2, 64, 4), (40, 10, 128, 1),
                  (16, 2, 256, 64), (20, 4, 256, 1), (16, 8, 256, 16), (24, 8, 256, 32)]


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from(PREFILL_SHAPES), batch=testing.ragged_batches(max_batch=8, max_q=300, max_kv=1200))
def test_drawn_shapes_match_reference(shape, batch):
    heads, kv_heads, head_dim, page_size = shape
    q_lens, kv_lens = batch
    _check(_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                 seed=sum(kv_lens) % 991))


@settings(max_examples=8, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4, 8, 16, 64]),
       batch=testing.ragged_batches(max_batch=8, max_q=300, max_kv=1200))
def test_drawn_page_sizes_match_reference(page_size, batch):
    """The definition's heads (h32/kv4, d128) with the page size drawn: small pages and the ones that were built."""
    q_lens, kv_lens = batch
    _check(_case(q_lens, kv_lens, page_size=page_size, seed=sum(q_lens) % 983 + page_size))


# ---------------------------------------------------------------------------------------- head_dim 256
# 128 packed rows x 64-key tiles, one Q stage (kernels/sm90/gqa_prefill.py); pages 1..64. Each case compiles its
# own config (group, page size) on first use.
D256_SHAPES = [(16, 2, 64), (16, 8, 16), (16, 2, 1), (20, 4, 4), (32, 4, 32), (8, 8, 8), (32, 2, 2), (24, 8, 64)]


@pytest.mark.parametrize("heads, kv_heads, page_size", D256_SHAPES, ids=str)
def test_head_dim_256_family(heads, kv_heads, page_size):
    # ragged, causal (bottom-right: kv > q), empty requests, tails inside a page and a 64-key tile
    _check(_case([333, 1, 70, 0, 5, 129], [1200, 1, 70, 9, 33, 257], num_qo_heads=heads, num_kv_heads=kv_heads,
                 head_dim=256, page_size=page_size, seed=heads + kv_heads + page_size))


@pytest.mark.parametrize("q_lens, kv_lens", [
    ([992] * 4, [992] * 4),                 # the seed workload's shape, kv == q
    ([1000, 3, 250], [1000, 3, 250]),       # ragged, kv == q
    ([64, 100], [128, 4096]),               # long items
    ([100, 40, 9], [30, 0, 9]),             # rows that see no key, an empty KV range
    ([1] * 40, [1, 5, 63, 64, 65, 700, 4000, 8192] * 5),  # one-token requests, tails inside a page
], ids=str)
def test_head_dim_256_matches_reference(q_lens, kv_lens):
    _check(_case(q_lens, kv_lens, num_qo_heads=16, num_kv_heads=2, head_dim=256, page_size=64, seed=len(q_lens)))


def test_head_dim_256_rows_see_no_key():
    out, lse = _check(_case([100, 40, 9], [30, 0, 9], num_qo_heads=16, num_kv_heads=2, head_dim=256, seed=13))
    assert torch.isinf(lse[:70]).all() and (out[:70] == 0).all()


@pytest.mark.parametrize("page_size", [64, 1])
def test_head_dim_256_split_and_interleaved(page_size):
    # a long request (split items + combine at head_dim_v 256) over kv[:, 0] / kv[:, 1] views of one tensor
    _check(testing.interleave_kv(_case([2048, 17], [8192, 17], num_qo_heads=16, num_kv_heads=2, head_dim=256,
                                       page_size=page_size, seed=50 + page_size)), natural_lse=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("heads, kv_heads, page_size", [(16, 2, 64), (20, 4, 4)], ids=str)
def test_head_dim_256_variants(variant, heads, kv_heads, page_size):
    # the default is overlap without the smem epilogue; the other three build and must be right too
    _check_variant(_case([333, 1, 70, 0, 5, 129], [1200, 1, 70, 9, 33, 257], num_qo_heads=heads,
                         num_kv_heads=kv_heads, head_dim=256, page_size=page_size, seed=61), variant)


@settings(max_examples=10, deadline=None)
@given(shape=st.sampled_from([(16, 2, 64), (16, 8, 16), (20, 4, 1), (32, 4, 32)]),
       batch=testing.ragged_batches(max_batch=16, max_q=600, max_kv=3000))
def test_head_dim_256_ragged_batches(shape, batch):
    heads, kv_heads, page_size = shape
    q_lens, kv_lens = batch
    _check(_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=256, page_size=page_size,
                 seed=sum(kv_lens) % 977))


# ---------------------------------------------------------------------------------------- fused merge
FUSED_SHAPES = [(32, 4, 128, 64), (20, 4, 128, 1), (16, 2, 256, 16), (40, 10, 128, 64)]


def _split_case(heads, kv_heads, head_dim, page_size, seed):
    """A batch whose plans split items: short requests beside one of 30K keys, empty and one-token ones."""
    return _case([1, 40, 0, 200, 64, 3], [3000, 40, 5, 1500, 30000, 3], num_qo_heads=heads, num_kv_heads=kv_heads,
                 head_dim=head_dim, page_size=page_size, seed=seed)


def _check_drawn(shape, batch):
    """The default call on a drawn batch of ``shape`` (heads, kv heads, head_dim, page size)."""
    heads, kv_heads, head_dim, page_size = shape
    q_lens, kv_lens = batch
    _check(_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                 seed=sum(kv_lens) % 977))


@pytest.mark.parametrize("on_device", [False, True], ids=["host_plan", "device_plan"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size", FUSED_SHAPES, ids=str)
def test_fused_merge_folds_split_items(on_device, heads, kv_heads, head_dim, page_size):
    """``fused_merge`` (sm_90a; ``ops/gqa_prefill.fused_merge_policy``): the last CTA of each split item folds its
    partials in-kernel, no combine launch. Two calls of one plan: the merge counters must be back at zero."""
    import cute_attn
    from cute_attn.ops.gqa_prefill import fused_merge_policy

    with fused_merge_policy(True):
        case = _split_case(heads, kv_heads, head_dim, page_size, seed=heads + page_size)
        plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=on_device)
        assert plan.config.fused_merge
        if not on_device:
            assert plan.plan.num_merges > 0  # the fold is what runs
        ref_out, ref_lse = case.reference()
        for call in range(2):
            out, lse = case.new_outputs()
            cute_attn.gqa_paged_prefill(*case.inputs(), out, lse, plan=plan)
            torch.cuda.synchronize()
            testing.assert_close_benchmark(out, ref_out, f"call {call} output")
            testing.assert_close_benchmark(lse, ref_lse, f"call {call} lse")
        assert int(plan.merge_counters.abs().sum()) == 0
        cute_attn.raise_on_device_error()


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(FUSED_SHAPES), batch=testing.ragged_batches(max_batch=8, max_q=600, max_kv=6000))
def test_fused_merge_drawn_batches_default_call(shape, batch):
    """The default call (a device plan every call) with the fold, on drawn batches and shapes."""
    from cute_attn.ops.gqa_prefill import fused_merge_policy

    with fused_merge_policy(True):
        _check_drawn(shape, batch)


# ---------------------------------------------------------------------------------------- bf16 partials
@pytest.mark.parametrize("on_device", [False, True], ids=["host_plan", "device_plan"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, page_size", FUSED_SHAPES, ids=str)
def test_bf16_partials_split_items(on_device, heads, kv_heads, head_dim, page_size):
    """``bf16_partials`` (``config.BF16_PARTIALS``): split items store bf16 partial rows, the combine widens them."""
    import cute_attn
    from cute_attn.config import bf16_partials_policy

    with bf16_partials_policy(True):
        case = _split_case(heads, kv_heads, head_dim, page_size, seed=heads + page_size + 1)
        plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), on_device=on_device)
        assert plan.config.bf16_partials and plan.partial_out.dtype == torch.bfloat16
        if not on_device:
            assert plan.plan.num_merges > 0  # the bf16 rows are what the combine reads
        out, lse = case.new_outputs()
        cute_attn.gqa_paged_prefill(*case.inputs(), out, lse, plan=plan)
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, "output")
        testing.assert_close_benchmark(lse, ref_lse, "lse")
        cute_attn.raise_on_device_error()


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(FUSED_SHAPES), batch=testing.ragged_batches(max_batch=8, max_q=600, max_kv=6000))
def test_bf16_partials_drawn_batches_default_call(shape, batch):
    """The default call (a device plan every call) with bf16 partials, on drawn batches and shapes."""
    from cute_attn.config import bf16_partials_policy

    with bf16_partials_policy(True):
        _check_drawn(shape, batch)


# ---------------------------------------------------------------------------------------- k_ahead row gathers
@pytest.mark.parametrize("page_size, heads, kv_heads", [(1, 32, 4), (1, 16, 1), (2, 20, 4), (4, 24, 8), (8, 32, 8)],
                         ids=str)
def test_k_ahead_row_gathers_match_reference(page_size, heads, kv_heads):
    """``k_ahead`` (``ops/gqa_prefill.k_ahead_policy``): the producer warps copy K_{t+1} before V_t (two pipeline
    states); split, empty, keyless and one-tile items, through the default call (a device plan every call)."""
    from cute_attn.ops.gqa_prefill import k_ahead_policy

    with k_ahead_policy((page_size,)):
        case = _case([1, 40, 0, 200, 64, 3, 700], [3000, 40, 5, 1500, 3000, 3, 700], num_qo_heads=heads,
                     num_kv_heads=kv_heads, page_size=page_size, seed=page_size + heads)
        import cute_attn

        assert cute_attn.plan_gqa_paged_prefill(*case.inputs()).config.k_ahead
        _check(case)


@settings(max_examples=6, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4, 8]), batch=testing.ragged_batches(max_batch=8, max_q=300, max_kv=3000))
def test_k_ahead_drawn_batches(page_size, batch):
    from cute_attn.ops.gqa_prefill import k_ahead_policy

    q_lens, kv_lens = batch
    with k_ahead_policy((page_size,)):
        _check(_case(q_lens, kv_lens, page_size=page_size, seed=sum(kv_lens) % 971 + page_size))


@pytest.mark.parametrize("q_lens, kv_lens, heads, kv_heads", [
    ([992] * 4, [992] * 4, 32, 4), ([992] * 8, [992] * 8, 16, 1), ([300, 1, 0, 777, 64], [300, 5, 9, 2000, 64], 20, 4),
], ids=["4x992", "8x992-h16kv1", "ragged-h20kv4"])
@pytest.mark.parametrize("mode", ["lap", "serpentine"])
def test_whole_deal_host_plans(q_lens, kv_lens, heads, kv_heads, mode):
    """``whole_deal`` (``ops/gqa_prefill.WHOLE_DEAL``): host plans of whole tiles dealt lap by lap or serpentine,
    through ``plan=`` and ``check_indices=True`` (the two host-planned routes), against the reference. The plans
    launch their lists: at 4 x 992 the planner-free route would take the plan (``config.ROUTE_PLAN_KINDS``)."""
    import cute_attn
    from cute_attn.config import route_plan_policy
    from cute_attn.ops.gqa_prefill import whole_deal_policy

    with whole_deal_policy(mode), route_plan_policy(False):
        case = _case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads, seed=len(q_lens) + heads)
        plan = cute_attn.plan_gqa_paged_prefill(*case.inputs())
        assert plan.config.plan_config(plan.work_indptr.shape[0] - 1).whole_deal == mode
        ref_out, ref_lse = case.reference()
        for kw in (dict(plan=plan), dict(check_indices=True)):
            out, lse = case.new_outputs()
            cute_attn.gqa_paged_prefill(*case.inputs(), out, lse, **kw)
            torch.cuda.synchronize()
            testing.assert_close_benchmark(out, ref_out, f"output {sorted(kw)}")
            testing.assert_close_benchmark(lse, ref_lse, f"lse {sorted(kw)}")

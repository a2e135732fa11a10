"""The sm_90a GQA decode kernel on a GPU, through the public API, against the fp32 reference.

Pools are shuffled and NaN-poisoned (unused pages and each last page's tail), outputs are NaN-prefilled,
so a kernel that reads a wrong slot or skips an element fails.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_TOTAL_KV = 250_000  # keeps the fp32 reference and the pools small


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn
    import cute_attn.kernels.sm90.gqa_decode  # noqa: F401  registers the launcher (no other kernel module needed)

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    yield


def _run(case, **kw):
    import cute_attn

    out, lse = case.new_outputs()
    cute_attn.gqa_paged_decode(*case.inputs(), out, lse, **kw)
    torch.cuda.synchronize()
    return out, lse


def _check(case, **kw):
    out, lse = _run(case, **kw)
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")
    return out, lse, ref_lse


def _case(kv_lens, **kw):
    return testing.make_gqa_decode_case(kv_lens, device="cuda", **kw)


def test_seed_case_batch1_51_pages():
    # 3232 keys = 50 full pages + 32: the planner splits it over the CTAs, the combine merges.
    _check(_case([3232], extra_pages=1))


@pytest.mark.parametrize("kv_lens", [[1], [64], [64 * 37], [128, 64, 4096, 1]], ids=str)
def test_short_and_page_multiple_lengths(kv_lens):
    _check(_case(kv_lens, seed=len(kv_lens)))


def test_kv_views_of_one_combined_tensor():
    _check(testing.interleave_kv(_case([3232, 70, 1], seed=11)))


def test_zero_page_requests():
    _, lse, _ = _check(_case([0, 100, 0, 3000, 0], seed=3))
    assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()


def test_only_empty_requests():
    out, lse, _ = _check(_case([0, 0], seed=4))
    assert (out == 0).all()


@pytest.mark.parametrize("num_qo_heads, num_kv_heads", [(8, 8), (16, 8), (32, 8), (32, 4), (20, 4)], ids=str)
def test_group_sizes(num_qo_heads, num_kv_heads):
    _check(_case([1000, 77, 0, 2049, 64], num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, seed=5))


def test_many_items_per_cta():
    # Few CTAs: each runs many items, so the K/V ring wraps across item boundaries.
    _check(_case([700, 64, 1, 5000, 333, 0, 129] * 6, seed=6), num_sms=3)


def test_natural_lse():
    case = _case([3232, 17], seed=7)
    _, lse = _run(case, natural_lse=True)
    _, ref_lse = case.reference()
    testing.assert_close_benchmark(lse, ref_lse * math.log(2.0), "lse")


def test_hypothesis_batches():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    batches = st.integers(1, 256).flatmap(
        lambda b: testing.decode_batches(max_batch=b, max_kv=min(32768, MAX_TOTAL_KV // b))
    )

    @settings(max_examples=25)
    @given(kv_lens=batches, seed=st.integers(0, 2**16))
    def check(kv_lens, seed):
        import cute_attn

        cute_attn.clear_plan_cache()
        _check(_case(kv_lens, seed=seed))

    check()

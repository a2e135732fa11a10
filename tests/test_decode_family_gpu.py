"""The sm_90a decode kernel across the family: page sizes 1..128, head_dim 64..256, group sizes 1..16.

Pages of 16..128 keys: one page is one ring stage (``kv_tile = page_size``), so these shapes run the definition's
kernel with other constants. Pages of 1, 2, 4, 8 keys: a 64-key stage of 64 / page_size one-page TMA boxes. Each case is a ragged batch over a shuffled NaN-poisoned pool (a long request that splits and folds
in-kernel, short ones, an empty one), NaN-prefilled outputs, judged element-wise against the float32 reference.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (num_qo_heads, num_kv_heads, head_dim, page_size): 13 configs, each compiled once
FAMILY = [
    (20, 4, 128, 16), (20, 4, 128, 32), (20, 4, 128, 128),  # page sizes around the definition's 64
    (20, 4, 64, 64), (20, 4, 256, 64),  # head dims
    (8, 8, 128, 16), (16, 1, 128, 32),  # group sizes 1 and 16
    (20, 4, 128, 1), (20, 4, 128, 2), (20, 4, 128, 4), (20, 4, 128, 8),  # small pages: many boxes per stage
    (8, 8, 64, 1), (16, 1, 256, 4),  # small pages with other head dims and groups
]
SMALL_PAGES = [shape for shape in FAMILY if shape[3] < 16]


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn

    torch.cuda.init()
    cute_attn.clear_plan_cache()
    yield


def _check(kv_lens, hq, hkv, d, ps, seed):
    import cute_attn

    case = testing.make_gqa_decode_case(kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                                        device="cuda", seed=seed)
    out, lse = case.new_outputs()
    cute_attn.gqa_paged_decode(*case.inputs(), out, lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")


@pytest.mark.parametrize("hq, hkv, d, ps", FAMILY, ids=lambda v: str(v))
def test_family_ragged_batch(hq, hkv, d, ps):
    # 5000 keys split over many CTAs (fused merge); ps - 1 and ps + 1 keys straddle a page end; 0 keys is empty
    _check([5000, ps - 1, ps + 1, 0, 3 * ps], hq, hkv, d, ps, seed=hq * ps + d)


@pytest.mark.parametrize("hq, hkv, d, ps", SMALL_PAGES, ids=lambda v: str(v))
def test_small_pages_around_stage_ends(hq, hkv, d, ps):
    # 63 / 64 / 65 keys straddle the 64-key stage end, 2 * ps + 1 a page end, 1 and 2049 a single key and the
    # 32-page id loads; 5000 splits (fused merge)
    _check([5000, 63, 64, 65, 1, 0, 2 * ps + 1, 2049], hq, hkv, d, ps, seed=hq * ps + d + 1)


@pytest.mark.parametrize("hq, hkv, d, ps", [(20, 4, 128, 1), (20, 4, 128, 2), (8, 8, 64, 1), (32, 16, 128, 1)],
                         ids=lambda v: str(v))
def test_four_gathering_warps(hq, hkv, d, ps):
    """``gather_warps`` 4 (``ops/gqa_decode.GATHER_WARPS_PAGE_SIZES``): a producer warpgroup copies each stage's rows,
    a quarter a warp, each with its slice's page ids; lengths straddle the quarter (16 keys at page 1), the stage and
    the 32-page id loads; 5000 splits (fused merge)."""
    from cute_attn.ops.gqa_decode import gather_warps_policy

    with gather_warps_policy((ps,)):
        _check([5000, 15, 16, 17, 63, 64, 65, 1, 0, 2 * ps + 1, 2049], hq, hkv, d, ps, seed=hq * ps + d + 7)


@pytest.mark.parametrize("hq, hkv, d, ps", [FAMILY[0], FAMILY[4], FAMILY[7]], ids=lambda v: str(v))
@settings(max_examples=6, deadline=None)
@given(kv_lens=testing.decode_batches(max_batch=40, max_kv=3000))
def test_family_hypothesis_batches(hq, hkv, d, ps, kv_lens):
    _check(kv_lens, hq, hkv, d, ps, seed=len(kv_lens))


@settings(max_examples=8, deadline=None)
@given(config=st.sampled_from(FAMILY), kv_lens=testing.decode_batches(max_batch=16, max_kv=2000))
def test_family_drawn_shapes(config, kv_lens):
    """The tier draws the shape too (page size, group, head_dim), over the configs compiled above."""
    _check(kv_lens, *config, seed=sum(kv_lens) % 1000)


@settings(max_examples=8, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4, 8, 16, 64]), kv_lens=testing.decode_batches(max_batch=24, max_kv=3000))
def test_drawn_page_sizes(page_size, kv_lens):
    """The definition's heads (h20/kv4, d128) with the page size drawn."""
    _check(kv_lens, 20, 4, 128, page_size, seed=sum(kv_lens) % 997 + page_size)

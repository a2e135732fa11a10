"""The swapped MLA decode kernel's short K stages (``ops/mla_decode.SM90_SHORT_STAGES``: four 32-key stages, S^T
still one 64-row tile whose rows past a stage's keys read the next 64-column block or the stage's pad and are masked)
on a GPU, against the float32 reference element by element. Built in session 39; none of it has run yet.

What a wrong short stage would show: a stage whose S^T rows 32..63 leak into the softmax (they hold the next
64-column block's keys or the pad's leftover bytes: every tile of a long request, and lengths 31 / 32 / 33 around a
stage edge), a stage address off by the pad (the TMA path at pages >= 8, the cp.async rows at page 1), the cluster
fold (three stages there) and the planner-free line build on the smaller ring. Pools hold NaN wherever no request owns
a slot and outputs start as NaN (``testing.make_mla_prefill_case``), so an unread or unwritten element fails. Each
test first asserts that its batch's plan has the 32-key stages, so a policy that stopped reaching a route fails."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
from cute_attn import testing  # noqa: E402
from cute_attn.ops import mla_decode  # noqa: E402
from test_mla_decode_gpu import LONG_KV, ROUTES, _run_and_compare, decode_batches  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
HEADS = (16, 8)
#: long split requests, an empty and a one-key one, lengths on and next to a 32-key stage edge and a 64-key page edge
EDGE_LENS = [LONG_KV, 0, 1, 31, 32, 33, 63, 65, 4095, LONG_KV // 2 + 3]


@pytest.fixture(autouse=True)
def _short_stages():
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    with mla_decode.short_stages_policy(True):
        yield
    torch.cuda.synchronize()


def _short(kv_lens, page_size, num_heads=16):
    """Runs ``_run_and_compare``'s batch shape through the plan entry: the one-token config has 32-key stages."""
    case = testing.make_mla_decode_case(kv_lens, num_heads=num_heads, page_size=page_size, device="cuda", seed=0)
    for on_device in (False, True):
        config = cute_attn.plan_mla_paged_decode(*case.inputs(), on_device=on_device).config
        assert config.kv_tile == 32 and config.tile_q_rows == num_heads, config


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("route", ROUTES)
def test_short_stages_edges(page_size, num_heads, route):
    _short(EDGE_LENS, page_size, num_heads)
    _run_and_compare([1] * len(EDGE_LENS), EDGE_LENS, False, page_size, num_heads, route,
                     seed=page_size + num_heads + 39)


@settings(max_examples=20, deadline=None)
@given(batch=decode_batches(), page_size=st.sampled_from([1, 64]), num_heads=st.sampled_from(HEADS),
       route=st.sampled_from(ROUTES))
def test_short_stages_drawn_batches(batch, page_size, num_heads, route):
    """Drawn batches (one token or 1..4: the multi-token ones keep the 64-row prefill tile, which the policy leaves
    alone)."""
    q_lens, kv_lens, multi_token = batch
    if not multi_token:
        _short(kv_lens, page_size, num_heads)
    _run_and_compare(q_lens, kv_lens, multi_token, page_size, num_heads, route,
                     seed=sum(kv_lens) + len(kv_lens) + 39)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kv_lens", [[4096], [4096] * 16, [8192] * 64, [4096] * 128, None],
                         ids=["1x4096", "16x4096", "64x8192", "128x4096", "ragged64"])
def test_short_stages_bench_rows(kv_lens, page_size):
    """The bench's MLA decode rows on the default call and a host plan (64 x 8192: the host plan's clusters of 2)."""
    kv_lens = kv_lens or np.random.default_rng(64).integers(1, 32769, size=64).tolist()
    _short(kv_lens, page_size)
    for route in ("device", "plan"):
        _run_and_compare([1] * len(kv_lens), kv_lens, False, page_size, 16, route, seed=len(kv_lens) + page_size)


@pytest.mark.parametrize("page_size", [1, 64])
def test_short_stages_line_build(page_size):
    """The planner-free line build on the short-stage ring (its table aliases the ring, pads included)."""
    import unit_scratch

    kv_lens = EDGE_LENS + [4096] * 6
    case = testing.make_mla_decode_case(kv_lens, num_heads=16, page_size=page_size, device="cuda", seed=page_size)
    with mla_decode.line_schedule_policy(True):
        route = unit_scratch.assert_matches_reference(cute_attn.mla_paged_decode, case, f"page {page_size}", None)
    assert route.config.line_schedule and route.config.kv_tile == 32


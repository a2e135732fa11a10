"""The MLA decode's line build with bf16 partial rows (``config.LINE_BF16_PARTIALS_KINDS``: the split items store bf16
rows, the CTA that folds a merge reads them 8 columns a 16-byte load, 8 slots a round, and sums in fp32) on a GPU, against the float32 reference
by the benchmark's rule: drawn batches at pages 1 and 64, the bench's rows (batch 1 folds 16 slots in one CTA), a grid
of 7 (merges of many slots), a page fault and a captured call replayed over new batches. Built in session 44."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cute_attn  # noqa: E402
import unit_scratch  # noqa: E402
from cute_attn import config as config_policies  # noqa: E402
from cute_attn import testing  # noqa: E402
from cute_attn.ops import mla_decode  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _line_bf16_partials():
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    with mla_decode.line_schedule_policy(True), config_policies.line_bf16_partials_policy(True):
        yield
    torch.cuda.synchronize()


def _case(kv_lens, seed, heads=16, page_size=1):
    return testing.make_mla_decode_case(kv_lens, num_heads=heads, page_size=page_size, device="cuda", seed=seed)


def _check(case, what, num_sms=None):
    route = unit_scratch.assert_matches_reference(cute_attn.mla_paged_decode, case, what, num_sms)
    assert route.config.line_schedule and route.config.bf16_partials, f"{what}: not the bf16-partials line build"
    scratch = next(iter(route.scratch.values()))
    assert scratch.partial_out.dtype == torch.bfloat16, f"{what}: the scratch's partial rows are not bf16"


@SETTINGS
@given(kv_lens=st.lists(st.one_of(st.just(0), st.integers(1, 130), st.integers(1, 12000)), min_size=1, max_size=40),
       heads=st.sampled_from([16, 8]), page_size=st.sampled_from([1, 64]), seed=st.integers(0, 2**16))
def test_drawn_batches_match_the_reference(kv_lens, heads, page_size, seed):
    _check(_case(kv_lens, seed, heads, page_size), f"h{heads} page {page_size} {kv_lens}")


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kv_lens", [[4096], [4096] * 16, [8192] * 64, None], ids=["1x4096", "16x4096", "64x8192",
                                                                                    "ragged64"])
def test_bench_rows(kv_lens, page_size):
    kv_lens = kv_lens or np.random.default_rng(64).integers(1, 32769, size=64).tolist()
    _check(_case(kv_lens, seed=len(kv_lens), page_size=page_size), f"{len(kv_lens)} requests page {page_size}")


def test_small_grid_folds_many_slots():
    _check(_case([9000, 0, 3, 4096, 700, 130], seed=7, page_size=64), "grid 7", 7)


def test_page_fault_empties_its_request():
    from cute_attn.device_errors import DeviceIndexError

    case = _case([5000, 70, 9000, 300], seed=5, page_size=64)
    ref_out, ref_lse = case.reference()
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


def test_captured_call_replays_across_batches():
    batch, page_size = 6, 64
    case = _case([4096] * batch, seed=3, page_size=page_size)
    unit_scratch.check_replays(cute_attn.mla_paged_decode, case, (case.ckv_cache, case.kpe_cache), batch, page_size,
                               steps=3, max_extra_keys=4000, rng=np.random.default_rng(9))

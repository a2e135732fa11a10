"""The MLA kernel at page sizes 1, 16 and 64, multi-token MLA decode, and bounds-safe row gathers, on a GPU.

Against the float32 reference, element by element (the benchmark's rule): pools are shuffled and hold NaN in every
slot no request owns (unused pages and the tail of every last page), outputs are NaN-prefilled, so a wrong row, a
key past a sequence end, a masked 0 x NaN in P V or a skipped element fails.

Bounds (issue 9, defence in depth): with a plan made from valid indices and ``check_indices=False``, page ids
written out of range afterwards (past the pool, negative) are never gathered: the other requests stay exact and
nothing faults. Run this file under ``compute-sanitizer --tool memcheck`` too (the out-of-range ids are far past
the pool, so a read of one would be an invalid global read).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    # every test with each consumer split of the sm_90a kernel (full_s, shared_s, score_wg); conftest.py
    pytest.mark.usefixtures("mla_consumers"),
]

PAGE_SIZES = (1, 16, 64)


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    yield


def _case(q_lens, kv_lens, page_size, seed=0):
    # page size 1: a pool of 97 spare rows; paged: the builder's quarter of spare pages
    num_pages = sum(kv_lens) + 97 if page_size == 1 else None
    return testing.make_mla_prefill_case(q_lens, kv_lens, page_size=page_size, num_pages=num_pages, device="cuda",
                                         seed=seed, with_last_page_len=page_size > 1)


def _compare(out, lse, ref_out, ref_lse, rows=slice(None)):
    testing.assert_close_benchmark(out[rows], ref_out[rows], "output")
    testing.assert_close_benchmark(lse[rows], ref_lse[rows], "lse")


def _prefill(case, **kw):
    import cute_attn

    out, lse = case.new_outputs()
    cute_attn.mla_paged_prefill(*case.inputs(), out, lse, **kw)
    torch.cuda.synchronize()
    return out, lse


def _decode_args(case):
    """The decode entry's positional arguments (FlashInfer-Bench order of the case's page size)."""
    last = () if case.kv_last_page_len is None else (case.kv_last_page_len,)
    return (case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, case.kv_indptr, case.kv_indices, *last,
            case.sm_scale)


def _decode(case, multi_token: bool, **kw):
    import cute_attn

    out, lse = case.new_outputs()
    extra = dict(qo_indptr=case.qo_indptr) if multi_token else {}
    cute_attn.mla_paged_decode(*_decode_args(case), out, lse, **extra, **kw)
    torch.cuda.synchronize()
    return out, lse


# ------------------------------------------------------------------------------------------------ prefill
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("q_lens, kv_lens", [
    ([1028], [1038]),                        # a recorded workload: many tiles, key tiles across pages
    ([0, 5, 0, 40, 3], [0, 70, 3, 40, 0]),   # empty requests, keys ending inside a tile and a page
    ([100, 40, 9], [30, 0, 9]),              # rows that see no key (kv < q): output 0, lse -inf
    ([64, 1, 7], [64, 128, 191]),            # lengths on and next to page / tile boundaries
], ids=str)
def test_paged_prefill_matches_reference(page_size, q_lens, kv_lens):
    case = _case(q_lens, kv_lens, page_size, seed=page_size + len(q_lens))
    _compare(*_prefill(case), *case.reference())


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_prefill_split_and_combined(page_size):
    import cute_attn

    case = _case([8, 2], [9000, 3000], page_size, seed=4)
    plan = cute_attn.plan_mla_paged_prefill(*case.inputs())
    assert plan.plan.num_merges > 0 and plan.config.page_size == page_size
    out, lse = _prefill(case, plan=plan, natural_lse=True)
    ref_out, ref_lse = case.reference()
    _compare(out, lse, ref_out, ref_lse * np.log(2.0))


@settings(max_examples=12)
@given(batch=testing.ragged_batches(max_batch=8, max_q=300, max_kv=1200), page_size=st.sampled_from(PAGE_SIZES))
def test_paged_prefill_ragged_batches(batch, page_size):
    q_lens, kv_lens = batch
    case = _case(q_lens, kv_lens, page_size, seed=sum(q_lens) + len(q_lens))
    _compare(*_prefill(case), *case.reference())


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_kv_tile_32_variant(page_size, mla_consumers):
    """kv_tile 32 (4 stages): a key tile is half a 64-row page."""
    if mla_consumers != "full_s":
        pytest.skip(f"{mla_consumers} builds kv_tile 64 only")
    import cute_attn
    from cute_attn.api import DevicePlan, _num_ctas
    from cute_attn.kernels import find_launcher
    from cute_attn.plan import plan_work

    q_lens, kv_lens = [100, 40, 9, 0], [130, 0, 9, 5]
    case = _case(q_lens, kv_lens, page_size, seed=6)
    config = dataclasses.replace(cute_attn.plan_mla_paged_prefill(*case.inputs()).config, kv_tile=32)
    plan = plan_work(config.plan_config(_num_ctas(config, case.q_nope.device, None)), np.asarray(q_lens),
                     np.asarray(kv_lens))
    device_plan = DevicePlan.upload(config, plan, case.q_nope.device)
    out, lse = case.new_outputs()
    find_launcher(config)(device_plan, *case.inputs(), out, lse, natural_lse=False)
    torch.cuda.synchronize()
    _compare(out, lse, *case.reference())


# ------------------------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kv_lens", [[3232, 1, 0, 700, 64], [1] * 7, [65, 4096]], ids=str)
def test_decode_one_query_per_request(page_size, kv_lens):
    case = _case([1] * len(kv_lens), kv_lens, page_size, seed=page_size)
    _compare(*_decode(case, multi_token=False), *case.reference())


@settings(max_examples=15)
@given(data=st.data())
def test_multi_token_decode(data):
    """MTP / speculative decoding: 1..4 queries per request, the request's last positions, bottom-right causal."""
    page_size = data.draw(st.sampled_from(PAGE_SIZES))
    batch = data.draw(st.integers(1, 12))
    q_lens = data.draw(st.lists(st.integers(1, 4), min_size=batch, max_size=batch))
    kv_lens = [q + data.draw(st.integers(0, 2000)) for q in q_lens]  # the queries' own keys are cached
    case = _case(q_lens, kv_lens, page_size, seed=batch + sum(kv_lens))
    _compare(*_decode(case, multi_token=True), *case.reference())


@pytest.mark.parametrize("page_size", [1, 64])
def test_multi_token_decode_fixed_batches(page_size):
    # q_len 1..4 with kv_len == q_len (the first query sees one key) and a long request split across CTAs
    case = _case([4, 1, 3, 2, 4], [4, 9000, 3, 65, 130], page_size, seed=11)
    out, lse = _decode(case, multi_token=True)
    _compare(out, lse, *case.reference())
    assert torch.isfinite(lse).all()


# ------------------------------------------------------------------------------------------------- bounds
BAD_IDS = (2**30, -1, -(2**31), 2**31 - 1)


def _corrupt(case, request: int, ids=BAD_IDS) -> list[int]:
    """Overwrite page ids of ``request`` in place (after planning); returns the positions written."""
    ptr = case.kv_indptr.tolist()
    positions = list(range(ptr[request], ptr[request + 1]))[: len(ids)]
    for pos, bad in zip(positions, ids):
        case.kv_indices[pos] = bad
    # one id just past the pool too, where an unchecked gather would read the allocation's neighbour
    if len(positions) < ptr[request + 1] - ptr[request]:
        case.kv_indices[ptr[request + 1] - 1] = case.ckv_cache.shape[0]
    torch.cuda.synchronize()
    return positions


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("entry", ["prefill", "decode", "mtp"])
def test_out_of_range_page_ids_are_never_gathered(page_size, entry):
    import cute_attn

    if entry == "prefill":
        q_lens, kv_lens = [30, 5, 17, 9], [600, 70, 17, 400]
    else:
        q_lens = [1] * 4 if entry == "decode" else [4, 2, 1, 3]
        kv_lens = [600, 70, 17, 4000]
    case = _case(q_lens, kv_lens, page_size, seed=21)
    ref_out, ref_lse = case.reference()  # of the valid batch
    if entry == "prefill":
        plan = cute_attn.plan_mla_paged_prefill(*case.inputs())
    else:
        extra = dict(qo_indptr=case.qo_indptr) if entry == "mtp" else {}
        plan = cute_attn.plan_mla_paged_decode(*_decode_args(case), **extra)
    bad_requests = (1, 3)
    for b in bad_requests:
        _corrupt(case, b)
    if entry == "prefill":
        out, lse = _prefill(case, plan=plan, check_indices=False)
    else:
        out, lse = _decode(case, multi_token=entry == "mtp", plan=plan, check_indices=False)
    torch.cuda.synchronize()  # a fault would surface here (and under compute-sanitizer memcheck)
    qo = case.qo_indptr.tolist()
    for b in range(len(q_lens)):
        rows = slice(qo[b], qo[b + 1])
        if b in bad_requests:  # unspecified, but written and finite: a bad id reads as a zero row
            assert torch.isfinite(out[rows].float()).all() and not torch.isnan(lse[rows]).any()
        else:
            _compare(out, lse, ref_out, ref_lse, rows)
    with pytest.raises(ValueError, match="kv_indices holds page id|kv_indices holds token row id"):
        if entry == "prefill":  # the host check names them, through the entry that made the plan
            cute_attn.mla_paged_prefill(*case.inputs(), plan=plan, check_indices=True)
        else:  # the decode entry's plan is made for its own kernel (one token a tile), not the prefill entry's
            _decode(case, multi_token=entry == "mtp", plan=plan, check_indices=True)

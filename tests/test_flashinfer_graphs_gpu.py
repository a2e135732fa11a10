"""cute_attn.flashinfer's wrappers with ``use_cuda_graph=True`` on a GPU, as an engine's decode step uses them:
buffers made at capacity, a warm-up ``run()`` and the capture on one side stream, then for each step a ``plan()``
of a new batch (lengths, page table, padding requests without pages), the new queries copied in, and a replay:
every replay equals the float32 reference of the batch then planned. Pools are finite (every page may be drawn),
the indices buffer's tail past the batch holds ids outside the pool (never read), outputs are NaN-filled before
each replay (an unwritten row fails). Also what those graphs rest on: planning into a kept plan
(``api.plan_for(into=)``), the refusal of a first run inside a capture, and a captured default call's buffers
outliving the route cache."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

import cute_attn  # noqa: E402
import cute_attn.flashinfer as ours  # noqa: E402
from cute_attn import reference, testing  # noqa: E402

BF16 = torch.bfloat16
BATCH = 8  # the captured batch: live requests plus padding ones (no pages)
STEPS = 4
MAX_KV = 4096  # keys a request may have: the pools hold BATCH of them (every page may be drawn)


@pytest.fixture(autouse=True)
def _clean():
    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    yield
    torch.cuda.synchronize()
    cute_attn.raise_on_device_error()


def _batch(rng, page_size: int, pool_pages: int, max_kv: int):
    """kv lengths (the last requests padding: 0 keys) and a page table over the whole pool, on the GPU."""
    live = int(rng.integers(1, BATCH + 1))
    kv_lens = [int(rng.integers(1, max_kv)) for _ in range(live)] + [0] * (BATCH - live)
    pages = [-(-n // page_size) for n in kv_lens]
    ids = rng.permutation(pool_pages)[: sum(pages)]
    indptr = np.concatenate([[0], np.cumsum(pages)])
    last = [(n - 1) % page_size + 1 if n else 0 for n in kv_lens]
    as_gpu = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32, device="cuda")  # noqa: E731
    return kv_lens, as_gpu(indptr), as_gpu(ids), as_gpu(last)


def _capture(run):
    """``run()`` once on a side stream (compiles, allocates), then captured on that stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        run()
    return graph


@pytest.mark.parametrize("page_size", [64, 1])
def test_decode_wrapper_replays_each_new_plan(page_size):
    heads, kv_heads, head_dim, pool_pages = 20, 4, 128, BATCH * MAX_KV // page_size + 16
    rng = np.random.default_rng(page_size)
    k_cache = torch.randn(pool_pages, page_size, kv_heads, head_dim, dtype=BF16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    buffers = dict(paged_kv_indptr_buffer=torch.zeros(BATCH + 1, dtype=torch.int32, device="cuda"),
                   paged_kv_indices_buffer=torch.full((pool_pages,), pool_pages + 9, dtype=torch.int32,
                                                      device="cuda"),
                   paged_kv_last_page_len_buffer=torch.zeros(BATCH, dtype=torch.int32, device="cuda"))
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    w = ours.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, **buffers)
    q = torch.empty(BATCH, heads, head_dim, dtype=BF16, device="cuda")
    outs = [torch.empty(BATCH, heads, head_dim, dtype=BF16, device="cuda") for _ in range(2)]
    caches = [(k_cache, v_cache), (torch.randn_like(k_cache), torch.randn_like(v_cache))]  # two layers

    def step_forward():  # an engine's captured forward: every layer's run() on the one plan
        for cache, out in zip(caches, outs):
            w.run(q, cache, out=out)

    graph = None
    for step in range(STEPS + 1):
        kv_lens, indptr, ids, last = _batch(rng, page_size, pool_pages, MAX_KV)
        w.plan(indptr, ids, last, heads, kv_heads, head_dim, page_size, q_data_type=BF16, kv_data_type=BF16)
        q.normal_()
        for out in outs:
            out.fill_(float("nan"))
        if graph is None:  # step 0: the warm-up computes this batch, the capture records it
            graph = _capture(step_forward)
        else:
            graph.replay()
        torch.cuda.synchronize()
        for layer, ((k, v), out) in enumerate(zip(caches, outs)):
            ref_out, _ = reference.gqa_paged_decode_ref(q, k, v, indptr, ids, last, 1.0 / head_dim ** 0.5)
            testing.assert_close_benchmark(out, ref_out, f"page {page_size} step {step} layer {layer} {kv_lens}")


@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_wrapper_replays_each_new_plan(page_size):
    heads, ckv, kpe, pool_pages = 16, 512, 64, BATCH * MAX_KV // page_size + 16
    rng = np.random.default_rng(10 + page_size)
    ckv_cache = torch.randn(pool_pages, page_size, ckv, dtype=BF16, device="cuda")
    kpe_cache = torch.randn(pool_pages, page_size, kpe, dtype=BF16, device="cuda")
    buffers = dict(qo_indptr=torch.zeros(BATCH + 1, dtype=torch.int32, device="cuda"),
                   kv_indptr=torch.zeros(BATCH + 1, dtype=torch.int32, device="cuda"),
                   kv_indices=torch.full((pool_pages,), -3, dtype=torch.int32, device="cuda"),
                   kv_len_arr=torch.zeros(BATCH, dtype=torch.int32, device="cuda"))
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    w = ours.BatchMLAPagedAttentionWrapper(workspace, True, **buffers)
    qo_indptr = torch.arange(BATCH + 1, dtype=torch.int32, device="cuda")  # one token a request (decode)
    q_nope = torch.empty(BATCH, heads, ckv, dtype=BF16, device="cuda")
    q_pe = torch.empty(BATCH, heads, kpe, dtype=BF16, device="cuda")
    out = torch.empty(BATCH, heads, ckv, dtype=BF16, device="cuda")
    lse = torch.empty(BATCH, heads, dtype=torch.float32, device="cuda")
    scale = testing.MLA_SM_SCALE
    graph = None
    for step in range(STEPS + 1):
        kv_lens, indptr, ids, last = _batch(rng, page_size, pool_pages, MAX_KV)
        kv_len_arr = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
        w.plan(qo_indptr, indptr, ids, kv_len_arr, heads, ckv, kpe, page_size, True, scale, BF16, BF16)
        q_nope.normal_()
        q_pe.normal_()
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        if graph is None:  # step 0: the warm-up computes this batch, the capture records it
            graph = _capture(lambda: w.run(q_nope, q_pe, ckv_cache, kpe_cache, out=out, lse=lse, return_lse=True))
        else:
            graph.replay()
        torch.cuda.synchronize()
        rest = (scale,) if page_size == 1 else (last, scale)
        ref_out, ref_lse = reference.mla_paged_prefill_ref(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, indptr,
                                                           ids, *rest)
        testing.assert_close_benchmark(out, ref_out, f"page {page_size} step {step} {kv_lens} output")
        testing.assert_close_benchmark(lse, ref_lse, f"page {page_size} step {step} {kv_lens} lse")


@pytest.mark.parametrize("kind", ["decode", "mla_decode", "prefill"])
def test_planning_into_a_kept_plan_runs_as_a_fresh_one(kind):
    """``api.plan_for(into=)`` (the wrappers' step plans and graph mode): a second batch of the same shapes planned
    into the first one's device plan runs as the reference; a plan of other shapes is refused by name."""
    from cute_attn import api, hostile
    from cute_attn.ops import gqa_decode, gqa_prefill, mla_decode

    if kind == "decode":
        make = lambda lens, seed: testing.make_gqa_decode_case(lens, device="cuda", seed=seed)  # noqa: E731
        spec, first, second, other = gqa_decode.SPEC, [300, 0, 4000, 64], [64, 2000, 1, 900], [5, 6]
    elif kind == "mla_decode":
        make = lambda lens, seed: testing.make_mla_prefill_case(  # noqa: E731
            [1] * len(lens), lens, page_size=64, device="cuda", seed=seed)
        spec, first, second, other = mla_decode.ONE_TOKEN_SPEC, [300, 0, 4000, 64], [64, 2000, 1, 900], [5, 6]
    else:
        make = lambda lens, seed: testing.make_gqa_prefill_case(  # noqa: E731
            [40] * len(lens), lens, device="cuda", seed=seed)
        spec, first, second, other = gqa_prefill.SPEC, [300, 40, 900], [40, 2000, 64], [50, 60]
    a, b = make(first, 1), make(second, 2)
    plan = api.plan_for(spec, a.inputs(), arch=None, num_sms=None, on_device=True)
    again = api.plan_for(spec, b.inputs(), arch=None, num_sms=None, on_device=True, into=plan)
    assert again is plan
    out, lse = b.new_outputs()
    if kind == "mla_decode":
        run = cute_attn.mla_paged_decode
        inputs = (b.q_nope, b.q_pe, b.ckv_cache, b.kpe_cache, b.kv_indptr, b.kv_indices, b.kv_last_page_len,
                  b.sm_scale)
    else:
        run, inputs = hostile.entry_for(b).run, b.inputs()
    run(*inputs, out, lse, plan=plan)
    torch.cuda.synchronize()
    ref_out, ref_lse = b.reference()
    testing.assert_close_benchmark(out, ref_out, f"{kind} planned into a kept plan: output")
    testing.assert_close_benchmark(lse, ref_lse, f"{kind} planned into a kept plan: lse")
    with pytest.raises(ValueError, match="into must be a DevicePlan"):
        api.plan_for(spec, make(other, 3).inputs(), arch=None, num_sms=None, on_device=True, into=plan)


def test_a_first_run_inside_a_capture_is_refused():
    """The device plan the captured runs read must be made outside the graph (one warm-up run())."""
    case = testing.make_gqa_decode_case([300, 20], device="cuda", seed=5)
    buffers = dict(paged_kv_indptr_buffer=case.kv_indptr.clone(), paged_kv_indices_buffer=case.kv_indices.clone(),
                   paged_kv_last_page_len_buffer=case.kv_last_page_len.clone())
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    w = ours.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True, **buffers)
    w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, 20, 4, 128, 64, q_data_type=BF16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="make one run\\(\\) before capturing"):
        with torch.cuda.graph(graph, stream=stream):
            w.run(case.q, (case.k_cache, case.v_cache))


def test_a_captured_default_call_outlives_the_route_cache():
    """The default call's route (plan slots on the capture stream) stays allocated after 64 other call shapes have
    cycled the route cache, and after clear_plan_cache(): the graph replays on its buffers."""
    rng = np.random.default_rng(64)
    case = testing.make_gqa_decode_case([300, 20, 4000, 7], device="cuda", seed=6)
    out, lse = case.new_outputs()
    graph = _capture(lambda: cute_attn.gqa_paged_decode(*case.inputs(), out, lse))
    for batch in range(1, 70):  # other shapes through the default call: each a route of its own
        other = testing.make_gqa_decode_case([int(n) for n in rng.integers(1, 300, size=batch)], device="cuda",
                                             seed=batch)
        cute_attn.gqa_paged_decode(*other.inputs())
    cute_attn.clear_plan_cache()
    garbage = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(8)]  # reuse freed blocks
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    del garbage
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, "replay after the route cache cycled: output")
    testing.assert_close_benchmark(lse, ref_lse, "replay after the route cache cycled: lse")

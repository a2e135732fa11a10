"""cute_attn.flashinfer's wrappers against FlashInfer's own (0.7.2), the same calls through both, on a GPU.

Each case makes one call sequence (constructor, ``plan``, ``run`` for two layers sharing the plan: the
first allocating, the second into ``out=``/``lse=``) through ``flashinfer.X`` and ``cute_attn.flashinfer.X``,
and compares output and LSE by the benchmark's rule (an element fails if ``|x-y| > 1e-2`` and
``|x-y|/|y| > 1e-2``) between the two, and ours against the fp32 reference.

The grid is a representative subset of FlashInfer's own test grids, restricted to what cute_attn builds
(bf16, NHD, head_dim 128 for GQA; FlashInfer's tests use fp16 and wider sets):

- decode, ``tests/attention/test_batch_decode_kernels.py`` (``test_batch_decode_with_paged_kv_cache``,
  ``test_batch_decode_with_tuple_paged_kv_cache``): batch_size {12, 17, 128}, kv_len {54, 97, 512, 2048,
  16384}, num_qo_heads {4, 32}, num_kv_heads 4, head_dim 128, return_lse, combined and tuple caches. Page
  size 64: their page sizes (1, 8, 16) are not built by cute_attn's decode kernel (one page per 64-key tile).
- prefill, ``tests/attention/test_batch_prefill_kernels.py`` (``test_batch_prefill_with_paged_kv_cache``,
  ``..._tuple_paged_kv_cache``): batch_size {12, 17, 128}, kv_len {54, 97, 512, 2048}, qo_len {17, 37, 127,
  577} (qo_len <= kv_len, as theirs skip otherwise), page_size 16 (theirs: 1, 5, 16) and 64, num_qo_heads
  {4, 32}, num_kv_heads 4, head_dim 128, causal=True only.
- MLA, ``tests/attention/test_deepseek_mla.py`` (``test_batch_mla_page_attention``,
  ``test_batch_mla_varlen_page_attention``): batch_size {1, 3, 5, 7, 157}, kv_len {17, 33, 96, 514, 1024} and
  the varlen triple (11, 79, 2743), qo_len {1, 9, 15, 17}, num_heads 16, ckv 512 + kpe 64, page_size 1,
  sm_scale 1/sqrt(128 + 64), causal=True, and causal=False at qo_len 1 (decode).

FlashInfer runs with its tests' backends: decode and prefill at their defaults (``backend="auto"``, CUDA-core
decode), MLA with ``backend="fa3"``. Unlike FlashInfer's tests (contiguous page ids), pools are shuffled
(``cute_attn.testing``); their NaN poison is replaced by random values, since this file judges agreement,
not poison handling. cute_attn compiles 6 configs here (decode h32/kv4 and h4/kv4 at page 64; prefill h32/kv4
at pages 16 and 64, h4/kv4 at page 16; MLA h16), FlashInfer JIT-compiles its decode, prefill and MLA modules.
"""

from __future__ import annotations

import inspect
import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

flashinfer = pytest.importorskip("flashinfer")

import cute_attn.flashinfer as ours  # noqa: E402
from cute_attn import reference, testing  # noqa: E402
from test_flashinfer_compat import signature_text  # noqa: E402

BF16 = torch.bfloat16
WORKSPACE_BYTES = 128 * 1024 * 1024


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn
    from cute_attn.compile import import_all_kernels

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    import_all_kernels()  # every launcher registered, whichever GPU test module ran first
    cute_attn.clear_plan_cache()
    yield


def _workspace():
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")  # FlashInfer decode wants it zeroed


def _without_poison(*tensors, seed=0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    for t in tensors:
        bad = torch.isnan(t)
        t[bad] = torch.randn(int(bad.sum()), generator=g, device="cuda").to(t.dtype)


def _like(t, seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randn(t.shape, generator=g, device="cuda").to(t.dtype)


def _compare(ours_result, fi_result, ref, what):
    (out, lse), (fi_out, fi_lse), (ref_out, ref_lse) = ours_result, fi_result, ref
    torch.cuda.synchronize()
    testing.assert_close_benchmark(out, ref_out, f"{what}: cute_attn output vs fp32 reference")
    testing.assert_close_benchmark(lse, ref_lse, f"{what}: cute_attn lse vs fp32 reference")
    testing.assert_close_benchmark(out, fi_out, f"{what}: cute_attn output vs FlashInfer")
    testing.assert_close_benchmark(lse, fi_lse, f"{what}: cute_attn lse vs FlashInfer")


def _nan_like(out, lse):
    return torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))


def _two_layers(wrappers, layers, run_inputs, references, what):
    """Layer 0 returns new tensors, layer 1 writes into out=/lse=; both wrappers share one plan per layer set."""
    fi, mine = wrappers
    for layer, tensors in enumerate(layers):
        args, kwargs = run_inputs(*tensors)
        if layer == 0:
            fi_result = fi.run(*args, return_lse=True, **kwargs)
            our_result = mine.run(*args, return_lse=True, **kwargs)
        else:
            fi_result = _nan_like(*fi_result)
            our_result = _nan_like(*our_result)
            fi.run(*args, out=fi_result[0], lse=fi_result[1], return_lse=True, **kwargs)
            got = mine.run(*args, out=our_result[0], lse=our_result[1], return_lse=True, **kwargs)
            assert got[0] is our_result[0] and got[1] is our_result[1]
        _compare(our_result, fi_result, references(*tensors), f"{what} layer {layer}")


# ---------------------------------------------------------------------------------------------- decode
DECODE_GRID = [  # batch_size, kv_len, num_qo_heads, cache form
    (12, 54, 32, "combined"),
    (17, 97, 4, "tuple"),
    (128, 512, 32, "tuple"),
    (17, 2048, 32, "combined"),
    (128, 2048, 4, "combined"),
    (12, 16384, 4, "tuple"),
]


@pytest.mark.parametrize("batch_size, kv_len, num_qo_heads, kv_form", DECODE_GRID, ids=str)
def test_decode_matches_flashinfer(batch_size, kv_len, num_qo_heads, kv_form):
    num_kv_heads, head_dim, page_size = 4, 128, 64
    case = testing.make_gqa_decode_case([kv_len] * batch_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, page_size=page_size, device="cuda", seed=kv_len)
    _without_poison(case.k_cache, case.v_cache)
    wrappers = (flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD"),
                ours.BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD"))
    for w in wrappers:  # sm_scale left to its default, 1/sqrt(head_dim), in both
        w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, num_qo_heads, num_kv_heads, head_dim,
               page_size, pos_encoding_mode="NONE", logits_soft_cap=0.0, q_data_type=BF16, kv_data_type=BF16)
    layers = [(case.q, case.k_cache, case.v_cache),
              (_like(case.q, 1), _like(case.k_cache, 2), _like(case.v_cache, 3))]

    def run_inputs(q, k, v):
        return (q, (k, v) if kv_form == "tuple" else torch.stack((k, v), dim=1)), {}

    def references(q, k, v):
        return reference.gqa_paged_decode_ref(q, k, v, case.kv_indptr, case.kv_indices, case.kv_last_page_len,
                                              1.0 / math.sqrt(head_dim))

    _two_layers(wrappers, layers, run_inputs, references, "decode")


# ---------------------------------------------------------------------------------------------- prefill
PREFILL_GRID = [  # batch_size, kv_len, qo_len, num_qo_heads, page_size, cache form
    (12, 54, 37, 32, 16, "combined"),
    (17, 97, 17, 4, 16, "tuple"),
    (128, 97, 37, 4, 16, "combined"),
    (12, 512, 127, 32, 64, "tuple"),
    (17, 2048, 577, 32, 16, "combined"),
    (12, 2048, 127, 4, 16, "tuple"),
]


@pytest.mark.parametrize("batch_size, kv_len, qo_len, num_qo_heads, page_size, kv_form", PREFILL_GRID, ids=str)
def test_prefill_matches_flashinfer(batch_size, kv_len, qo_len, num_qo_heads, page_size, kv_form):
    num_kv_heads, head_dim = 4, 128
    case = testing.make_gqa_prefill_case([qo_len] * batch_size, [kv_len] * batch_size, num_qo_heads=num_qo_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                                         device="cuda", seed=kv_len + qo_len)
    _without_poison(case.k_cache, case.v_cache)
    sm_scale = 0.7 / math.sqrt(head_dim)  # not the default: the scale must reach the kernel
    wrappers = (flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD"),
                ours.BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD"))
    for w in wrappers:
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len, num_qo_heads, num_kv_heads,
               head_dim, page_size, causal=True, pos_encoding_mode="NONE", logits_soft_cap=0.0, sm_scale=sm_scale,
               q_data_type=BF16, kv_data_type=BF16)
    layers = [(case.q, case.k_cache, case.v_cache),
              (_like(case.q, 4), _like(case.k_cache, 5), _like(case.v_cache, 6))]

    def run_inputs(q, k, v):
        return (q, (k, v) if kv_form == "tuple" else torch.stack((k, v), dim=1)), {}

    def references(q, k, v):
        return reference.gqa_paged_prefill_ref(q, k, v, case.qo_indptr, case.kv_indptr, case.kv_indices,
                                               case.kv_last_page_len, sm_scale)

    _two_layers(wrappers, layers, run_inputs, references, "prefill")


def test_prefill_natural_lse_matches_flashinfer():
    case = testing.make_gqa_prefill_case([37] * 12, [54] * 12, num_qo_heads=32, num_kv_heads=4, page_size=16,
                                         device="cuda", seed=9)
    _without_poison(case.k_cache, case.v_cache)
    results = []
    for cls in (flashinfer.BatchPrefillWithPagedKVCacheWrapper, ours.BatchPrefillWithPagedKVCacheWrapper):
        w = cls(_workspace(), "NHD")
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len, 32, 4, 128, 16, causal=True,
               q_data_type=BF16, kv_data_type=BF16)
        results.append(w.run(case.q, (case.k_cache, case.v_cache), return_lse=True, lse_base="ln"))
    ref_out, ref_lse = reference.gqa_paged_prefill_ref(*case.inputs()[:-1], 1.0 / math.sqrt(128), natural_lse=True)
    _compare(results[1], results[0], (ref_out, ref_lse), "prefill lse_base='ln'")


# ---------------------------------------------------------------------------------------------- MLA
MLA_SM_SCALE = 1.0 / math.sqrt(128 + 64)  # FlashInfer's tests: the head dim before absorption
MLA_GRID = [  # kv_lens per request (repeated batch_size times), qo_len, causal
    ((17,) * 1, 1, False),
    ((33,) * 157, 1, False),
    ((96,) * 3, 17, True),
    ((514,) * 7, 9, True),
    ((1024,) * 5, 15, True),
    ((11, 79, 2743) * 3, 9, True),
]


def _mla_plan_inputs(case, causal):
    common = dict(num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=1, causal=causal,
                  sm_scale=MLA_SM_SCALE, q_data_type=BF16, kv_data_type=BF16)
    kv_len_arr = (case.kv_indptr[1:] - case.kv_indptr[:-1]).to(torch.int32)
    metadata_cls = getattr(flashinfer.mla, "MLAPlanMetadata", None)
    if metadata_cls is None:  # releases before the structural form: the flat CSR form
        return (case.qo_indptr, case.kv_indptr, case.kv_indices, kv_len_arr), common, False
    metadata = metadata_cls.csr(case.qo_indptr, case.kv_indptr, case.kv_indices, kv_len_arr)
    return (), dict(common, metadata=metadata, query_layout="split", kv_cache_layout="split", lse_mode="base2"), True


@pytest.mark.parametrize("kv_lens, qo_len, causal", MLA_GRID, ids=lambda x: str(x)[:24])
def test_mla_matches_flashinfer(kv_lens, qo_len, causal):
    case = testing.make_mla_prefill_case([qo_len] * len(kv_lens), list(kv_lens), num_heads=16,
                                         num_pages=sum(kv_lens) + 97, device="cuda", seed=len(kv_lens) + qo_len,
                                         sm_scale=MLA_SM_SCALE)
    _without_poison(case.ckv_cache, case.kpe_cache)
    plan_args, plan_kwargs, structural = _mla_plan_inputs(case, causal)
    # backend="fa3" as FlashInfer's MLA tests and tools/bench_peers.py (ours accepts and ignores it)
    wrappers = (flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(), backend="fa3"),
                ours.BatchMLAPagedAttentionWrapper(_workspace(), backend="fa3"))
    for w in wrappers:
        w.plan(*plan_args, **plan_kwargs)
    layers = [(case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache),
              (_like(case.q_nope, 7), _like(case.q_pe, 8), _like(case.ckv_cache, 9), _like(case.kpe_cache, 10))]

    def run_inputs(q_nope, q_pe, ckv, kpe):
        if structural:
            return (), dict(query=(q_nope, q_pe), kv_cache=(ckv, kpe))
        return (q_nope, q_pe, ckv, kpe), {}

    def references(q_nope, q_pe, ckv, kpe):
        return reference.mla_paged_prefill_ref(q_nope, q_pe, ckv, kpe, case.qo_indptr, case.kv_indptr,
                                               case.kv_indices, MLA_SM_SCALE, causal=causal)

    _two_layers(wrappers, layers, run_inputs, references, "mla")


def test_mla_legacy_positional_form_matches_flashinfer():
    """The form FlashInfer's own MLA tests use: 12 positional plan arguments, split run tensors."""
    case = testing.make_mla_prefill_case([9] * 3, [96] * 3, num_heads=16, num_pages=400, device="cuda", seed=11,
                                         sm_scale=MLA_SM_SCALE)
    _without_poison(case.ckv_cache, case.kpe_cache)
    kv_len_arr = (case.kv_indptr[1:] - case.kv_indptr[:-1]).to(torch.int32)
    results = []
    for cls in (flashinfer.mla.BatchMLAPagedAttentionWrapper, ours.BatchMLAPagedAttentionWrapper):
        w = cls(_workspace(), backend="fa3")
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, kv_len_arr, 16, 512, 64, 1, True, MLA_SM_SCALE,
               BF16, BF16)
        results.append(w.run(case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, return_lse=True))
    _compare(results[1], results[0], case.reference(), "mla legacy form")


# ---------------------------------------------------------------------------------------------- signatures
def _plan_impl_keywords(cls):
    params = inspect.signature(cls._plan_impl).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


def test_signatures_match_the_installed_flashinfer():
    """The hard-coded 0.7.2 signatures of the CPU tests, checked against the FlashInfer installed here."""
    pairs = [(flashinfer.BatchDecodeWithPagedKVCacheWrapper, ours.BatchDecodeWithPagedKVCacheWrapper),
             (flashinfer.BatchPrefillWithPagedKVCacheWrapper, ours.BatchPrefillWithPagedKVCacheWrapper),
             (flashinfer.mla.BatchMLAPagedAttentionWrapper, ours.BatchMLAPagedAttentionWrapper)]
    for theirs, mine in pairs:
        for method in ("__init__", "plan", "run"):
            if theirs is flashinfer.BatchDecodeWithPagedKVCacheWrapper and method == "plan":
                continue  # (..., page_size, *deprecated_positional_args, **kwargs): checked below
            assert signature_text(getattr(mine, method)) == signature_text(getattr(theirs, method)), \
                f"{mine.__name__}.{method}"
    fi_decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    mine = list(inspect.signature(ours.BatchDecodeWithPagedKVCacheWrapper.plan).parameters.values())[1:]
    required = [p.name for p in list(inspect.signature(fi_decode.plan).parameters.values())[1:8]]
    assert [p.name for p in mine[:7]] == required
    assert {p.name: p.default for p in mine[7:]} == _plan_impl_keywords(fi_decode)
    legacy = getattr(flashinfer.decode, "_BATCH_DECODE_PLAN_LEGACY_POS_ARGS", None)
    if legacy is not None:
        assert [p.name for p in mine[7:] if p.kind is p.POSITIONAL_OR_KEYWORD] == list(legacy)

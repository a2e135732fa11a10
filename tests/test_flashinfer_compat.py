"""cute_attn.flashinfer on the CPU: FlashInfer 0.7.2's signatures, what is rejected, plan() checks, run() wiring.

run() is checked against the fp32 reference through a stand-in for the entry point (the kernels need a
GPU); one test per wrapper also calls the real entry point, whose validation must accept what the
wrapper passes before it stops at the CUDA-device rule. tests/test_flashinfer_compat_gpu.py compares
against FlashInfer itself.
"""

from __future__ import annotations

import inspect
import math
import types

import pytest
import torch

import cute_attn
from cute_attn import reference, testing
from cute_attn.flashinfer import (BatchDecodeWithPagedKVCacheWrapper, BatchMLAPagedAttentionWrapper,
                                  BatchPrefillWithPagedKVCacheWrapper)

BF16 = torch.bfloat16

# ---------------------------------------------------------------------------------------------
# Signatures, written out from flashinfer-python 0.7.2 (the wheel's sources; parameters after self):
#   flashinfer/decode.py   BatchDecodeWithPagedKVCacheWrapper.__init__, .run; .plan takes
#                          (indptr .. page_size, *deprecated_positional_args, **kwargs), the extra names in the
#                          order of _BATCH_DECODE_PLAN_LEGACY_POS_ARGS, then _plan_impl's window_right, is_causal
#   flashinfer/prefill.py  BatchPrefillWithPagedKVCacheWrapper.__init__, .plan, .run
#   flashinfer/mla/_batch_mla/_wrapper.py  BatchMLAPagedAttentionWrapper.__init__, .plan, .run (the
#                          implementations under the @overload stubs)
# ---------------------------------------------------------------------------------------------
FLASHINFER_0_7_2 = {
    (BatchDecodeWithPagedKVCacheWrapper, "__init__"):
        "float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, use_tensor_cores=False, "
        "paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, "
        "backend='auto', jit_args=None",
    (BatchDecodeWithPagedKVCacheWrapper, "plan"):
        "indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, "
        "pos_encoding_mode='NONE', window_left=-1, logits_soft_cap=None, q_data_type='float16', "
        "kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, "
        "non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False, "
        "q_len_per_req=1, *, window_right=0, is_causal=None",
    (BatchDecodeWithPagedKVCacheWrapper, "run"):
        "q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, "
        "return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None, "
        "skip_softmax_threshold_scale_factor=None, kv_cache_sf=None",
    (BatchPrefillWithPagedKVCacheWrapper, "__init__"):
        "float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, qo_indptr_buf=None, "
        "paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, "
        "custom_mask_buf=None, mask_indptr_buf=None, backend='auto', jit_args=None, jit_kwargs=None, "
        "variant_owns_mask=False",
    (BatchPrefillWithPagedKVCacheWrapper, "plan"):
        "qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads, "
        "head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False, "
        "pos_encoding_mode='NONE', use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, "
        "logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type='float16', kv_data_type=None, "
        "o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None, "
        "token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None, "
        "max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False, "
        "uniform_q_len=None",  # 0.7.2.post1 (the H200 bundle's) added uniform_q_len
    (BatchPrefillWithPagedKVCacheWrapper, "run"):
        "q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None, "
        "return_lse=False, lse_base='log2', lse_layout='NH', enable_pdl=None, window_left=None, sinks=None, "
        "kv_cache_sf=None, skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None",
    (BatchMLAPagedAttentionWrapper, "__init__"):
        "float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None, "
        "kv_len_arr=None, backend='auto'",
    (BatchMLAPagedAttentionWrapper, "plan"):
        "qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None, num_heads=None, head_dim_ckv=None, "
        "head_dim_kpe=None, page_size=None, causal=None, sm_scale=None, q_data_type=None, kv_data_type=None, "
        "use_profiler=False, *, metadata=None, cum_seq_lens_q=None, block_tables=None, seq_lens=None, "
        "max_q_len=None, query_layout=None, kv_cache_layout=None, lse_mode='none', output_dtype=None, "
        "output_scale='none', scale_mode='default', skip_softmax=False, enable_pdl=None, use_sinks=False",
    (BatchMLAPagedAttentionWrapper, "run"):
        "q_nope=None, q_pe=None, ckv_cache=None, kpe_cache=None, out=None, lse=None, return_lse=False, "
        "profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e=False, o_scale=None, *, "
        "query=None, kv_cache=None, ckv_scale=None, ckv_scale_arr=None, kpe_scale=None, sinks=None, "
        "skip_softmax_threshold_scale_factor=None, bmm1_scale=None, bmm2_scale=None",
}


def signature_text(fn) -> str:
    """Parameters after ``self`` as Python writes them, without annotations: names, order, kinds, defaults."""
    parts, star = [], False
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts)


@pytest.mark.parametrize("cls, method", list(FLASHINFER_0_7_2), ids=lambda x: getattr(x, "__name__", x))
def test_signatures_match_flashinfer_0_7_2(cls, method):
    assert signature_text(getattr(cls, method)) == FLASHINFER_0_7_2[(cls, method)]


def test_aliases_flashinfer_engines_call():
    for cls in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
        assert cls.begin_forward is cls.plan
        assert cls(_workspace()).is_cuda_graph_enabled is False
    for cls in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper, BatchMLAPagedAttentionWrapper):
        assert cls.run_return_lse._partialmethod.keywords == {"return_lse": True}


# ---------------------------------------------------------------------------------------------
# Small CPU batches, and a stand-in entry point that answers with the fp32 reference
# ---------------------------------------------------------------------------------------------
def _workspace():
    return torch.empty(16, dtype=torch.uint8)


def _decode_case(seed=0):
    return testing.make_gqa_decode_case([70, 0, 130, 16], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                                        page_size=16, seed=seed)


def _prefill_case(seed=0):
    return testing.make_gqa_prefill_case([3, 0, 17], [10, 5, 40], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                                         page_size=16, seed=seed)


def _mla_case(q_lens=(1, 4), kv_lens=(5, 9), seed=0):
    return testing.make_mla_prefill_case(list(q_lens), list(kv_lens), num_heads=4, ckv_dim=32, kpe_dim=16, seed=seed)


def _kv_len_arr(case):
    return (case.kv_indptr[1:] - case.kv_indptr[:-1]).to(torch.int32)


def _planned(kind, **plan_kw):
    """A planned wrapper, the case and the run() inputs for each wrapper kind."""
    if kind == "decode":
        case = _decode_case()
        w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD")
        kw = dict(q_data_type=BF16) | plan_kw
        w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, 8, 2, 64, 16, **kw)
        return w, case, (case.q, (case.k_cache, case.v_cache))
    if kind == "prefill":
        case = _prefill_case()
        w = BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD")
        kw = dict(causal=True, q_data_type=BF16) | plan_kw
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len, 4, 2, 64, 16, **kw)
        return w, case, (case.q, (case.k_cache, case.v_cache))
    case = _mla_case()
    w = BatchMLAPagedAttentionWrapper(_workspace())
    kw = dict(num_heads=4, head_dim_ckv=32, head_dim_kpe=16, page_size=1, causal=True, sm_scale=case.sm_scale,
              q_data_type=BF16, kv_data_type=BF16) | plan_kw
    w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, _kv_len_arr(case), **kw)
    return w, case, (case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache)


_ENTRIES = {"decode": ("gqa_paged_decode", reference.gqa_paged_decode_ref),
            "prefill": ("gqa_paged_prefill", reference.gqa_paged_prefill_ref)}  # MLA: ops.mla_prefill.run_mla


@pytest.fixture
def entry_calls(monkeypatch):
    """Replace the three entry points by the fp32 reference; returns the list of calls they receive."""
    return reference_entries(monkeypatch)


def reference_entries(monkeypatch) -> list:
    """The entry points replaced by the fp32 reference, and the device planner by a stand-in plan (``monkeypatch``);
    the list of calls the entries receive (each with the ``plan`` it was given). The wrappers plan once per batch
    (``step_plan.py``): the list's ``plans`` holds the plans they asked for. A stand-in plan remembers the index
    values it was made from, and an entry given it checks that its index tensors still hold them: a run on a plan
    of another batch (a stale plan) fails here."""
    calls = _Calls()
    plans = calls.plans

    def plan_for(spec, args, *, arch, num_sms, on_device=False, into=None, recycle=None):
        assert on_device and arch is None and num_sms is None, "the wrappers plan on the device, for the inputs"
        plan = into if into is not None else recycle if recycle is not None else types.SimpleNamespace(spec=spec)
        plan.index = {p: args[p].clone() for p in _index_positions(spec) if args[p] is not None}
        plans.append(types.SimpleNamespace(spec=spec, args=args, into=into, recycle=recycle, plan=plan))
        return plan

    def record(inputs, output, lse, options):
        plan = options.get("plan")
        if plan is not None:
            for p, values in plan.index.items():
                assert torch.equal(inputs[p], values), f"run on a stale plan: argument {p} changed since planning"
        calls.append(types.SimpleNamespace(inputs=inputs, output=output, lse=lse, options=options, plan=plan))

    def answer(ref_out, ref_lse, output, lse):
        if output is None:
            return ref_out, ref_lse
        output.copy_(ref_out)
        lse.copy_(ref_lse)
        return output, lse

    def stand_in(ref):
        def entry(*args, **options):
            *inputs, output, lse = args
            assert set(options) <= {"natural_lse", "plan"}, options
            record(inputs, output, lse, options)
            return answer(*ref(*inputs, natural_lse=options.get("natural_lse", False)), output, lse)
        return entry

    def run_mla(*args, spec=None):
        """``ops.mla_prefill.run_mla`` (the MLA wrapper's call: canonical order, ``spec`` picks the kernel)."""
        *inputs, output, lse, plan, check_indices, natural_lse, arch, num_sms = args
        assert check_indices is False and arch is None and num_sms is None
        record(inputs, output, lse, dict(natural_lse=natural_lse, plan=plan, spec=spec))
        rest = inputs[8:] if inputs[7] is None else inputs[7:]  # the ps1 order: no kv_last_page_len
        return answer(*reference.mla_paged_prefill_ref(*inputs[:7], *rest, natural_lse=natural_lse), output, lse)

    for name, ref in _ENTRIES.values():
        monkeypatch.setattr(cute_attn, name, stand_in(ref))
    monkeypatch.setattr(cute_attn.ops.mla_prefill, "run_mla", run_mla)
    monkeypatch.setattr(cute_attn.api, "plan_for", plan_for)
    monkeypatch.setattr(cute_attn.api, "self_schedules", lambda spec, args, **kw: calls.self_scheduled)
    return calls


def _index_positions(spec) -> list:
    return [spec.arg_names.index(n) for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")
            if n in spec.arg_names]


class _Calls(list):
    """The entry calls a test's wrappers made, and (``plans``) the device plans they asked for."""

    def __init__(self):
        super().__init__()
        self.plans = []
        self.self_scheduled = False  # what the stand-in api.self_schedules answers (the planner-free route)


def _assert_equal(actual, expected, what):
    assert torch.equal(actual, expected), f"{what} differs from the reference"


# ---------------------------------------------------------------------------------------------
# run() wiring
# ---------------------------------------------------------------------------------------------
def test_decode_run_tuple_and_combined_cache_give_the_reference(entry_calls):
    w, case, (q, kv) = _planned("decode")
    ref_out, ref_lse = case.reference()
    out = w.run(q, kv)
    _assert_equal(out, ref_out, "output (k, v tuple)")
    combined = torch.stack((case.k_cache, case.v_cache), dim=1)  # FlashInfer NHD: [pages, 2, page, heads, dim]
    out2, lse2 = w.run(q, combined, return_lse=True)
    _assert_equal(out2, ref_out, "output (combined tensor)")
    _assert_equal(lse2, ref_lse, "lse (combined tensor)")
    k_view = entry_calls[1].inputs[1]
    assert k_view.data_ptr() == combined.data_ptr() and k_view.stride(0) == combined.stride(0), "K must be a view"
    # every layer gets the very index tensors of the plan: the entry point's plan cache keys on them
    assert all(a is b for a, b in zip(entry_calls[0].inputs[3:6], entry_calls[1].inputs[3:6]))
    assert entry_calls[0].inputs[6] == 1.0 / math.sqrt(64)  # FlashInfer's default sm_scale


def test_decode_out_and_lse_destinations_are_returned(entry_calls):
    w, case, (q, kv) = _planned("decode", sm_scale=0.3)
    out = torch.empty(4, 8, 64, dtype=BF16)
    assert w.run(q, kv, out=out) is out
    lse = torch.empty(4, 8)
    got_out, got_lse = w.run_return_lse(q, kv, lse=lse)
    assert got_lse is lse and got_out is not out
    ref_out, ref_lse = reference.gqa_paged_decode_ref(*case.inputs()[:-1], 0.3)
    _assert_equal(out, ref_out, "out=")
    _assert_equal(lse, ref_lse, "lse=")


def test_decode_accepts_what_engines_pass_for_bf16(entry_calls):
    case = _decode_case()
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD", use_tensor_cores=True, backend="fa2")
    # FlashInfer's own tests plan with data_type=, logits_soft_cap=0.0; vLLM runs with k_scale/v_scale 1.0
    w.plan(case.kv_indptr.long(), case.kv_indices.long(), case.kv_last_page_len.long(), 8, 2, 64, 16,
           "NONE", -1, 0.0, None, None, None, BF16, non_blocking=False, rope_scale=2.0, is_causal=False)
    out = w.run(case.q, (case.k_cache, case.v_cache), k_scale=1.0, v_scale=1.0, enable_pdl=True, window_left=-1,
                q_len_per_req=1)
    _assert_equal(out, case.reference()[0], "output")
    assert all(t.dtype == torch.int32 for t in entry_calls[0].inputs[3:6]), "index tensors go in as int32"
    assert w.use_tensor_cores is True


def test_decode_replan_passes_the_new_batch(entry_calls):
    w, _, (q, kv) = _planned("decode")
    w.run(q, kv)
    other = testing.make_gqa_decode_case([33, 5], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, seed=3)
    w.plan(other.kv_indptr, other.kv_indices, other.kv_last_page_len, 8, 2, 64, 16, q_data_type=BF16)
    out = w.run(other.q, (other.k_cache, other.v_cache))
    assert entry_calls[1].inputs[3] is not entry_calls[0].inputs[3]
    _assert_equal(out, other.reference()[0], "output after re-plan")


def test_prefill_run_gives_the_causal_reference(entry_calls):
    w, case, (q, kv) = _planned("prefill", sm_scale=0.2)
    combined = torch.stack(kv, dim=1)
    out, lse = w.run(q, combined, return_lse=True)
    ref_out, ref_lse = reference.gqa_paged_prefill_ref(*case.inputs()[:-1], 0.2)
    _assert_equal(out, ref_out, "output")
    _assert_equal(lse, ref_lse, "lse")
    _, lse_ln = w.run(q, kv, return_lse=True, lse_base="ln")
    assert entry_calls[-1].options["natural_lse"] is True
    _assert_equal(lse_ln, reference.gqa_paged_prefill_ref(*case.inputs()[:-1], 0.2, natural_lse=True)[1], "ln lse")


def test_prefill_plan_positional_like_flashinfer_tests(entry_calls):
    case = _prefill_case(seed=2)
    w = BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD", backend="fa3")
    # positional up to page_size, then FlashInfer's keywords (tests/attention/test_batch_prefill_kernels.py style)
    w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len, 4, 2, 64, 16, 64, None, None,
           True, "NONE", logits_soft_cap=0.0, q_data_type="bfloat16", kv_data_type=BF16, o_data_type=BF16,
           max_token_per_sequence=17, max_sequence_kv=40)
    out = w.run(case.q, (case.k_cache, case.v_cache), use_fp16_softmax=True, enable_pdl=False)
    _assert_equal(out, case.reference()[0], "output")
    assert entry_calls[0].inputs[7] == 1.0 / math.sqrt(64)


def test_mla_run_forms_give_the_reference(entry_calls):
    case = _mla_case()
    w = BatchMLAPagedAttentionWrapper(_workspace(), backend="fa3")
    # FlashInfer's tests/attention/test_deepseek_mla.py plans positionally, 12 arguments
    w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, _kv_len_arr(case), 4, 32, 16, 1, True, case.sm_scale,
           BF16, BF16)
    ref_out, ref_lse = case.reference()
    out, lse = w.run(case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, return_lse=True)
    _assert_equal(out, ref_out, "output (legacy form)")
    _assert_equal(lse, ref_lse, "lse (legacy form)")
    out2 = w.run(query=(case.q_nope, case.q_pe), kv_cache=(case.ckv_cache, case.kpe_cache))
    _assert_equal(out2, ref_out, "output (structural form)")
    _, lse_e = w.run(case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, return_lse=True,
                     return_lse_base_on_e=True)
    _assert_equal(lse_e, reference.mla_paged_prefill_ref(*case.inputs(), natural_lse=True)[1], "natural lse")


def test_mla_metadata_object_and_decode_without_causal(entry_calls):
    case = _mla_case(q_lens=(1, 1, 0), kv_lens=(5, 9, 3), seed=4)
    w = BatchMLAPagedAttentionWrapper(_workspace())
    # MLAPlanMetadata.csr(...) carries these four (and None for the dense fields)
    meta = types.SimpleNamespace(qo_indptr=case.qo_indptr, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices,
                                 kv_len_arr=_kv_len_arr(case), cum_seq_lens_q=None, block_tables=None, seq_lens=None)
    w.plan(metadata=meta, num_heads=4, head_dim_ckv=32, head_dim_kpe=16, page_size=1, causal=False,
           sm_scale=case.sm_scale, q_data_type=BF16, kv_data_type=BF16, query_layout="split",
           kv_cache_layout="split", lse_mode="base2")
    out, lse = w.run(query=(case.q_nope, case.q_pe), kv_cache=(case.ckv_cache, case.kpe_cache), return_lse=True)
    # one query per request: the causal kernel's answer is the non-causal one
    ref_out, ref_lse = reference.mla_paged_prefill_ref(*case.inputs(), causal=False)
    _assert_equal(out, ref_out, "output")
    _assert_equal(lse, ref_lse, "lse")


@pytest.mark.parametrize("page_size", [16, 64])
def test_mla_paged_cache_gives_the_reference(entry_calls, page_size):
    # requests ending mid-page, on a page boundary, and without keys
    case = testing.make_mla_prefill_case([1, 4, 2, 0], [5, 2 * page_size, 70, 0], num_heads=4, ckv_dim=32,
                                         kpe_dim=16, page_size=page_size, seed=7)
    kv_len_arr = torch.tensor(case.kv_lens, dtype=torch.int32)
    w = BatchMLAPagedAttentionWrapper(_workspace())
    w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, kv_len_arr, 4, 32, 16, page_size, True, case.sm_scale,
           BF16, BF16)
    out, lse = w.run(case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, return_lse=True)
    assert torch.equal(entry_calls[-1].inputs[7], case.kv_last_page_len)  # derived from kv_len_arr
    ref_out, ref_lse = case.reference()
    _assert_equal(out, ref_out, "output")
    _assert_equal(lse, ref_lse, "lse")
    with pytest.raises(ValueError, match="must be 16 as planned" if page_size == 16 else "must be 64 as planned"):
        w.run(case.q_nope, case.q_pe, case.ckv_cache[:, :1].contiguous(), case.kpe_cache[:, :1].contiguous())
    bad = kv_len_arr.clone()
    bad[1] += page_size  # one page more than the request holds
    with pytest.raises(ValueError, match=r"kv_len_arr\[1\]"):
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, bad, 4, 32, 16, page_size, True, case.sm_scale,
               BF16, BF16)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mla"])
def test_real_entry_accepts_what_the_wrapper_passes(kind):
    """No stand-in: the entry point's validation must pass (combined KV views included) up to the device rule."""
    w, case, run_inputs = _planned(kind)
    if kind != "mla":
        run_inputs = (run_inputs[0], torch.stack(run_inputs[1], dim=1))
    with pytest.raises(ValueError, match="CUDA device"):
        w.run(*run_inputs, return_lse=True)


# ---------------------------------------------------------------------------------------------
# What is not supported raises NotImplementedError naming the argument and its value
# ---------------------------------------------------------------------------------------------
_T = torch.zeros(3, dtype=torch.int32)

UNSUPPORTED_INIT = [
    ("decode", dict(kv_layout="HND")), ("decode", dict(jit_args=[1])),
    ("prefill", dict(kv_layout="HND")), ("prefill", dict(use_cuda_graph=True)),
    ("prefill", dict(custom_mask_buf=_T)), ("prefill", dict(mask_indptr_buf=_T)), ("prefill", dict(jit_args=[1])),
    ("prefill", dict(jit_kwargs={"a": 1})), ("prefill", dict(variant_owns_mask=True)),
]

UNSUPPORTED_PLAN = [
    ("decode", dict(pos_encoding_mode="ROPE_LLAMA")), ("decode", dict(window_left=128)),
    ("decode", dict(logits_soft_cap=30.0)), ("decode", dict(q_data_type=torch.float16)),
    ("decode", dict(kv_data_type=torch.float8_e4m3fn)), ("decode", dict(o_data_type=torch.float32)),
    ("decode", dict(block_tables=_T)), ("decode", dict(seq_lens=_T)), ("decode", dict(fixed_split_size=4)),
    ("decode", dict(disable_split_kv=True)), ("decode", dict(q_len_per_req=2)), ("decode", dict(window_right=-1)),
    ("decode", dict(is_causal=True)),
    ("prefill", dict(causal=False)), ("prefill", dict(custom_mask=_T)), ("prefill", dict(packed_custom_mask=_T)),
    ("prefill", dict(pos_encoding_mode="ALIBI")), ("prefill", dict(use_fp16_qk_reduction=True)),
    ("prefill", dict(window_left=64)), ("prefill", dict(logits_soft_cap=50.0)),
    ("prefill", dict(q_data_type="float16")), ("prefill", dict(kv_data_type=torch.float8_e5m2)),
    ("prefill", dict(head_dim_vo=32)), ("prefill", dict(prefix_len_ptr=_T)),
    ("prefill", dict(token_pos_in_items_ptr=_T)), ("prefill", dict(token_pos_in_items_len=3)),
    ("prefill", dict(max_item_len_ptr=_T)), ("prefill", dict(seq_lens=_T)), ("prefill", dict(seq_lens_q=_T)),
    ("prefill", dict(block_tables=_T)), ("prefill", dict(fixed_split_size=8)),
    ("prefill", dict(disable_split_kv=True)),
    ("mla", dict(page_size=12)), ("mla", dict(page_size=256)), ("mla", dict(causal=False)), ("mla", dict(use_profiler=True)),
    ("mla", dict(query_layout="packed")), ("mla", dict(kv_cache_layout="packed")),
    ("mla", dict(output_scale="per-tensor")), ("mla", dict(scale_mode="kv-per-tensor")),
    ("mla", dict(skip_softmax=True)), ("mla", dict(use_sinks=True)), ("mla", dict(q_data_type=torch.float16)),
    ("mla", dict(kv_data_type=torch.float8_e4m3fn)), ("mla", dict(output_dtype=torch.float16)),
    ("mla", dict(cum_seq_lens_q=_T)), ("mla", dict(block_tables=_T)), ("mla", dict(seq_lens=_T)),
]

UNSUPPORTED_RUN = [
    ("decode", dict(q_scale=0.5)), ("decode", dict(k_scale=2.0)), ("decode", dict(v_scale=0.25)),
    ("decode", dict(window_left=64)), ("decode", dict(sinks=_T)), ("decode", dict(q_len_per_req=2)),
    ("decode", dict(skip_softmax_threshold_scale_factor=1.0)), ("decode", dict(kv_cache_sf=_T)),
    ("prefill", dict(q_scale=2.0)), ("prefill", dict(lse_layout="HN")), ("prefill", dict(window_left=16)),
    ("prefill", dict(sinks=_T)), ("prefill", dict(kv_cache_sf=_T)),
    ("prefill", dict(skip_softmax_threshold_scale_factor=0.5)),
    ("mla", dict(profiler_buffer=_T)), ("mla", dict(kv_len=_T)), ("mla", dict(page_table=_T)),
    ("mla", dict(o_scale=1.0)), ("mla", dict(ckv_scale=1.0)), ("mla", dict(ckv_scale_arr=_T)),
    ("mla", dict(kpe_scale=1.0)), ("mla", dict(sinks=_T)), ("mla", dict(skip_softmax_threshold_scale_factor=1.0)),
    ("mla", dict(bmm1_scale=1.0)), ("mla", dict(bmm2_scale=1.0)),
]

_CLASSES = {"decode": BatchDecodeWithPagedKVCacheWrapper, "prefill": BatchPrefillWithPagedKVCacheWrapper,
            "mla": BatchMLAPagedAttentionWrapper}


def _named(exc_info, kw):
    (name, value), = kw.items()
    message = str(exc_info.value)
    assert name in message, message
    if not isinstance(value, (torch.Tensor, list, dict, torch.dtype)):
        assert repr(value) in message, message


def _id(case):
    kind, kw = case
    return f"{kind}-{next(iter(kw))}"


@pytest.mark.parametrize("case", UNSUPPORTED_INIT, ids=_id)
def test_unsupported_constructor_arguments(case):
    kind, kw = case
    with pytest.raises(NotImplementedError) as exc_info:
        _CLASSES[kind](_workspace(), **kw)
    _named(exc_info, kw)


@pytest.mark.parametrize("case", UNSUPPORTED_PLAN, ids=_id)
def test_unsupported_plan_arguments(case):
    kind, kw = case
    _planned(kind)  # the same call without the override plans fine
    with pytest.raises(NotImplementedError) as exc_info:
        _planned(kind, **kw)
    _named(exc_info, kw)


@pytest.mark.parametrize("case", UNSUPPORTED_RUN, ids=_id)
def test_unsupported_run_arguments(case, entry_calls):
    kind, kw = case
    w, _, run_inputs = _planned(kind)
    w.run(*run_inputs)  # the same call without the override runs fine
    with pytest.raises(NotImplementedError) as exc_info:
        w.run(*run_inputs, **kw)
    _named(exc_info, kw)


def test_prefill_default_causal_false_is_rejected():
    case = _prefill_case()
    w = BatchPrefillWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(NotImplementedError, match="causal=False"):
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len, 4, 2, 64, 16,
               q_data_type=BF16)


def test_default_q_data_type_float16_is_rejected():
    """FlashInfer plans for float16 unless told: a bf16 engine passes q_data_type, as it must with FlashInfer."""
    case = _decode_case()
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(NotImplementedError, match="q_data_type='float16'"):
        w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, 8, 2, 64, 16)


def test_custom_kernel_positional_run_arguments_are_rejected(entry_calls):
    for kind in ("decode", "prefill"):
        w, _, (q, kv) = _planned(kind)
        with pytest.raises(NotImplementedError, match=r"\*args"):
            w.run(q, kv, torch.zeros(1))


@pytest.mark.parametrize("which", ["query", "kv_cache"])
def test_mla_packed_structural_inputs_are_rejected(which, entry_calls):
    w, case, _ = _planned("mla")
    query = torch.cat((case.q_nope, case.q_pe), dim=-1) if which == "query" else (case.q_nope, case.q_pe)
    kv = torch.cat((case.ckv_cache, case.kpe_cache), dim=-1) if which == "kv_cache" else (case.ckv_cache,
                                                                                         case.kpe_cache)
    with pytest.raises(NotImplementedError, match=f"{which}=<packed tensor"):
        w.run(query=query, kv_cache=kv)


def test_mla_dense_metadata_is_rejected():
    case = _mla_case()
    w = BatchMLAPagedAttentionWrapper(_workspace())
    meta = types.SimpleNamespace(cum_seq_lens_q=case.qo_indptr, block_tables=_T.view(1, 3), seq_lens=_T)
    with pytest.raises(NotImplementedError, match="metadata=.*block_tables"):
        w.plan(metadata=meta, num_heads=4, head_dim_ckv=32, head_dim_kpe=16, page_size=1, causal=True,
               sm_scale=0.1, q_data_type=BF16, kv_data_type=BF16)


# ---------------------------------------------------------------------------------------------
# plan() checks its arguments; run() needs a successful plan() and the planned shapes
# ---------------------------------------------------------------------------------------------
def _decode_plan_call(**changes):
    case = _decode_case()
    args = dict(indptr=case.kv_indptr, indices=case.kv_indices, last_page_len=case.kv_last_page_len,
                num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, q_data_type=BF16) | changes
    BatchDecodeWithPagedKVCacheWrapper(_workspace()).plan(**args)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("changes, error, match", [
    (dict(indptr=_i32(1, 5, 5, 14, 15)), ValueError, r"indptr\[0\] must be 0"),
    (dict(indptr=_i32(0, 5, 4, 14, 15)), ValueError, "non-decreasing"),
    (dict(indptr=_i32(0, 5, 5, 14)), ValueError, "last_page_len must have batch_size"),
    (dict(indices=torch.arange(14, dtype=torch.int32)), ValueError,
     r"indptr\[-1\] \(15\) must be at most len\(indices\) \(14\)"),  # longer is fine (engines pad it)
    (dict(last_page_len=_i32(6, 0, 2, 0)), ValueError, r"last_page_len\[3\] = 0 must be in 1..page_size"),
    (dict(last_page_len=_i32(17, 0, 2, 16)), ValueError, r"last_page_len\[0\] = 17"),
    (dict(indices=torch.full((15,), -1, dtype=torch.int32)), ValueError, "negative page id"),
    (dict(indices=torch.zeros(15)), TypeError, "indices must hold integers"),
    (dict(indptr=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "indptr must be 1-D"),
    (dict(indptr=[0, 5]), TypeError, "indptr must be a torch.Tensor"),
    (dict(num_qo_heads=7), ValueError, "multiple of num_kv_heads"),
    (dict(page_size=0), ValueError, "page_size must be >= 1"),
    (dict(head_dim=64.0), TypeError, "head_dim must be an int"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale must be finite and > 0"),
    (dict(q_data_type="no_such_dtype"), TypeError, "q_data_type must be a torch.dtype"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_decode_plan_checks_its_arguments(changes, error, match):
    _decode_plan_call()  # the unchanged call plans fine
    with pytest.raises(error, match=match):
        _decode_plan_call(**changes)


def test_prefill_plan_checks_the_query_indptr():
    case = _prefill_case()
    w = BatchPrefillWithPagedKVCacheWrapper(_workspace())
    plan = lambda qo: w.plan(qo, case.kv_indptr, case.kv_indices, case.kv_last_page_len, 4, 2, 64, 16,  # noqa: E731
                             causal=True, q_data_type=BF16)
    plan(case.qo_indptr)
    with pytest.raises(ValueError, match="qo_indptr must have batch_size \\+ 1 = 4 entries"):
        plan(_i32(0, 3, 20))
    with pytest.raises(ValueError, match="qo_indptr must be non-decreasing"):
        plan(_i32(0, 3, 2, 20))


def test_mla_plan_checks_its_arguments():
    case = _mla_case()
    w = BatchMLAPagedAttentionWrapper(_workspace())
    common = dict(num_heads=4, head_dim_ckv=32, head_dim_kpe=16, page_size=1, causal=True, sm_scale=0.1,
                  q_data_type=BF16, kv_data_type=BF16)
    csr = (case.qo_indptr, case.kv_indptr, case.kv_indices)
    w.plan(*csr, _kv_len_arr(case), **common)
    with pytest.raises(ValueError, match=r"kv_len_arr\[1\] = 10 must equal request 1's page count \(9\)"):
        w.plan(*csr, _i32(5, 10), **common)
    with pytest.raises(TypeError, match="missing required argument.*sm_scale"):
        w.plan(*csr, _kv_len_arr(case), **(common | dict(sm_scale=None)))
    with pytest.raises(TypeError, match="not both"):
        w.plan(*csr, _kv_len_arr(case), metadata=types.SimpleNamespace(), **common)
    with pytest.raises(TypeError, match="causal must be a bool"):
        w.plan(*csr, _kv_len_arr(case), **(common | dict(causal=1)))


@pytest.mark.parametrize("kind", ["decode", "prefill", "mla"])
def test_run_before_plan_raises(kind):
    w = _CLASSES[kind](_workspace())
    with pytest.raises(RuntimeError, match=r"before a successful plan\(\)"):
        w.run(torch.zeros(1), torch.zeros(1))


def test_failed_plan_leaves_no_stale_batch(entry_calls):
    w, case, (q, kv) = _planned("decode")
    with pytest.raises(NotImplementedError):
        w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, 8, 2, 64, 16, q_data_type=torch.float16)
    with pytest.raises(RuntimeError, match="successful plan"):
        w.run(q, kv)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_run_checks_the_planned_shapes(kind, entry_calls):
    w, _, (q, (k, v)) = _planned(kind)
    with pytest.raises(ValueError, match="q must be"):
        w.run(q[:, :2], (k, v))
    with pytest.raises(ValueError, match="k_cache pages must be"):
        w.run(q, (k[:, :8], v))
    with pytest.raises(ValueError, match="combined paged_kv_cache"):
        w.run(q, torch.stack((k, v, v), dim=1))


def test_mla_run_checks_the_planned_shapes(entry_calls):
    w, case, _ = _planned("mla")
    with pytest.raises(ValueError, match="q_nope must be"):
        w.run(case.q_nope[:, :2], case.q_pe[:, :2], case.ckv_cache, case.kpe_cache)
    with pytest.raises(TypeError, match="q_pe must be a torch.Tensor"):
        w.run(case.q_nope, None, case.ckv_cache, case.kpe_cache)


def test_constructor_needs_a_workspace_tensor():
    for cls in _CLASSES.values():
        with pytest.raises(TypeError, match="float_workspace_buffer must be a torch.Tensor"):
            cls(None)
    with pytest.raises(ValueError, match="kv_layout must be"):
        BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NDH")

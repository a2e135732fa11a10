"""Every validation rule fires with a readable error; malformed inputs never escape as other exceptions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn import testing, validate
from cute_attn.ops import get_spec, kinds


def prefill_args(**over):
    case = testing.make_gqa_prefill_case([3, 0, 5], [7, 2, 5], num_qo_heads=8, num_kv_heads=2, head_dim=16,
                                         page_size=4)
    out, lse = case.new_outputs()
    args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, qo_indptr=case.qo_indptr,
                kv_indptr=case.kv_indptr, kv_indices=case.kv_indices, kv_last_page_len=case.kv_last_page_len,
                sm_scale=case.sm_scale, output=out, lse=lse)
    args.update(over)
    return args


def decode_args(**over):
    case = testing.make_gqa_decode_case([7, 0, 65], num_qo_heads=10, num_kv_heads=2, head_dim=16, page_size=8)
    out, lse = case.new_outputs()
    args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, kv_indptr=case.kv_indptr,
                kv_indices=case.kv_indices, kv_last_page_len=case.kv_last_page_len, sm_scale=case.sm_scale,
                output=out, lse=lse)
    args.update(over)
    return args


def mla_args(**over):
    case = testing.make_mla_prefill_case([2, 3], [4, 3], num_heads=4, ckv_dim=16, kpe_dim=8)
    out, lse = case.new_outputs()
    args = dict(q_nope=case.q_nope, q_pe=case.q_pe, ckv_cache=case.ckv_cache, kpe_cache=case.kpe_cache,
                qo_indptr=case.qo_indptr, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices,
                sm_scale=case.sm_scale, output=out, lse=lse)
    args.update(over)
    return args


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def test_valid_inputs_pass_and_describe_the_problem():
    problem, host = validate.check_gqa_paged_prefill(**prefill_args())
    assert (problem.batch_size, problem.total_q, problem.group_size, problem.page_size) == (3, 8, 4, 4)
    assert host.kv_lens.tolist() == [7, 2, 5]
    problem, host = validate.check_gqa_paged_decode(**decode_args())
    assert (problem.batch_size, problem.group_size) == (3, 5) and host.kv_lens.tolist() == [7, 0, 65]
    problem, host = validate.check_mla_paged_prefill(**mla_args())
    assert (problem.head_dim_qk, problem.head_dim_v) == (24, 16) and host.kv_lens.tolist() == [4, 3]


def test_strided_page_views_of_one_kv_tensor_are_accepted():
    base = prefill_args()
    pages, ps, heads, dim = base["k_cache"].shape
    kv = torch.zeros(pages, 2, ps, heads, dim, dtype=torch.bfloat16)
    kv[:, 0], kv[:, 1] = base["k_cache"], base["v_cache"]
    problem, _ = validate.check_gqa_paged_prefill(**prefill_args(k_cache=kv[:, 0], v_cache=kv[:, 1]))
    assert problem.num_pages == pages


def test_index_checks_can_be_skipped():
    bad = prefill_args(kv_indices=torch.full((5,), 999, dtype=torch.int32))
    with pytest.raises(ValueError):
        validate.check_gqa_paged_prefill(**bad)
    _, host = validate.check_gqa_paged_prefill(**bad, check_indices=False)
    assert host is None


PREFILL_RULES = [
    (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.zeros(8, 8, 16)), TypeError, "q must have dtype torch.bfloat16"),
    (dict(q=torch.zeros(8, 8, 16, 1, dtype=torch.bfloat16)), ValueError, "q must be 3-D"),
    (dict(q=torch.zeros(16, 8, 8, dtype=torch.bfloat16).transpose(0, 2)), ValueError, "q must be contiguous"),
    (dict(q=torch.zeros(8, 8, 32, dtype=torch.bfloat16)), ValueError, r"q.shape\[2\] must equal the caches' head_dim"),
    (dict(q=torch.zeros(8, 7, 16, dtype=torch.bfloat16)), ValueError, r"query heads \(7\) must be a multiple of kv heads \(2\)"),
    (dict(v_cache=torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)), ValueError, "k_cache and v_cache must have one shape"),
    (dict(k_cache=torch.zeros(7, 16, 2, 4, dtype=torch.bfloat16).transpose(1, 3)), ValueError,
     "k_cache must have compact pages"),
    (dict(k_cache=torch.zeros(7, 4 * 2 * 16 + 4, dtype=torch.bfloat16)[:, :128].view(7, 4, 2, 16)), ValueError,
     r"page stride that is a multiple of 8 elements \(16 bytes\)"),
    (dict(v_cache=torch.zeros(7, 4, 2, 16)), TypeError, "v_cache must have dtype torch.bfloat16"),
    (dict(qo_indptr=torch.tensor([0, 3, 3, 8])), TypeError, "qo_indptr must have dtype torch.int32"),
    (dict(qo_indptr=i32(0, 3, 8)), ValueError, r"qo_indptr.shape\[0\] must equal len\(kv_indptr\)"),
    (dict(qo_indptr=i32(1, 3, 3, 8)), ValueError, r"qo_indptr\[0\] must be 0"),
    (dict(qo_indptr=i32(0, 4, 3, 8)), ValueError, "qo_indptr must be non-decreasing"),
    (dict(qo_indptr=i32(0, 3, 3, 7)), ValueError, r"qo_indptr\[-1\] \(7\) must equal total_q"),
    (dict(kv_indptr=i32(0, 2, 3, 9)), ValueError, r"kv_indptr\[-1\] \(9\) must be at most len\(kv_indices\)"),
    (dict(kv_indptr=i32(0, 3, 2, 5)), ValueError, "kv_indptr must be non-decreasing"),
    (dict(kv_indices=i32(0, 1, 2, 3, -1)), ValueError, "kv_indices holds page id -1"),
    (dict(kv_indices=i32(0, 1, 2, 3, 10**6)), ValueError, r"kv_indices holds page id 1000000, outside \[0,"),
    (dict(kv_last_page_len=i32(3, 0, 1)), ValueError, r"kv_last_page_len\[1\] = 0 must be in 1..page_size"),
    (dict(kv_last_page_len=i32(3, 5, 1)), ValueError, r"kv_last_page_len\[1\] = 5 must be in 1..page_size \(4\)"),
    (dict(kv_last_page_len=i32(3, 2)), ValueError, r"kv_last_page_len.shape\[0\] must equal batch_size"),
    (dict(sm_scale=0.0), ValueError, "sm_scale must be finite and > 0"),
    (dict(sm_scale=math.nan), ValueError, "sm_scale must be finite and > 0"),
    (dict(sm_scale=math.inf), ValueError, "sm_scale must be finite and > 0"),
    (dict(sm_scale="0.1"), TypeError, "sm_scale must be a real number"),
    (dict(sm_scale=True), TypeError, "sm_scale must be a real number"),
    (dict(output=torch.zeros(8, 8, 16, dtype=torch.bfloat16), lse=None), ValueError, "must be passed together"),
    (dict(output=torch.zeros(8, 8, 16)), TypeError, "output must have dtype torch.bfloat16"),
    (dict(output=torch.zeros(9, 8, 16, dtype=torch.bfloat16)), ValueError, r"output must have shape \(8, 8, 16\)"),
    (dict(lse=torch.zeros(8, 8, dtype=torch.bfloat16)), TypeError, "lse must have dtype torch.float32"),
    (dict(lse=torch.zeros(8, 4)), ValueError, r"lse must have shape \(8, 8\)"),
]


@pytest.mark.parametrize("change,exc,message", PREFILL_RULES)
def test_prefill_rule(change, exc, message):
    with pytest.raises(exc, match=message):
        validate.check_gqa_paged_prefill(**prefill_args(**change))


DECODE_RULES = [
    (dict(q=torch.zeros(4, 10, 16, dtype=torch.bfloat16)), ValueError, r"q.shape\[0\] must equal batch_size"),
    (dict(q=torch.zeros(3, 7, 16, dtype=torch.bfloat16)), ValueError, r"query heads \(7\) must be a multiple"),
    (dict(kv_indptr=torch.zeros(0, dtype=torch.int32)), ValueError, "kv_indptr must have batch_size"),
    (dict(kv_last_page_len=i32(0, 0, 1)), ValueError,
     r"kv_last_page_len\[0\] = 0 must be in 1..page_size \(8\) for a request with pages \(0..page_size for one with none\)"),
    (dict(kv_last_page_len=i32(7, -1, 1)), ValueError, r"kv_last_page_len\[1\] = -1"),
    (dict(output=torch.zeros(3, 10, 8, dtype=torch.bfloat16)), ValueError, "output must have shape"),
]


def test_decode_zero_page_request_may_carry_any_last_len_in_range():
    validate.check_gqa_paged_decode(**decode_args(kv_last_page_len=i32(7, 8, 1)))


@pytest.mark.parametrize("change,exc,message", DECODE_RULES)
def test_decode_rule(change, exc, message):
    with pytest.raises(exc, match=message):
        validate.check_gqa_paged_decode(**decode_args(**change))


MLA_RULES = [
    (dict(q_pe=torch.zeros(5, 3, 8, dtype=torch.bfloat16)), ValueError, r"q_pe.shape\[:2\] must equal q_nope"),
    (dict(ckv_cache=torch.zeros(14, 2, 16, dtype=torch.bfloat16), kpe_cache=torch.zeros(14, 2, 8, dtype=torch.bfloat16)),
     ValueError, "kv_last_page_len is required at page_size 2"),
    (dict(ckv_cache=torch.zeros(10, 2, 16, dtype=torch.bfloat16)), ValueError, "kpe_cache must have shape"),
    (dict(ckv_cache=torch.zeros(14, 1, 32, dtype=torch.bfloat16)), ValueError, r"ckv_cache.shape\[2\] must equal"),
    (dict(kpe_cache=torch.zeros(14, 1, 4, dtype=torch.bfloat16)), ValueError, "kpe_cache must have shape"),
    (dict(kv_indptr=i32(0, 4)), ValueError, r"kv_indptr.shape\[0\] must equal len\(qo_indptr\)"),
    (dict(kv_indptr=i32(0, 4, 60)), ValueError, r"kv_indptr\[-1\] \(60\) must be at most len\(kv_indices\)"),
    (dict(kv_indices=i32(0, 1, 2, 3, 4, 5, 99)), ValueError, "kv_indices holds token row id 99"),
    (dict(qo_indptr=i32(0, 2, 4)), ValueError, r"qo_indptr\[-1\] \(4\) must equal total_q"),
    (dict(sm_scale=-0.1), ValueError, "sm_scale must be finite and > 0"),
    (dict(lse=torch.zeros(5, 4, dtype=torch.float64)), TypeError, "lse must have dtype torch.float32"),
]


@pytest.mark.parametrize("change,exc,message", MLA_RULES)
def test_mla_rule(change, exc, message):
    with pytest.raises(exc, match=message):
        validate.check_mla_paged_prefill(**mla_args(**change))


def paged_mla_args(**over):
    """A page-size-4 MLA batch (request 1 ends mid-page, request 2 has no page) in the ps64 order."""
    case = testing.make_mla_prefill_case([2, 3, 1], [6, 4, 0], num_heads=4, ckv_dim=16, kpe_dim=8, page_size=4)
    out, lse = case.new_outputs()
    args = dict(q_nope=case.q_nope, q_pe=case.q_pe, ckv_cache=case.ckv_cache, kpe_cache=case.kpe_cache,
                qo_indptr=case.qo_indptr, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices,
                kv_last_page_len=case.kv_last_page_len, sm_scale=case.sm_scale, output=out, lse=lse)
    args.update(over)
    return args


def test_paged_mla_inputs_pass_and_give_kv_lens_from_pages():
    problem, host = validate.check_mla_paged_prefill(**paged_mla_args())
    assert problem.page_size == 4 and host.kv_lens.tolist() == [6, 4, 0] and host.kv_indptr.tolist() == [0, 2, 3, 3]
    # the ps1 order positionally: a number where kv_last_page_len goes is sm_scale
    ps1 = mla_args()
    problem, host = validate.check_mla_paged_prefill(*list(ps1.values())[:7], ps1["sm_scale"], ps1["output"],
                                                     ps1["lse"])
    assert problem.page_size == 1 and host.kv_lens.tolist() == [4, 3]
    # and page size 1 with kv_last_page_len (ones; 0 for a request without keys) means the same
    problem, host = validate.check_mla_paged_prefill(**mla_args(kv_last_page_len=i32(1, 1)))
    assert host.kv_lens.tolist() == [4, 3]


PAGED_MLA_RULES = [
    (dict(kv_last_page_len=i32(4, 4)), ValueError, r"kv_last_page_len.shape\[0\] must equal batch_size"),
    (dict(kv_last_page_len=torch.tensor([4, 4, 0], dtype=torch.int64)), TypeError, "kv_last_page_len must have dtype"),
    (dict(kv_last_page_len=i32(2, 5, 0)), ValueError, r"kv_last_page_len\[1\] = 5 must be in 1..page_size \(4\)"),
    (dict(kv_last_page_len=i32(0, 4, 0)), ValueError, r"kv_last_page_len\[0\] = 0 must be in 1..page_size"),
    (dict(kv_indices=i32(0, 1, -1)), ValueError, "kv_indices holds page id -1"),
    (dict(kpe_cache=torch.zeros(4, 2, 8, dtype=torch.bfloat16)), ValueError, "kpe_cache must have shape"),
]


@pytest.mark.parametrize("change,exc,message", PAGED_MLA_RULES)
def test_paged_mla_rule(change, exc, message):
    with pytest.raises(exc, match=message):
        validate.check_mla_paged_prefill(**paged_mla_args(**change))


# ---------------------------------------------------------------------------------------------
# Fuzz: any malformed input is a ValueError or TypeError, never another exception
# ---------------------------------------------------------------------------------------------
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.bool]
NASTY_SCALARS = [0.0, -1.0, math.nan, math.inf, 1e-30, 1e30, "x", None, True, 3, 0.125]


@st.composite
def mutated_tensor(draw, template):
    kind = draw(st.sampled_from(["keep", "dtype", "shape", "values", "noncontig", "nontensor", "empty"]))
    if kind == "keep" or not isinstance(template, torch.Tensor):
        return template
    if kind == "dtype":
        return template.to(draw(st.sampled_from(DTYPES)))
    if kind == "shape":
        dims = draw(st.lists(st.integers(0, 9), min_size=0, max_size=5))
        return torch.zeros(dims, dtype=template.dtype)
    if kind == "values":
        if template.dtype == torch.int32 and template.numel():
            vals = draw(st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(-3, 20),
                                 min_size=template.numel(), max_size=template.numel()))
            return torch.tensor(vals, dtype=torch.int32).reshape(template.shape)
        return torch.full_like(template, draw(st.sampled_from([math.nan, math.inf, -1.0, 0.0])))
    if kind == "noncontig" and template.dim() >= 1 and template.shape[0] > 1:
        return torch.cat([template, template]).view(-1, *template.shape[1:])[::2] if template.dim() == 1 else template.transpose(0, -1)
    if kind == "nontensor":
        return draw(st.sampled_from([None, 3, [0, 1], "tensor"]))
    return template[:0]


def _fuzz(draw_fn, base, check):
    args = dict(base)
    names = list(args)
    for name in draw_fn(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        if name == "sm_scale":
            args[name] = draw_fn(st.sampled_from(NASTY_SCALARS))
        else:
            args[name] = draw_fn(mutated_tensor(args[name]))
    try:
        check(**args)
    except (ValueError, TypeError):
        pass


# thousands of malformed inputs per entry even in the CI profile: each example costs microseconds
FUZZ = settings(settings.default, max_examples=max(1000, settings.default.max_examples))


@FUZZ
@given(st.data())
def test_fuzz_prefill_rejects_only_with_value_or_type_errors(data):
    _fuzz(data.draw, prefill_args(), validate.check_gqa_paged_prefill)


@FUZZ
@given(st.data())
def test_fuzz_decode_rejects_only_with_value_or_type_errors(data):
    _fuzz(data.draw, decode_args(), validate.check_gqa_paged_decode)


@FUZZ
@given(st.data())
def test_fuzz_mla_rejects_only_with_value_or_type_errors(data):
    _fuzz(data.draw, mla_args(), validate.check_mla_paged_prefill)


def test_devices_are_compared_whole():
    # get_device() is -1 for both cpu and meta: the rule compares torch.device objects
    with pytest.raises(ValueError, match="all tensors must be on one device: q is on cpu, k_cache on meta"):
        validate.check_gqa_paged_decode(**decode_args(k_cache=decode_args()["k_cache"].to("meta")))


# ---------------------------------------------------------------------------------------------
# The API's fast path skips these rules for a call that matches an earlier one (api._signature): every
# rule above must be impossible to break while keeping that match
# ---------------------------------------------------------------------------------------------
def _fast_path_view(check, args):
    """What a fast-path hit compares: index identities, the scale, output presence, the signature."""
    from cute_attn import api

    kind = next(k for k in map(get_spec, kinds()) if k.check is check)
    inputs = tuple(v for name, v in args.items() if name not in ("output", "lse"))
    index = [v for name, v in args.items() if name.endswith(("indptr", "indices", "page_len"))]
    scale = args["sm_scale"]
    try:
        sig = api._signature(kind, inputs, args["output"], args["lse"])
    except Exception:
        sig = "no fast path"
    return [id(t) for t in index], (scale.__class__, scale), args["output"] is None, args["lse"] is None, sig


@pytest.mark.parametrize("check,base,change", [
    *[(validate.check_gqa_paged_prefill, prefill_args, c) for c, _, _ in PREFILL_RULES],
    *[(validate.check_gqa_paged_decode, decode_args, c) for c, _, _ in DECODE_RULES],
    *[(validate.check_mla_paged_prefill, mla_args, c) for c, _, _ in MLA_RULES],
])
def test_no_rule_can_be_broken_behind_the_fast_path(check, base, change):
    args = base()
    broken = dict(args, **change)
    assert _fast_path_view(check, args) != _fast_path_view(check, broken)

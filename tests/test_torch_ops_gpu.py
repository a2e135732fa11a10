"""The ``torch.ops.cute_attn`` custom ops on a GPU: opcheck, torch.compile, against the fp32 reference.

Cases come from ``cute_attn.testing`` (shuffled NaN-poisoned pools, NaN-prefilled outputs) at the
definitions' shapes: decode 20/4 heads, prefill 32/4 (d 128, page 64), MLA 16 heads ckv 512 + kpe 64,
page 1. Small on purpose: the first use of each kernel config compiles it (~20-60 s), and each
``torch.compile`` costs Inductor's compile on top.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cute_attn import testing, torch_ops  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KINDS = ("gqa_paged_prefill", "gqa_paged_decode", "mla_paged_prefill")
LN_2 = math.log(2.0)


@pytest.fixture(autouse=True)
def _fresh_state():
    import cute_attn
    from cute_attn.compile import import_all_kernels

    import_all_kernels()  # find_launcher imports them only when none is registered yet
    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _case(kind: str, seed: int = 0, lengths=None):
    if kind == "gqa_paged_prefill":
        q_lens, kv_lens = lengths or ([33, 1, 130], [200, 64, 130])
        return testing.make_gqa_prefill_case(q_lens, kv_lens, device="cuda", seed=seed, extra_pages=3)
    if kind == "gqa_paged_decode":
        # 3232 keys (the seed shape) split over CTAs: the kernel's fused merge runs too
        return testing.make_gqa_decode_case(lengths or [3232, 70, 1], device="cuda", seed=seed, extra_pages=3)
    q_lens, kv_lens = lengths or ([5, 1, 40], [40, 7, 90])
    # page size 64 (the ps64 order); a fixed pool size keeps the shapes of _SAME_SHAPES' batch
    return testing.make_mla_prefill_case(q_lens, kv_lens, device="cuda", seed=seed, page_size=64, num_pages=12)


# the same tensor shapes as _case(kind) with other lengths: a new batch a compiled graph must not recompile for
_SAME_SHAPES = {"gqa_paged_prefill": ([30, 4, 130], [250, 60, 131]), "gqa_paged_decode": [3201, 65, 64],
                "mla_paged_prefill": ([6, 2, 38], [41, 9, 87])}


def _op(kind: str):
    return getattr(torch.ops.cute_attn, kind).default


def _check(case, out, lse, natural_lse=False, what=""):
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, f"output{what}")
    testing.assert_close_benchmark(lse, ref_lse * LN_2 if natural_lse else ref_lse, f"lse{what}")


# ---------------------------------------------------------------------------------------------
# (c) the ops and the wrappers against the reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("natural_lse", [False, True], ids=["log2", "ln"])
@pytest.mark.parametrize("kind", KINDS)
def test_op_writes_the_reference_in_place(kind, natural_lse):
    case = _case(kind)
    out, lse = case.new_outputs()
    assert _op(kind)(*case.inputs(), out, lse, natural_lse) is None
    torch.cuda.synchronize()
    _check(case, out, lse, natural_lse)
    # the wrapper in eager code takes the entry point's own path: the same kernel and plan, so the same bits
    wrapped_out, wrapped_lse = getattr(torch_ops, kind)(*case.inputs(), natural_lse=natural_lse)
    torch.cuda.synchronize()
    assert torch.equal(wrapped_out, out) and torch.equal(wrapped_lse, lse)


def test_wrapper_under_inference_mode():
    """Inference tensors have no version counter (the entry points' plan cache reads it): the op serves them."""
    case = _case("gqa_paged_decode")
    with torch.inference_mode():
        inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in case.inputs()]
        assert inputs[0].is_inference()
        out, lse = torch_ops.gqa_paged_decode(*inputs)
    torch.cuda.synchronize()
    _check(case, out, lse)


# ---------------------------------------------------------------------------------------------
# (a) opcheck: schema (only output and lse written), fake vs real, AOT dispatch with dynamic shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_opcheck(kind):
    case = _case(kind)
    results = torch.library.opcheck(_op(kind), (*case.inputs(), *case.new_outputs()))
    assert set(results.values()) == {"SUCCESS"}, results


# ---------------------------------------------------------------------------------------------
# (b) torch.compile of a module that calls the ops
# ---------------------------------------------------------------------------------------------
class _AttendThenProject(torch.nn.Module):
    """One attention op, then a matmul on its output: what a model's attention block does."""

    def __init__(self, kind: str, sm_scale: float, weight: torch.Tensor):
        super().__init__()
        self.kind, self.sm_scale, self.weight = kind, sm_scale, weight

    def forward(self, *tensors):
        out, lse = getattr(torch_ops, self.kind)(*tensors, self.sm_scale)
        return out, lse, out.flatten(1) @ self.weight


def _weight(case) -> torch.Tensor:
    out, _ = case.new_outputs()
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    return (torch.randn(out.shape[1] * out.shape[2], 16, generator=g, device="cuda") * 0.02).to(torch.bfloat16)


def _check_projection(y, out, weight, what):
    expected = out.float().flatten(1) @ weight.float()
    testing.assert_close_benchmark(y, expected, f"projection{what}")


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_module_is_one_graph_with_the_eager_result(kind):
    from torch._dynamo.testing import CompileCounterWithBackend

    case = _case(kind)
    weight = _weight(case)
    tensors = case.inputs()[:-1]
    module = _AttendThenProject(kind, case.sm_scale, weight)
    eager_out, eager_lse, _ = module(*tensors)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(module, backend=counter, fullgraph=True)  # fullgraph: a graph break raises
    out, lse, y = compiled(*tensors)
    torch.cuda.synchronize()
    _check(case, out, lse)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse), "compiled result differs from eager"
    _check_projection(y, out, weight, "")
    # a new batch of the same shapes: same graph, planned from its own index values
    other = _case(kind, seed=3, lengths=_SAME_SHAPES[kind])
    assert all(a.shape == b.shape for a, b in zip(other.inputs()[:-1], tensors))
    out, lse, y = compiled(*other.inputs()[:-1])
    torch.cuda.synchronize()
    _check(other, out, lse, what=" (second batch)")
    _check_projection(y, out, weight, " (second batch)")
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled"


class _TwoDecodesOverComputedLengths(torch.nn.Module):
    """Two decodes whose last-page lengths are computed in the graph, the second after the first call.

    The second depends on the first call's lse, so it is computed once the first lengths are dead:
    Inductor hands it their buffer (``bufN = bufM  # reuse``), the same tensor object with other values and
    an unchanged version counter. An op that matched index tensors by identity would reuse the first plan.
    """

    def __init__(self, sm_scale: float, page_size: int):
        super().__init__()
        self.sm_scale, self.page_size = sm_scale, page_size

    def forward(self, q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens_a, kv_lens_b):
        last_a = ((kv_lens_a - 1) % self.page_size + 1).to(torch.int32)
        out_a, lse_a = torch_ops.gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, last_a,
                                                  self.sm_scale)
        after_a = (lse_a[:, 0] * 0).to(torch.int64)  # finite lse: 0, but only once the first call has run
        last_b = ((kv_lens_b - 1) % self.page_size + 1 + after_a).to(torch.int32)
        out_b, lse_b = torch_ops.gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, last_b,
                                                  self.sm_scale)
        return out_a, lse_a, out_b, lse_b


def test_index_tensors_computed_in_the_graph_get_their_own_plan(monkeypatch):
    import dataclasses

    import cute_attn

    seen = []
    real_entry = cute_attn.gqa_paged_decode

    def recording_entry(*args, **options):
        last = args[5]
        seen.append((id(last), last.data_ptr(), last._version))
        return real_entry(*args, **options)

    monkeypatch.setattr(cute_attn, "gqa_paged_decode", recording_entry)
    # b's lengths keep a's page counts and stay inside a's unpoisoned slots: one pool serves both
    case_a = _case("gqa_paged_decode", seed=4, lengths=[3232, 128])
    lens_a, lens_b = [3232, 128], [3201, 65]
    case_b = dataclasses.replace(case_a, kv_last_page_len=torch.tensor([1, 1], dtype=torch.int32, device="cuda"),
                                 kv_lens=lens_b)
    model = torch.compile(_TwoDecodesOverComputedLengths(case_a.sm_scale, case_a.page_size), fullgraph=True)
    lengths = [torch.tensor(lens, device="cuda") for lens in (lens_a, lens_b)]
    out_a, lse_a, out_b, lse_b = model(case_a.q, case_a.k_cache, case_a.v_cache, case_a.kv_indptr,
                                       case_a.kv_indices, *lengths)
    torch.cuda.synchronize()
    _check(case_a, out_a, lse_a, what=" a")
    _check(case_b, out_b, lse_b, what=" b")
    assert len(seen) == 2
    if seen[0] != seen[1]:
        pytest.skip(f"results correct, but this Inductor gave the second lengths a new tensor ({seen}): "
                    "the identity hazard was not exercised")


def test_reduce_overhead_mode_never_replays_a_stale_plan():
    """The op is captured into Inductor's CUDA graphs; it plans on the GPU inside the graph, so every replayed
    batch (new lengths and page tables in the graph's static inputs) is right."""
    kind = "gqa_paged_decode"
    first = _case(kind)
    batches = [first, _case(kind, seed=3, lengths=_SAME_SHAPES[kind]), _case(kind, seed=5)]
    weight = _weight(first)
    compiled = torch.compile(_AttendThenProject(kind, first.sm_scale, weight), mode="reduce-overhead",
                             fullgraph=True)
    for step, case in enumerate(batches * 2):  # cudagraph trees warm up, then record, then replay
        torch.compiler.cudagraph_mark_step_begin()
        out, lse, y = (t.clone() for t in compiled(*case.inputs()[:-1]))  # graph outputs are overwritten
        torch.cuda.synchronize()
        _check(case, out, lse, what=f" (step {step})")
        _check_projection(y, out, weight, f" (step {step})")

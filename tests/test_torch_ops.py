"""The ``torch.ops.cute_attn`` custom ops on CPU: registration, schema, fake impls, tracing, plumbing.

The real impl needs a GPU (``test_torch_ops_gpu.py``). Here it runs only where a CPU stand-in replaces the
launch (``stand_in_launch``): the float32 reference written into the outputs, so ``torch.library.opcheck``
and Inductor can run the ops end to end.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_attn
from cute_attn import reference, testing, torch_ops, validate

REPO = Path(__file__).resolve().parents[1]
KINDS = ("gqa_paged_prefill", "gqa_paged_decode", "mla_paged_prefill", "gqa_paged_multi_token_decode")


def _case(kind: str, seed: int = 0):
    if kind == "gqa_paged_prefill":
        return testing.make_gqa_prefill_case([5, 0, 17], [70, 3, 200], seed=seed)
    if kind == "gqa_paged_decode":
        return testing.make_gqa_decode_case([70, 3, 200], seed=seed)
    if kind == "gqa_paged_multi_token_decode":
        return testing.make_gqa_multi_token_decode_case([4, 1, 8], [70, 3, 200], seed=seed)
    # page size 16, FlashInfer-Bench's ps64 order (kv_last_page_len before sm_scale): the op's full schema
    return testing.make_mla_prefill_case([5, 0, 9], [12, 3, 30], seed=seed, page_size=16)


def _op(kind: str):
    return getattr(torch.ops.cute_attn, kind).default


def _meta(values):
    return [v.to("meta") if isinstance(v, torch.Tensor) else v for v in values]


_REFERENCES = {"gqa_paged_prefill": reference.gqa_paged_prefill_ref,
               "gqa_paged_decode": reference.gqa_paged_decode_ref,
               "mla_paged_prefill": reference.mla_paged_prefill_ref,
               "gqa_paged_multi_token_decode": reference.gqa_paged_prefill_ref}


@pytest.fixture
def stand_in_launch(monkeypatch):
    """CPU stand-ins for the device rule and the public entry points; records every plan and launch."""
    calls = {"plans": [], "launches": [], "index_values": []}
    monkeypatch.setattr(torch_ops, "_require_cuda", lambda device: None)
    for kind in KINDS:
        def plan(*inputs, kind=kind):
            calls["plans"].append((kind, [t.tolist() for t in inputs if _is_index(t)]))
            return object()

        def launch(*args, kind=kind, **options):
            *inputs, output, lse = args
            calls["launches"].append((kind, options))
            calls["index_values"].append((kind, [t.tolist() for t in inputs if _is_index(t)]))
            ref_out, ref_lse = _REFERENCES[kind](*inputs)
            output.copy_(ref_out)
            lse.copy_(ref_lse)
            return output, lse

        monkeypatch.setattr(cute_attn, f"plan_{kind}", plan)
        monkeypatch.setattr(cute_attn, kind, launch)
    return calls


def _is_index(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.int32


# ---------------------------------------------------------------------------------------------
# Registration and schema
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_schema_is_the_entry_points_argument_order_with_mutated_outputs(kind):
    schema = _op(kind)._schema
    entry_params = list(inspect.signature(getattr(cute_attn, kind)).parameters)
    through_lse = entry_params[: entry_params.index("lse") + 1]
    assert [a.name for a in schema.arguments] == through_lse + ["natural_lse"]
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["output", "lse"]
    types = {a.name: str(a.type) for a in schema.arguments}
    assert types.pop("sm_scale") == "float" and types.pop("natural_lse") == "bool"
    if kind == "mla_paged_prefill":  # omitted at page size 1 (FlashInfer-Bench's ps1 order)
        assert types.pop("kv_last_page_len") == "Optional[Tensor]"
    assert set(types.values()) == {"Tensor"}
    natural_lse = schema.arguments[-1]
    assert natural_lse.default_value is False and not natural_lse.kwarg_only
    assert list(schema.returns) == []


@pytest.mark.parametrize("kind", KINDS)
def test_ops_may_be_captured_in_cuda_graphs(kind):
    # the op plans on the GPU inside its launch: a replayed capture re-plans from the index values of the replay
    unsafe = torch.Tag.__members__.get("cudagraph_unsafe")
    assert unsafe is None or unsafe not in _op(kind).tags


def test_package_import_registers_the_ops_without_the_dsl():
    code = ("import sys, torch, cute_attn\n"
            "print(hasattr(torch.ops.cute_attn, 'gqa_paged_decode'), 'cutlass' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "False"]


# ---------------------------------------------------------------------------------------------
# Fake impls: meta and fake tensors, shape rules
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_meta_tensors_go_through_the_fake_impl_only(kind, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("the real impl ran on meta tensors")

    monkeypatch.setattr(torch_ops, "_launch_device_planned", no_launch)
    case = _case(kind)
    inputs = _meta(case.inputs())
    out, lse = _meta(case.new_outputs())
    assert _op(kind)(*inputs, out, lse, True) is None
    got_out, got_lse = getattr(torch_ops, kind)(*inputs)
    ref_out, ref_lse = case.new_outputs()
    assert (got_out.device.type, got_out.shape, got_out.dtype) == ("meta", ref_out.shape, torch.bfloat16)
    assert (got_lse.device.type, got_lse.shape, got_lse.dtype) == ("meta", ref_lse.shape, torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_fake_tensors_trace_without_touching_data(kind):
    case = _case(kind)
    with FakeTensorMode() as mode:  # a fake tensor has no data: reading any raises
        inputs = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in case.inputs()]
        out, lse = getattr(torch_ops, kind)(*inputs)
    ref_out, ref_lse = case.new_outputs()
    assert out.__class__.__name__ == "FakeTensor" and out.shape == ref_out.shape and lse.shape == ref_lse.shape


def _bad_variants(kind: str, case):
    """(what, inputs, output, lse): one rule broken in each, on CPU tensors."""
    inputs = list(case.inputs())
    out, lse = case.new_outputs()
    names = [p for p in inspect.signature(getattr(cute_attn, kind)).parameters][: len(inputs)]
    at = {n: i for i, n in enumerate(names)}

    def swap(name, value):
        changed = list(inputs)
        changed[at[name]] = value
        return changed

    first = names[0]
    cache = "ckv_cache" if kind == "mla_paged_prefill" else "k_cache"
    index = "kv_indices"
    yield "q dtype", swap(first, inputs[0].float()), out, lse
    yield "q rank", swap(first, inputs[0][0]), out, lse
    yield "cache rank", swap(cache, inputs[at[cache]][0]), out, lse
    yield "cache head dim", swap(cache, inputs[at[cache]][..., :64].contiguous()), out, lse
    yield "index dtype", swap(index, inputs[at[index]].long()), out, lse
    yield "index rank", swap(index, inputs[at[index]][None]), out, lse
    yield "kv_indptr length", swap("kv_indptr", inputs[at["kv_indptr"]][:-1]), out, lse
    yield "output shape", inputs, out[:, :1], lse
    yield "output dtype", inputs, out.float(), lse
    yield "lse shape", inputs, out, lse[:-1]
    yield "lse dtype", inputs, out, lse.double()
    yield "output device", inputs, out.to("meta"), lse
    if kind != "mla_paged_prefill":
        yield "v_cache shape", swap("v_cache", inputs[at["v_cache"]][:, :, :1].contiguous()), out, lse
        yield "heads not a multiple", swap("q", inputs[0][:, :3].contiguous()), out[:, :3], lse[:, :3]
    else:
        yield "q_pe heads", swap("q_pe", inputs[1][:, :1].contiguous()), out, lse
        yield "kpe_cache pages", swap("kpe_cache", inputs[3][:-1]), out, lse
        yield "ckv page size", swap("ckv_cache", inputs[2][:, :8].contiguous()), out, lse
    yield "kv_last_page_len length", swap("kv_last_page_len", inputs[at["kv_last_page_len"]][:-1]), out, lse
    if kind == "gqa_paged_decode":
        yield "q batch", swap("q", inputs[0][:-1]), out[:-1], lse[:-1]
    else:
        yield "qo_indptr length", swap("qo_indptr", inputs[at["qo_indptr"]][:-1]), out, lse


@pytest.mark.parametrize("kind", KINDS)
def test_fake_rules_agree_with_validate(kind):
    """Every shape rule the fake impl holds raises what validate.py raises, naming the same argument."""
    check = getattr(validate, f"check_{kind}")
    case = _case(kind)
    inputs, (out, lse) = list(case.inputs()), case.new_outputs()
    check(*inputs, out, lse, check_indices=False)
    _op(kind)(*_meta(inputs), *_meta((out, lse)))
    variants = list(_bad_variants(kind, case))
    assert len(variants) >= 15
    for what, bad_inputs, bad_out, bad_lse in variants:
        with pytest.raises((TypeError, ValueError)) as want:
            check(*bad_inputs, bad_out, bad_lse, check_indices=False)
        # meta copies: the real impl cannot run, and none of these rules reads a value
        meta_out = bad_out if bad_out.device.type == "meta" else bad_out.to("meta")
        meta_inputs = _meta(bad_inputs)
        if what == "output device":  # the inputs on CPU, the output on meta
            meta_inputs = bad_inputs
        with pytest.raises((TypeError, ValueError)) as got:
            _op(kind)(*meta_inputs, meta_out, bad_lse if what == "output device" else bad_lse.to("meta"))
        assert got.type is want.type, f"{what}: fake raised {got.value!r}, validate {want.value!r}"
        assert str(got.value).split()[0] == str(want.value).split()[0], f"{what}: {got.value} vs {want.value}"


def test_bad_output_shape_names_the_expected_shape():
    case = _case("gqa_paged_decode")
    out, lse = _meta(case.new_outputs())
    with pytest.raises(ValueError, match=r"output must have shape \(3, 20, 128\), got \(3, 20, 64\)"):
        torch.ops.cute_attn.gqa_paged_decode(*_meta(case.inputs()), out[..., :64], lse)


def test_wrapper_wants_both_destinations_or_neither():
    case = _case("gqa_paged_decode")
    out, _ = _meta(case.new_outputs())
    with pytest.raises(ValueError, match="output and lse must be passed together"):
        torch_ops.gqa_paged_decode(*_meta(case.inputs()), out)


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_tensors_reach_the_device_rule(kind):
    case = _case(kind)
    with pytest.raises(ValueError, match="run on a CUDA device; the inputs are on cpu"):
        _op(kind)(*case.inputs(), *case.new_outputs())
    with pytest.raises(ValueError, match="run on a CUDA device; the inputs are on cpu"):
        getattr(torch_ops, kind)(*case.inputs())


# ---------------------------------------------------------------------------------------------
# Graph capture
# ---------------------------------------------------------------------------------------------
class _DecodeThenProject(torch.nn.Module):
    """Decode, then a matmul on its output: what a model's attention block does."""

    def __init__(self, sm_scale: float, weight: torch.Tensor):
        super().__init__()
        self.sm_scale = sm_scale
        self.weight = weight

    def forward(self, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len):
        out, lse = torch_ops.gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len,
                                              self.sm_scale)
        return out.flatten(1) @ self.weight, lse


def test_export_records_one_op_call_and_the_output_shapes():
    case = _case("gqa_paged_decode")
    weight = torch.ones(20 * 128, 8, dtype=torch.bfloat16)
    exported = torch.export.export(_DecodeThenProject(case.sm_scale, weight), case.inputs()[:-1])
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.cute_attn.gqa_paged_decode.default) == 1
    output_node = next(n for n in reversed(exported.graph.nodes) if n.op == "output")
    y, lse = (n.meta["val"] for n in output_node.args[0])
    assert tuple(y.shape) == (3, 8) and tuple(lse.shape) == (3, 20)


def test_dynamo_captures_one_graph_and_runs_the_real_impl():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    case = _case("gqa_paged_decode")
    counter = CompileCounterWithBackend("aot_eager")
    model = torch.compile(_DecodeThenProject(case.sm_scale, torch.ones(20 * 128, 8, dtype=torch.bfloat16)),
                          backend=counter, fullgraph=True)
    # traced through the fake impl (no graph break: fullgraph), then the real impl meets the CPU tensors
    with pytest.raises(ValueError, match="run on a CUDA device"):
        model(*case.inputs()[:-1])
    assert counter.frame_count == 1


@pytest.mark.parametrize("kind", KINDS)
def test_opcheck_with_a_cpu_stand_in_for_the_launch(kind, stand_in_launch):
    """Schema (only output and lse written), fake impl against the real one, dynamic-shape AOT dispatch."""
    case = _case(kind)
    results = torch.library.opcheck(_op(kind), (*case.inputs(), *case.new_outputs()))
    assert set(results.values()) == {"SUCCESS"}, results
    assert stand_in_launch["launches"], "opcheck never ran the real impl"


# ---------------------------------------------------------------------------------------------
# Index tensors: the op never trusts their identity
# ---------------------------------------------------------------------------------------------
def test_each_call_plans_from_the_values_it_is_given(stand_in_launch):
    """Same tensor objects, rewritten without a version bump (as Inductor's kernels write): each launch takes the
    device route (no plan=, no host check), which plans from the values the launch sees."""
    a = testing.make_gqa_decode_case([3232, 128], seed=1)
    b_last = torch.tensor([1, 1], dtype=torch.int32)
    out, lse = a.new_outputs()
    last = a.kv_last_page_len
    torch.ops.cute_attn.gqa_paged_decode(*a.inputs(), out, lse, True)
    version = last._version
    last.data.copy_(b_last)  # .data: the write does not reach the tensor's version counter
    assert last._version == version
    torch.ops.cute_attn.gqa_paged_decode(*a.inputs(), out, lse)
    assert [v[1][-1] for v in stand_in_launch["index_values"]] == [[32, 64], [1, 1]]
    options = [launch[1] for launch in stand_in_launch["launches"]]
    assert options == [dict(natural_lse=True), dict(natural_lse=False)]  # no plan=, check_indices left False
    assert stand_in_launch["plans"] == []  # no host plan


def test_inference_tensors_go_through_the_op(stand_in_launch):
    with torch.inference_mode():
        case = _case("gqa_paged_decode")
        out, lse = torch_ops.gqa_paged_decode(*case.inputs())
    assert out.is_inference() and len(stand_in_launch["launches"]) == 1 and not stand_in_launch["plans"]
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")


class _TwoDecodesOverComputedLengths(torch.nn.Module):
    """Two decodes whose last-page lengths are computed in the graph, the second after the first call.

    The second depends on the first call's lse, so it is computed once the first lengths are dead:
    Inductor hands it their buffer, the same tensor object with other values.
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


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor CPU needs a C++ compiler")
def test_inductor_buffer_reuse_gets_a_fresh_plan(stand_in_launch, monkeypatch):
    seen = []
    stand_in = cute_attn.gqa_paged_decode

    def launch(*args, **options):
        seen.append((id(args[5]), args[5].data_ptr(), args[5]._version))
        return stand_in(*args, **options)

    monkeypatch.setattr(cute_attn, "gqa_paged_decode", launch)
    torch._dynamo.reset()
    case = testing.make_gqa_decode_case([3232, 128], seed=2)
    model = torch.compile(_TwoDecodesOverComputedLengths(case.sm_scale, case.page_size), fullgraph=True)
    lens_a, lens_b = torch.tensor([3232, 128]), torch.tensor([3201, 65])
    out_a, lse_a, out_b, lse_b = model(case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices,
                                       lens_a, lens_b)
    assert len(seen) == 2
    if seen[0] != seen[1]:
        pytest.skip(f"this Inductor gave the second lengths a new tensor ({seen}): nothing to alias")
    # one object, one pointer, one version, two sets of values: the second launch must see the second values
    assert [v[1][-1] for v in stand_in_launch["index_values"]] == [[32, 64], [1, 1]]
    inputs_b = (case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices,
                torch.tensor([1, 1], dtype=torch.int32), case.sm_scale)
    ref_out_b, ref_lse_b = reference.gqa_paged_decode_ref(*inputs_b)
    testing.assert_close_benchmark(out_b, ref_out_b, "output b")
    testing.assert_close_benchmark(lse_b, ref_lse_b, "lse b")

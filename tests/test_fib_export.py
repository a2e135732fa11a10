"""tools/export_fib_solution.py against the real FlashInfer-Bench 0.1.2 package (CPU only).

The Solutions must pass flashinfer_bench's own pydantic models, load from a trace-set folder the way
``flashinfer-bench run`` loads them, and build with its Python builder: the launcher's parameters must
match the definition (inputs, then outputs) and it must reach the *shipped* cute_attn copy.

flashinfer-bench is installed without its dependencies (``pip install --no-deps flashinfer-bench==0.1.2``,
plus pydantic, safetensors, docstring-parser): its ``flashinfer-python`` dependency is a CUDA build this
tier does not need. Without it the module is skipped, except where ``CUTE_ATTN_REQUIRE_FIB=1`` (CI sets
it), where a missing package is a failure rather than a silent skip.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "CUTE_ATTN_REQUIRE_FIB"

try:
    import flashinfer_bench.data as fib
    from flashinfer_bench.compile.builders.python_builder import PythonBuilder
except ImportError as exc:
    if os.environ.get(REQUIRE_ENV) == "1":
        raise
    pytest.skip(f"flashinfer-bench not installed ({exc}); pip install --no-deps flashinfer-bench==0.1.2 "
                "pydantic safetensors docstring-parser", allow_module_level=True)

from pydantic import ValidationError  # noqa: E402  (a flashinfer-bench dependency)

from cute_attn import testing  # noqa: E402

SOLUTION_FILES = {
    "gqa_paged_prefill_causal_h32_kv4_d128_ps64": "cute_attn_gqa_paged_prefill_sm90a.json",
    "gqa_paged_decode_h20_kv4_d128_ps64": "cute_attn_gqa_paged_decode_sm90a.json",
    "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1": "cute_attn_mla_paged_prefill_sm90a.json",
}


def _definition(name, op_type, consts, inputs, outputs) -> "fib.Definition":
    """A Definition with the published interface (names, order, shapes, dtypes); written out here, apart
    from the exporter's own table, so that a drift between the two fails the builder's signature check.
    The reference body is not needed to build or load a solution."""
    specs = [*inputs, *outputs]
    axes = {a: {"type": "const", "value": consts[a]} if a in consts else {"type": "var"}
            for _, shape, _ in specs for a in (shape or ())}

    def tensors(rows):
        return {n: {"shape": None if shape is None else list(shape), "dtype": dtype} for n, shape, dtype in rows}

    return fib.Definition(name=name, op_type=op_type, axes=axes, inputs=tensors(inputs), outputs=tensors(outputs),
                          reference="def run(*args):\n    raise NotImplementedError('not needed here')\n")


_PAGED_KV = ("num_pages", "page_size", "num_kv_heads", "head_dim")
_GQA_OUT = [("output", ("total_q", "num_qo_heads", "head_dim"), "bfloat16"),
            ("lse", ("total_q", "num_qo_heads"), "float32")]
DEFINITIONS = {
    "gqa_paged_prefill_causal_h32_kv4_d128_ps64": _definition(
        "gqa_paged_prefill_causal_h32_kv4_d128_ps64", "gqa_paged",
        dict(num_qo_heads=32, num_kv_heads=4, head_dim=128, page_size=64),
        [("q", ("total_q", "num_qo_heads", "head_dim"), "bfloat16"), ("k_cache", _PAGED_KV, "bfloat16"),
         ("v_cache", _PAGED_KV, "bfloat16"), ("qo_indptr", ("len_indptr",), "int32"),
         ("kv_indptr", ("len_indptr",), "int32"), ("kv_indices", ("num_kv_indices",), "int32"),
         ("kv_last_page_len", ("batch_size",), "int32"), ("sm_scale", None, "float32")],
        _GQA_OUT),
    "gqa_paged_decode_h20_kv4_d128_ps64": _definition(
        "gqa_paged_decode_h20_kv4_d128_ps64", "gqa_paged",
        dict(num_qo_heads=20, num_kv_heads=4, head_dim=128, page_size=64),
        [("q", ("batch_size", "num_qo_heads", "head_dim"), "bfloat16"), ("k_cache", _PAGED_KV, "bfloat16"),
         ("v_cache", _PAGED_KV, "bfloat16"), ("kv_indptr", ("len_indptr",), "int32"),
         ("kv_indices", ("num_kv_indices",), "int32"), ("kv_last_page_len", ("batch_size",), "int32"),
         ("sm_scale", None, "float32")],
        [("output", ("batch_size", "num_qo_heads", "head_dim"), "bfloat16"),
         ("lse", ("batch_size", "num_qo_heads"), "float32")]),
    "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1": _definition(
        "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1", "mla_paged",
        dict(num_qo_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=1),
        [("q_nope", ("total_q", "num_qo_heads", "head_dim_ckv"), "bfloat16"),
         ("q_pe", ("total_q", "num_qo_heads", "head_dim_kpe"), "bfloat16"),
         ("ckv_cache", ("num_pages", "page_size", "head_dim_ckv"), "bfloat16"),
         ("kpe_cache", ("num_pages", "page_size", "head_dim_kpe"), "bfloat16"),
         ("qo_indptr", ("len_indptr",), "int32"), ("kv_indptr", ("len_indptr",), "int32"),
         ("kv_indices", ("num_kv_indices",), "int32"), ("sm_scale", None, "float32")],
        [("output", ("total_q", "num_qo_heads", "head_dim_ckv"), "bfloat16"),
         ("lse", ("total_q", "num_qo_heads"), "float32")]),
}

DEFINITION_CONFIGS = {  # the definitions' shapes as default_paged_config arguments
    "gqa_paged_decode_h20_kv4_d128_ps64": dict(kind="gqa_paged_decode", num_qo_heads=20, num_kv_heads=4,
                                               head_dim_qk=128, head_dim_v=128, page_size=64, causal=False),
    "gqa_paged_prefill_causal_h32_kv4_d128_ps64": dict(kind="gqa_paged_prefill", num_qo_heads=32, num_kv_heads=4,
                                                       head_dim_qk=128, head_dim_v=128, page_size=64, causal=True),
    "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1": dict(kind="mla_paged_prefill", num_qo_heads=16, num_kv_heads=1,
                                                          head_dim_qk=576, head_dim_v=512, page_size=1, causal=True),
}

CPU_CASES = {  # small CPU inputs per definition: the launcher must get as far as cute_attn's device rule
    "gqa_paged_prefill_causal_h32_kv4_d128_ps64": lambda: testing.make_gqa_prefill_case([3, 5], [70, 5]),
    "gqa_paged_decode_h20_kv4_d128_ps64": lambda: testing.make_gqa_decode_case([70, 3]),
    "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1": lambda: testing.make_mla_prefill_case([2, 3], [5, 3]),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The exporter's CLI output folder (run once for the module, as a user would run it)."""
    out = tmp_path_factory.mktemp("solutions")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "export_fib_solution.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return out


def _load(exported, definition) -> "fib.Solution":
    return fib.load_json_file(fib.Solution, exported / SOLUTION_FILES[definition])  # what TraceSet.from_path uses


@pytest.mark.parametrize("definition", sorted(SOLUTION_FILES))
def test_every_exported_solution_passes_the_schema(exported, definition):
    sol = _load(exported, definition)
    assert sol.definition == definition and sol.author == "cute_attn"
    assert sol.spec.language is fib.SupportedLanguages.PYTHON
    assert sol.spec.destination_passing_style  # the benchmark passes output, lse after the inputs
    assert not any("B200" in hw or "B100" in hw for hw in sol.spec.target_hardware)  # never run on Blackwell
    paths = {s.path for s in sol.sources}
    assert sol.get_entry_path() == Path("main.py") and sol.get_entry_symbol() == "run"
    assert {"main.py", "cute_attn/__init__.py", "cute_attn/api.py", "cute_attn/kernels/sm90/gqa_decode.py"} <= paths
    shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cute_attn").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert paths - {"main.py"} == shipped  # the whole package travels, nothing else
    # The builder imports the copy as <package>.cute_attn: an absolute import would reach another install.
    absolute = re.compile(r"^\s*(from|import)\s+cute_attn\b", re.M)
    assert not [s.path for s in sol.sources if absolute.search(s.content)]


def test_descriptions_are_per_kernel_and_state_the_hardware_truth(exported):
    sols = {d: _load(exported, d) for d in SOLUTION_FILES}
    texts = {d: s.description for d, s in sols.items()}
    assert len(set(texts.values())) == 3
    for text in texts.values():
        assert "sm_100a" in text and "never run" in text
    mla = texts["mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"]
    assert "cp.async" in mla and "TMA page" not in mla
    decode = texts["gqa_paged_decode_h20_kv4_d128_ps64"]
    assert "fused into the decode kernel" in decode and "no combine kernel" in decode
    assert "combine kernel" in texts["gqa_paged_prefill_causal_h32_kv4_d128_ps64"]


def test_schema_rejects_what_the_exporter_must_avoid(exported):
    """The model really is strict: a capitalised language, or an entry file not shipped, is refused."""
    good = json.loads((exported / SOLUTION_FILES["gqa_paged_decode_h20_kv4_d128_ps64"]).read_text())
    fib.Solution.model_validate(good)
    bad_language = json.loads(json.dumps(good))
    bad_language["spec"]["language"] = "Python"
    with pytest.raises(ValidationError, match="language"):
        fib.Solution.model_validate(bad_language)
    no_entry = json.loads(json.dumps(good))
    no_entry["sources"] = [s for s in no_entry["sources"] if s["path"] != "main.py"]
    with pytest.raises(ValidationError, match="main.py"):
        fib.Solution.model_validate(no_entry)


def test_trace_set_folder_loads_the_solutions_under_their_definitions(exported, tmp_path):
    """The layout the README gives for ``flashinfer-bench run --local``: definitions/ and solutions/."""
    for definition in DEFINITIONS.values():
        fib.save_json_file(definition, tmp_path / "definitions" / definition.op_type / f"{definition.name}.json")
    target = tmp_path / "solutions" / "cute_attn"
    target.mkdir(parents=True)
    for name in SOLUTION_FILES.values():
        (target / name).write_text((exported / name).read_text())
    trace_set = fib.TraceSet.from_path(str(tmp_path))
    assert set(trace_set.definitions) == set(SOLUTION_FILES)
    for definition, file_name in SOLUTION_FILES.items():
        (sol,) = trace_set.solutions[definition]
        assert sol.name == Path(file_name).stem and trace_set.get_solution(sol.name) is sol


@pytest.mark.parametrize("definition", sorted(SOLUTION_FILES))
def test_python_builder_builds_the_shipped_package(exported, definition, tmp_path, monkeypatch):
    """FlashInfer-Bench's own builder: signature checked against the definition, the copy in the Solution
    imported (not this checkout), and a call with the definition's arguments reaches cute_attn's rules."""
    monkeypatch.setenv("FIB_CACHE_PATH", str(tmp_path))
    runnable = PythonBuilder().build(DEFINITIONS[definition], _load(exported, definition))
    try:
        package = runnable.metadata.misc["module_name"].rsplit(".", 1)[0]
        shipped = sys.modules[f"{package}.cute_attn"]
        assert Path(shipped.__file__).is_relative_to(tmp_path)
        case = CPU_CASES[definition]()
        with pytest.raises(ValueError, match="cute_attn kernels run on a CUDA device"):
            runnable(*case.inputs(), *case.new_outputs())
        # the shipped copy finds its own kernels: an absolute `cute_attn.kernels...` import would register them
        # in another copy (this checkout's, on PYTHONPATH) and leave the shipped one without a launcher
        config = shipped.config.default_paged_config(arch="sm_90a", **DEFINITION_CONFIGS[definition])
        assert shipped.kernels.find_launcher(config) is not None
        kernel_modules = [m for m in sys.modules if m.startswith(f"{package}.cute_attn.kernels.sm90.")]
        assert kernel_modules, "the shipped package imported no kernel module of its own"
    finally:
        runnable.cleanup()

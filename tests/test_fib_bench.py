"""tools/fib_bench.py --dry-run against the real FlashInfer-Bench 0.1.2 package and definitions (CPU only).

The trace-set folder must load with flashinfer_bench's own loader, every workload must fit its definition
(the package's safetensors loader, the definition's constraints, a sane shuffled page table), both Solutions
must pass the real ``Solution`` model, and the FlashInfer baseline must build with the package's Python
builder (its signature check). What needs a GPU (the numbers, FlashInfer's wrappers accepting these
arguments) is not checked here. Skipped without flashinfer-bench or the definitions, except where
``CUTE_ATTN_REQUIRE_FIB=1`` (CI), where either missing is a failure.
"""

import ast
import importlib.util
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRE = os.environ.get("CUTE_ATTN_REQUIRE_FIB") == "1"
sys.path.insert(0, str(ROOT / "tools"))

try:
    import flashinfer_bench.data as fib
    from flashinfer_bench.compile.builders.python_builder import PythonBuilder
except ImportError as exc:
    if REQUIRE:
        raise
    pytest.skip(f"flashinfer-bench not installed ({exc})", allow_module_level=True)

import bench_workloads as bw  # noqa: E402
import fib_bench  # noqa: E402
import fib_definitions  # noqa: E402

if fib_definitions.definitions_dir() is None:
    if REQUIRE:
        raise FileNotFoundError("FlashInfer-Bench definitions missing (../shared/spec/fib-definitions)")
    pytest.skip("FlashInfer-Bench definitions not found", allow_module_level=True)

SEED_DEFINITIONS = {bw.PREFILL, bw.DECODE, bw.MLA}
RANDOM_INPUTS = {"gqa_paged": {"q", "k_cache", "v_cache"}, "mla_paged": {"q_nope", "q_pe", "ckv_cache", "kpe_cache"}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The dry run's trace-set folder, made by the CLI as a user would run it."""
    out = tmp_path_factory.mktemp("fib") / "traceset"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "fib_bench.py"), "--dry-run", "--out-dir", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "valid" in res.stdout
    return out


@pytest.fixture(scope="module")
def trace_set(folder):
    return fib.TraceSet.from_path(str(folder))  # what `flashinfer-bench run --local` loads


def _workload(trace_set, definition, label):
    (trace,) = [t for t in trace_set.workloads[definition] if t.workload.uuid == label]
    return trace.workload


def test_folder_loads_with_both_solutions_and_the_seed_workloads(trace_set):
    assert set(trace_set.definitions) == SEED_DEFINITIONS
    for name in SEED_DEFINITIONS:
        names = sorted(s.name for s in trace_set.solutions[name])
        assert [fib_bench.solution_kind(n) for n in names] == ["cute_attn", "flashinfer"]
        assert {t.workload.uuid for t in trace_set.workloads[name]} == set(fib_bench.DEFAULT_WORKLOADS[name])
    assert fib_bench.trace_set_problems(trace_set) == []


def test_workload_axes_are_the_seed_shapes(trace_set):
    prefill = _workload(trace_set, bw.PREFILL, "n32_q992_kv992").axes
    assert prefill["batch_size"] == 32 and prefill["total_q"] == 32 * 992 and prefill["num_kv_indices"] == 32 * 16
    decode = _workload(trace_set, bw.DECODE, "n1_kv3232").axes
    assert decode == {**decode, "batch_size": 1, "len_indptr": 2, "num_kv_indices": 51}  # 50 full pages + 32 keys
    assert _workload(trace_set, bw.DECODE, "n128_kv4096").axes["num_kv_indices"] == 128 * 64
    mla = _workload(trace_set, bw.MLA, "n28_q1954_kv2044").axes
    assert mla == {"total_q": 1954, "num_kv_indices": 2044, "len_indptr": 29, "num_pages": bw.MLA_POOL_PAGES}


def test_index_tensors_are_real_shuffled_and_the_rest_random(trace_set, folder):
    from flashinfer_bench.bench.utils import load_safetensors

    for name in SEED_DEFINITIONS:
        d = trace_set.definitions[name]
        for t in trace_set.workloads[name]:
            kinds = {n: spec.type for n, spec in t.workload.inputs.items()}
            assert kinds["sm_scale"] == "scalar"
            assert {n for n, k in kinds.items() if k == "random"} == RANDOM_INPUTS[d.op_type]
            indices = load_safetensors(d, t.workload, folder)["kv_indices"].numpy()
            assert not np.all(np.diff(indices) == 1), f"{name}/{t.workload.uuid}: pages in pool order"


def test_the_workload_check_can_fail(trace_set, folder):
    """Each kind of fault the check exists for is reported (it would otherwise pass anything)."""
    d = trace_set.definitions[bw.PREFILL]
    good = _workload(trace_set, bw.PREFILL, "n8_q992_kv992")
    assert fib_bench.workload_problems(d, good, folder) == []

    wrong_total = good.model_copy(update={"axes": {**good.axes, "total_q": good.axes["total_q"] + 1}})
    assert fib_bench.workload_problems(d, wrong_total, folder)  # q's shape no longer matches qo_indptr[-1]

    random_scale = good.model_copy(update={"inputs": {**good.inputs, "sm_scale": fib.RandomInput()}})
    assert any("sm_scale" in p for p in fib_bench.workload_problems(d, random_scale, folder))

    random_index = good.model_copy(update={"inputs": {**good.inputs, "kv_indices": fib.RandomInput()}})
    assert any("kv_indices" in p for p in fib_bench.workload_problems(d, random_index, folder))

    where = "x"
    torch = pytest.importorskip("torch")
    shared = {"kv_indptr": torch.tensor([0, 2, 4], dtype=torch.int32),
              "kv_indices": torch.tensor([3, 1, 1, 0], dtype=torch.int32),
              "kv_last_page_len": torch.tensor([64, 65], dtype=torch.int32)}
    problems = fib_bench.page_table_problems(where, 64, 4, shared)
    assert any("used twice" in p for p in problems) and any("kv_last_page_len" in p for p in problems)
    assert any("outside" in p for p in fib_bench.page_table_problems(where, 64, 3, shared))


def test_both_solutions_pass_the_real_solution_model(folder):
    files = sorted((folder / "solutions").rglob("*.json"))
    assert len(files) == 6
    for path in files:
        sol = fib.load_json_file(fib.Solution, path)
        assert sol.definition in SEED_DEFINITIONS and sol.spec.destination_passing_style
        assert sol.spec.language is fib.SupportedLanguages.PYTHON
        assert path.parent.name == fib_bench.solution_kind(sol.name)


@pytest.mark.parametrize("definition", sorted(SEED_DEFINITIONS))
def test_flashinfer_solution_compiles_and_takes_the_definition_arguments(trace_set, definition, tmp_path,
                                                                        monkeypatch):
    d = trace_set.definitions[definition]
    sol = trace_set.get_solution(fib_bench.flashinfer_solution_name(definition))
    (main,) = [s for s in sol.sources if s.path == "main.py"]
    path = tmp_path / "main.py"
    path.write_text(main.content)
    py_compile.compile(str(path), doraise=True)
    (run,) = [n for n in ast.parse(main.content).body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    assert [a.arg for a in run.args.args] == [*d.inputs, *d.outputs]
    # The wrapper class the definition's tags name (fi_api:...) is the one the source builds.
    (api,) = [tag.split(":", 1)[1] for tag in d.tags if tag.startswith("fi_api:")]
    assert f"{api.rsplit('.', 1)[1]}(" in main.content

    monkeypatch.setenv("FIB_CACHE_PATH", str(tmp_path / "cache"))
    runnable = PythonBuilder().build(d, sol)  # flashinfer-bench's own signature check
    try:
        if importlib.util.find_spec("flashinfer") is None:
            # flashinfer is imported at call time, so building never needs it; a call says what is missing.
            with pytest.raises(ModuleNotFoundError, match="flashinfer"):
                runnable(*[None] * (len(d.inputs) + len(d.outputs)))
    finally:
        runnable.cleanup()


def test_without_a_gpu_the_real_run_exits_2_and_writes_nothing(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run would start")
    out, rows = tmp_path / "traceset", tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "fib_bench.py"), "--out-dir", str(out),
                          "--json", str(rows)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "no CUDA GPU" in res.stderr
    assert not out.exists() and not rows.exists()


def test_rows_come_from_the_benchmarks_own_trace_records(trace_set):
    """The GPU run's reporting, fed real Trace/Evaluation models: a latency only for a PASSED trace."""
    workload = _workload(trace_set, bw.DECODE, "n1_kv3232")
    env = fib.Environment(hardware="NVIDIA_H200")

    def trace(solution, evaluation):
        return fib.Trace(definition=bw.DECODE, workload=workload, solution=solution, evaluation=evaluation)

    passed = fib.Evaluation(status=fib.EvaluationStatus.PASSED, environment=env, timestamp="t",
                            correctness=fib.Correctness(), performance=fib.Performance(latency_ms=0.0123))
    failed = fib.Evaluation(status=fib.EvaluationStatus.RUNTIME_ERROR, environment=env, timestamp="t",
                            log="Traceback ...\nNotImplementedError: why")
    rows = fib_bench.rows_of({bw.DECODE: [trace("cute_attn_gqa_paged_decode_sm90a", passed),
                                          trace(fib_bench.flashinfer_solution_name(bw.DECODE), failed)]})
    assert rows == [
        {"definition": bw.DECODE, "workload": "n1_kv3232", "solution": "cute_attn", "latency_ms": 0.0123,
         "status": "PASSED"},
        {"definition": bw.DECODE, "workload": "n1_kv3232", "solution": "flashinfer", "latency_ms": None,
         "status": "RUNTIME_ERROR", "log": "Traceback ...\nNotImplementedError: why"},
    ]
    lines = fib_bench.table(rows).splitlines()
    assert len(lines) == 3 and "0.0123" in lines[1] and lines[2].split()[-2:] == ["-", "RUNTIME_ERROR"]


def test_benchmark_config_accepts_the_tools_settings(tmp_path):
    """The settings the GPU run passes (BenchmarkConfig validates types: an int timeout, a list of names)."""
    from flashinfer_bench.bench import BenchmarkConfig

    args = fib_bench.parse_args(["--warmup", "2", "--iterations", "5", "--trials", "1"])
    config = fib_bench.benchmark_config(args, ["a"], tmp_path)
    assert (config.warmup_runs, config.iterations, config.num_trials) == (2, 5, 1)
    assert isinstance(config, BenchmarkConfig) and not config.profile_baseline

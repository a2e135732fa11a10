"""Several ``cute_attn.tuning.sweep`` A/Bs in one process (one device call), written to one JSON.

    python tools/sweep_many.py [--compile-jobs N] OUT.json SPEC [SPEC ...]
    SPEC = kind;layout;workload;space, e.g.
        "gqa_paged_prefill;page_size=2;8x992/992;row_gather=False,True"
        "mla_paged_prefill;page_size=64;128x1/4096;tile_q_rows=64,16"

``layout``: ``field=value`` pairs (comma-separated) over the kind's definition layout, or empty;
``workload``: ``N x Q / KV`` (N requests of Q queries over KV keys; decode: ``N x 1 / KV``);
``space``: ``knob=v1,v2`` pairs joined by ``&`` (``True`` / ``False`` / ``None`` / ints; other words are strings, as
``probe=compute_only``). Each variant is checked against the float32 reference and timed with the cold-L2 timer
(median of 50), as ``tuning.sweep`` does; a failing spec is recorded with its error and the rest still run.
Without a GPU it compiles and plans only.
``--compile-jobs N``: every variant's kernel is compiled first by N processes at once (the on-disk cache), so the
timed sweep only loads them (a fresh device machine has no cache; an MLA build takes ~30 s).
"""
from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cute_attn import tuning  # noqa: E402


def _value(text: str):
    text = text.strip()
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    try:
        return int(text)
    except ValueError:
        return text  # a string knob's value (``probe=compute_only``)


def parse_spec(spec: str) -> tuple[str, dict, tuple, dict]:
    """``(kind, layout, (n, q, kv), space)`` of one SPEC string; ValueError naming what is malformed."""
    parts = spec.split(";")
    if len(parts) != 4:
        raise ValueError(f"spec {spec!r} must be kind;layout;workload;space")
    kind, layout_text, workload_text, space_text = parts
    layout = {}
    for pair in filter(None, layout_text.split(",")):
        name, _, value = pair.partition("=")
        layout[name.strip()] = _value(value)
    count, _, lengths = workload_text.partition("x")
    q_len, _, kv_len = lengths.partition("/")
    if not (count and q_len and kv_len):
        raise ValueError(f"workload {workload_text!r} must be N x Q / KV, e.g. 8x992/992")
    space = {}
    for pair in filter(None, space_text.split("&")):
        name, _, values = pair.partition("=")
        space[name.strip()] = [_value(v) for v in values.split(",")]
    return kind.strip(), layout, (int(count), int(q_len), int(kv_len)), space


def spec_workload(spec: str) -> tuple:
    """``(kind, workload, space)`` of one SPEC."""
    kind, layout, (n, q_len, kv_len), space = parse_spec(spec)
    q_lens = None if kind == "gqa_paged_decode" else [q_len] * n
    return kind, tuning.Workload.for_kind(kind, [kv_len] * n, q_lens, **layout), space


def run_spec(spec: str) -> dict:
    kind, workload, space = spec_workload(spec)
    result = tuning.sweep(kind, workload, space, progress=lambda row: print(f"  {row.summary()}", flush=True))
    print(result.table(), flush=True)
    return {"spec": spec, "workload": workload.label, "arch": result.arch, "rows": result.to_dicts()}


def spec_configs(spec: str) -> list:
    """Every variant config of one SPEC (the sweep's ``api_config`` with each knob combination)."""
    import dataclasses

    from cute_attn.arch import resolve_arch

    kind, workload, space = spec_workload(spec)
    base = tuning.api_config(kind, workload, resolve_arch(None))
    return [(f"{spec.split(';')[1]} {knobs}", dataclasses.replace(base, **knobs)) for knobs in tuning._variants(space)]


def _compile_one(config) -> str:
    from cute_attn.compile import compile_kernel_with_info

    if config.can_implement() is not None:
        return "refused"
    try:
        return f"{compile_kernel_with_info(config).seconds:.0f} s"
    except Exception as exc:  # noqa: BLE001 - the timed sweep records it as the variant's error
        return f"{type(exc).__name__}"


def precompile(specs: list[str], jobs: int) -> None:
    """Compile every variant of ``specs`` in ``jobs`` processes (``--compile-jobs``)."""
    import multiprocessing

    named = dict((config, name) for spec in specs for name, config in spec_configs(spec))  # one per config
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for (config, name), status in zip(named.items(), pool.map(_compile_one, list(named))):
            print(f"[compile] {status}: {name}", flush=True)


def main(argv: list[str]) -> int:
    jobs = 0
    if argv[:1] == ["--compile-jobs"]:
        jobs, argv = int(argv[1]), argv[2:]
    if len(argv) < 2:
        print(__doc__)
        return 2
    out, specs = argv[0], argv[1:]
    for spec in specs:  # malformed specs fail before any compile
        parse_spec(spec)
    if jobs > 1:
        precompile(specs, jobs)
    results = []
    for spec in specs:
        print(f"== {spec}", flush=True)
        try:
            results.append(run_spec(spec))
        except Exception as exc:  # noqa: BLE001 - record and go on: one device call runs them all
            traceback.print_exc()
            results.append({"spec": spec, "error": f"{type(exc).__name__}: {exc}"})
        with open(out, "w") as f:  # after each spec: a later hang keeps the earlier rows
            json.dump(results, f, indent=1, default=str)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

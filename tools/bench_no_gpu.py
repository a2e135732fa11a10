"""The parts of tools/bench.py that need no GPU: kernel compile times and planner timings.

For the selected workloads at one arch (``--arch``, default sm_90a), the kernels ``cute_attn`` would
launch are the attention config of each definition (``default_paged_config``, as the API builds it)
plus, for prefill and MLA, the LSE-combine config when a workload's plan splits (decode folds its merge
inside the kernel: no combine launch). Each is compiled through ``compile_kernel_with_info`` for that
explicit arch, so nothing depends on the DSL's own default (sm_100a when no GPU is present).

The planner runs on the host before every batch, so its time is measured here too: per workload (the
plan the bench would launch) and the 4096-request decode batch against its 5 ms budget.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import bench_timing
import bench_workloads as bw

PLANNER_BUDGET_MS = 5.0  # planning 4096 decode requests must stay below this
PLANNER_BATCH = 4096
FUSED_MERGE_KINDS = ("gqa_paged_decode", "gqa_paged_multi_token_decode")  # kernels/common/paged_launch.py: gqa_decode_entry, fused_merge=True

# definition op (bench_workloads.Definition.op) -> the cute_attn kind whose kernel serves it: mla_paged_decode has
# no kind of its own yet (ops/mla_decode.py runs the MLA prefill kind with one query per request)
_KINDS = {"prefill": "gqa_paged_prefill", "decode": "gqa_paged_decode", "mtp": "gqa_paged_multi_token_decode",
          "mla": "mla_paged_prefill", "mla_decode": "mla_paged_prefill"}


def _problem(kernel: str):
    """(cute_attn kind, default_paged_config keyword arguments) of a definition name: the head layout and page
    size come from the name (the four bench kernels' names give their GQA_*_HEADS / MLA_DIMS); the mask is the
    kind's own, as the API builds the config (MLA decode: the prefill kind's bottom-right causal mask, which lets
    one query see every key)."""
    from cute_attn.ops import get_spec

    try:
        d = bw.parse_definition(kernel)
    except ValueError:
        raise ValueError(f"kernel must be one of {', '.join(sorted(bw.KERNEL_ALIASES.values()))} or another "
                         f"definition name (e.g. gqa_paged_decode_h20_kv4_d128_ps1), got {kernel!r}") from None
    if d.op.startswith("mla"):
        dims = dict(num_qo_heads=d.num_qo_heads, num_kv_heads=1, head_dim_qk=d.head_dim + d.kpe_dim,
                    head_dim_v=d.head_dim)
    else:
        dims = dict(num_qo_heads=d.num_qo_heads, num_kv_heads=d.num_kv_heads, head_dim_qk=d.head_dim,
                    head_dim_v=d.head_dim)
    kind = _KINDS[d.op]
    return kind, dict(dims, page_size=d.page_size, causal=get_spec(kind).causal)


def pin_dsl_arch(arch: str) -> str:
    """The canonical arch; also ``CUTE_DSL_ARCH`` when unset, before the DSL is imported.

    Every compile passes the arch explicitly anyway (``cute_attn.arch``); the variable keeps any DSL code
    that reads its own notion of the target from falling back to sm_100a on a machine without a GPU.
    """
    from cute_attn.arch import normalize_arch

    canon = normalize_arch(arch)
    os.environ.setdefault("CUTE_DSL_ARCH", canon)
    return canon


def attention_config(kernel: str, arch: str, workload: Optional[bw.Workload] = None):
    """The config the API builds for ``kernel`` (a definition name) at ``arch``; with ``workload``, as the API
    builds it for that batch: the spec's shape-driven knobs (``OpSpec.workload_tiles``, e.g. MLA prefill's consumer
    split by item length) and, for MLA decode with one query a request, the decode entry's one-token tiles."""
    from cute_attn import api
    from cute_attn.config import default_paged_config
    from cute_attn.ops import get_spec
    from cute_attn.ops.mla_decode import ONE_TOKEN_SPEC
    from cute_attn.validate import PagedProblem

    kind, problem = _problem(kernel)
    if workload is None:
        return default_paged_config(kind, arch=arch, **problem)
    spec = get_spec(kind)
    if bw.op_of(kernel) == "mla_decode" and all(q == 1 for q in workload.q_lens):
        spec = ONE_TOKEN_SPEC  # ops/mla_decode.py: one query per request takes the entry's own tiles
    return api._make_config(spec, PagedProblem.for_lengths(workload.q_lens, workload.kv_lens, **problem), arch)


def plan_workload(w: bw.Workload, arch: str, iters: int = 5) -> Dict:
    """Plan ``w`` as the API would on a GPU of ``arch``'s default SM count; time it (median ms)."""
    import numpy as np

    from cute_attn.arch import sm_count
    from cute_attn.plan import plan_work

    config = attention_config(w.kernel, arch, w)
    plan_config = config.plan_config(sm_count(arch) * config.ctas_per_sm)
    q_lens, kv_lens = np.asarray(w.q_lens, dtype=np.int64), np.asarray(w.kv_lens, dtype=np.int64)
    plan = plan_work(plan_config, q_lens, kv_lens)
    ms = bench_timing.median_ms(lambda: plan_work(plan_config, q_lens, kv_lens), iters=iters, warmup=1)
    return dict(kernel=w.kernel, workload=w.label, num_ctas=plan_config.num_ctas, plan_ms=ms,
                num_items=plan.num_items, num_merges=plan.num_merges, num_partials=plan.num_partials)


def kernels_to_compile(workloads: Sequence[bw.Workload], plans: Sequence[Dict], arch: str) -> List[Tuple[str, object]]:
    """``(role, config)`` of every distinct kernel the workloads launch, in workload order."""
    from cute_attn.kernels.common.combine import CombineConfig

    out: List[Tuple[str, object]] = []
    for w, plan in zip(workloads, plans):
        config = attention_config(w.kernel, arch, w)
        wanted = [("attention", config)]
        if plan["num_merges"] and config.kind not in FUSED_MERGE_KINDS and not config.fused_merge:
            wanted.append(("combine", CombineConfig.for_paged(config)))
        out.extend(item for item in wanted if item not in out)
    return out


def compile_kernels(kernels: Sequence[Tuple[str, object]], skip: bool = False) -> List[Dict]:
    """One row per config: ``status`` (compiled / disk / memory: where the function came from; error;
    skipped) and ``seconds`` (a disk or memory hit times the load, not a compile)."""
    from cute_attn.compile import compile_kernel_with_info

    rows = []
    for role, config in kernels:
        row = dict(role=role, config=config.cache_key(), arch=config.arch, status="skipped", seconds=None)
        rows.append(row)
        if skip:
            continue
        start = time.perf_counter()
        try:
            row["status"] = compile_kernel_with_info(config).source
        except Exception as exc:  # one failing config must not hide the others' times
            row.update(status="error", error=f"{type(exc).__name__}: {exc}")
        row["seconds"] = time.perf_counter() - start
        print(f"[compile]   {row['status']:8s} {row['seconds']:7.2f} s  {role:9s} {row['config']}"
              + (f": {row['error']}" if "error" in row else ""), flush=True)
    return rows


def planner_inputs(batch: int = PLANNER_BATCH, seed: int = 0):
    """(q_lens, kv_lens) of a decode batch: 1 query each, 1..16K keys (the sibling sets' range)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.ones(batch, dtype=np.int64), rng.integers(1, 16 * 1024, size=batch).astype(np.int64)


def run_planner_timing(iters: int = 50, arch: str = "sm_90a") -> Optional[Dict]:
    """The 4096-request decode batch on the decode definition's own config, one CTA per SM of ``arch``."""
    from cute_attn.arch import sm_count
    from cute_attn.plan import plan_work

    try:
        config = attention_config(bw.DECODE, arch).plan_config(sm_count(arch))
        q_lens, kv_lens = planner_inputs()
        ms = bench_timing.median_ms(lambda: plan_work(config, q_lens, kv_lens), iters=iters)
    except Exception as exc:  # a signature change must not take the bench down
        print(f"[plan] plan_work failed: {type(exc).__name__}: {exc}")
        return None
    ok = ms < PLANNER_BUDGET_MS
    print(f"[plan] plan_work, {PLANNER_BATCH} decode requests (h20/kv4, tile {config.tile_q_rows} rows x "
          f"{config.kv_tile} keys, {config.num_ctas} CTAs): median {ms:.3f} ms over {iters} runs "
          f"(budget {PLANNER_BUDGET_MS} ms): {'OK' if ok else 'TOO SLOW'}")
    return dict(batch=PLANNER_BATCH, num_ctas=config.num_ctas, plan_ms=ms, budget_ms=PLANNER_BUDGET_MS,
                within_budget=ok, iters=iters)


def no_gpu_report(workloads: Sequence[bw.Workload], arch: str, compile_kernels_too: bool = True) -> Dict:
    """Everything the no-GPU run measures, as the JSON object it writes (``"gpu": null``)."""
    arch = pin_dsl_arch(arch)
    plans = [plan_workload(w, arch) for w in workloads]
    for p in plans:
        print(f"[plan] {bw.short_name(p['kernel']):20s} {p['workload']:22s} {p['num_items']:6d} items "
              f"{p['num_merges']:4d} merges  {p['plan_ms']:.3f} ms")
    kernels = kernels_to_compile(workloads, plans, arch)
    print(f"[compile] {arch}: {len(kernels)} kernel config(s) the selected workloads launch"
          + ("" if compile_kernels_too else ", not compiled (--no-compile)"))
    compiled = compile_kernels(kernels, skip=not compile_kernels_too)
    return {"gpu": None, "arch": arch, "mode": "compile-only + planner (no CUDA GPU)", "records": [],
            "compile": compiled, "planner": {"workloads": plans, "decode_batch": run_planner_timing(arch=arch)}}

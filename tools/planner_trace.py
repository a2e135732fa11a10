"""Where the device planner's time goes, phase by phase, on a GPU (one call on the H200).

    python tools/planner_trace.py [--reps 30]

Builds the planner of each case with ``trace_phases=True`` (the planning CTA's thread 0 writes clock64 stamps at
its phase boundaries to the tail of the global ``q_tile_start`` scratch, which the shared-memory path leaves
unused) and launches it after a dirty L2 flush, as the bench does. Prints the median cycles of each phase and the
kernel's in-kernel span (globaltimer), beside the CUDA-event time of the launch. The cases are the bench's
decode and prefill points, so the numbers line up with ``tools/bench.py``'s cold rows.

``--l2 code-warm`` launches the planner once on copies of the indices (its own plan buffers) between the flush and the
timed launch: the planner's code is then in L2 while the timed launch's indices and buffers stay cold, so the
difference to ``flushed`` is what fetching the planner's instructions from DRAM costs (the prefill planner is ~140 KB
of SASS, decode's ~75 KB). ``warm`` skips the flush.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, clock64 stamp slot that ends it), in order from slot 0 (the planning CTA's start); the kernel's last three
# slots (TRACE_STAMPS - 3 .. - 1) are the end clock64, the globaltimer start and end
PHASE_ENDS = (
    ("arrival (prefetch, scan, [fence, atomic])", 1),
    ("rules: index loads + tile-count scan", 8),
    ("rules: fault vote", 2),
    ("q tiles + cost line", 4),
    ("cuts: one thread an edge", 15),
    ("cuts: whole-tile vote", 5),
    ("sorted deal (causal kinds: loads, [sort, deal loads])", 7),
    ("merges: run marks + packed scan", 12),
    ("merges: run ends", 13),
    ("merges: partial slots + work_indptr", 6),
    ("lists: merges written", 14),
    ("lists: items, all chunks but the last + the last one's build", 9),
    ("lists: items, the last chunk's barrier", 10),
    ("lists: items, the last chunk's stores issued", 11),
    ("lists: items, the last barrier + exit", -3),
)
PHASES = tuple(name for name, _ in PHASE_ENDS)


def _cases():
    """(label, plan_* entry, case, qo_indptr or None, cache pages, query rows): the bench's decode and prefill points,
    then MLA prefill (the seed) and MLA decode at 128 x 4096 (their cold spans: +25 / +12.5 us, session 10)."""
    import cute_attn
    from cute_attn import testing

    def gqa(label, plan, case, qo):
        return label, plan, case, qo, case.k_cache.shape[0], case.q.shape[0]

    def mla(label, plan, case):
        return label, plan, case, case.qo_indptr, case.ckv_cache.shape[0], case.q_nope.shape[0]

    decode, prefill = cute_attn.plan_gqa_paged_decode, cute_attn.plan_gqa_paged_prefill
    yield gqa("decode 1 x 3232", decode, testing.make_gqa_decode_case([3232], device="cuda", seed=1), None)
    yield gqa("decode 64 x 2048", decode, testing.make_gqa_decode_case([2048] * 64, device="cuda", seed=2), None)
    yield gqa("decode 128 x 4096", decode, testing.make_gqa_decode_case([4096] * 128, device="cuda", seed=3), None)
    # page 1: 131072 ids, a page scan of 32 CTAs and their arrival (the default call runs ~2 us longer than at page 64)
    yield gqa("decode 64 x 2048 page 1", decode,
              testing.make_gqa_decode_case([2048] * 64, page_size=1, device="cuda", seed=6), None)
    case = testing.make_gqa_prefill_case([992] * 8, [992] * 8, device="cuda", seed=4)
    yield gqa("prefill 8 x 992", prefill, case, case.qo_indptr)
    case = testing.make_gqa_prefill_case([992] * 8, [992] * 8, page_size=1, device="cuda", seed=5)
    yield gqa("prefill 8 x 992 page 1", prefill, case, case.qo_indptr)
    for n in (1, 2, 4, 16, 32):  # the lists phase grows with the items (3968 / 7936 at 16 / 32)
        case = testing.make_gqa_prefill_case([992] * n, [992] * n, device="cuda", seed=n)
        yield gqa(f"prefill {n} x 992", prefill, case, case.qo_indptr)
    import bench_workloads as bw

    seed = next(w for w in bw.all_workloads() if w.kernel.startswith("mla_paged_prefill") and w.label.startswith("n28"))
    yield mla("MLA prefill 28 / 1954 / 2044", cute_attn.plan_mla_paged_prefill,
              testing.make_mla_prefill_case(list(seed.q_lens), list(seed.kv_lens), device="cuda", seed=6))
    yield mla("MLA decode 128 x 4096", cute_attn.plan_mla_paged_decode,
              testing.make_mla_decode_case([4096] * 128, device="cuda", seed=7))


def main(argv=None) -> int:
    import torch

    import bench_timing
    from cute_attn.config import lap_turn_policy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--q-tiles-per-pass", type=int, default=1,
                   help="q tiles a thread builds per pass of the q-tile phase (DevicePlannerConfig.q_tiles_per_pass)")
    p.add_argument("--items-per-thread", type=int, nargs="+", default=[0],
                   help="lists-phase rows a thread builds per pass, one trace each (0: the default)")
    p.add_argument("--only", nargs="+", default=None, help="case labels that start with any of these")
    p.add_argument("--deal-first", type=int, nargs="+", default=[-1],
                   help="causal planners built with DevicePlannerConfig.deal_first 0 / 1, one trace each (-1: the "
                        "default config's)")
    p.add_argument("--lap-turn", type=int, nargs="+", default=[-1],
                   help="GQA prefill planners built under config.lap_turn_policy 0 / 1, one trace each (-1: the "
                        "default config's)")
    p.add_argument("--row-writers", type=int, default=0,
                   help="planners built with this many row writers (device_planner.row_writers_policy; 0: the "
                        "default build); each writer's end is printed after CTA 0's phases")
    p.add_argument("--rows-per-writer", type=int, default=0, help="with --row-writers: the launch rule's rows a writer")
    p.add_argument("--count-sort", action="store_true",
                   help="planners built with the deal's order by counting (device_planner.count_sort_policy)")
    p.add_argument("--l2", choices=("flushed", "code-warm", "warm"), default="flushed",
                   help="L2 before each timed launch (see the module docstring)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    flush = bench_timing.make_l2_flusher() if args.l2 != "warm" else (lambda: None)
    report = []
    for label, planner_fn, case, qo, num_pages, total_q in _cases():
        if args.only and not any(label.startswith(prefix) for prefix in args.only):
            continue
        for per_thread in args.items_per_thread:
            for first in args.deal_first:
                for turn in args.lap_turn:
                    name = label
                    if len(args.items_per_thread) > 1:
                        name += f" [items/thread {per_thread or 'default'}]"
                    if first >= 0:
                        name += f" [deal first {first}]"
                    if turn >= 0:
                        name += f" [lap turn {turn}]"
                    with contextlib.ExitStack() as stack:
                        if turn >= 0:
                            stack.enter_context(lap_turn_policy(bool(turn)))
                        if args.count_sort:
                            from cute_attn.kernels.common.device_planner import count_sort_policy

                            stack.enter_context(count_sort_policy())
                        if args.row_writers:
                            from cute_attn.kernels.common.device_planner import ROWS_PER_WRITER, row_writers_policy

                            stack.enter_context(row_writers_policy(args.row_writers,
                                                                   args.rows_per_writer or ROWS_PER_WRITER))
                        row = _trace(name, planner_fn, case, qo, num_pages, total_q, per_thread, args.reps, flush,
                                     args.q_tiles_per_pass, args.l2 == "code-warm", first)
                    report.append(row)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _trace(label, planner_fn, case, qo, num_pages, total_q, per_thread, reps, flush, q_tiles_per_pass=1,
           code_warm=False, deal_first=-1) -> dict:
    import torch

    from cute_attn.compile import compile_kernel
    from cute_attn.device_planning import launch_planner
    from cute_attn.kernels.common.device_planner import TRACE_STAMPS, TRACE_WRITER_ENDS, DevicePlannerConfig

    plan = planner_fn(*case.inputs(), on_device=True)
    num_ctas = plan.work_indptr.shape[0] - 1
    config = DevicePlannerConfig.for_plan(plan.config.plan_config(num_ctas), arch=plan.config.arch,
                                          has_qo_indptr=qo is not None, head_dim_v=plan.config.head_dim_v)
    if deal_first >= 0 and config.sorted_deal:
        config = dataclasses.replace(config, deal_first=bool(deal_first))
    traced = compile_kernel(dataclasses.replace(config, trace_phases=True, items_per_thread=per_thread,
                                                q_tiles_per_pass=q_tiles_per_pass))
    out, lse = case.new_outputs()
    # code-warm: a launch on copies of the indices, into its own plan, brings the planner's code into L2 only
    twin_indices = [t.clone() for t in (qo, case.kv_indptr, case.kv_indices, case.kv_last_page_len) if t is not None]
    twin_qo = twin_indices.pop(0) if qo is not None else None
    twin_plan = planner_fn(*case.inputs(), on_device=True) if code_warm else None
    twin_out, twin_lse = case.new_outputs()
    stamps, event_us = [], []
    for _ in range(reps + 3):
        flush()
        if code_warm:
            launch_planner(traced, twin_plan, twin_qo, *twin_indices, twin_out, twin_lse, num_pages, total_q)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch_planner(traced, plan, qo, case.kv_indptr, case.kv_indices, case.kv_last_page_len, out, lse,
                       num_pages, total_q)
        end.record()
        torch.cuda.synchronize()
        event_us.append(start.elapsed_time(end) * 1e3)
        stamps.append(plan.planner.q_tile_start[-TRACE_STAMPS:].cpu().tolist())
    stamps, event_us = stamps[3:], event_us[3:]
    slots = [0] + [slot % TRACE_STAMPS for _, slot in PHASE_ENDS]
    cycles = [[s[b] - s[a] for a, b in zip(slots, slots[1:])] for s in stamps]
    phase_cycles = [statistics.median(c[i] for c in cycles) for i in range(len(PHASES))]
    total_cycles = statistics.median(s[TRACE_STAMPS - 3] - s[0] for s in stamps)
    span_ns = statistics.median(s[TRACE_STAMPS - 1] - s[TRACE_STAMPS - 2] for s in stamps)
    row = dict(case=label, event_us=round(statistics.median(event_us), 2), in_kernel_ns=span_ns,
               total_cycles=total_cycles, phases={n: c for n, c in zip(PHASES, phase_cycles)})
    writers = plan.planner.writers if config.row_writers > 1 else 1
    if writers > 1:  # each writer's end (globaltimer), ns after CTA 0's start
        row["writer_ends_ns"] = [statistics.median(s[TRACE_WRITER_ENDS + k] - s[TRACE_STAMPS - 2] for s in stamps)
                                 for k in range(writers)]
    print(f"{label}: event {row['event_us']} us, in-kernel {span_ns / 1e3:.2f} us, {total_cycles} cycles",
          flush=True)
    for name, c in row["phases"].items():
        print(f"    {c:8.0f} cycles  {name}")
    if writers > 1:
        print("    writer ends, us after CTA 0's start: " + " ".join(f"{t / 1e3:.2f}" for t in row["writer_ends_ns"]))
    return row


if __name__ == "__main__":
    sys.exit(main())

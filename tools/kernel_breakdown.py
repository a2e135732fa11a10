"""Per-kernel GPU time of cute_attn calls (attention kernel vs combine), and a one-call mode for ncu.

    python tools/kernel_breakdown.py [--json OUT.json] [--only LABEL ...] [--mla-split score_wg]
    python tools/kernel_breakdown.py --device-clusters [--json OUT.json]
    ncu --clock-control none ... python tools/kernel_breakdown.py --once LABEL [--mla-split shared_s]

Each workload is checked against the fp32 reference first, then profiled under CUPTI (cold L2, 50 calls):
the median duration of every kernel the call launches, by name, next to the call's span. The gap between
the span and the kernels' sum is launch-to-launch latency (the combine waits for the attention kernel).
``--device-clusters``: MLA decode 64 x 8192 (pages 64 and 1) in the arms of the device plans' run-time-checked
clusters (``ops/mla_decode.SM90_DEVICE_CLUSTER_MERGE``): the host plan with its unchecked clusters (no combine), the
same plan under the checked build (the combine follows, skipping), the device plan with and without the checked
build, and the default call with and without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_timing  # noqa: E402

WORKLOADS = {
    "decode_n1_kv3232": ("decode", [3232]),
    "decode_n16_kv2048": ("decode", [2048] * 16),
    "decode_n64_kv2048": ("decode", [2048] * 64),
    "decode_n128_kv4096": ("decode", [4096] * 128),
    "decode_n64_kv2048_p1": ("decode", [2048] * 64, 1),  # page 1: the row-gather decode
    # the two FIB representatives behind FlashInfer's CUDA-core kernel (h32/kv16), planned once as the bench's row
    "decode_h32kv16_n64_kv2048": ("decode_planned", [2048] * 64),
    "decode_h32kv16_n64_kv2048_p1": ("decode_planned", [2048] * 64, 1),
    "prefill_n1_q992": ("prefill", [992]),
    "prefill_n32_q992": ("prefill", [992] * 32),
    "prefill_n4_q992": ("prefill", [992] * 4),
    # MLA prefill (page 1), host-planned: one attention kernel (and the combine) a call, no planner kernel
    "mla_n1_q1028": ("mla", ([1028], [1038])),
    "mla_n1_q4096": ("mla", ([4096], [4096])),
    # the seed definition's recorded workload (28 ragged requests, ~4 short items a CTA)
    "mla_seed": ("mla", "n28_q1954_kv2044"),
    # MLA decode at page 64 (the bench's rows), planned once: the attention kernel and, with splits, the combine
    "mla_decode_n1_kv4096_p64": ("mla_decode", [4096]),
    "mla_decode_n16_kv4096_p64": ("mla_decode", [4096] * 16),
    "mla_decode_n64_kv8192_p64": ("mla_decode", [8192] * 64),
    "mla_decode_n128_kv4096_p64": ("mla_decode", [4096] * 128),
    # MLA decode's default call (the line build) at page 64, for its prologue under ncu (``--line-uniform``)
    "mla_decode_default_n1_kv4096_p64": ("mla_decode_default", [4096]),
    "mla_decode_default_n64_kv8192_p64": ("mla_decode_default", [8192] * 64),
}


def build(label: str):
    """(case, run) for one workload, with the plan built and cached by the public entry."""
    import cute_attn
    from cute_attn import testing

    kind, lens, *page = WORKLOADS[label]
    page_size = page[0] if page else 64
    if isinstance(lens, str):  # a bench workload's label: its recorded lengths
        import bench_workloads

        recorded = next(w for w in bench_workloads.all_workloads() if w.label == lens)
        lens = (list(recorded.q_lens), list(recorded.kv_lens))
    if kind == "mla_decode_default":  # no plan: the line build derives its stretch every call
        case = testing.make_mla_decode_case(lens, page_size=64, device="cuda", seed=1)
        out, lse = case.new_outputs()

        def run_default():
            cute_attn.mla_paged_decode(*case.inputs(), out, lse)

        return case, out, lse, run_default
    if kind in ("mla", "mla_decode"):  # host-planned once, as the bench's planned rows
        if kind == "mla":
            case = testing.make_mla_prefill_case(*lens, device="cuda", seed=1)
            entry, plan_fn = cute_attn.mla_paged_prefill, cute_attn.plan_mla_paged_prefill
        else:
            case = testing.make_mla_decode_case(lens, page_size=64, device="cuda", seed=1)
            entry, plan_fn = cute_attn.mla_paged_decode, cute_attn.plan_mla_paged_decode
        out, lse = case.new_outputs()
        plan = plan_fn(*case.inputs())

        def run_planned():
            entry(*case.inputs(), out, lse, plan=plan)

        return case, out, lse, run_planned
    if kind == "decode":
        case = testing.make_gqa_decode_case(lens, page_size=page_size, device="cuda", seed=1)
        entry = cute_attn.gqa_paged_decode
    elif kind == "decode_planned":
        case = testing.make_gqa_decode_case(lens, num_qo_heads=32, num_kv_heads=16, page_size=page_size,
                                            device="cuda", seed=1)
        entry = cute_attn.gqa_paged_decode
    else:
        case = testing.make_gqa_prefill_case(lens, lens, num_qo_heads=32, num_kv_heads=4, head_dim=128,
                                             page_size=64, device="cuda", seed=1)
        entry = cute_attn.gqa_paged_prefill
    out, lse = case.new_outputs()
    plan = None
    if kind == "decode_planned":
        plan = cute_attn.plan_gqa_paged_decode(*case.inputs())
    if kind == "prefill" and _PREFILL_WHOLE_DEAL is not None:  # a host plan of that deal, made once
        from cute_attn.ops.gqa_prefill import whole_deal_policy

        with whole_deal_policy(_PREFILL_WHOLE_DEAL):
            plan = cute_attn.plan_gqa_paged_prefill(*case.inputs())

    def run():
        entry(*case.inputs(), out, lse, **({} if plan is None else dict(plan=plan)))

    return case, out, lse, run


_PREFILL_WHOLE_DEAL: str | None = None  # --prefill-whole-deal


def device_cluster_arms():
    """``(label, case, out, lse, run)`` of each ``--device-clusters`` arm (module docstring)."""
    import cute_attn
    from cute_attn import testing
    from cute_attn.api import DevicePlan
    from cute_attn.ops import mla_decode

    for page_size in (64, 1):
        case = testing.make_mla_decode_case([8192] * 64, page_size=page_size, device="cuda", seed=1)
        args = case.inputs()
        out, lse = case.new_outputs()
        with mla_decode.cluster_merge_policy(True):
            host = cute_attn.plan_mla_paged_decode(*args)
        with mla_decode.device_cluster_merge_policy(True):  # the checked build of the host's plan
            checked = DevicePlan.upload(mla_decode.device_cluster_config(host.config), host.plan, out.device)
        arms = {"host_clusters": host, "host_plan_checked_build": checked}
        for on in (True, False):
            with mla_decode.device_cluster_merge_policy(on):
                arms[f"device_plan_checked_{on}"] = cute_attn.plan_mla_paged_decode(*args, on_device=True)
        for name, plan in arms.items():
            yield (f"p{page_size}_{name}", case, out, lse,
                   lambda plan=plan: cute_attn.mla_paged_decode(*args, out, lse, plan=plan))
        for on in (True, False):  # the default call plans on the device every call: the policy stays on for it
            policy = mla_decode.device_cluster_merge_policy(on)
            policy.__enter__()
            yield f"p{page_size}_default_checked_{on}", case, out, lse, lambda: cute_attn.mla_paged_decode(
                *args, out, lse)
            policy.__exit__(None, None, None)


def per_kernel(run, flush, iters: int = 50) -> dict:
    """Median µs per kernel name over `iters` profiled calls (flush and range markers left out)."""
    prof = bench_timing.profile_calls(run, flush, iters, warmup=10)
    names: dict[str, list[float]] = {}
    for evt in prof.events():
        if (evt.device_type.name == "CUDA" and "fill" not in evt.name.lower()
                and not evt.name.startswith(bench_timing.ITER_PREFIX)):  # the flush, the range markers
            names.setdefault(evt.name, []).append(evt.device_time)
    return {name[:80]: dict(median_us=statistics.median(v), count=len(v)) for name, v in names.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--device-clusters", action="store_true", help="the arms of the module docstring")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--once", help="run one workload 3 times (for ncu) and exit")
    ap.add_argument("--peer", choices=["fa4", "flashinfer_cuda_cores"],
                    help="with --once: run the peer on the same case instead")
    ap.add_argument("--mla-split", help="the sm_90a MLA kernel's consumer split (ops.mla_prefill.SM90_CONSUMERS)")
    ap.add_argument("--mla-decode-split-scores", type=int, choices=[0, 1],
                    help="the swapped MLA decode kernel's S^T split (ops.mla_decode.SM90_SPLIT_SCORES)")
    ap.add_argument("--prefill-whole-deal", choices=["serpentine", "lap", "none"],
                    help="GQA prefill: a host plan made once with this whole-tile deal ('none': the LPT or the cuts), "
                         "instead of the default call (a device plan every call)")
    ap.add_argument("--line-uniform", type=int, choices=[0, 1],
                    help="the default call's line builds with (1) or without (0) the uniform closed form, both kinds "
                         "(config.line_uniform_policy)")
    args = ap.parse_args(argv)
    global _PREFILL_WHOLE_DEAL
    if args.prefill_whole_deal:
        _PREFILL_WHOLE_DEAL = "" if args.prefill_whole_deal == "none" else args.prefill_whole_deal
    # Policies for the whole run, held by the stack until main returns: a context manager entered and dropped is
    # collected at once, and its generator's finally restores the policy (session 18: --mla-split and
    # --mla-decode-split-scores had measured the default)
    with contextlib.ExitStack() as policies:
        if args.line_uniform is not None:
            from cute_attn.config import line_uniform_policy

            policies.enter_context(line_uniform_policy(bool(args.line_uniform)))
        if args.mla_decode_split_scores is not None:
            from cute_attn.ops.mla_decode import split_scores_policy

            policies.enter_context(split_scores_policy(bool(args.mla_decode_split_scores)))
        if args.mla_split:
            from cute_attn.ops.mla_prefill import consumer_split

            try:
                policies.enter_context(consumer_split(args.mla_split))
            except ValueError as exc:
                raise SystemExit(f"--mla-split: {exc}") from None
        return _run(args)


def _run(args) -> int:
    import torch

    from cute_attn import testing

    if args.once:
        case, out, lse, run = build(args.once)
        if args.peer == "fa4":  # same inputs, so ncu compares the two kernels on identical work
            import bench_peers
            from bench_workloads import DECODE, PREFILL

            run = bench_peers.setup_fa4_gqa(case, PREFILL if args.once.startswith("prefill") else DECODE)
        elif args.peer == "flashinfer_cuda_cores":
            import bench_peers

            run = bench_peers.setup_flashinfer_decode(case, tensor_cores=False).run
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        return 0
    flush = bench_timing.make_l2_flusher()
    rows = []
    for label, case, out, lse, run in (device_cluster_arms() if args.device_clusters else
                                       ((label, *build(label)) for label in args.only or list(WORKLOADS))):
        run()
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, "output")
        testing.assert_close_benchmark(lse, ref_lse, "lse")
        t = bench_timing.measure(run, flush, iters=50, warmup=10)
        row = dict(workload=label, span_us=t.gpu_us, sum_us=t.gpu_sum_us, wall_us=t.wall_us,
                   kernels=per_kernel(run, flush))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the host time of one cute_attn call goes (GPU needed): per-piece timings and a cProfile.

    python tools/host_overhead.py [--calls 500]

Small problems keep the GPU faster than the host, so the per-call host time is what is measured.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_call_us(fn, calls: int) -> float:
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main(argv=None) -> int:
    import torch

    import cute_attn
    from cute_attn import api, testing, validate
    from cute_attn.compile import compile_kernel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args(argv)
    case = testing.make_gqa_decode_case([64] * 16, device="cuda")
    out, lse = case.new_outputs()
    inputs = case.inputs()
    index = (case.kv_indptr, case.kv_indices, case.kv_last_page_len)

    def public():
        cute_attn.gqa_paged_decode(*inputs, out, lse)

    public()
    problem, _ = validate.check_gqa_paged_decode(*inputs, out, lse, check_indices=False)
    config = api._make_config("gqa_paged_decode", problem, None, False)
    plan = api._PLANS.get((config, None), index)
    fn = compile_kernel(config)
    raw_args = (case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices, plan.work_indptr, plan.items,
                out, lse, plan.partial_out, plan.partial_lse, case.sm_scale * 1.4426950408889634, 1.0)
    pieces = {
        "public gqa_paged_decode (plan cached)": public,
        "public, check_indices=False": lambda: cute_attn.gqa_paged_decode(*inputs, out, lse, check_indices=False),
        "public, plan= passed": lambda: cute_attn.gqa_paged_decode(*inputs, out, lse, plan=plan),
        "validate (metadata only)": lambda: validate.check_gqa_paged_decode(*inputs, out, lse, check_indices=False),
        "config (cached)": lambda: api._make_config("gqa_paged_decode", problem, None, False),
        "plan cache lookup": lambda: api._PLANS.get((config, None), index),
        "compile_kernel (memory hit)": lambda: compile_kernel(config),
        "raw tvm-ffi kernel call": lambda: fn(*raw_args),
        "empty torch op (x.zero_())": lambda: case.kv_indptr[:0].zero_(),
        "public gqa_paged_decode again (order check)": public,
    }
    print(f"GPU: {torch.cuda.get_device_name()}  plan: {plan.plan.num_items} items, {plan.plan.num_merges} merges")
    for name, f in pieces.items():
        print(f"{per_call_us(f, args.calls):9.2f} us  {name}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        public()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode plan/launch knobs: split-KV chunk length and CTAs per SM, measured on the GPU.

    python tools/decode_variants.py OUT.json

For each workload, minimum chunk length (``min_chunk_keys``) and CTAs per SM (``ctas_per_sm``: more CTAs
in flight per SM, fewer pipeline stages each), plans the batch, checks the result against the fp32
reference and times the launch (cold L2, CUPTI span, median of 50): the decode kernel folds its split
merges itself, so ``n_kernels`` should be 1; its DevicePlan's merge counters must be zero after each run.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_timing  # noqa: E402

WORKLOADS = {"n1_kv3232": [3232], "n16_kv2048": [2048] * 16, "n64_kv2048": [2048] * 64}
MIN_CHUNKS = (0, 256, 512, 1024, 2048)
CTAS_PER_SM = (1, 2)


def main(argv=None) -> int:
    import torch

    import cute_attn
    from cute_attn import api, testing
    from cute_attn.kernels import find_launcher
    from cute_attn.plan import plan_work

    out_path = (argv or sys.argv[1:] or ["decode_variants.json"])[0]
    flush = bench_timing.make_l2_flusher()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for label, kv_lens in WORKLOADS.items():
        case = testing.make_gqa_decode_case(kv_lens, device="cuda", seed=1)
        ref_out, ref_lse = case.reference()
        base = cute_attn.plan_gqa_paged_decode(*case.inputs())
        launcher = find_launcher(base.config)
        for ctas_per_sm, min_chunk in itertools.product(CTAS_PER_SM, MIN_CHUNKS):
            config = dataclasses.replace(base.config, ctas_per_sm=ctas_per_sm, min_chunk_keys=min_chunk)
            plan = plan_work(config.plan_config(num_sms * ctas_per_sm), [1] * len(kv_lens), kv_lens)
            dp = api.DevicePlan.upload(config, plan, "cuda")
            out, lse = case.new_outputs()

            def run():
                launcher(dp, *case.inputs(), out, lse)

            row = dict(workload=label, ctas_per_sm=ctas_per_sm, min_chunk_keys=min_chunk, items=plan.num_items,
                       merges=plan.num_merges)
            try:
                run()
                torch.cuda.synchronize()
                testing.assert_close_benchmark(out, ref_out, "output")
                testing.assert_close_benchmark(lse, ref_lse, "lse")
                assert int(dp.merge_counters.abs().sum()) == 0, "merge counters not reset by the kernel"
                row["passed"] = True
                t = bench_timing.measure(run, flush, iters=50, warmup=10)
                row.update(gpu_us=t.gpu_us, gpu_sum_us=t.gpu_sum_us, n_kernels=t.n_kernels, wall_us=t.wall_us)
            except Exception as exc:  # keep measuring the other variants
                row.update(passed=False, error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out_path, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Persistent plans against one CTA an item (the hardware's dynamic dispatch), GQA prefill, on a GPU.

    python tools/grid_study.py [--json OUT] [--pages 64 1] [--iters 50]

Why: FA4 and FlashInfer fa3 stay 3-13% ahead of our planned GQA prefill on the FIB representatives (session 21's bench,
``docs/perf/h200-latest.json``), and the serpentine deal beat plans that the cost model rates better balanced (session
20). A grid of one CTA per whole q tile (each KV head's), longest first, lets the hardware hand each freed SM the next
longest tile: greedy list scheduling on measured times, not on the model, at the price of a CTA prologue per item and
no overlap of the next item's Q load with this item's epilogue. This measures that plan beside the API's host plan
(``plan_gqa_paged_prefill``) in one process, each checked against the float32 reference, timed as the bench times
(cold L2, median CUPTI span). If one CTA an item wins, a persistent kernel that takes items from an atomic counter in
the same order keeps the win and the overlap; if it loses, the per-item prologue and the lost overlap cost more than
the balance buys.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

CASES = {  # label: (q_lens, kv_lens, heads, kv_heads): the lap-deal rows and the FIB representatives furthest behind
    "n4_q992_h32kv4": ([992] * 4, [992] * 4, 32, 4),
    "n8_q992_h32kv4": ([992] * 8, [992] * 8, 32, 4),
    "n16_q992_h32kv4": ([992] * 16, [992] * 16, 32, 4),
    "n8_q992_h16kv1": ([992] * 8, [992] * 8, 16, 1),
    "n8_q992_h20kv4": ([992] * 8, [992] * 8, 20, 4),
    "n8_q992_h5kv1": ([992] * 8, [992] * 8, 5, 1),
    "n8_q992_h24kv4": ([992] * 8, [992] * 8, 24, 4),
    "n4_q512_kv4096_h32kv4": ([512] * 4, [4096] * 4, 32, 4),
}


def item_grid_plan(config, q_lens, kv_lens, device):
    """The whole-tile plan of one CTA per item, longest first (the serpentine deal over as many CTAs as items: one
    lap), uploaded."""
    from cute_attn.api import DevicePlan
    from cute_attn.plan import PlanCapacity
    from cute_attn.plan_partition import q_tiles, whole_dealt_plan
    import numpy as np

    q = np.asarray(q_lens, dtype=np.int64)
    kv = np.asarray(kv_lens, dtype=np.int64)
    probe = config.plan_config(1)
    num_items = q_tiles(probe, q, kv, np.zeros(q.size, bool))[0].size * config.num_kv_heads
    plan_config = dataclasses.replace(config.plan_config(num_items), whole_deal="serpentine")
    capacity = PlanCapacity(max_items=num_items, max_partials=0, max_merges=0)
    plan = whole_dealt_plan(plan_config, q, kv, capacity)
    assert plan.num_merges == 0 and int(np.diff(plan.work_indptr).max()) == 1
    return DevicePlan.upload(config, plan, device), num_items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--pages", type=int, nargs="+", default=[64])
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    import torch

    import cute_attn
    from ab_policy import checked_span  # this folder: the tools' run-check-time step
    from cute_attn import testing
    from cute_attn.timing import ColdL2Timer

    if not torch.cuda.is_available():
        print("grid_study: needs a CUDA GPU")
        return 0
    timer = ColdL2Timer(iters=args.iters)
    rows = []
    for label, (q_lens, kv_lens, heads, kv_heads) in CASES.items():
        if args.only and label not in args.only:
            continue
        for page_size in args.pages:
            case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads,
                                                 page_size=page_size, device="cuda", seed=len(q_lens))
            inputs = tuple(case.inputs())
            reference = case.reference()
            planned = cute_attn.plan_gqa_paged_prefill(*inputs)
            grid, num_items = item_grid_plan(planned.config, q_lens, kv_lens, torch.device("cuda"))
            row = dict(batch=label, page_size=page_size, items=num_items)
            for mode, plan in (("planned", planned), ("item_grid", grid)):
                out, lse = case.new_outputs()

                def run(out=out, lse=lse, plan=plan):
                    cute_attn.gqa_paged_prefill(*inputs, out, lse, plan=plan)

                row[mode] = checked_span(run, out, lse, reference, f"{label} p{page_size} {mode}", timer)
            cute_attn.raise_on_device_error()
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

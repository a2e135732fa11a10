"""What a GQA prefill item costs on the GPU: a fixed part and a part per key tile, fitted from uniform plans.

    python tools/item_cost_study.py [--json OUT] [--page-size 64] [--iters 50]

Why: the planners price an item at ``kv tiles x kv_tile + PREFILL_ITEM_OVERHEAD_KEYS`` (320) keys, and that price
misleads them: the lap deal, which the model rates 5% better balanced than the serpentine deal, ran 6% slower (session
20), and under ncu its busiest SM issued 48% of its peak where the serpentine's issued 44%, at the same mean and the
same DRAM bytes (session 21, ``docs/perf-history.md``). This measures the price instead. Each case is a batch of
``33 n`` requests of one q tile each (16 tokens at h32/kv4: 128 packed rows) over ``k`` kv tiles, whose host plan deals
exactly ``n`` whole items of ``k`` tiles to each of the 132 CTAs (4 KV heads); every item's last tile is the causal
diagonal. The call is checked against the float32 reference, then timed as the bench times (cold L2, median CUPTI
span). A least-squares fit of ``span = c + n (fixed + per_tile k)`` over the grid gives the item's fixed cost in key
tiles (``fixed / per_tile``), the number the planners' overhead should be.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TILES = (1, 2, 4, 8)
ITEMS_PER_CTA = (1, 2, 4, 8)
HEADS, KV_HEADS, CTAS = 32, 4, 132


def batch(items_per_cta: int, kv_tiles: int, kv_tile: int = 128, tile_tokens: int = 16):
    """(q_lens, kv_lens): requests of one q tile each over ``kv_tiles`` key tiles, ``items_per_cta`` items a CTA."""
    requests = CTAS * items_per_cta // KV_HEADS
    return [tile_tokens] * requests, [kv_tiles * kv_tile] * requests


def fit(rows) -> dict:
    """Least squares of ``span = c + n fixed + n k per_tile`` over the rows (keys n, k, span_us)."""
    import numpy as np

    a = np.array([[1.0, r["n"], r["n"] * r["k"]] for r in rows])
    y = np.array([r["span_us"] for r in rows])
    (c, fixed, per_tile), *_ = np.linalg.lstsq(a, y, rcond=None)
    return dict(launch_us=round(float(c), 2), item_fixed_us=round(float(fixed), 3),
                per_tile_us=round(float(per_tile), 3), fixed_in_tiles=round(float(fixed / per_tile), 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    import cute_attn
    from ab_policy import checked_span  # this folder: the tools' run-check-time step
    from cute_attn import testing
    from cute_attn.timing import ColdL2Timer

    if not torch.cuda.is_available():
        print("item_cost_study: needs a CUDA GPU")
        return 0
    timer = ColdL2Timer(iters=args.iters)
    rows = []
    for n in ITEMS_PER_CTA:
        for k in TILES:
            q_lens, kv_lens = batch(n, k)
            case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=HEADS, num_kv_heads=KV_HEADS,
                                                 page_size=args.page_size, device="cuda", seed=n * 10 + k)
            inputs = tuple(case.inputs())
            plan = cute_attn.plan_gqa_paged_prefill(*inputs)
            counts = np.diff(plan.plan.work_indptr)
            assert plan.plan.num_merges == 0 and counts.min() == counts.max() == n, counts
            out, lse = case.new_outputs()

            def run(out=out, lse=lse):
                cute_attn.gqa_paged_prefill(*inputs, out, lse, plan=plan)

            row = dict(n=n, k=k, span_us=checked_span(run, out, lse, case.reference(), f"n{n} k{k}", timer, digits=2))
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = dict(page_size=args.page_size, rows=rows, fit=fit(rows))
    print(json.dumps(result["fit"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

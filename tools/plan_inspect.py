"""Inspect what the planner does with a batch: items, splits, partials and CTA balance.

    python tools/plan_inspect.py decode --kv 3232
    python tools/plan_inspect.py prefill --q 992 992 992 992 --kv 992 992 992 992 --ctas 132
    python tools/plan_inspect.py decode --kv 3232 --items 10      # also print the first work items
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cute_attn.config import default_paged_config  # noqa: E402
from cute_attn.plan import ItemField, plan_work  # noqa: E402

DEFINITIONS = {  # kind, heads, head dims, page size, causal
    "prefill": ("gqa_paged_prefill", (32, 4), (128, 128), 64, True),
    "decode": ("gqa_paged_decode", (20, 4), (128, 128), 64, False),
    "mla": ("mla_paged_prefill", (16, 1), (576, 512), 1, True),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", choices=sorted(DEFINITIONS))
    p.add_argument("--q", type=int, nargs="*", help="query tokens per request (decode: 1 each)")
    p.add_argument("--kv", type=int, nargs="+", required=True, help="keys per request")
    p.add_argument("--ctas", type=int, default=132, help="persistent CTAs (SM count x CTAs per SM)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--items", type=int, default=0, help="print this many work items")
    args = p.parse_args(argv)
    kind, heads, dims, page, causal = DEFINITIONS[args.kernel]
    q_lens = [1] * len(args.kv) if args.kernel == "decode" or not args.q else args.q
    if len(q_lens) != len(args.kv):
        p.error("--q and --kv need one value per request")
    config = default_paged_config(kind, arch=args.arch, num_qo_heads=heads[0], num_kv_heads=heads[1],
                                  head_dim_qk=dims[0], head_dim_v=dims[1], page_size=page, causal=causal)
    plan = plan_work(config.plan_config(args.ctas), q_lens, args.kv)
    load = plan.cta_cost
    print(f"{config.cache_key()}")
    print(f"items {plan.num_items} (capacity {plan.capacity.max_items}), partial slots {plan.num_partials}, "
          f"merges {plan.num_merges}, busy CTAs {plan.num_ctas}/{args.ctas}")
    print(f"CTA cost: max {load.max()}  mean {load.mean():.1f}  max/mean {load.max() / max(load.mean(), 1e-9):.3f}")
    per_cta = np.diff(plan.work_indptr)
    print(f"items per CTA: min {per_cta.min()}  max {per_cta.max()}")
    if args.items:
        names = [f.name.lower() for f in ItemField]
        print("  ".join(f"{n:>13s}" for n in names))
        for row in plan.valid_items()[: args.items]:
            print("  ".join(f"{v:13d}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

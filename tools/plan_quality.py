"""How balanced each planner's plans are on the bench's prefill and MLA workloads (CPU only, the cost model).

    python tools/plan_quality.py [--json OUT]

Per workload: the device planner's contiguous cuts (``plan_partition``, the numpy twin of the kernel), the host
LPT (``plan.plan_work``), and a candidate for the device: the q tiles sorted by cost and dealt serpentine
(CTA 0, 1, .., m-1, m-1, .., 0, ...), whole tiles only, so no merges; and what the device planner now takes
(``PlanConfig.sorted_deal``: the deal where the cuts split and it is no worse). Each as the busiest CTA's modelled cost over
the mean (1.0: perfectly even) and its merge count. A device plan worse than the host's shows up as the
device-planned call's extra time (the MLA seed: 1.18 with 21 merges against 1.06, 64.4 against 52.9 us).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TOOLS)
sys.path.insert(0, os.path.dirname(_TOOLS))

import bench_workloads as bw  # noqa: E402

from cute_attn.config import default_paged_config  # noqa: E402
from cute_attn.plan import plan_work  # noqa: E402
from cute_attn.plan_partition import partition_plan, q_tiles  # noqa: E402

LAYOUTS = {
    "mla_paged_prefill": dict(num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_v=512, page_size=1),
    "gqa_paged_prefill": dict(num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128, page_size=1),
}


def tile_costs(plan_config, q_lens, kv_lens) -> np.ndarray:
    """The modelled cost of every (q tile, KV head) of the batch, as the planners see it."""
    return np.repeat(q_tiles(plan_config, q_lens, kv_lens).cost, plan_config.num_kv_heads)


def serpentine_loads(costs: np.ndarray, num_ctas: int) -> np.ndarray:
    """Per-CTA cost when the tiles, longest first, are dealt 0..m-1, m-1..0, ... (whole tiles)."""
    order = np.argsort(-costs, kind="stable")
    position = np.arange(costs.size)
    lap, offset = position // num_ctas, position % num_ctas
    cta = np.where(lap % 2 == 0, offset, num_ctas - 1 - offset)
    return np.bincount(cta, weights=costs[order], minlength=num_ctas)


def compare(kind: str, q_lens, kv_lens, num_ctas: int = 132) -> dict:
    config = default_paged_config(kind, arch="sm_90a", causal=True, **LAYOUTS[kind])
    plan_config = config.plan_config(num_ctas)
    cuts = partition_plan(dataclasses.replace(plan_config, sorted_deal=False), q_lens, kv_lens)
    device = partition_plan(plan_config, q_lens, kv_lens)  # what the device planner picks: cuts or the deal
    lpt = plan_work(plan_config, np.asarray(q_lens), np.asarray(kv_lens))
    costs = tile_costs(plan_config, q_lens, kv_lens)
    serp = serpentine_loads(costs, num_ctas)

    def balance(loads):
        loads = np.asarray(loads, dtype=np.float64)
        return round(float(loads.max() / loads.mean()), 3)

    return dict(tiles=int(costs.size), max_tile_over_width=round(float(costs.max() * num_ctas / costs.sum()), 2),
                cuts=balance(cuts.cta_cost), cuts_merges=int(cuts.num_merges), lpt=balance(lpt.cta_cost),
                lpt_merges=int(lpt.num_merges), serpentine=balance(serp), device=balance(device.cta_cost),
                device_merges=int(device.num_merges))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    for kind, workloads in (("mla_paged_prefill", bw._mla_workloads()), ("gqa_paged_prefill", bw._prefill_workloads())):
        for w in workloads:
            row = dict(kind=kind, workload=w.label, **compare(kind, w.q_lens, w.kv_lens))
            rows.append(row)
            print(f"{kind:18s} {w.label:20s} tiles {row['tiles']:5d} max tile / W {row['max_tile_over_width']:6.2f} | "
                  f"cuts {row['cuts']:.3f} ({row['cuts_merges']} merges) | LPT {row['lpt']:.3f} "
                  f"({row['lpt_merges']}) | serpentine {row['serpentine']:.3f} (0) | device {row['device']:.3f} "
                  f"({row['device_merges']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

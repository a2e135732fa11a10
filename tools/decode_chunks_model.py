"""How balanced a planner-free split-KV decode would be: equal key chunks fetched from an atomic counter, in the cost
model.

    python tools/decode_chunks_model.py [--sms 132] [--json OUT]

Issue 9's last cold row is a decode one (MLA decode 64 x 8192 page 64: the default call +11.2 µs over plan-once, the
device planner's ~7-9 µs in it). Decode has too few whole units to fill the GPU (64 requests, 132 SMs), so a
planner-free decode must split keys without a plan. The rule modelled here needs no pass over the batch beyond the
one every self-scheduling CTA already makes (``unit_schedule.batch_rules``): every CTA reads the batch's key total
(``kv_indptr[batch]`` pages) and cuts each request into chunks of the same ``chunk`` keys, ``chunk`` = the total over
``split`` x SMs rounded up to the kv tile; units (request, KV head, chunk) go request-major to whichever CTA frees
first (a counter), a request of more than one chunk merges its partials (the combine, or the last CTA's fold).

For each bench decode row (GQA decode h20/kv4 page 64, MLA decode h16 page 64) it prints the busiest CTA in
key-equivalents (``plan._cost``: keys rounded to the kv tile, plus the item overhead) of the host plan (the plan-once
call), the device twin's plan (the default call) and the chunk rule at ``split`` 1, 2 and 3, with each one's merges;
the ``sorted`` columns take the same units longest first (LPT order: what an in-kernel sort of the batch's requests by
length before the first unit would buy). CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dynamic_schedule_model import greedy_makespan  # noqa: E402  (the same list scheduling as the prefill model)


def rows() -> dict:
    """The bench's decode rows: label -> (kind, layout, kv_lens)."""
    import bench_workloads as bw

    out = {}
    for w in bw.all_workloads():
        if w.kernel == bw.DECODE:
            out[f"gqa_{w.label}"] = ("gqa_paged_decode", {}, list(w.kv_lens))
        elif w.kernel == "mla_paged_decode_h16_ckv512_kpe64_ps64":
            out[f"mla_{w.label}"] = ("mla_paged_prefill", {}, list(w.kv_lens))
    return out


def chunk_keys(total_keys: int, kv_heads: int, sms: int, split: int, kv_tile: int) -> int:
    """The chunk every CTA derives from the batch's key total: the work over ``split`` x SMs, whole kv tiles."""
    per = -(-total_keys * kv_heads // (sms * split))
    return max(kv_tile, -(-per // kv_tile) * kv_tile)


#: a request stays whole up to this much past the chunk (the planner's slack idea: 4096 keys against a 4032-key chunk
#: must not become 4032 + 64), and is otherwise cut in even pieces of whole kv tiles
SLACK = 1 / 8


def chunk_costs(config, kv_lens, chunk: int) -> tuple[np.ndarray, int]:
    """Unit costs in counter order (request-major, KV heads, then pieces) and the (request, head)s that merge."""
    from cute_attn.plan import _cost

    costs = []
    merges = 0
    tile = config.kv_tile
    for kv in kv_lens:
        n = max(1, -(-kv // int(chunk * (1 + SLACK))))
        step = -(-(-(-kv // n)) // tile) * tile  # even pieces, whole tiles: the last one is the short one
        n = max(1, -(-kv // step))
        merges += n > 1
        keys = [min(step, kv - c * step) for c in range(n)]
        for _ in range(config.num_kv_heads):
            costs.extend(keys)
    return _cost(np.asarray(costs, dtype=np.int64), config), merges * config.num_kv_heads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from cute_attn import tuning
    from cute_attn.plan import PlanCapacity, plan_work
    from cute_attn.plan_partition import partition

    out = []
    splits = (1, 2, 3)
    print(f"{'row':26s} {'mean':>7s} {'host':>7s} {'twin':>7s} "
          + " ".join(f"{f'split{s}':>7s} {'sorted':>7s}" for s in splits)
          + "   merges host/twin/" + "/".join(map(str, splits)))
    for label, (kind, layout, kv_lens) in rows().items():
        q_lens = [1] * len(kv_lens)
        workload = tuning.Workload.for_kind(kind, kv_lens, None if kind == "gqa_paged_decode" else q_lens, **layout)
        config = tuning.api_config(kind, workload, "sm_90a").plan_config(args.sms)
        host = plan_work(config, q_lens, kv_lens)
        capacity = PlanCapacity.for_limits(config, max_batch=len(kv_lens), max_total_q=len(kv_lens))
        twin, _ = partition(config, np.asarray(q_lens), np.asarray(kv_lens), capacity=capacity)
        row = dict(row=label, host=int(host.cta_cost.max()), twin=int(twin.cta_cost.max()),
                   host_merges=int(host.num_merges), twin_merges=int(twin.num_merges))
        for split in splits:
            costs, merges = chunk_costs(config, kv_lens, chunk_keys(sum(kv_lens), config.num_kv_heads, args.sms,
                                                                    split, config.kv_tile))
            row[f"split{split}"], row[f"split{split}_merges"] = greedy_makespan(costs, args.sms), merges
            row[f"split{split}_sorted"] = greedy_makespan(np.sort(costs)[::-1], args.sms)
            if split == 1:
                row["mean"] = float(costs.sum() / args.sms)
        out.append(row)
        best = min(row[f"split{s}_sorted"] for s in splits)
        print(f"{label:26s} {row['mean']:7.0f} {row['host']:7d} {row['twin']:7d} "
              + " ".join(f"{row[f'split{s}']:7d} {row[f'split{s}_sorted']:7d}" for s in splits)
              + f"   {row['host_merges']}/{row['twin_merges']}/"
              + "/".join(str(row[f'split{s}_merges']) for s in splits)
              + f"   (split1 x host {row['split1'] / row['host']:.3f}, best sorted x host {best / row['host']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

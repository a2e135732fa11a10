"""How balanced a planner-free prefill would be: whole q tiles fetched from an atomic counter, in the cost model.

    python tools/dynamic_schedule_model.py [--sms 132] [--json OUT]

Issue 9's prefill cold rows pay the device planner (10-22 µs in-kernel at 1-32 x 992) and the combine launch a device
plan always makes (~2.3 µs with nothing to fold, session 32). A kernel that schedules itself, as FA3 / FA4 do, pays
neither: each CTA takes the next whole (request, q tile, KV head) unit from a global counter, in an order computed
from the indptrs alone, with no split and so no merge. This models that schedule with the planner's own cost model
(``plan._cost``: keys rounded to the kv tile, plus the item overhead) and greedy list scheduling (the next unit goes to
the CTA that frees first: what an atomic counter does when every unit costs what the model says), for two orders:

* ``request_major``: requests in order, each request's q tiles last (longest) first, heads innermost (FA3's varlen
  order, and the order of the self-scheduling build of session 33: ``cute_attn.plan_units.unit_items``);
* ``rank_major``: q tiles by their rank from each request's end (every request's last tile, then every second-last,
  ...), requests then heads inside a rank: exactly longest first for equal requests, needing a prefix per rank.

It prints each bench prefill row's modelled busiest CTA against the host plan's (``plan_work``, the planned call) and
the device twin's (``plan_partition``, the default call's plan), in key-equivalents and as a ratio: GQA prefill
(h32/kv4, page 64) and the MLA prefill bench's recorded workloads (h16, page 1). CPU only.

``--claim`` models when a CTA takes its next unit, in the kernel's own order (session 36). The greedy schedule above
assumes a CTA claims a unit when it frees; the built kernel's load role claims unit n+1 as unit n's loads begin, a
whole unit ahead, so at start-up every CTA holds two units before any has finished one and, in longest-first order,
the longest units pair up. ``ahead`` is that schedule; ``late`` claims once the current unit's last K tile is issued,
the K ring's depth (two tiles) before it ends (``PagedAttentionConfig.late_claim``). H200, session 36, planner-free
kernel over the host plan's: 1 x 992 1.20 (ahead 1.21), MLA 1 x 1028 1.30 (1.38), MLA seed 1.12 (1.14), MLA
20 x 3842 1.13 (1.09), ragged 12 1.21 (1.10); late 1.00, 1.00, 1.07, 1.02, 1.07.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cute_attn.plan_units import claim_ahead_makespan, claim_late_makespan  # noqa: E402  (the claims' model)

#: the bench's GQA prefill rows (h32/kv4, page 64): label -> (q_lens, kv_lens)
ROWS = {
    "n1_q992": ([992], [992]),
    "n4_q992": ([992] * 4, [992] * 4),
    "n8_q992": ([992] * 8, [992] * 8),
    "n16_q992": ([992] * 16, [992] * 16),
    "n32_q992": ([992] * 32, [992] * 32),
    "n4_q512_kv4096": ([512] * 4, [4096] * 4),
    "n8_q128_kv2048": ([128] * 8, [2048] * 8),
    "ragged_12": ([33, 700, 1, 990, 400, 128, 64, 512, 900, 5, 260, 7], [33, 900, 3000, 990, 800, 4096, 64, 600, 900,
                                                                          5, 2000, 7]),
}


def mla_rows() -> dict:
    """The MLA prefill bench's workloads (``bench_workloads``): label -> (q_lens, kv_lens)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_workloads

    return {f"mla_{w.label}": (list(w.q_lens), list(w.kv_lens)) for w in bench_workloads.all_workloads()
            if w.kernel == bench_workloads.MLA}


def unit_costs(config, q_lens, kv_lens, order: str) -> np.ndarray:
    """Costs of the whole (request, q tile, head) units in ``order`` (module docstring)."""
    from cute_attn.plan import _cost, _tiles
    from cute_attn.plan_units import unit_costs as kernel_order_costs

    if order == "request_major":  # the self-scheduling kernel's own order (plan_units, its numpy twin)
        return kernel_order_costs(config, q_lens, kv_lens)
    tiles = _tiles(config, np.asarray(q_lens), np.asarray(kv_lens))
    cost = _cost(tiles.kv_end.astype(np.int64), config)  # one per q tile, request-major, tiles ascending
    request = tiles.q_tiles[:, 0]
    last = np.searchsorted(request, request, side="right") - 1  # each q tile's request's last tile
    rank = last - np.arange(request.size)  # 0 for a request's last (longest) tile
    if order == "request_major":
        keys = np.lexsort((rank, request))
    elif order == "rank_major":
        keys = np.lexsort((request, rank))
    else:
        raise ValueError(order)
    return np.repeat(cost[keys], tiles.num_heads)


def greedy_makespan(costs: np.ndarray, num_ctas: int) -> int:
    """Busiest CTA when each unit, in order, goes to the CTA that frees first (ties: the lower CTA)."""
    heap = [(0, cta) for cta in range(num_ctas)]
    for c in costs:
        load, cta = heapq.heappop(heap)
        heapq.heappush(heap, (load + int(c), cta))
    return max(load for load, _ in heap)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--json")
    ap.add_argument("--claim", action="store_true", help="also model claiming a unit ahead / late (docstring)")
    args = ap.parse_args(argv)
    from cute_attn import tuning
    from cute_attn.plan import PlanCapacity, plan_work
    from cute_attn.plan_partition import partition

    rows = []
    print(f"{'row':24s} {'units':>6s} {'mean':>8s} {'host':>8s} {'twin':>8s} {'req-major':>10s} {'rank-major':>10s}")
    for label, (q_lens, kv_lens) in {**ROWS, **mla_rows()}.items():
        kind = "mla_paged_prefill" if label.startswith("mla_") else "gqa_paged_prefill"
        workload = tuning.Workload.for_kind(kind, kv_lens, q_lens)
        config = tuning.api_config(kind, workload, "sm_90a").plan_config(args.sms)
        host = plan_work(config, q_lens, kv_lens)
        capacity = PlanCapacity.for_limits(config, max_batch=len(q_lens), max_total_q=int(sum(q_lens)))
        twin, _ = partition(config, np.asarray(q_lens), np.asarray(kv_lens), capacity=capacity)
        row = dict(row=label, host=int(host.cta_cost.max()), twin=int(twin.cta_cost.max()))
        for order in ("request_major", "rank_major"):
            costs = unit_costs(config, q_lens, kv_lens, order)
            row[order] = greedy_makespan(costs, args.sms)
            row["units"], row["mean"] = int(costs.size), float(costs.sum() / args.sms)
        claims = ""
        if args.claim:
            costs = unit_costs(config, q_lens, kv_lens, "request_major")
            row["claim_ahead"] = claim_ahead_makespan(costs, args.sms)
            row["claim_late"] = claim_late_makespan(costs, args.sms, 2 * config.kv_tile)
            claims = f"  claimed ahead / late x host: {row['claim_ahead'] / row['host']:.3f} / " \
                     f"{row['claim_late'] / row['host']:.3f}"
        rows.append(row)
        print(f"{label:24s} {row['units']:6d} {row['mean']:8.0f} {row['host']:8d} {row['twin']:8d} "
              f"{row['request_major']:10d} {row['rank_major']:10d}   "
              f"(x host: {row['request_major'] / row['host']:.3f} / {row['rank_major'] / row['host']:.3f}){claims}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

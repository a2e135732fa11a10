"""Per-CTA and per-item times of the sm_90a GQA prefill attention kernel (a ``cta_stamps`` build), on a GPU.

    python tools/cta_timeline.py [--batch 8 1] [--q 992] [--kv 992] [--heads 32 --kv-heads 4] [--iters 30]
        [--arms default device serpentine lap lpt lpt-tile] [--row-writers 8 [--rows-per-writer 1024]] [--json OUT]

Each CTA of the kernel built with ``probe="cta_stamps"`` (``ops/gqa_prefill.probe_policy``) writes the time it
entered, the time its ``griddepcontrol.wait`` returned, its consumers' end (``globaltimer``, ns), its item count, its
SM and each item's end to scratch (the last rows of ``partial_lse``). Arms: ``default`` (the device planner launched
before it every call), ``device`` (that device plan reused), and fixed whole-tile plans built here on the host and
loaded into the same buffers: ``serpentine`` (the twin's deal), ``lap`` (each lap's longest to its least loaded CTA),
``lpt`` (greedy, longest first to the least loaded CTA, counts free: the planners' price, kv tiles x 128 + 320 keys)
and ``lpt-tile`` (the same with an item priced at one kv tile, session 22's fit). Each call runs after a cold-L2
flush; it prints medians over calls in us from the call's earliest release (entries, releases, ends: first, median,
last), the kernel's modelled balance, and a least-squares fit of an item's time on its kv tiles over every arm's
items (a CTA's first item apart: it pays the pipeline's fill). Every arm's output is checked against the float32
reference first.

Questions (docs/perf-history.md, sessions 26-27): where the default call's attention kernel loses time after the planner
(session 26: ends are the reused plan's but for the last CTA), and what an item really costs: at 8 x 992 the
serpentine's busiest CTA models 1.082 of the mean and ends ~13 us after the median CTA, while the lap deal (1.024)
ran slower in session 20.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def relative_ns(words: np.ndarray, reference: int) -> np.ndarray:
    """int32 globaltimer_lo stamps as signed ns from ``reference`` (the low words wrap every ~4.3 s)."""
    return ((words.astype(np.int64) - reference + 2**31) % 2**32) - 2**31


def summarize(stamps: np.ndarray) -> dict:
    """One call's ``[ctas, 4]`` stamps (entry, release, end, items) -> times in us from its earliest release."""
    release0 = int(stamps[:, 1][np.argmin(relative_ns(stamps[:, 1], int(stamps[0, 1])))])
    entry, release, end = (relative_ns(stamps[:, k], release0) / 1000.0 for k in range(3))
    last = int(np.argmax(end))
    return dict(entry_first=float(entry.min()), entry_last=float(entry.max()), release_last=float(release.max()),
                end_first=float(end.min()), end_median=float(np.median(end)), end_last=float(end.max()),
                last_cta=last, last_cta_entry=float(entry[last]), last_cta_items=int(stamps[last, 3]))


def item_times(stamps: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Per CTA, each item's time in us (item 0 from the CTA's release) from a call's ``[ctas, 5 + items]`` stamps,
    as far as the row holds item stamps."""
    from cute_attn.kernels.sm90.gqa_prefill import CTA_STAMPS

    out = []
    for cta in range(stamps.shape[0]):
        n = min(int(counts[cta]), stamps.shape[1] - CTA_STAMPS)
        ends = relative_ns(stamps[cta, CTA_STAMPS:CTA_STAMPS + n], int(stamps[cta, 1])) / 1000.0
        out.append(np.diff(np.concatenate([[0.0], ends])))
    return out


def fit_item_cost(times: list[np.ndarray], tiles: list[np.ndarray]) -> dict:
    """Least squares of ``time = fixed + per_tile * kv_tiles`` over every CTA's items but its first (which pays the
    pipeline's fill), and the first items' mean excess over that fit."""
    x, y, first_excess = [], [], []
    for t, k in zip(times, tiles):
        x.extend(k[1:len(t)]), y.extend(t[1:])
    a = np.stack([np.ones(len(x)), np.asarray(x, dtype=float)], axis=1)
    (fixed, per_tile), *_ = np.linalg.lstsq(a, np.asarray(y), rcond=None)
    for t, k in zip(times, tiles):
        if len(t):
            first_excess.append(t[0] - fixed - per_tile * k[0])
    residual = np.asarray(y) - a @ np.array([fixed, per_tile])
    return dict(fixed_us=float(fixed), per_tile_us=float(per_tile), fixed_in_tiles=float(fixed / per_tile),
                first_item_excess_us=float(np.mean(first_excess)), residual_rms_us=float(np.sqrt(np.mean(residual**2))),
                items=len(y))


def greedy_deal(cost: np.ndarray, heads: int, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """(q tile, CTA) of each position, as ``plan_partition.sorted_deal`` lays positions (q tiles longest first, each
    tile's heads in a row), each position to the least loaded CTA so far (ties: the lowest CTA): the LPT, counts free."""
    import heapq

    order = np.argsort(-np.asarray(cost), kind="stable")
    tile = order[np.arange(order.size * heads) // heads]
    heap = [(0, c) for c in range(num_ctas)]
    cta = np.empty(tile.size, dtype=np.int64)
    for p, t in enumerate(tile):
        load, c = heapq.heappop(heap)
        cta[p] = c
        heapq.heappush(heap, (load + int(cost[t]), c))
    return tile, cta


def host_plan(arm: str, plan_config, q_lens, kv_lens, capacity):
    """The whole-tile WorkPlan of a host arm (module docstring)."""
    import dataclasses

    from cute_attn import plan_partition as pp

    if arm == "lap":
        return pp.whole_dealt_plan(dataclasses.replace(plan_config, whole_deal="lap"), q_lens, kv_lens, capacity)
    if arm == "serpentine":
        return pp.whole_dealt_plan(dataclasses.replace(plan_config, whole_deal="serpentine"), q_lens, kv_lens,
                                   capacity)
    price = {"lpt": plan_config.item_overhead_keys, "lpt-tile": plan_config.kv_tile}[arm]
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    req, row_start, row_count, kv_end, offset, _ = pp.q_tiles(plan_config, q_lens, kv_lens)
    cost = -(-kv_end // plan_config.kv_tile) * plan_config.kv_tile + price
    tile, cta = greedy_deal(cost, plan_config.num_kv_heads, plan_config.num_ctas)
    loads = np.bincount(cta, weights=pp.piece_cost(plan_config, kv_end)[tile], minlength=plan_config.num_ctas)
    pages = -(-kv_lens // plan_config.page_size)
    return pp._dealt_plan(plan_config, capacity, tile, cta, loads.astype(np.int64), req, row_start, row_count, kv_end,
                          offset, np.cumsum(pages) - pages)


def _stamps(device_plan, num_ctas: int) -> np.ndarray:
    import torch

    words = device_plan.scratch()[1].view(torch.int32).cpu().numpy()
    return words[words.shape[0] - 1 - np.arange(num_ctas)]


def _default_plan(batch: int):
    """The DevicePlan the default call's route used (``api._DEVICE_ROUTES``: the one built with the probe)."""
    from cute_attn import api

    for hit in api._DEVICE_ROUTES.values():
        route = hit.route
        if route is not None and hit.config.probe == "cta_stamps" and route.batch == batch and route.slots:
            return next(iter(route.slots.values()))
    raise RuntimeError("no default-call route with a cta_stamps build: did the call take the device path?")


def _loaded_plan(device_plan, work_plan):
    """A DevicePlan of ``device_plan``'s config holding ``work_plan``, with stamp rows past its partial slots."""
    import torch

    from cute_attn.api import DevicePlan

    plan = DevicePlan.allocate(device_plan.config, work_plan.capacity, work_plan.work_indptr.size - 1,
                               device_plan.items.device)
    plan.refresh(work_plan)
    plan.plan = work_plan
    rows = max(work_plan.num_partials, 1) + work_plan.work_indptr.size
    config = device_plan.config
    plan.partial_out = torch.empty(rows, config.tile_q_rows, config.head_dim_v, dtype=plan.partial_out.dtype,
                                   device="cuda")
    plan.partial_lse = torch.empty(rows, config.tile_q_rows, dtype=torch.float32, device="cuda")
    return plan


def _plan_lists(plan) -> tuple[np.ndarray, list[np.ndarray]]:
    """(items a CTA, each CTA's items' kv tiles) of a DevicePlan's lists."""
    from cute_attn.plan import ItemField as F

    work = plan.work_indptr.cpu().numpy()
    items = plan.items.cpu().numpy()
    kv_tile = plan.config.kv_tile
    tiles = [-(-(items[work[c]:work[c + 1], F.KV_END] - items[work[c]:work[c + 1], F.KV_START]) // kv_tile)
             for c in range(work.size - 1)]
    return np.diff(work), tiles


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 1])
    p.add_argument("--q", type=int, default=992)
    p.add_argument("--kv", type=int, default=992)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--heads", type=int, default=32, help="query heads (FIB layouts: e.g. 5 with --kv-heads 1)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--arms", nargs="+", default=["default", "device"],
                   choices=["default", "device", "serpentine", "lap", "lpt", "lpt-tile"])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--row-writers", type=int, default=0,
                   help="device planners built with this many row writers (device_planner.row_writers_policy, with "
                        "--rows-per-writer: the launch rule's rows a writer); 0: the default build")
    p.add_argument("--rows-per-writer", type=int, default=0)
    args = p.parse_args(argv)
    import contextlib

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("cta_timeline.py reads stamps the kernel writes: it needs a CUDA GPU")
    import cute_attn
    from cute_attn import testing, timing
    from cute_attn.ops.gqa_prefill import probe_policy

    flush = timing.make_l2_flusher()
    report, all_times, all_tiles = {}, [], []
    writers = contextlib.nullcontext()
    if args.row_writers:
        from cute_attn.kernels.common.device_planner import ROWS_PER_WRITER, row_writers_policy

        writers = row_writers_policy(args.row_writers, args.rows_per_writer or ROWS_PER_WRITER)
    with probe_policy("cta_stamps"), writers:
        for batch in args.batch:
            case = testing.make_gqa_prefill_case([args.q] * batch, [args.kv] * batch, num_qo_heads=args.heads,
                                                 num_kv_heads=args.kv_heads, head_dim=128, page_size=64,
                                                 device="cuda", seed=batch)
            ref_out, ref_lse = case.reference()
            inputs = case.inputs()
            out, lse = case.new_outputs()
            device_plan = cute_attn.plan_gqa_paged_prefill(*inputs, on_device=True)
            for arm in args.arms:
                if arm == "default":
                    plan_of = (lambda: _default_plan(batch))
                    call = (lambda: cute_attn.gqa_paged_prefill(*inputs, out, lse))
                else:
                    plan = device_plan
                    if arm != "device":
                        plan_config = device_plan.config.plan_config(device_plan.work_indptr.shape[0] - 1)
                        plan = _loaded_plan(device_plan, host_plan(arm, plan_config, [args.q] * batch,
                                                                   [args.kv] * batch, _capacity(device_plan)))
                    plan_of = (lambda plan=plan: plan)
                    call = (lambda plan=plan: cute_attn.gqa_paged_prefill(*inputs, out, lse, plan=plan))
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                for name, got, want in (("output", out, ref_out), ("lse", lse, ref_lse)):
                    # a failure here may be a plan whose partial slots reach the stamp rows
                    testing.assert_close_benchmark(got, want, f"{batch} x {args.q} {arm} {name}")
                plan = plan_of()
                num_ctas = plan.work_indptr.shape[0] - 1
                counts, tiles = _plan_lists(plan)
                calls, times = [], []
                for _ in range(args.iters):
                    flush()
                    call()
                    torch.cuda.synchronize()
                    stamps = _stamps(plan, num_ctas)
                    calls.append(summarize(stamps))
                    times.append(item_times(stamps, counts))
                med = {k: statistics.median(c[k] for c in calls) for k in calls[0]}
                item_med = [np.median(np.stack([t[c] for t in times]), axis=0) for c in range(num_ctas)]
                all_times.extend(item_med), all_tiles.extend(tiles)
                price = plan.config.item_overhead_keys / plan.config.kv_tile  # the planners' item, in kv tiles
                busy = np.array([k.sum() + price * k.size for k in tiles], dtype=float)
                label = f"prefill {batch} x {args.q} / {args.kv} h{args.heads}/kv{args.kv_heads}, {arm}"
                med.update(modelled_busiest=float(busy.max() / busy.mean()), items=counts.tolist(),
                           kv_tiles=[k.tolist() for k in tiles], item_us=[t.round(3).tolist() for t in item_med],
                           sm=[int(x) for x in _stamps(plan, num_ctas)[:, 4]])
                report[label] = med
                print(f"{label}: entry {med['entry_first']:.2f} .. {med['entry_last']:.2f}, releases to "
                      f"{med['release_last']:.2f}, ends {med['end_first']:.2f} / {med['end_median']:.2f} / "
                      f"{med['end_last']:.2f} us; last CTA {med['last_cta']:.0f} entered {med['last_cta_entry']:.2f}, "
                      f"{med['last_cta_items']:.0f} items; model busiest {med['modelled_busiest']:.3f}", flush=True)
    fit = fit_item_cost(all_times, all_tiles)
    report["item cost fit"] = fit
    print(f"item time = {fit['fixed_us']:.3f} + {fit['per_tile_us']:.3f} x kv tiles us (fixed = "
          f"{fit['fixed_in_tiles']:.2f} tiles; rms {fit['residual_rms_us']:.3f} us over {fit['items']} items; a CTA's "
          f"first item +{fit['first_item_excess_us']:.2f} us)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _capacity(device_plan):
    from cute_attn.plan import PlanCapacity

    return PlanCapacity(device_plan.items.shape[0], device_plan.partial_out.shape[0], device_plan.merges.shape[0])


if __name__ == "__main__":
    sys.exit(main())

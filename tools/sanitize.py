"""Every registered kernel of one arch under compute-sanitizer: memcheck, racecheck, synccheck, initcheck.

    python tools/sanitize.py [--tools memcheck,racecheck,synccheck,initcheck] [--out docs/perf/h200-sanitizer.txt]
                             [--log-dir DIR] [--cases decode,prefill,...]

GPU only (one call on the H200). The driver first runs every case in its own process, without a sanitizer,
against the float32 reference (this also compiles every kernel into one disk cache), then runs one
``compute-sanitizer --tool T python tools/sanitize.py --worker`` per tool over all cases, and writes the
summary table. Kernels are compiled with line info (``CUTE_DSL_LINEINFO=1``), so a report names the
source line of each access.

Cases (small, ragged, each a registered config's shape):
    decode-*       split-KV items and the fused in-kernel merge (one long request among short and empty ones)
    prefill-*      causal prefill with split KV and the combine launch
    mla            absorbed MLA prefill over a shuffled page-size-1 pool
    edge-decode    an edge page table: page id num_pages - 1, two requests sharing pages, empty requests
    edge-prefill   the same for prefill
    mtp-*          multi-token decode (1..8 causal draft tokens), mla-p*: MLA at larger pages
    mla-<split>-p* the sm_90a MLA prefill kernel with each consumer split (full-s, shared-s, score-wg, score-wg-ovl) at
                   pages 1 and 64
    mla-*fused-p*  the sm_90a MLA prefill and decode kernels with ``fused_merge`` (the in-kernel fold of split items)
    prefill-fused-* the sm_90a GQA prefill kernel with ``fused_merge``: device plan (p1, p64) and host plan (hostplan)
    prefill-k-ahead-p* the sm_90a GQA prefill's row gathers with ``k_ahead`` (K one tile ahead of V), pages 1 and 4
    gather-warps-*  the sm_90a decode kernels' row gathers by a producer warpgroup (``gather_warps`` 4): decode at
                   pages 1 and 2, multi-token decode at page 1
    q-tile-pairs-* the device planner's q-tile pass chosen per launch (``q_tile_pass_policy(0)``: two tiles a thread
                   past one pass), with and without empty requests
    early-dependents-* attention kernels that release the combine's launch right after their wait
                   (``config.early_dependents_policy``)
    combine-grid-* the combine launch with a capped grid (CTAs walk the merges; 4 CTAs for MLA decode's case)
    hostplan-decode  check_indices=True: the host-planned path (every other case plans on the device)
    line-deal-decode  the device planner's line deal at page 1 (on by default at pages 1-2 and from 8 KV heads)
    deal-first-prefill / deal-first-mla  the sorted deal made before the cuts (``config.deal_first_policy``, session
                   25): kept with no cuts made at GQA 8 x 992, then decided by the cuts on an MLA batch;
                   deal-one-site-*: the same with the deal's code at one call site (``deal_one_site_policy``)
    lap-lists-prefill  a dealt plan's rows built in one pass by (lap, CTA) slots (``lap_lists_policy``, session 25;
                   the GQA prefill default since session 26)
    lap-turn-prefill / lap-turn-ragged  each lap's CTA order rotated past the CTAs of its longest cost
                   (``config.lap_turn_policy``, session 27): 8 x 992, and a ragged batch whose laps hold several costs
    rank-deal-mla  a ranked deal past the MLA sort's 1024 keys (``config.rank_deal_policy``; built in session 24)
    hostile-decode the device planner's bounds checks (ids past the pool and negative; those requests 0 / -inf, a split
                   one included); -late: the last CTA to arrive empties their items (``late_scan_policy``), -scan-last: a
                   scan CTA is that last one (built in session 24; clean in session 25)
    hostile-prefill-writers  the same on GQA prefill with three row writers a launch (``row_writers_policy``,
                   session 30): each writer takes the marks; -late / -scan-last: the last CTA to arrive empties the
                   late writers' items
    count-sort-prefill  the sorted deal's order by counting (``count_sort_policy``, session 30; built, not run)
    dynamic-schedule-* / mla-dynamic-schedule-*  the planner-free GQA / MLA prefill (``dynamic_schedule_policy``,
                   sessions 33 / 34): pages 64 and 1, and -fault / -fault-p1: a page id past the pool (its request
                   0 / -inf) at page 16 (checked before the TMA boxes) / page 1 (in the row gathers)
    late-claim-* / mla-late-claim-*  the same, pages 64 and 1, with ``late_claim_policy`` (session 36: the next unit claimed
                   after the current one's loads are issued)
    gather         the TMA page gather kernel (a test-side kernel)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
_TOOL_FLAGS = {
    "memcheck": ["--leak-check", "no"],
    # racecheck: both hazard kinds (errors and warnings) count
    "racecheck": ["--racecheck-report", "all"],
    "synccheck": [],
    "initcheck": [],
}


# ------------------------------------------------------------------------------------------- cases
def _cases(arch: str) -> dict:
    """name -> (kernel kind, thunk that runs it once and returns (out, lse, ref_out, ref_lse))."""
    import torch

    import cute_attn
    from cute_attn import testing
    from cute_attn.compile import registered_configs

    cases = {}
    for config in registered_configs(arch):
        if getattr(config, "kind", None) is None:
            continue
        hq, hkv, ps = config.num_qo_heads, config.num_kv_heads, config.page_size
        if config.kind == "gqa_paged_decode":
            def run(hq=hq, hkv=hkv, ps=ps):
                case = testing.make_gqa_decode_case([3232, 0, 130, 1, 700], num_qo_heads=hq, num_kv_heads=hkv,
                                                    page_size=ps, device="cuda", seed=hq + ps)
                return _run_api(cute_attn.gqa_paged_decode, case, arch)
            cases[f"decode-h{hq}kv{hkv}-p{ps}"] = (config.kind, run)
        elif config.kind == "gqa_paged_prefill":
            def run(hq=hq, hkv=hkv, ps=ps):
                case = testing.make_gqa_prefill_case([1, 40, 0, 200], [700, 40, 5, 1500], num_qo_heads=hq,
                                                     num_kv_heads=hkv, page_size=ps, device="cuda", seed=hq + ps)
                return _run_api(cute_attn.gqa_paged_prefill, case, arch)
            cases[f"prefill-h{hq}kv{hkv}-p{ps}"] = (config.kind, run)
        elif config.kind == "gqa_paged_multi_token_decode":
            def run(hq=hq, hkv=hkv, ps=ps):
                case = testing.make_gqa_multi_token_decode_case([4, 1, 8, 2], [3232, 3, 200, 900], num_qo_heads=hq,
                                                                num_kv_heads=hkv, page_size=ps, device="cuda",
                                                                seed=hq + ps)
                return _run_api(cute_attn.gqa_paged_multi_token_decode, case, arch)
            cases[f"mtp-h{hq}kv{hkv}-p{ps}"] = (config.kind, run)
        elif config.kind == "mla_paged_prefill":
            def run(ps=ps):
                case = testing.make_mla_prefill_case([3, 50, 0], [100, 300, 7], page_size=ps, device="cuda", seed=5)
                return _run_api(cute_attn.mla_paged_prefill, case, arch)
            cases["mla" if ps == 1 else f"mla-p{ps}"] = (config.kind, run)
            for heads in (16, 8):  # one query a request: the decode spec's own kernel (heads as the MMA's N)
                def run_decode(ps=ps, heads=heads):
                    case = testing.make_mla_decode_case([4100, 0, 1, 300, 65], num_heads=heads, page_size=ps,
                                                        device="cuda", seed=6 + heads)
                    return _run_api(cute_attn.mla_paged_decode, case, arch)
                cases[f"mla-decode-h{heads}-p{ps}"] = ("mla_paged_decode", run_decode)

    def mla_split(split: str, page_size: int):  # a consumer split of the sm_90a MLA kernel other than the default
        def run():
            from cute_attn.ops.mla_prefill import consumer_split

            with consumer_split(split):  # short, empty, keyless and split items (partials + the combine)
                case = testing.make_mla_prefill_case([3, 50, 0, 20, 9], [100, 300, 7, 3000, 0], page_size=page_size,
                                                     device="cuda", seed=7)
                return _run_api(cute_attn.mla_paged_prefill, case, arch)
        return run

    def mla_fused(page_size: int, heads: int | None):  # fused_merge: the in-kernel fold (None: prefill)
        def run():
            from cute_attn.ops.mla_prefill import fused_merge_policy

            with fused_merge_policy(True):
                if heads is None:
                    case = testing.make_mla_prefill_case([3, 50, 0, 20, 9], [100, 300, 7, 3000, 0],
                                                         page_size=page_size, device="cuda", seed=8)
                    return _run_api(cute_attn.mla_paged_prefill, case, arch)
                case = testing.make_mla_decode_case([4100, 0, 1, 300, 65, 8000], num_heads=heads,
                                                    page_size=page_size, device="cuda", seed=9 + heads)
                return _run_api(cute_attn.mla_paged_decode, case, arch)
        return run

    if arch == "sm_90a":
        from cute_attn.ops.mla_prefill import SM90_CONSUMER_SPLITS

        for page_size in (1, 64):
            cases[f"mla-fused-p{page_size}"] = ("mla_paged_prefill", mla_fused(page_size, None))
            cases[f"mla-decode-h16-fused-p{page_size}"] = ("mla_paged_decode", mla_fused(page_size, 16))
        cases["mla-decode-h8-fused-p1"] = ("mla_paged_decode", mla_fused(1, 8))
        for split in SM90_CONSUMER_SPLITS:
            for page_size in (1, 64):
                name = f"mla-{split.replace('_', '-')}-p{page_size}"
                cases[name] = ("mla_paged_prefill", mla_split(split, page_size))

    def edge_decode():
        case = testing.with_edge_page_table(testing.make_gqa_decode_case(
            [0, 300, 300, 1, 0, 2000], device="cuda", seed=77), share=(1, 2))
        return _run_api(cute_attn.gqa_paged_decode, case, arch)

    def edge_prefill():
        case = testing.with_edge_page_table(testing.make_gqa_prefill_case(
            [0, 30, 30, 1, 0], [0, 300, 300, 1, 5], device="cuda", seed=78), share=(1, 2))
        return _run_api(cute_attn.gqa_paged_prefill, case, arch)

    def host_planned_decode():  # the check_indices=True path: host plan, cached (the others plan on the device)
        case = testing.make_gqa_decode_case([3232, 0, 130, 1, 700], device="cuda", seed=79)
        return _run_api(cute_attn.gqa_paged_decode, case, arch, check_indices=True)

    def hostile_decode(late):  # the device planner's bounds checks: requests 0 (split), 1 and 3 hold ids
        # outside the pool; ``late``: the last CTA to arrive empties their items in place (planner_scan.py)
        def run():
            from cute_attn.kernels.common.device_planner import late_scan_policy

            with late_scan_policy(scan_last=late == "scan_last") if late else contextlib.nullcontext():
                case = testing.make_gqa_decode_case([3232, 300, 130, 700], device="cuda", seed=80)
                ref_out, ref_lse = case.reference()  # of the valid batch, before the corruption
                ref_out[[0, 1, 3]], ref_lse[[0, 1, 3]] = 0, float("-inf")  # what faulted requests get
                kvp = case.kv_indptr.tolist()
                case.kv_indices[kvp[0] + 2] = case.k_cache.shape[0]
                case.kv_indices[kvp[1]] = case.k_cache.shape[0] + 5
                case.kv_indices[kvp[3]] = -7
                out, lse, _ = _run_api(cute_attn.gqa_paged_decode, case, arch)
                _expect_index_fault()
            return out, lse, lambda: (ref_out, ref_lse)
        return run

    def prefill_small_pages(page_size):  # pages 2..8 gather rows as page 1 does (no registered config of their own)
        def run():
            case = testing.make_gqa_prefill_case([1, 40, 0, 200], [700, 40, 5, 1500], page_size=page_size,
                                                 device="cuda", seed=90 + page_size)
            return _run_api(cute_attn.gqa_paged_prefill, case, arch)
        return run

    def deal_prefill():  # the device planner's sorted deal replaces cuts that split 49 tiles (GQA, 4 KV heads)
        case = testing.make_gqa_prefill_case([700], [700], device="cuda", seed=81)
        return _run_api(cute_attn.gqa_paged_prefill, case, arch)

    def deal_whole_cuts():  # whole-tile cuts within W/32 given way to the serpentine deal (the sort then runs)
        from cute_attn.ops.gqa_prefill import device_whole_deal_policy

        with device_whole_deal_policy(True):
            case = testing.make_gqa_prefill_case([992] * 8, [992] * 8, device="cuda", seed=108)
            return _run_api(cute_attn.gqa_paged_prefill, case, arch)

    def deal_2048():  # 1984 q tiles sorted four keys a thread and dealt (DEAL_MAX_Q_TILES 2048)
        from cute_attn.ops.gqa_prefill import deal_max_q_tiles_policy

        with deal_max_q_tiles_policy(2048):
            case = testing.make_gqa_prefill_case([992] * 32, [992] * 32, device="cuda", seed=111)
            return _run_api(cute_attn.gqa_paged_prefill, case, arch)

    def deal_mla():  # the sorted deal on an MLA batch of short requests (the seed's shape, smaller)
        q_lens, kv_lens = [179, 23, 43, 55, 43, 177, 191, 130], [186, 41, 109, 141, 167, 272, 243, 161]
        case = testing.make_mla_prefill_case(q_lens, kv_lens, device="cuda", seed=82)
        return _run_api(cute_attn.mla_paged_prefill, case, arch)

    def deal_whole_tiles():  # whole-tile cuts that snap unevenly (h20/kv4, 8 x 992: 1.12 x the mean) are dealt too
        case = testing.make_gqa_prefill_case([992] * 8, [992] * 8, num_qo_heads=20, num_kv_heads=4, device="cuda",
                                             seed=83)
        return _run_api(cute_attn.gqa_paged_prefill, case, arch)

    def line_deal_decode():  # decode's line deal (ops/gqa_decode.line_deals)
        from cute_attn.ops.gqa_decode import line_deal_policy

        with line_deal_policy((1,)):
            case = testing.make_gqa_decode_case([2048] * 7 + [5, 0, 3000], page_size=1, device="cuda", seed=84)
            return _run_api(cute_attn.gqa_paged_decode, case, arch)

    def prefill_fused(page_size: int, host_plan: bool):  # fused_merge: the GQA prefill's in-kernel fold
        def run():
            from cute_attn.ops.gqa_prefill import fused_merge_policy

            with fused_merge_policy(True):
                case = testing.make_gqa_prefill_case([1, 40, 0, 200, 3], [3000, 40, 5, 1500, 3], page_size=page_size,
                                                     num_qo_heads=20, num_kv_heads=4, device="cuda", seed=85)
                return _run_api(cute_attn.gqa_paged_prefill, case, arch, check_indices=host_plan)
        return run

    def prefill_k_ahead(page_size: int):  # row gathers with K one tile ahead of V (two pipeline states)
        def run():
            from cute_attn.ops.gqa_prefill import k_ahead_policy

            with k_ahead_policy((page_size,)):
                case = testing.make_gqa_prefill_case([1, 40, 0, 200, 64, 3], [3000, 40, 5, 1500, 3000, 3],
                                                     page_size=page_size, num_qo_heads=16, num_kv_heads=1,
                                                     device="cuda", seed=86)
                return _run_api(cute_attn.gqa_paged_prefill, case, arch)
        return run

    def gather_warps(kind: str, page_size: int):  # decode row gathers by four warps, a quarter of each stage each
        def run():
            from cute_attn.ops.gqa_decode import gather_warps_policy

            with gather_warps_policy((page_size,)):
                if kind == "decode":
                    case = testing.make_gqa_decode_case([3000, 15, 17, 0, 65], page_size=page_size, device="cuda",
                                                        seed=88 + page_size)
                    return _run_api(cute_attn.gqa_paged_decode, case, arch)
                case = testing.make_gqa_multi_token_decode_case([4, 1, 8, 2], [3000, 17, 65, 2], page_size=page_size,
                                                                device="cuda", seed=90 + page_size)
                return _run_api(cute_attn.gqa_paged_multi_token_decode, case, arch)
        return run

    def with_combine(kind: str, policy, seeds: tuple):  # a device-planned call that launches the combine, under
        # ``policy()``: GQA prefill (a short request beside a 40k-key one: merges) or MLA decode (ragged, an empty one)
        def run():
            with policy():
                if kind == "prefill":
                    case = testing.make_gqa_prefill_case([3, 40, 1], [40000, 300, 9000], device="cuda", seed=seeds[0])
                    return _run_api(cute_attn.gqa_paged_prefill, case, arch)
                case = testing.make_mla_decode_case([4096, 0, 70, 9000], device="cuda", seed=seeds[1])
                return _run_api(cute_attn.mla_paged_decode, case, arch)
        return run

    def combine_grid(kind: str, max_ctas: int):  # the capped combine grid: CTAs walk the merges a grid apart
        def policy():
            from cute_attn.kernels.common.combine import combine_grid_policy

            return combine_grid_policy(max_ctas)
        return with_combine(kind, policy, (87, 88))

    def q_tile_pass(q_lens, kv_lens):  # the device planner's q-tile pass chosen per launch (two a thread past 512)
        def run():
            from cute_attn.kernels.common.device_planner import q_tile_pass_policy

            with q_tile_pass_policy(0):
                case = testing.make_gqa_prefill_case(q_lens, kv_lens, device="cuda", seed=89)
                return _run_api(cute_attn.gqa_paged_prefill, case, arch)
        return run

    # 16 x 800 at group 8, 128-row tiles: 800 q tiles, two passes of pairs; the ragged one has empty requests
    cases["q-tile-pairs-prefill"] = ("device_planner", q_tile_pass([800] * 16, [800] * 16))
    cases["q-tile-pairs-ragged"] = ("device_planner", q_tile_pass([0, 130, 0, 1, 700, 0, 17, 2500] * 4,
                                                                  [5, 130, 64, 900, 700, 3, 17, 2600] * 4))

    def early_dependents(kind: str):  # attention CTAs release the combine's launch right after their wait
        def policy():
            from cute_attn.config import early_dependents_policy

            return early_dependents_policy(True)
        return with_combine(kind, policy, (96, 97))

    def mla_split_scores(page_size: int, policy_name: str = "split_scores_policy"):  # S^T split over the dims
        def run():  # (or another policy of the swapped kernel: its short stages)
            from cute_attn.ops import mla_decode

            with getattr(mla_decode, policy_name)(True):
                case = testing.make_mla_decode_case([4096, 0, 70, 9000, 1], page_size=page_size, device="cuda",
                                                    seed=98 + page_size)
                return _run_api(cute_attn.mla_paged_decode, case, arch)
        return run

    if arch == "sm_90a":
        cases["mla-decode-split-scores-p1"] = ("mla_paged_decode", mla_split_scores(1))
        cases["mla-decode-split-scores-p64"] = ("mla_paged_decode", mla_split_scores(64))
        for page_size in (1, 64):  # four 32-key K stages, S^T's 64-row view over each stage and its pad
            cases[f"mla-short-stages-p{page_size}"] = ("mla_paged_decode",
                                                       mla_split_scores(page_size, "short_stages_policy"))

    def combine_early_rows(kind: str):  # the combine's first slot rows loaded with the LSEs
        def policy():
            from cute_attn.kernels.common.combine import combine_early_rows_policy

            return combine_early_rows_policy(True)
        return with_combine(kind, policy, (99, 100))

    def even_pieces(kind: str, kv_lens, page_size: int):  # device plans cut equal one-tile requests in even pieces
        def run():
            from cute_attn.config import even_pieces_policy

            with even_pieces_policy(True):
                maker = testing.make_mla_decode_case if kind == "mla" else testing.make_gqa_decode_case
                case = maker(kv_lens, page_size=page_size, device="cuda", seed=101 + page_size)
                entry = cute_attn.mla_paged_decode if kind == "mla" else cute_attn.gqa_paged_decode
                return _run_api(entry, case, arch)
        return run

    def page_boxes(kind: str, page_size: int):  # whole-page K stages as kv_tile-row TMA boxes
        def run():
            from cute_attn.ops.mla_prefill import page_boxes_policy

            with page_boxes_policy(True):
                kv_lens = [4096, 0, 70, 9000, 1, 127]
                if kind == "decode":
                    case = testing.make_mla_decode_case(kv_lens, page_size=page_size, device="cuda",
                                                        seed=103 + page_size)
                    return _run_api(cute_attn.mla_paged_decode, case, arch)
                case = testing.make_mla_prefill_case([64, 0, 70, 300, 1, 127], kv_lens, page_size=page_size,
                                                     device="cuda", seed=104 + page_size, with_last_page_len=True)
                return _run_api(cute_attn.mla_paged_prefill, case, arch)
        return run

    def slack_cap():  # device plans' slacks capped in keys: MLA prefill 12K splits (merges) where it took whole tiles
        from cute_attn.config import max_slack_keys_policy

        with max_slack_keys_policy(1024):
            case = testing.make_mla_prefill_case([12000], [12000], device="cuda", seed=105)
            return _run_api(cute_attn.mla_paged_prefill, case, arch)

    cases["slack-cap-mla-prefill"] = ("device_planner", slack_cap)

    def split_merges(policy, kind: str, page_size: int, seed: int):  # batches whose plans split, under ``policy()``
        def run():
            with policy():
                if kind == "mla_decode":  # device-planned: planner, attention and combine in one chain
                    case = testing.make_mla_decode_case([4096, 0, 70, 9000, 1, 4096], page_size=page_size,
                                                        device="cuda", seed=seed)
                    return _run_api(cute_attn.mla_paged_decode, case, arch)
                if kind == "mla_prefill":  # host plan: real merges
                    case = testing.make_mla_prefill_case([8, 2, 0, 40], [9000, 3000, 7, 40], page_size=page_size,
                                                         device="cuda", seed=seed)
                    return _run_api(cute_attn.mla_paged_prefill, case, arch, check_indices=True)
                case = testing.make_gqa_prefill_case([1, 40, 0, 200, 3], [3000, 40, 5, 1500, 3], page_size=page_size,
                                                     device="cuda", seed=seed)
                return _run_api(cute_attn.gqa_paged_prefill, case, arch, check_indices=True)
        return run

    def eager_combine(kind: str, page_size: int):  # the combine folds each merge once its slots are counted in
        def policy():
            from cute_attn.ops.mla_prefill import eager_combine_policy

            return eager_combine_policy(True)
        return split_merges(policy, kind, page_size, (106 if kind == "mla_decode" else 107) + page_size)

    if arch == "sm_90a":
        cases["eager-combine-mla-decode-p64"] = ("combine", eager_combine("mla_decode", 64))
        cases["eager-combine-mla-decode-p1"] = ("combine", eager_combine("mla_decode", 1))
        cases["eager-combine-mla-prefill"] = ("combine", eager_combine("mla_prefill", 1))

    def bf16_partials(kind: str, page_size: int):  # split items store bf16 partial rows, the combine widens them
        def policy():
            from cute_attn.config import bf16_partials_policy

            return bf16_partials_policy(True)
        seed = {"mla_decode": 108, "mla_prefill": 109, "gqa_prefill": 110}[kind] + page_size
        return split_merges(policy, kind, page_size, seed)

    def cluster_merge(page_size: int, kv_lens: list):  # host plans whose merges each fill a cluster of CTAs
        def run():
            from cute_attn.ops.mla_decode import cluster_merge_policy

            with cluster_merge_policy(True):
                case = testing.make_mla_decode_case(kv_lens, page_size=page_size, device="cuda", seed=111 + page_size)
                return _run_api(cute_attn.mla_paged_decode, case, arch, check_indices=True)
        return run

    if arch == "sm_90a":  # 8 pieces a request (clusters of 8), 2 pieces (clusters of 2)
        cases["cluster-merge-mla-decode-8"] = ("mla_decode", cluster_merge(64, [2048] * 8))
        cases["cluster-merge-mla-decode-2"] = ("mla_decode", cluster_merge(1, [1000] * 64))

    def device_cluster_merge(page_size: int, kv_lens: list):  # device plans in clusters of 2, checked at run time
        def run():
            from cute_attn.ops.mla_decode import device_cluster_merge_policy

            with device_cluster_merge_policy(True):
                case = testing.make_mla_decode_case(kv_lens, page_size=page_size, device="cuda", seed=113 + page_size)
                return _run_api(cute_attn.mla_paged_decode, case, arch)
        return run

    if arch == "sm_90a":  # every merge folded in pairs; pairs beside combined merges
        cases["device-cluster-merge-mla-decode"] = ("mla_decode", device_cluster_merge(64, [1000] * 64))
        cases["device-cluster-merge-mla-decode-mixed"] = ("mla_decode", device_cluster_merge(
            1, [1000] * 50 + [9000, 3, 70, 20000] * 3))
    if arch == "sm_90a":
        cases["bf16-partials-mla-decode-p64"] = ("combine", bf16_partials("mla_decode", 64))
        cases["bf16-partials-mla-decode-p1"] = ("combine", bf16_partials("mla_decode", 1))
        cases["bf16-partials-mla-prefill"] = ("combine", bf16_partials("mla_prefill", 1))
        cases["bf16-partials-gqa-prefill"] = ("combine", bf16_partials("gqa_prefill", 64))
    if arch == "sm_90a":
        cases["mla-decode-page-boxes-p64"] = ("mla_paged_decode", page_boxes("decode", 64))
        cases["mla-decode-page-boxes-p128"] = ("mla_paged_decode", page_boxes("decode", 128))
        cases["mla-prefill-page-boxes-p64"] = ("mla_paged_prefill", page_boxes("prefill", 64))
    cases["even-pieces-decode"] = ("device_planner", even_pieces("gqa", [2048] * 16, 64))
    cases["even-pieces-mla-decode"] = ("device_planner", even_pieces("mla", [4096] * 16, 1))
    cases["combine-early-rows-prefill"] = ("combine", combine_early_rows("prefill"))
    cases["combine-early-rows-mla-decode"] = ("combine", combine_early_rows("mla_decode"))
    cases["early-dependents-prefill"] = ("combine", early_dependents("prefill"))
    cases["early-dependents-mla-decode"] = ("combine", early_dependents("mla_decode"))
    cases["combine-grid-prefill"] = ("combine", combine_grid("prefill", 1056))
    cases["combine-grid-mla-decode"] = ("combine", combine_grid("mla_decode", 4))
    if arch == "sm_90a":
        cases["prefill-k-ahead-p1"] = ("gqa_paged_prefill", prefill_k_ahead(1))
        cases["gather-warps-decode-p1"] = ("gqa_paged_decode", gather_warps("decode", 1))
        cases["gather-warps-decode-p2"] = ("gqa_paged_decode", gather_warps("decode", 2))
        cases["gather-warps-mtp-p1"] = ("gqa_paged_multi_token_decode", gather_warps("mtp", 1))
        cases["prefill-k-ahead-p4"] = ("gqa_paged_prefill", prefill_k_ahead(4))
        cases["prefill-fused-p1"] = ("gqa_paged_prefill", prefill_fused(1, False))
        cases["prefill-fused-p64"] = ("gqa_paged_prefill", prefill_fused(64, False))
        cases["prefill-fused-hostplan"] = ("gqa_paged_prefill", prefill_fused(64, True))
    if arch == "sm_90a":  # the planner-free builds' cases (sanitize_planner_free.py)
        from sanitize_planner_free import planner_free_cases

        cases.update(planner_free_cases(arch, _run_api, _page_fault_reported))
    cases["deal-prefill"] = ("gqa_paged_prefill", deal_prefill)
    cases["line-deal-decode"] = ("gqa_paged_decode", line_deal_decode)
    cases["deal-whole-tiles"] = ("gqa_paged_prefill", deal_whole_tiles)
    cases["deal-whole-cuts"] = ("device_planner", deal_whole_cuts)
    cases["deal-2048"] = ("device_planner", deal_2048)
    cases["deal-mla"] = ("mla_paged_prefill", deal_mla)
    for page_size in (2, 4, 8):
        cases[f"prefill-rows-p{page_size}"] = ("gqa_paged_prefill", prefill_small_pages(page_size))
    cases["edge-decode"] = ("gqa_paged_decode", edge_decode)
    cases["edge-prefill"] = ("gqa_paged_prefill", edge_prefill)
    cases["hostplan-decode"] = ("gqa_paged_decode", host_planned_decode)
    def rank_deal_mla():  # a ranked deal past the MLA sort's 1024 keys (config.rank_deal_policy, built in session 24)
        from cute_attn.config import rank_deal_policy

        with rank_deal_policy(4096):
            case = testing.make_mla_prefill_case([2200, 2200], [2300, 2250], device="cuda", seed=81)
            return _run_api(cute_attn.mla_paged_prefill, case, arch)

    cases["rank-deal-mla"] = ("device_planner", rank_deal_mla)

    def deal_first(mla, one_site=False):  # the sorted deal made before the cuts (config.deal_first_policy)
        def run():
            from cute_attn.config import deal_first_policy
            from cute_attn.kernels.common.device_planner import deal_one_site_policy

            with deal_first_policy(), deal_one_site_policy(one_site):
                if mla:  # made first, past W + W / 8: the cuts then decide
                    case = testing.make_mla_prefill_case([179, 23, 43, 55, 43, 177, 191, 130],
                                                         [186, 41, 109, 141, 167, 272, 243, 161], device="cuda",
                                                         seed=83)
                    return _run_api(cute_attn.mla_paged_prefill, case, arch)
                case = testing.make_gqa_prefill_case([992] * 8, [992] * 8, device="cuda", seed=84)
                return _run_api(cute_attn.gqa_paged_prefill, case, arch)
        return run

    cases["deal-first-prefill"] = ("device_planner", deal_first(False))
    cases["deal-first-mla"] = ("device_planner", deal_first(True))
    cases["deal-one-site-prefill"] = ("device_planner", deal_first(False, True))
    cases["deal-one-site-mla"] = ("device_planner", deal_first(True, True))

    def lap_lists():  # a dealt plan's rows in one pass by (lap, CTA) slots (device_planner.lap_lists_policy)
        from cute_attn.kernels.common.device_planner import lap_lists_policy

        with lap_lists_policy():
            case = testing.make_gqa_prefill_case([992] * 8, [992] * 8, device="cuda", seed=85)
            return _run_api(cute_attn.gqa_paged_prefill, case, arch)

    cases["lap-lists-prefill"] = ("device_planner", lap_lists)

    def lap_turn(ragged):  # each lap's CTA order rotated (config.lap_turn_policy)
        def run():
            from cute_attn.config import lap_turn_policy

            with lap_turn_policy():
                lens = (([35, 294, 224, 288, 28, 217], [269, 726, 963, 509, 608, 345]) if ragged
                        else ([992] * 8, [992] * 8))
                case = testing.make_gqa_prefill_case(*lens, device="cuda", seed=86)
                # 120 CTAs: on 132 the ragged batch's cuts win and no lap is turned
                return _run_api(cute_attn.gqa_paged_prefill, case, arch, num_sms=120 if ragged else None)
        return run

    cases["lap-turn-prefill"] = ("device_planner", lap_turn(False))
    cases["lap-turn-ragged"] = ("device_planner", lap_turn(True))
    def hostile_prefill_writers(late):  # three row writers (one a 40 rows) and page ids outside the pool in requests 2
        # (split) and 0: each writer takes the marks or (late) the last CTA to arrive empties the items of all three
        def run():
            from cute_attn.kernels.common.device_planner import late_scan_policy, row_writers_policy

            with row_writers_policy(8, 40), \
                    late_scan_policy(scan_last=late == "scan_last") if late else contextlib.nullcontext():
                case = testing.make_gqa_prefill_case([5, 0, 300, 1], [300, 3, 4000, 1], device="cuda", seed=87)
                ref_out, ref_lse = case.reference()
                qo, kvp = case.qo_indptr.tolist(), case.kv_indptr.tolist()
                for b in (0, 2):
                    ref_out[qo[b]:qo[b + 1]], ref_lse[qo[b]:qo[b + 1]] = 0, float("-inf")
                case.kv_indices[kvp[2] + 3] = case.k_cache.shape[0] + 2
                case.kv_indices[kvp[0]] = -1
                out, lse, _ = _run_api(cute_attn.gqa_paged_prefill, case, arch)
                _expect_index_fault()
            return out, lse, lambda: (ref_out, ref_lse)
        return run

    def count_sort_prefill():  # the sorted deal's order by counting (count_sort_policy, session 30): 1984 keys
        from cute_attn.kernels.common.device_planner import count_sort_policy

        with count_sort_policy():
            case = testing.make_gqa_prefill_case([992] * 8, [992] * 8, device="cuda", seed=88)
            return _run_api(cute_attn.gqa_paged_prefill, case, arch)

    cases["count-sort-prefill"] = ("device_planner", count_sort_prefill)
    cases["hostile-prefill-writers"] = ("device_planner", hostile_prefill_writers(False))
    cases["hostile-prefill-writers-late"] = ("device_planner", hostile_prefill_writers(True))
    cases["hostile-prefill-writers-scan-last"] = ("device_planner", hostile_prefill_writers("scan_last"))
    cases["hostile-decode"] = ("device_planner", hostile_decode(False))
    cases["hostile-decode-late"] = ("device_planner", hostile_decode(True))
    cases["hostile-decode-scan-last"] = ("device_planner", hostile_decode("scan_last"))

    def gather():
        from cute_attn.compile import compile_kernel
        from cute_attn.kernels.common.page_gather import PageGatherConfig

        fn = compile_kernel(PageGatherConfig(arch=arch, page_size=16, num_kv_heads=8, head_dim=128))
        g = torch.Generator(device="cuda").manual_seed(3)
        pool = torch.randn((41, 16, 8, 128), generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.randperm(41, generator=g, device="cuda")[:17].to(torch.int32)
        out = torch.full((17, 16, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn(pool, ids, out)
        torch.cuda.synchronize()
        return out, None, lambda: (pool[ids.long()], None)

    cases["gather"] = ("page_gather", gather)
    return cases


def _expect_index_fault():
    """The device error word names an index fault (and is cleared): the hostile cases' check."""
    import cute_attn
    from cute_attn.device_errors import DeviceIndexError

    try:
        cute_attn.raise_on_device_error()
    except DeviceIndexError:
        return
    raise AssertionError("the device planner recorded no fault")


def _page_fault_reported(result):
    """A planner-free case with a page id past the pool: the fault was reported (and is cleared); the rows' values are
    the GPU tier's business, so the check compares the output with itself."""
    import cute_attn

    try:
        cute_attn.raise_on_device_error()
    except ValueError:
        return result[0], None, lambda: (result[0], None)
    raise AssertionError("the page past the pool was not reported")


def _run_api(entry, case, arch, route=None, **kw):
    """Run once; the reference is a thunk, so sanitized runs (which skip the check) never compute it. ``route``: the
    call must launch one self-scheduling build with that config flag (a case its policy routed elsewhere would
    sanitize another kernel and pass)."""
    import torch

    from cute_attn.unit_schedule_route import recorded_launches

    out, lse = case.new_outputs()
    with recorded_launches() as routes:
        entry(*case.inputs(), out, lse, arch=arch, **kw)
    torch.cuda.synchronize()
    if route is not None and [bool(getattr(r.config, route)) for r in routes] != [True]:
        raise AssertionError(f"expected one {route} launch, got {[r.config for r in routes]}")
    return out, lse, case.reference


def _check(name, result) -> str:
    from cute_attn import testing

    out, lse, reference = result
    ref_out, ref_lse = reference()
    try:
        testing.assert_close_benchmark(out, ref_out, "output")
        if lse is not None:
            testing.assert_close_benchmark(lse, ref_lse, "lse")
    except AssertionError as exc:
        return f"FAIL {exc}"
    return "PASS"


# ------------------------------------------------------------------------------------------- worker
def worker(arch: str, names: list[str], check: bool) -> int:
    import torch

    torch.cuda.init()
    cases = _cases(arch)
    failures = 0
    for name in names:
        kind, run = cases[name]
        print(f"=== case {name} ({kind})", flush=True)
        result = run()
        verdict = _check(name, result) if check else "RAN"
        failures += verdict.startswith("FAIL")
        print(f"=== case {name}: {verdict}", flush=True)
    return 1 if failures else 0


# ------------------------------------------------------------------------------------------- driver
_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) error")
_RACES = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def _summarise(tool: str, text: str) -> str:
    if tool == "racecheck":
        m = _RACES.search(text)
        if m:
            return f"{m.group(1)} hazards ({m.group(2)} errors, {m.group(3)} warnings)"
    m = _ERRORS.search(text)
    return f"{m.group(1)} errors" if m else "no summary line (see the log)"


def _clean(tool: str, text: str) -> bool:
    if tool == "racecheck":
        m = _RACES.search(text)
        return bool(m) and m.group(1) == "0"
    m = _ERRORS.search(text)
    return bool(m) and m.group(1) == "0"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="summary file (e.g. docs/perf/h200-sanitizer.txt)")
    parser.add_argument("--log-dir", type=Path, default=None, help="full sanitizer logs, one per tool")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    os.environ.setdefault("CUTE_DSL_LINEINFO", "1")
    os.environ.setdefault("CUTE_ATTN_CACHE_DIR", str(Path.home() / ".cache" / "cute_attn_sanitize"))
    if args.worker:
        return worker(args.arch, args.cases.split(","), check=not args.no_check)

    import torch

    if not torch.cuda.is_available():
        print("tools/sanitize.py needs a CUDA GPU and compute-sanitizer; none here, nothing written")
        return 2
    names = args.cases.split(",") if args.cases else list(_cases(args.arch))
    me = [sys.executable, str(Path(__file__).resolve()), "--arch", args.arch, "--cases", ",".join(names)]
    lines = []
    start = time.time()
    ref = subprocess.run(me + ["--worker"], capture_output=True, text=True)
    verdicts = re.findall(r"=== case (\S+): (.*)", ref.stdout)
    print(ref.stdout[-4000:], ref.stderr[-4000:])
    lines.append(f"reference check, no sanitizer (exit {ref.returncode}):")
    lines += [f"  {n:<28} {v}" for n, v in verdicts]
    status = 0 if ref.returncode == 0 else 1
    lines.append("")
    lines.append(f"{'tool':<10} {'result':<40} seconds")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    for tool in args.tools.split(","):
        t0 = time.time()
        cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "50", *_TOOL_FLAGS[tool], *me,
               "--worker", "--no-check"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        if args.log_dir:
            (args.log_dir / f"sanitizer-{tool}.log").write_text(text)
        ran = len(re.findall(r"=== case \S+: RAN", text))
        summary = f"{_summarise(tool, text)}, {ran}/{len(names)} cases ran"
        clean = _clean(tool, text) and ran == len(names)
        status |= 0 if clean else 1
        lines.append(f"{tool:<10} {summary:<40} {time.time() - t0:.0f}")
        print(f"{tool}: {summary}\n{text[-3000:]}", flush=True)
    header = [
        f"# compute-sanitizer over every registered {args.arch} kernel ({time.strftime('%Y-%m-%d')}, "
        f"{torch.cuda.get_device_name()}, commit {_commit()}; {time.time() - start:.0f} s)",
        f"# cases: {', '.join(names)}",
        "",
    ]
    report = "\n".join(header + lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return status


def _commit() -> str:
    if os.environ.get("CUTE_ATTN_COMMIT"):  # the device machine gets a copy of the tree without .git
        return os.environ["CUTE_ATTN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())

"""A/B of a spec policy (a default that a measurement decides) in one process, on a GPU.

    python tools/ab_policy.py POLICY [--json OUT] [--pages 1 64] [--only LABEL ...] [--iters 1]

POLICY is one of
    line_deal     small-page decode's line deal (``ops/gqa_decode.LINE_DEAL_PAGE_SIZES``) off / on at the case's page
    prefill_fold  the sm_90a GQA prefill's in-kernel merge fold (``ops/gqa_prefill.FUSED_MERGE``) off / on
    k_ahead       the sm_90a GQA prefill's row gathers with K one tile ahead of V (``ops/gqa_prefill.K_AHEAD_PAGE_SIZES``)
                  off / on at the case's page (pages 1..8)
    combine_grid  the combine launch's grid: a CTA per merge slot of the capacity, or capped at
                  ``COMBINE_GRID_TRIAL`` CTAs walking the merges (``kernels/common/combine.COMBINE_MAX_CTAS``)
    early_dependents  attention kernels release the next launch right after their wait (``config.EARLY_DEPENDENTS``):
                  the combine that follows a device plan is dispatched during the attention grid, not after it
    combine_early_rows  the combine loads a row's first slots with its LSEs (``combine.COMBINE_EARLY_ROWS``) off / on:
                  the combine's cases plus MLA decode 16 x 4096
    even_pieces   device plans cut equal one-tile requests in even pieces (``config.EVEN_PIECES``) off / on: the bench's
                  split decode rows; only the device-planned and default calls move
    page_boxes    sm_90a MLA K stages of one page's rows as kv_tile-row TMA boxes (``ops/mla_prefill.PAGE_BOXES``) off /
                  on: MLA decode's bench batches and the MLA prefill seed at pages 64 and 128
    max_slack     device plans' snap and whole-tile slacks capped at 1024 keys (``config.MAX_SLACK_KEYS``) off / on: MLA
                  prefill 16K and 12K, whose whole-tile cuts sit ~3% above the mean; only device-planned calls move
    eager_combine the sm_90a MLA combine folds each merge once its slots are in, while the attention grid runs
                  (``ops/mla_prefill.EAGER_COMBINE``) off / on: the page-boxes cases and MLA prefill 1 / 1028
    lap_deal      GQA prefill host plans dealt lap by lap onto the least loaded CTAs (``ops/gqa_prefill.WHOLE_DEAL``
                  "lap") off / on: the FIB prefill rows whose serpentine deal the model rates uneven; planned calls move
    serpentine_deal  GQA prefill host plans always the twin's serpentine deal (``WHOLE_DEAL`` "serpentine") off / on:
                  the rows whose host plan is the LPT or the twin's cuts today; only planned calls move
    gather_warps  the sm_90a decode row gathers (pages 1, 2) by a producer warpgroup, a quarter of each stage a warp
                  (``ops/gqa_decode.GATHER_WARPS_PAGE_SIZES``), against the one producer warp: the line deal's decode
                  batches and layouts; all three calls move
    device_whole_deal  GQA prefill device plans' whole-tile cuts given way to the serpentine deal within 1/16
                  (``ops/gqa_prefill.DEVICE_WHOLE_DEAL``) off / on: the serpentine_deal rows; device-planned and default
                  calls move
    dynamic_schedule  the GQA prefill default call planner-free (``ops/gqa_prefill.DYNAMIC_SCHEDULE``: in-kernel index
                  checks, then units from a counter; no planner, no combine) off / on: the bench's prefill rows
                  and two FIB layouts; only the default call moves
    mla_dynamic_schedule  the same for MLA prefill (``ops/mla_prefill.DYNAMIC_SCHEDULE``, session 34) off / on: the
                  bench's seven recorded MLA prefill batches at pages 1 and 64; only the default call moves
    late_claim    the planner-free route's load role claims its next unit once the current unit's last K tile is issued
                  (``config.LATE_CLAIM_KINDS``, session 36) off / on, every batch
                  on the route (MLA's floor at 0): the dynamic_schedule rows and the MLA bench batches; only the
                  default call moves
    route_plans   host plans launch the planner-free build where the cost model says it is no slower
                  (``config.ROUTE_PLAN_KINDS``, session 37) off / on: the late_claim rows; only the plan-once call
                  moves, on the rows the rule routes
    line_schedule the default call of decode planner-free (``ops/gqa_decode.LINE_SCHEDULE``, session 38: each CTA
                  derives its stretch of the device plan, no planner launch) off / on: the bench's decode rows at
                  h20/kv4 and h8/kv1, pages 64 and 16; only the default call moves
    mla_line_schedule  the same for one-token MLA decode (``ops/mla_decode.SM90_LINE_SCHEDULE``): its bench rows
    mla_short_stages  the swapped MLA decode's four 32-key K stages, not two of 64 (``mla_decode.SM90_SHORT_STAGES``):
                  the bench's MLA decode rows at pages 64 and 1; all three calls move
    rank_major    the GQA route's uniform batches of few units a CTA rank-major (``config.RANK_MAJOR_KINDS``) off / on
    line_uniform  the line builds' closed form for uniform batches (``config.LINE_UNIFORM_KINDS``, session 42)
                  off / on: the line_schedule and mla_line_schedule rows at pages 64 and 1; only the default call moves
    line_scan     the line builds' page-id scan 8 ids a pass, not 1 (``config.LINE_SCAN_IDS_PER_THREAD``, session 40):
                  the line_schedule and mla_line_schedule rows at pages 1 and 64; only the default call moves
    deal_2048     GQA prefill plans deal batches of up to 2048 q tiles (``ops/gqa_prefill.DEAL_MAX_Q_TILES``, the device
                  sort four keys a thread) off / on: 32 x 992 (1984 q tiles) and a ragged batch of 1840; all three calls
                  move (host plans take the twin's deal)
    bf16_partials split items store bf16 partial rows (``config.BF16_PARTIALS``, the sm_90a MLA and GQA prefill
                  kernels) off / on: the eager-combine cases and GQA prefill 1 x 992 and 4 x 512 / 4096, whose plans split
    rank_deal     device plans rank the q tiles of small batches past the sort's keys and deal them
                  (``config.RANK_DEAL_MAX_Q_TILES`` 0 / 4096, built in session 24): MLA prefill 1 x 16384, 1 x 6000 and
                  2 x 2200; only the device-planned and default calls move
    deal_first    device plans make the sorted deal before the cuts and keep it, with no cuts made, within W + W / 8
                  (``config.DEAL_FIRST_KINDS``, session 25; no bench plan changes): GQA prefill 8 x 992 at h32/kv4 and
                  h20/kv4, 16 x 992, 4 x 512 / 4096, 1 x 992 at h16/kv1 (cut), the MLA seed and 1 / 1028; only the
                  device-planned and default calls move
    deal_one_site the deal-first planner with the deal's code at one call site (``device_planner.DEAL_ONE_SITE``,
                  session 25) against the landed two-site build, deal-first on for both causal kinds: GQA prefill
                  8 x 992, 1 x 992 at h16/kv1, the MLA seed and 1 / 1028 (MLA -0.5 us, GQA +1.7: off)
    lap_lists     a dealt plan's rows built in one pass by (lap, CTA) slots, no search for an item's CTA
                  (``device_planner.LAP_LISTS`` False / True; its default follows deal_first since session 26): GQA
                  prefill 8 x 992 h32/kv4 and h20/kv4, 16 x 992, 4 x 512 / 4096, the MLA seed and 1 / 1028; only the
                  device-planned and default calls move
    lap_turn      each lap's CTA order rotated past the CTAs of its longest cost instead of the serpentine's turn
                  (``config.LAP_TURN_KINDS``, on since session 28): GQA prefill 4 / 8 / 16 x 992 h32/kv4, 8 x 992 h16/kv1,
                  h20/kv4, h32/kv16; all three calls move (host plans take the twin's deal)
    row_writers   the item rows written by several planning CTAs, each making the same plan
                  (``device_planner.ROW_WRITERS`` 1 / MAX_ROW_WRITERS; built in session 30 and kept off): GQA prefill
                  2..32 x 992, h20/kv4, 4 x 512 / 4096; only the device-planned and default calls move.
                  ``CUTE_ATTN_ROWS_PER_WRITER`` overrides the launch rule's rows a writer
                  (``device_planner.ROWS_PER_WRITER``)
    count_sort    the sorted deal's order by counting where every q tile holds fewer than 64 kv tiles
                  (``device_planner.COUNT_SORT``; built in session 30, not run): the row writers' GQA prefill batches,
                  the MLA seed and 1 / 1028; only the device-planned and default calls move
    cluster_merge sm_90a MLA decode host plans whose merges each fill a thread-block cluster folded by the cluster in
                  distributed shared memory, no combine launch (``ops/mla_decode.SM90_CLUSTER_MERGE``, session 31) off /
                  on: MLA decode's bench batches (16 x 4096 and 64 x 8192 take it; 1 x 4096 and 128 x 4096 do not) and
                  2 x 2048; only planned calls move
    device_cluster_merge  sm_90a MLA decode device plans launched in clusters of 2 that check their shape at run time,
                  fold the merges a pair holds whole and flag them for the combine (``ops/mla_decode.
                  SM90_DEVICE_CLUSTER_MERGE``, session 32) off / on: the cluster_merge cases and the ragged batch of
                  64; only the device-planned and default calls move
    q_tile_pass   the device planner's q-tile pass: one tile a thread, or chosen per launch (two past one pass;
                  ``kernels/common/device_planner.Q_TILES_PER_PASS`` 1 / 0); only the device-planned and default calls
                  move

For each case (batch, page size, head layout) and both settings: the call with the plan made once on the device
(``plan_*(on_device=True)``, the bench's ``cute_attn_device_planned``), the default call (plans on every call:
``cute_attn``) and the host-planned call (``cute_attn_planned``), each checked against the float32 reference, then
timed as the bench times its rows (cold L2, median of 50 CUPTI spans). ``--iters 1``: check and compile only (a
step that fills the compile cache while other work runs, before the timed step).
Predictions live with each policy in ``docs/perf-history.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ab_cases_mla_decode import (_cluster_merge_cases, _device_cluster_merge_cases,  # noqa: E402  (this folder)
                                 _mla_line_schedule_cases, _mla_short_stages_cases)

DECODE_BATCHES = {"n64_kv2048": [2048] * 64, "n128_kv4096": [4096] * 128, "n37_ragged": None}
DECODE_LAYOUTS = ((20, 4), (24, 8), (32, 16))
PREFILL_CASES = {  # label: (q_lens, kv_lens, heads, kv_heads)
    "n1_q992_h32kv4": ([992], [992], 32, 4),
    "n8_q992_h32kv4": ([992] * 8, [992] * 8, 32, 4),
    "n16_q992_h32kv4": ([992] * 16, [992] * 16, 32, 4),
    "n8_q992_h20kv4": ([992] * 8, [992] * 8, 20, 4),
    "n8_q992_h24kv8": ([992] * 8, [992] * 8, 24, 8),
    "n4_q512_kv4096_h32kv4": ([512] * 4, [4096] * 4, 32, 4),
}


def _ragged():
    import numpy as np

    return np.random.default_rng(37).integers(1, 9000, 37).tolist()


def _line_deal_cases(pages):
    from cute_attn import testing
    from cute_attn.ops import gqa_decode

    for label, kv_lens in DECODE_BATCHES.items():
        kv_lens = kv_lens or _ragged()
        for page_size in pages:
            for heads, kv_heads in DECODE_LAYOUTS:
                def make(kv_lens=kv_lens, page_size=page_size, heads=heads, kv_heads=kv_heads):
                    return testing.make_gqa_decode_case(kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads,
                                                        page_size=page_size, device="cuda", seed=len(kv_lens))
                yield (dict(batch=label, page_size=page_size, heads=heads, kv_heads=kv_heads), make, "decode",
                       lambda on, page_size=page_size: gqa_decode.line_deal_policy((page_size,) if on else ()))


def _line_schedule_cases(pages):
    """The default call of decode planner-free (``ops/gqa_decode.LINE_SCHEDULE``: each CTA derives its stretch, no
    planner launch) off / on, on the bench's decode rows at h20/kv4 (the seed) and h8/kv1: only the default call
    moves."""
    from cute_attn import testing
    from cute_attn.ops import gqa_decode

    batches = {"n1_kv3232": [3232], "n16_kv2048": [2048] * 16, **DECODE_BATCHES}
    for label, kv_lens in batches.items():
        kv_lens = kv_lens or _ragged()
        for page_size in pages:
            for heads, kv_heads in ((20, 4), (8, 1)):
                def make(kv_lens=kv_lens, page_size=page_size, heads=heads, kv_heads=kv_heads):
                    return testing.make_gqa_decode_case(kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads,
                                                        page_size=page_size, device="cuda", seed=len(kv_lens))
                yield (dict(batch=label, page_size=page_size, heads=heads, kv_heads=kv_heads), make, "decode",
                       gqa_decode.line_schedule_policy)


def _line_build_cases(pages, knob_policy):
    """The line_schedule rows (GQA decode) and the MLA decode bench rows with both line builds on, under
    ``knob_policy(on)`` off / on (a line build's knob: only the default call moves)."""
    from cute_attn.ops import gqa_decode, mla_decode

    def policy(on):
        import contextlib

        stack = contextlib.ExitStack()
        for ctx in (gqa_decode.line_schedule_policy(True), mla_decode.line_schedule_policy(True), knob_policy(on)):
            stack.enter_context(ctx)
        return stack

    for row0, make, kind, _ in _line_schedule_cases(pages):
        yield row0, make, kind, policy
    for row0, make, kind, _ in _mla_line_schedule_cases(pages):
        yield row0, make, kind, policy


def _line_scan_cases(pages):
    """The line builds' page-id scan eight ids a pass, not one (``config.LINE_SCAN_IDS_PER_THREAD``, session 40)."""
    from cute_attn.config import line_scan_policy

    return _line_build_cases(pages, lambda on: line_scan_policy(8 if on else 1))


def _line_uniform_cases(pages):
    """The line builds' closed form for uniform batches (``config.LINE_UNIFORM_KINDS``, session 42); only the uniform
    rows move (the ragged ones are controls)."""
    from cute_attn.config import line_uniform_policy

    return _line_build_cases(pages, line_uniform_policy)


def _gather_warps_cases(pages):
    from cute_attn.ops import gqa_decode

    for row0, make, kind, _ in _line_deal_cases(pages):  # the same batches and layouts, the line deal as it is
        yield (row0, make, kind,
               lambda on, page_size=row0["page_size"]: gqa_decode.gather_warps_policy((page_size,) if on else ()))


def _prefill_cases(cases, pages, policy_at):
    """GQA prefill A/B cases: ``cases`` label -> (q_lens, kv_lens, heads, kv_heads) at each page size;
    ``policy_at(page_size)`` -> the policy context (``policy(on)``)."""
    from cute_attn import testing

    for label, (q_lens, kv_lens, heads, kv_heads) in cases.items():
        for page_size in pages:
            def make(q_lens=q_lens, kv_lens=kv_lens, page_size=page_size, heads=heads, kv_heads=kv_heads):
                return testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads,
                                                     page_size=page_size, device="cuda", seed=len(q_lens))
            yield (dict(batch=label, page_size=page_size, heads=heads, kv_heads=kv_heads), make, "prefill",
                   policy_at(page_size))


def _prefill_fold_cases(pages):
    from cute_attn.ops import gqa_prefill

    return _prefill_cases(PREFILL_CASES, pages, lambda page_size: gqa_prefill.fused_merge_policy)


K_AHEAD_CASES = {  # the FIB page-1 prefill representatives furthest behind FA4 (session 15), and the seed layout
    "n8_q992_h32kv4": ([992] * 8, [992] * 8, 32, 4),
    "n8_q992_h16kv1": ([992] * 8, [992] * 8, 16, 1),
    "n8_q992_h24kv4": ([992] * 8, [992] * 8, 24, 4),
    "n8_q992_h32kv16": ([992] * 8, [992] * 8, 32, 16),
}


LAP_DEAL_CASES = {  # the GQA prefill rows whose host plan the lap deal changes (the model: 1.082 -> 1.024 etc.)
    "n4_q992_h32kv4": ([992] * 4, [992] * 4, 32, 4),
    "n8_q992_h32kv4": ([992] * 8, [992] * 8, 32, 4),  # the same busiest CTA: the lap deal's order, not its balance
    "n16_q992_h32kv4": ([992] * 16, [992] * 16, 32, 4),
    "n8_q992_h16kv1": ([992] * 8, [992] * 8, 16, 1),
    "n8_q992_h16kv2": ([992] * 8, [992] * 8, 16, 2),
    "n8_q992_h20kv4": ([992] * 8, [992] * 8, 20, 4),
    "n8_q992_h32kv16": ([992] * 8, [992] * 8, 32, 16),
}


def _lap_deal_cases(pages):
    from cute_attn.ops import gqa_prefill

    return _prefill_cases(LAP_DEAL_CASES, pages,
                          lambda page_size: lambda on: gqa_prefill.whole_deal_policy("lap" if on else ""))


SERPENTINE_DEAL_CASES = {  # GQA prefill rows whose host plan the serpentine changes (within 1/16 of the model)
    "n8_q992_h32kv4": ([992] * 8, [992] * 8, 32, 4),
    "n8_q992_h32kv8": ([992] * 8, [992] * 8, 32, 8),
    "n8_q128_kv2048_h32kv4": ([128] * 8, [2048] * 8, 32, 4),
}


DYNAMIC_SCHEDULE_CASES = {  # the bench's GQA prefill rows (h32/kv4) and FIB layouts of other groups
    "n1_q992": ([992], [992], 32, 4),
    "n8_q992": ([992] * 8, [992] * 8, 32, 4),
    "n32_q992": ([992] * 32, [992] * 32, 32, 4),
    "n4_q512_kv4096": ([512] * 4, [4096] * 4, 32, 4),
    "n8_q128_kv2048": ([128] * 8, [2048] * 8, 32, 4),
    "ragged_12": ([33, 700, 1, 990, 400, 128, 64, 512, 900, 5, 260, 7],
                  [33, 900, 3000, 990, 800, 4096, 64, 600, 900, 5, 2000, 7], 32, 4),
    "n8_q992_h5kv1": ([992] * 8, [992] * 8, 5, 1),
    "n8_q992_h6kv1": ([992] * 8, [992] * 8, 6, 1),
    "n8_q992_h32kv16": ([992] * 8, [992] * 8, 32, 16),
}


def _dynamic_schedule_cases(pages):
    """The default call planner-free (``ops/gqa_prefill.DYNAMIC_SCHEDULE``: in-kernel index checks, units from a
    counter) off / on; only the default call moves."""
    from cute_attn.ops import gqa_prefill

    return _prefill_cases(DYNAMIC_SCHEDULE_CASES, pages, lambda page_size: gqa_prefill.dynamic_schedule_policy)


def _mla_dynamic_schedule_cases(pages):
    """The MLA prefill default call planner-free (``ops/mla_prefill.DYNAMIC_SCHEDULE``) off / on: the bench's seven
    recorded MLA prefill batches at each page size (the rule, one unit a CTA or at most 256 key slots since session
    37's late claim, two before, keeps 22 x 22 planned)."""
    from cute_attn import testing
    from cute_attn.ops import mla_prefill

    import bench_workloads as bw

    for w in bw.all_workloads():
        if w.kernel != bw.MLA:
            continue
        for page_size in pages:
            def make(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens), page_size=page_size):
                return testing.make_mla_prefill_case(q_lens, kv_lens, page_size=page_size, device="cuda", seed=9)
            yield (dict(batch="mla_" + w.label, page_size=page_size, heads=0, kv_heads=0), make, "mla_prefill",
                   mla_prefill.dynamic_schedule_policy)


def _late_claim_cases(pages):
    """The planner-free route claiming late (``config.LATE_CLAIM_KINDS``) off / on, with the route forced on (the MLA
    floor at 0, so its few-unit batches take it too): ``tools/dynamic_schedule_model.py --claim`` models claiming a
    unit ahead at 1.21x the host plan's busiest CTA on 1 x 992 and 1.38x on MLA 1 x 1028, late at 1.00x."""
    import contextlib

    from cute_attn.config import late_claim_policy
    from cute_attn.ops import gqa_prefill, mla_prefill, policy

    def on_route(ops, **forced):
        @contextlib.contextmanager
        def policy_of(on):
            with policy(vars(ops), DYNAMIC_SCHEDULE=True, **forced), late_claim_policy(on):
                yield bool(on)
        return policy_of

    yield from _prefill_cases(DYNAMIC_SCHEDULE_CASES, pages, lambda page_size: on_route(gqa_prefill))
    for row0, make, kind, _ in _mla_dynamic_schedule_cases(pages):
        yield row0, make, kind, on_route(mla_prefill, DYNAMIC_MIN_UNITS_PER_CTA=0)


def _route_plans_cases(pages):
    """Host plans that launch the planner-free build where the rule says it is no slower (``config.ROUTE_PLAN_KINDS``,
    ``plan_units.self_schedule_wins``) off / on: the dynamic_schedule rows and the MLA bench batches; only the
    plan-once call (``planned``) moves, and only on the rows the rule routes."""
    from cute_attn.config import route_plan_policy

    yield from _prefill_cases(DYNAMIC_SCHEDULE_CASES, pages, lambda page_size: route_plan_policy)
    for row0, make, kind, _ in _mla_dynamic_schedule_cases(pages):
        yield row0, make, kind, route_plan_policy


def _rank_major_cases(pages):
    """Rank-major few-unit batches (``config.RANK_MAJOR_KINDS``) off / on: h5/kv1, h6/kv1 8 x 992 move; controls."""
    from cute_attn.config import rank_major_policy

    return _prefill_cases(DYNAMIC_SCHEDULE_CASES, pages, lambda page_size: rank_major_policy)


def _device_whole_deal_cases(pages):
    from cute_attn.ops import gqa_prefill

    return _prefill_cases(SERPENTINE_DEAL_CASES, pages, lambda page_size: gqa_prefill.device_whole_deal_policy)


def _serpentine_deal_cases(pages):
    from cute_attn.ops import gqa_prefill

    return _prefill_cases(SERPENTINE_DEAL_CASES, pages,
                          lambda page_size: lambda on: gqa_prefill.whole_deal_policy("serpentine" if on else ""))


def _k_ahead_cases(pages):
    from cute_attn.ops import gqa_prefill

    def policy_at(page_size):
        return lambda on: gqa_prefill.k_ahead_policy((page_size,) if on else ())

    return _prefill_cases(K_AHEAD_CASES, pages, policy_at)


COMBINE_GRID_TRIAL = 1056  # 8 CTAs of 128 threads an SM on 132 SMs: one resident wave with room to spare
COMBINE_CASES = {  # label: (kind, q_lens, kv_lens): device plans launch the combine whether or not they merge
    "gqa_n8_q992": ("prefill", [992] * 8, [992] * 8),
    "gqa_n1_q992": ("prefill", [992], [992]),
    "gqa_n16_q992": ("prefill", [992] * 16, [992] * 16),
    "mla_seed_n28": ("mla_prefill", None, None),
    "mla_n1_q1028": ("mla_prefill", [1028], [1038]),
    "mla_decode_n64_kv8192": ("mla_decode", [1] * 64, [8192] * 64),
    "mla_decode_n1_kv4096": ("mla_decode", [1], [4096]),
}


def _mla_seed_lengths():
    """The MLA prefill seed workload's (q_lens, kv_lens), as the bench draws them."""
    import bench_workloads as bw

    seed = next(w for w in bw.all_workloads() if w.kernel.startswith("mla_paged_prefill") and w.label.startswith("n28"))
    return list(seed.q_lens), list(seed.kv_lens)


def _combine_grid_cases(pages):
    from cute_attn import testing
    from cute_attn.kernels.common import combine

    for label, (kind, q_lens, kv_lens) in COMBINE_CASES.items():
        for page_size in pages:
            if kind == "prefill":
                def make(q_lens=q_lens, kv_lens=kv_lens, page_size=page_size):
                    return testing.make_gqa_prefill_case(q_lens, kv_lens, page_size=page_size, device="cuda", seed=3)
            elif kind == "mla_prefill":
                def make(q_lens=q_lens, kv_lens=kv_lens, page_size=page_size):
                    q, kv = (q_lens, kv_lens) if q_lens else _mla_seed_lengths()
                    return testing.make_mla_prefill_case(q, kv, page_size=page_size, device="cuda", seed=3)
            else:
                def make(kv_lens=kv_lens, page_size=page_size):
                    return testing.make_mla_decode_case(kv_lens, page_size=page_size, device="cuda", seed=3)
            yield (dict(batch=label, page_size=page_size, heads=0, kv_heads=0), make, kind,
                   lambda on: combine.combine_grid_policy(COMBINE_GRID_TRIAL if on else 0))


Q_TILE_PASS_CASES = {  # label: (q_lens or None for decode, kv_lens): one pass of q tiles and several
    "decode_n64_kv2048": (None, [2048] * 64),
    "gqa_n8_q992": ([992] * 8, [992] * 8),
    "gqa_n16_q992": ([992] * 16, [992] * 16),
    "gqa_n32_q992": ([992] * 32, [992] * 32),
    "gqa_n8_q128_kv2048": ([128] * 8, [2048] * 8),
}


def _q_tile_pass_cases(pages):
    from cute_attn import testing
    from cute_attn.kernels.common import device_planner

    for label, (q_lens, kv_lens) in Q_TILE_PASS_CASES.items():
        for page_size in pages:
            if q_lens is None:
                def make(kv_lens=kv_lens, page_size=page_size):
                    return testing.make_gqa_decode_case(kv_lens, page_size=page_size, device="cuda", seed=4)
            else:
                def make(q_lens=q_lens, kv_lens=kv_lens, page_size=page_size):
                    return testing.make_gqa_prefill_case(q_lens, kv_lens, page_size=page_size, device="cuda", seed=4)
            yield (dict(batch=label, page_size=page_size, heads=0, kv_heads=0), make,
                   "decode" if q_lens is None else "prefill",
                   lambda on: device_planner.q_tile_pass_policy(0 if on else 1))


def _combine_early_rows_cases(pages):
    from cute_attn.kernels.common import combine

    for row0, make, kind, _ in _combine_grid_cases(pages):  # the combine's cases, plus MLA decode 16 x 4096
        yield row0, make, kind, combine.combine_early_rows_policy
    from cute_attn import testing

    for page_size in pages:
        def make(page_size=page_size):
            return testing.make_mla_decode_case([4096] * 16, page_size=page_size, device="cuda", seed=3)
        yield (dict(batch="mla_decode_n16_kv4096", page_size=page_size, heads=0, kv_heads=0), make, "mla_decode",
               combine.combine_early_rows_policy)


EVEN_PIECES_CASES = {  # label: (kind, kv_lens): the bench's split decode rows, whose device plans even pieces change
    "mla_decode_n1_kv4096": ("mla_decode", [4096]),
    "mla_decode_n16_kv4096": ("mla_decode", [4096] * 16),
    "mla_decode_n64_kv8192": ("mla_decode", [8192] * 64),
    "decode_n1_kv3232": ("decode", [3232]),
    "decode_n16_kv2048": ("decode", [2048] * 16),
}


def _even_pieces_cases(pages):
    from cute_attn import testing
    from cute_attn.config import even_pieces_policy

    for label, (kind, kv_lens) in EVEN_PIECES_CASES.items():
        for page_size in pages:
            maker = testing.make_mla_decode_case if kind == "mla_decode" else testing.make_gqa_decode_case

            def make(maker=maker, kv_lens=kv_lens, page_size=page_size):
                return maker(kv_lens, page_size=page_size, device="cuda", seed=5)
            yield dict(batch=label, page_size=page_size, heads=0, kv_heads=0), make, kind, even_pieces_policy


PAGE_BOXES_CASES = {  # label: (kind, q_lens or None, kv_lens)
    "mla_decode_n1_kv4096": ("mla_decode", None, [4096]),
    "mla_decode_n16_kv4096": ("mla_decode", None, [4096] * 16),
    "mla_decode_n64_kv8192": ("mla_decode", None, [8192] * 64),
    "mla_decode_n128_kv4096": ("mla_decode", None, [4096] * 128),
    "mla_prefill_n28_q1954": ("mla_prefill", None, None),  # the seed's lengths at this page size
}


def _page_boxes_cases(pages):
    from cute_attn import testing
    from cute_attn.ops.mla_prefill import page_boxes_policy

    for label, (kind, _, kv_lens) in PAGE_BOXES_CASES.items():
        for page_size in pages:
            if kind == "mla_decode":
                def make(kv_lens=kv_lens, page_size=page_size):
                    return testing.make_mla_decode_case(kv_lens, page_size=page_size, device="cuda", seed=6)
            else:
                def make(page_size=page_size):
                    q_lens, kv_lens = _mla_seed_lengths()
                    return testing.make_mla_prefill_case(q_lens, kv_lens, page_size=page_size, device="cuda", seed=6,
                                                         with_last_page_len=page_size > 1)
            yield dict(batch=label, page_size=page_size, heads=0, kv_heads=0), make, kind, page_boxes_policy


def _eager_combine_cases(pages):
    """MLA decode's bench batches and the MLA seed prefill (the page-boxes cases) plus MLA prefill 1 / 1028, whose
    device plans split: the combine folds each merge once its slots are in, or after the attention grid."""
    from cute_attn.ops.mla_prefill import eager_combine_policy

    for row0, make, kind, _ in _page_boxes_cases(pages):
        yield row0, make, kind, eager_combine_policy
    for page_size in pages:
        def make(page_size=page_size):
            from cute_attn import testing

            return testing.make_mla_prefill_case([1028], [1038], page_size=page_size, device="cuda", seed=8,
                                                 with_last_page_len=page_size > 1)
        yield dict(batch="mla_prefill_n1_q1028", page_size=page_size, heads=0, kv_heads=0), make, "mla_prefill", \
            eager_combine_policy


BF16_PARTIALS_PREFILL_CASES = {  # GQA prefill rows whose plans split (merges, a combine launch)
    "n1_q992_h32kv4": ([992], [992], 32, 4),
    "n4_q512_kv4096_h32kv4": ([512] * 4, [4096] * 4, 32, 4),
}


def _bf16_partials_cases(pages):
    """The eager-combine cases (MLA decode's bench batches, the MLA seed and 1 / 1028) and the GQA prefill rows whose
    plans split: the split items' partial rows stored as bf16 or fp32."""
    from cute_attn.config import bf16_partials_policy

    for row0, make, kind, _ in _eager_combine_cases(pages):
        yield row0, make, kind, bf16_partials_policy
    yield from _prefill_cases(BF16_PARTIALS_PREFILL_CASES, pages, lambda page_size: bf16_partials_policy)


DEAL_2048_CASES = {  # GQA prefill batches of 1025..2048 q tiles, which the 1024-key sort leaves to the cuts
    "n32_q992_h32kv4": ([992] * 32, [992] * 32, 32, 4),
    "ragged96_h32kv4": ([0, 130, 1, 700, 64, 900] * 16, [5, 130, 64, 900, 64, 1000] * 16, 32, 4),
}


def _deal_2048_cases(pages):
    from cute_attn.ops.gqa_prefill import deal_max_q_tiles_policy

    return _prefill_cases(DEAL_2048_CASES, pages,
                          lambda page_size: lambda on: deal_max_q_tiles_policy(2048 if on else 1024))


def _max_slack_cases(pages):
    """MLA prefill's long batches, whose device plans the slack cap splits (page 1, the definition's)."""
    from cute_attn import testing
    from cute_attn.config import max_slack_keys_policy

    for label, (q_lens, kv_lens) in {"mla_n1_q16384": ([16384], [16387]), "mla_n1_q12000": ([12000], [12000])}.items():
        def make(q_lens=q_lens, kv_lens=kv_lens):
            return testing.make_mla_prefill_case(q_lens, kv_lens, page_size=1, device="cuda", seed=7)
        yield (dict(batch=label, page_size=1, heads=0, kv_heads=0), make, "mla_prefill",
               lambda on: max_slack_keys_policy(1024 if on else 0))


def _rank_deal_cases(pages):
    """MLA prefill batches past the sort's 1024 keys that a ranked deal takes (page 1, the definition's)."""
    from cute_attn import testing
    from cute_attn.config import rank_deal_policy

    for label, (q_lens, kv_lens) in {"mla_n1_q16384": ([16384], [16387]), "mla_n1_q6000": ([6000], [6100]),
                                     "mla_n2_q2200": ([2200, 2200], [2300, 2250])}.items():
        def make(q_lens=q_lens, kv_lens=kv_lens):
            return testing.make_mla_prefill_case(q_lens, kv_lens, page_size=1, device="cuda", seed=8)
        yield (dict(batch=label, page_size=1, heads=0, kv_heads=0), make, "mla_prefill",
               lambda on: rank_deal_policy(4096 if on else 0))


DEAL_FIRST_CASES = {  # GQA prefill: the FIB 8 x 992 layouts the deal takes with no cuts, and one it does not
    "n8_q992_h32kv4": ([992] * 8, [992] * 8, 32, 4),
    "n8_q992_h20kv4": ([992] * 8, [992] * 8, 20, 4),
    "n16_q992_h32kv4": ([992] * 16, [992] * 16, 32, 4),
    "n4_q512_kv4096_h32kv4": ([512] * 4, [4096] * 4, 32, 4),
    "n1_q992_h16kv1": ([992], [992], 16, 1),  # split cuts: the deal is made first, then loses to them
}


LAP_TURN_CASES = {  # GQA prefill: the seed's batches and the FIB 8 x 992 layouts the serpentine deals unevenly
    "n4_q992_h32kv4": ([992] * 4, [992] * 4, 32, 4),
    "n8_q992_h32kv4": ([992] * 8, [992] * 8, 32, 4),
    "n16_q992_h32kv4": ([992] * 16, [992] * 16, 32, 4),
    "n8_q992_h16kv1": ([992] * 8, [992] * 8, 16, 1),
    "n8_q992_h20kv4": ([992] * 8, [992] * 8, 20, 4),
    "n8_q992_h32kv16": ([992] * 8, [992] * 8, 32, 16),
}


def _lap_turn_cases(pages):
    """Device (and host) plans turn the deal's laps by load (``config.lap_turn_policy``), GQA prefill."""
    from cute_attn.config import lap_turn_policy

    return _prefill_cases(LAP_TURN_CASES, pages, lambda page_size: lap_turn_policy)


def _deal_first_cases(pages):
    """Device plans deal before they cut (``config.deal_first_policy``): GQA prefill, then the MLA seed and 1 / 1028
    at page 1 (the definition's)."""
    from cute_attn import testing
    from cute_attn.config import deal_first_policy

    yield from _prefill_cases(DEAL_FIRST_CASES, pages, lambda page_size: deal_first_policy)
    import bench_workloads as bw

    for w in bw.all_workloads():
        if w.kernel == bw.MLA and w.label in ("n28_q1954_kv2044", "n1_q1028_kv1038"):
            def make(q_lens=list(w.q_lens), kv_lens=list(w.kv_lens)):
                return testing.make_mla_prefill_case(q_lens, kv_lens, page_size=1, device="cuda", seed=9)
            yield (dict(batch="mla_" + w.label, page_size=1, heads=0, kv_heads=0), make, "mla_prefill",
                   deal_first_policy)


def _deal_one_site_cases(pages):
    """The deal-first build with the deal's code at one call site against the landed one (two sites), deal-first on
    for both causal kinds: GQA prefill 8 x 992 and the MLA seed and 1 / 1028."""
    import contextlib

    from cute_attn.config import deal_first_policy
    from cute_attn.kernels.common.device_planner import deal_one_site_policy

    @contextlib.contextmanager
    def builds(on):
        with deal_first_policy(), deal_one_site_policy(on):
            yield

    for row0, make, kind, _ in _deal_first_cases(pages):
        if row0["batch"] in ("n8_q992_h32kv4", "n1_q992_h16kv1") or row0["batch"].startswith("mla_"):
            yield row0, make, kind, builds


def _lap_lists_cases(pages):
    """A dealt plan's rows in one pass by (lap, CTA) slots (``device_planner.lap_lists_policy``): GQA prefill 8 x 992
    at h32/kv4 and h20/kv4 (one pass), 16 x 992 (past both buffers: unchanged), the MLA seed and 1 / 1028."""
    from cute_attn.kernels.common.device_planner import lap_lists_policy

    for row0, make, kind, _ in _deal_first_cases(pages):
        if row0["batch"] != "n1_q992_h16kv1":
            yield row0, make, kind, lap_lists_policy


ROW_WRITER_CASES = {  # GQA prefill: the seed's batches, where the lists phase grows with the rows
    "n2_q992_h32kv4": ([992] * 2, [992] * 2, 32, 4),
    "n4_q992_h32kv4": ([992] * 4, [992] * 4, 32, 4),
    "n8_q992_h32kv4": ([992] * 8, [992] * 8, 32, 4),
    "n16_q992_h32kv4": ([992] * 16, [992] * 16, 32, 4),
    "n32_q992_h32kv4": ([992] * 32, [992] * 32, 32, 4),
    "n8_q992_h20kv4": ([992] * 8, [992] * 8, 20, 4),
    "n4_q512_kv4096_h32kv4": ([512] * 4, [4096] * 4, 32, 4),
}


def _row_writers_cases(pages):
    """The item rows written by several planning CTAs (``device_planner.row_writers_policy``: 1 against
    MAX_ROW_WRITERS; built in session 30, kept off)."""
    import contextlib

    from cute_attn.kernels.common.device_planner import MAX_ROW_WRITERS, ROWS_PER_WRITER, row_writers_policy

    rows = int(os.environ.get("CUTE_ATTN_ROWS_PER_WRITER", "0")) or ROWS_PER_WRITER  # the launch rule's rows a writer

    @contextlib.contextmanager
    def builds(on):
        with row_writers_policy(MAX_ROW_WRITERS if on else 1, rows):
            yield

    return _prefill_cases(ROW_WRITER_CASES, pages, lambda page_size: builds)


def _count_sort_cases(pages):
    """The sorted deal's order by counting where its keys take few values (``device_planner.count_sort_policy``,
    built in session 30): the GQA prefill batches of the row writers' A/B, then the MLA seed and 1 / 1028."""
    from cute_attn.kernels.common.device_planner import count_sort_policy

    yield from _prefill_cases(ROW_WRITER_CASES, pages, lambda page_size: count_sort_policy)
    for row0, make, kind, _ in _deal_first_cases(pages):
        if row0["batch"].startswith("mla_"):
            yield row0, make, kind, count_sort_policy


def _early_dependents_cases(pages):
    from cute_attn.config import early_dependents_policy

    for row0, make, kind, _ in _combine_grid_cases(pages):  # the combine's cases: device plans launch it always
        yield row0, make, kind, early_dependents_policy


POLICIES = {"line_deal": _line_deal_cases, "prefill_fold": _prefill_fold_cases, "k_ahead": _k_ahead_cases,
            "combine_grid": _combine_grid_cases, "q_tile_pass": _q_tile_pass_cases,
            "early_dependents": _early_dependents_cases, "combine_early_rows": _combine_early_rows_cases,
            "even_pieces": _even_pieces_cases, "page_boxes": _page_boxes_cases, "max_slack": _max_slack_cases,
            "eager_combine": _eager_combine_cases, "lap_deal": _lap_deal_cases,
            "serpentine_deal": _serpentine_deal_cases, "device_whole_deal": _device_whole_deal_cases,
            "bf16_partials": _bf16_partials_cases, "deal_2048": _deal_2048_cases, "gather_warps": _gather_warps_cases,
            "rank_deal": _rank_deal_cases, "deal_first": _deal_first_cases, "deal_one_site": _deal_one_site_cases,
            "lap_lists": _lap_lists_cases, "lap_turn": _lap_turn_cases, "row_writers": _row_writers_cases,
            "count_sort": _count_sort_cases, "cluster_merge": _cluster_merge_cases,
            "device_cluster_merge": _device_cluster_merge_cases, "dynamic_schedule": _dynamic_schedule_cases,
            "mla_dynamic_schedule": _mla_dynamic_schedule_cases, "late_claim": _late_claim_cases,
            "route_plans": _route_plans_cases, "line_schedule": _line_schedule_cases,
            "mla_line_schedule": _mla_line_schedule_cases, "mla_short_stages": _mla_short_stages_cases,
            "rank_major": _rank_major_cases, "line_scan": _line_scan_cases, "line_uniform": _line_uniform_cases}
DEFAULT_PAGES = {"line_deal": [1, 64], "prefill_fold": [64, 1], "k_ahead": [1], "combine_grid": [64],
                 "q_tile_pass": [64], "early_dependents": [64], "combine_early_rows": [64], "even_pieces": [64, 1],
                 "page_boxes": [64, 128], "max_slack": [1], "eager_combine": [64, 1],
                 "lap_deal": [64], "serpentine_deal": [64],
                 "device_whole_deal": [64], "bf16_partials": [64, 1], "deal_2048": [64, 1], "gather_warps": [1, 2],
                 "rank_deal": [1], "deal_first": [64], "deal_one_site": [64], "lap_lists": [64],
                 "lap_turn": [64], "row_writers": [64], "count_sort": [64], "cluster_merge": [64, 1],
                 "device_cluster_merge": [64, 1], "dynamic_schedule": [64, 1], "mla_dynamic_schedule": [1, 64],
                 "late_claim": [64], "route_plans": [64], "line_schedule": [64, 16], "mla_line_schedule": [1, 64],
                 "mla_short_stages": [64, 1], "rank_major": [64, 1], "line_scan": [1, 64], "line_uniform": [64, 1]}


def checked_span(run, out, lse, reference, label: str, timer, digits: int = 1):
    """Run ``run`` once (it writes ``out`` / ``lse``), check both against ``reference`` (the float32 ``(out, lse)``)
    by the benchmark's rule, then time it as the bench times its rows: the GPU span in µs (the wall time where CUPTI
    gave none), rounded to ``digits``; None without a ``timer`` (a check-and-compile pass)."""
    import torch

    from cute_attn import testing

    run()
    torch.cuda.synchronize()
    testing.assert_close_benchmark(out, reference[0], f"{label} output")
    testing.assert_close_benchmark(lse, reference[1], f"{label} lse")
    if timer is None:
        return None
    timing = timer(run)
    return round(timing.gpu_us if timing.gpu_us is not None else timing.wall_us, digits)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy", choices=sorted(POLICIES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--pages", type=int, nargs="+", default=None, help="default: the policy's DEFAULT_PAGES")
    ap.add_argument("--only", nargs="+", default=None, help="case labels to keep")
    ap.add_argument("--iters", type=int, default=50, help="1: check and compile only, no timing")
    args = ap.parse_args(argv)
    import torch

    import cute_attn
    from cute_attn.timing import ColdL2Timer

    if not torch.cuda.is_available():
        print("ab_policy: needs a CUDA GPU")
        return 0
    timer = ColdL2Timer(iters=args.iters) if args.iters > 1 else None
    entries = dict(decode=(cute_attn.gqa_paged_decode, cute_attn.plan_gqa_paged_decode),
                   prefill=(cute_attn.gqa_paged_prefill, cute_attn.plan_gqa_paged_prefill),
                   mla_prefill=(cute_attn.mla_paged_prefill, cute_attn.plan_mla_paged_prefill),
                   mla_decode=(cute_attn.mla_paged_decode, cute_attn.plan_mla_paged_decode))
    pages = args.pages or DEFAULT_PAGES[args.policy]
    rows = []
    for row0, make, kind, policy in POLICIES[args.policy](pages):
        if args.only and row0["batch"] not in args.only:
            continue
        case = make()
        reference = case.reference()
        inputs = tuple(case.inputs())
        entry, plan_fn = entries[kind]
        for on in (False, True):
            with policy(on):
                row = dict(row0, policy=args.policy, on=on)
                plans = dict(device_planned=plan_fn(*inputs, on_device=True), default=None, planned=plan_fn(*inputs))
                if plans["planned"].route is not None:  # a host plan on the planner-free route (route_plans)
                    row["planned_route"] = True
                for mode, plan in plans.items():
                    out, lse = case.new_outputs()
                    kw = {} if plan is None else dict(plan=plan)

                    def run(out=out, lse=lse, kw=kw):
                        entry(*inputs, out, lse, **kw)

                    span = checked_span(run, out, lse, reference, f"{row0} {mode}", timer)
                    if span is not None:
                        row[mode] = span
                cute_attn.raise_on_device_error()
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

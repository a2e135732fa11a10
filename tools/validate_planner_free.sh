#!/usr/bin/env bash
# The validation of the planner-free prefills (GPU machine only; sessions 33-35 built them, off), in device calls:
#
#   bash tools/validate_planner_free.sh OUT_DIR gqa [BUDGET_SECONDS]   # GQA: GPU tier, memcheck, racecheck
#   bash tools/validate_planner_free.sh OUT_DIR mla [BUDGET_SECONDS]   # MLA: the same
#   bash tools/validate_planner_free.sh OUT_DIR ab [BUDGET_SECONDS]    # the default call's A/Bs, GQA then MLA
#   bash tools/validate_planner_free.sh OUT_DIR late [BUDGET_SECONDS]  # late claim (session 36): tiers, sanitizer, A/B
#   bash tools/validate_planner_free.sh OUT_DIR route [BUDGET_SECONDS] # host plans on the route (session 37): tier, A/B
#   bash tools/validate_planner_free.sh OUT_DIR line [BUDGET_SECONDS]  # planner-free decode (session 38): GQA and MLA
#       tiers, the planned decode tiers (their fold and item reads changed beside it), memcheck, racecheck, GQA's A/B
#   bash tools/validate_planner_free.sh OUT_DIR mla-line [BUDGET_SECONDS]  # the MLA decode line build's A/B
#   bash tools/validate_planner_free.sh OUT_DIR line-peers [BUDGET_SECONDS]  # FlashInfer call: the decode and MLA
#       decode bench rows beside FlashInfer / FA4 with both line policies on (for docs/perf/h200-latest.json)
#   bash tools/validate_planner_free.sh OUT_DIR peers [BUDGET_SECONDS] # FlashInfer call (flashinfer.tar.xz installed):
#       the family bench, FlashInfer-Bench's harness, the wrapper tiers, under the route (FlashInfer JITs first: ~200 s)
#
# (budget default 570: one run's 600 s less slack). Each step runs under tools/gpu_steps.py with its own time limit,
# so a slow step leaves the others their time, and memcheck and racecheck are separate steps, so a racecheck cut short
# keeps memcheck's report; test failures' assertion lines are grepped into the step's summary (session 33 lost which
# test failed to a cut log). Sanitizer cases: pages 64 and 1, and page ids past the pool at pages 16 and 1 (the TMA
# boxes' and the row gathers' checks). The A/Bs: GQA at pages 64 and 1 with two FIB layouts, MLA on the bench's
# seven recorded batches at pages 1 and 64.
set -u
usage="usage: validate_planner_free.sh OUT_DIR gqa|mla|ab|late|route|line|mla-line|line-peers|peers [BUDGET_SECONDS]"
out=${1:?$usage}
part=${2:?$usage}
budget=${3:-570}
mkdir -p "$out"

sanitizer_steps() {  # $1: the cases, $2 / $3: memcheck's / racecheck's seconds -> their two steps' arguments in $steps
  steps=(--step "$2" "python tools/sanitize.py --tools memcheck --cases $1 --out $out/memcheck.txt \
> $out/memcheck.log 2>&1; tail -8 $out/memcheck.log"
         --step "$3" "python tools/sanitize.py --tools racecheck --cases $1 --out $out/racecheck.txt \
> $out/racecheck.log 2>&1; tail -8 $out/racecheck.log")
}

checks() {  # $1: the kind's prefix ("" or "mla-"), $2: its GPU tier
  local prefix=$1 tier=$2 workers="" cases
  python -c 'import xdist' 2>/dev/null && workers="-n 4 --dist load"
  cases=${prefix}dynamic-schedule-p64,${prefix}dynamic-schedule-p1
  cases+=,${prefix}dynamic-schedule-fault,${prefix}dynamic-schedule-fault-p1
  sanitizer_steps "$cases" 110 150
  python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 12 \
    --step 300 "python -m pytest -q $workers -rf --tb=short -k 'not late' $tier > $out/tier.txt 2>&1; \
grep -E '^E |FAILED|passed|failed' $out/tier.txt | head -40" "${steps[@]}"
}

case $part in
  gqa) checks "" tests/test_dynamic_schedule_gpu.py ;;
  mla) checks mla- tests/test_mla_dynamic_schedule_gpu.py ;;
  ab)
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 24 \
      --step 260 "python tools/ab_policy.py dynamic_schedule --pages 64 1 --iters 50 --json $out/ab_gqa.json \
> $out/ab_gqa.txt 2>&1; tail -24 $out/ab_gqa.txt" \
      --step 300 "python tools/ab_policy.py mla_dynamic_schedule --iters 50 --json $out/ab_mla.json \
> $out/ab_mla.txt 2>&1; tail -24 $out/ab_mla.txt" ;;
  late)
    workers=""
    python -c 'import xdist' 2>/dev/null && workers="-n 4 --dist load"
    cases=late-claim-p64,late-claim-p1,mla-late-claim-p64,mla-late-claim-p1
    sanitizer_steps "$cases" 70 90
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 24 \
      --step 200 "python -m pytest -q $workers -rf --tb=short -k late tests/test_dynamic_schedule_gpu.py \
tests/test_mla_dynamic_schedule_gpu.py > $out/tier.txt 2>&1; grep -E '^E |FAILED|passed|failed' $out/tier.txt | head -40" \
      "${steps[@]}" --step 200 "python tools/ab_policy.py late_claim --iters 50 --json $out/ab_late.json > $out/ab_late.txt 2>&1; \
tail -24 $out/ab_late.txt" ;;
  route)  # the kernels are the route's (already validated): the new part is the host plan's launch path
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 \
      --step 150 "python -m pytest -q -rf --tb=short -k route_plan tests/test_dynamic_schedule_gpu.py \
tests/test_mla_dynamic_schedule_gpu.py > $out/tier.txt 2>&1; grep -E '^E |FAILED|passed|failed' $out/tier.txt | head -40" \
      --step 330 "python tools/ab_policy.py route_plans --iters 50 --json $out/ab_route.json > $out/ab_route.txt 2>&1; \
tail -40 $out/ab_route.txt" ;;
  line)
    workers=""
    python -c 'import xdist' 2>/dev/null && workers="-n 4 --dist loadfile"
    cases=line-schedule-p64,line-schedule-p16,line-schedule-fault,line-schedule-p1,mla-line-schedule-p1
    cases+=,mla-line-schedule-p64
    sanitizer_steps "$cases" 60 80
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 \
      --step 200 "python -m pytest -q $workers -rf --tb=short tests/test_line_schedule_gpu.py \
tests/test_mla_line_schedule_gpu.py > $out/tier.txt 2>&1; grep -E '^E |FAILED|passed|failed' $out/tier.txt | head -40" \
      --step 120 "python -m pytest -q $workers -rf --tb=short tests/test_gqa_decode_gpu.py \
tests/test_multi_token_decode_gpu.py tests/test_mla_decode_gpu.py > $out/planned.txt 2>&1; \
grep -E '^E |FAILED|passed|failed' $out/planned.txt | head -20" \
      "${steps[@]}" --step 100 "python tools/ab_policy.py line_schedule --iters 50 --json $out/ab_line.json > $out/ab_line.txt 2>&1; \
tail -30 $out/ab_line.txt" ;;
  line-peers)
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 \
      --step 540 "python tools/bench.py --kernel decode mla_decode --compile-jobs 12 --iters 50 --png= \
--policy gqa_decode.LINE_SCHEDULE=True --policy mla_decode.SM90_LINE_SCHEDULE=True --json $out/bench_line.json \
> $out/bench_line.txt 2>&1; tail -30 $out/bench_line.txt" ;;
  mla-line)  # the A/B of the MLA decode's line build (run after line, on the same warm machine)
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 \
      --step 200 "python tools/ab_policy.py mla_line_schedule --iters 50 --json $out/ab_mla_line.json \
> $out/ab_mla_line.txt 2>&1; tail -30 $out/ab_mla_line.txt" ;;
  peers)
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 \
      --step 330 "python tools/bench.py --kernel family --compile-jobs 12 --iters 50 --png= \
--json $out/bench_family.json > $out/bench_family.txt 2>&1; grep -E 'FIB|met' $out/bench_family.txt | tail -12" \
      --step 150 "python tools/fib_bench.py --json $out/h200-fib.json > $out/fib.txt 2>&1; tail -20 $out/fib.txt" \
      --step 100 "python -m pytest -q -rf --tb=short tests/test_flashinfer_compat_gpu.py \
tests/test_flashinfer_graphs_gpu.py > $out/wrappers.txt 2>&1; grep -E '^E |FAILED|passed|failed' $out/wrappers.txt | head" ;;
  *) echo "part must be gqa, mla, ab, late, route, line, mla-line, line-peers or peers, got $part" >&2; exit 2 ;;
esac

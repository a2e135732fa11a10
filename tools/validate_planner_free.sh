#!/usr/bin/env bash
# The validation of the planner-free prefills (GPU machine only; sessions 33-34 built them, off), in two device calls:
#
#   bash tools/validate_planner_free.sh OUT_DIR checks [BUDGET_SECONDS]   # GPU tiers, then memcheck + racecheck
#   bash tools/validate_planner_free.sh OUT_DIR ab [BUDGET_SECONDS]       # the default call's A/Bs, GQA then MLA
#
# (budget default 570: one run's 600 s less slack). Each step runs under tools/gpu_steps.py with its own time limit,
# so a slow step leaves the others their time; test failures' assertion lines are grepped into the step's summary
# (session 33 lost which test failed to a cut log). The A/Bs: GQA at pages 64 and 1 with two FIB layouts, MLA on the
# bench's seven recorded batches at pages 1 and 64.
set -u
out=${1:?usage: validate_planner_free.sh OUT_DIR checks|ab [BUDGET_SECONDS]}
part=${2:?usage: validate_planner_free.sh OUT_DIR checks|ab [BUDGET_SECONDS]}
budget=${3:-570}
mkdir -p "$out"
case $part in
  checks)
    workers=""
    python -c 'import xdist' 2>/dev/null && workers="-n 4 --dist load"
    cases=dynamic-schedule-p64,dynamic-schedule-p1,dynamic-schedule-fault
    cases+=,mla-dynamic-schedule-p64,mla-dynamic-schedule-p1,mla-dynamic-schedule-fault
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 12 \
      --step 330 "python -m pytest -q $workers -rf --tb=short tests/test_dynamic_schedule_gpu.py \
tests/test_mla_dynamic_schedule_gpu.py > $out/tiers.txt 2>&1; grep -E '^E |FAILED|passed|failed' $out/tiers.txt | head -40" \
      --step 230 "python tools/sanitize.py --tools memcheck,racecheck --cases $cases --out $out/sanitizer.txt \
> $out/sanitize.log 2>&1; tail -12 $out/sanitize.log" ;;
  ab)
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 24 \
      --step 260 "python tools/ab_policy.py dynamic_schedule --pages 64 1 --iters 50 --json $out/ab_gqa.json \
> $out/ab_gqa.txt 2>&1; tail -24 $out/ab_gqa.txt" \
      --step 300 "python tools/ab_policy.py mla_dynamic_schedule --iters 30 --json $out/ab_mla.json \
> $out/ab_mla.txt 2>&1; tail -24 $out/ab_mla.txt" ;;
  *) echo "part must be checks or ab, got $part" >&2; exit 2 ;;
esac

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
#   bash tools/validate_planner_free.sh OUT_DIR mla-short [BUDGET_SECONDS]  # the swapped MLA decode's 32-key stages
#       (session 39): their GPU tier, memcheck, racecheck, A/B
#   bash tools/validate_planner_free.sh OUT_DIR rank-major [BUDGET_SECONDS]  # the routes' rank-major order for
#       uniform batches of few units (session 39): its GPU tier, memcheck, racecheck, A/B
#   bash tools/validate_planner_free.sh OUT_DIR scan [BUDGET_SECONDS]  # the line builds' batched page-id scan
#       (session 40): its GPU tier (the line tiers rerun with 8 ids a pass), memcheck, racecheck, A/B
#   bash tools/validate_planner_free.sh OUT_DIR uniform [BUDGET_SECONDS]  # the line builds' closed form for uniform
#       batches (session 42): its GPU tier (the line tiers rerun with it, every branch), memcheck, racecheck, A/B
#   bash tools/validate_planner_free.sh OUT_DIR mla-default [BUDGET_SECONDS]  # the default call's MLA decode tiers
#       with its line build on (session 40), the FIB MLA decode definitions (carry .fibdefs), the route_plan tier
#   bash tools/validate_planner_free.sh OUT_DIR line-peers [BUDGET_SECONDS]  # FlashInfer call: the decode and MLA
#       decode bench rows beside FlashInfer / FA4 with both line policies on (for docs/perf/h200-latest.json)
#   bash tools/validate_planner_free.sh OUT_DIR peers [BUDGET_SECONDS] # FlashInfer call (flashinfer.tar.xz installed):
#       the family bench under the default policies (FlashInfer JITs first; session 40 on an H100: 29 of the 37
#       definitions in 330 s, so the bench has the whole call)
#   bash tools/validate_planner_free.sh OUT_DIR fib [BUDGET_SECONDS]   # FlashInfer call, carrying .fibdefs (a copy of
#       ../shared/spec/fib-definitions: the device sees only the checkout): FlashInfer-Bench's harness, the wrapper tiers
#
# (budget default 570: one run's 600 s less slack). Each step runs under tools/gpu_steps.py with its own time limit,
# so a slow step leaves the others their time, and memcheck and racecheck are separate steps, so a racecheck cut short
# keeps memcheck's report; test failures' assertion lines are grepped into the step's summary (session 33 lost which
# test failed to a cut log), and a step exits with its command's status, not its summary's (``shown``). Sanitizer
# cases: pages 64 and 1, and page ids past the pool at pages 16 and 1 (the TMA boxes' and the row gathers' checks).
# The A/Bs: GQA at pages 64 and 1 with two FIB layouts, MLA on the bench's seven recorded batches at pages 1 and 64.
set -u
usage="usage: validate_planner_free.sh OUT_DIR gqa|mla|ab|late|route|line|mla-line|mla-short|rank-major|scan|\
uniform|mla-default|line-peers|peers|fib [BUDGET_SECONDS]"
out=${1:?$usage}
part=${2:?$usage}
budget=${3:-570}
mkdir -p "$out"

shown() {  # $1: a command, $2: its log, $3: what of the log to show -> one step's command, exiting with $1's status
  printf '%s > %s 2>&1; rc=$?; %s; exit $rc' "$1" "$2" "$3"  # (a trailing tail or grep would report 0 for a failure)
}

sanitizer_steps() {  # $1: the cases, $2 / $3: memcheck's / racecheck's seconds -> their two steps' arguments in $steps
  local tool cases=$1 seconds=("$2" "$3") n=0
  steps=()
  for tool in memcheck racecheck; do
    steps+=(--step "${seconds[$n]}" "$(shown "python tools/sanitize.py --tools $tool --cases $cases \
--out $out/$tool.txt" "$out/$tool.log" "tail -8 $out/$tool.log")")
    n=$((n + 1))
  done
}

workers=""
python -c 'import xdist' 2>/dev/null && workers="-n 4 --dist load"

tier_step() {  # $1: seconds, $2: pytest's arguments, $3: its log's name, $4: summary lines -> one step's arguments
  step=(--step "$1" "$(shown "python -m pytest -q $workers -rf --tb=short $2" "$out/$3" \
"grep -E '^E |FAILED|passed|failed' $out/$3 | head -$4")")
}

tool_step() {  # $1: seconds, $2: a tool's command, $3: its log's name, $4: summary lines -> one step's arguments
  step=(--step "$1" "$(shown "$2" "$out/$3" "tail -$4 $out/$3")")
}

checks() {  # $1: the kind's prefix ("" or "mla-"), $2: its GPU tier
  local prefix=$1 cases
  cases=${prefix}dynamic-schedule-p64,${prefix}dynamic-schedule-p1
  cases+=,${prefix}dynamic-schedule-fault,${prefix}dynamic-schedule-fault-p1
  sanitizer_steps "$cases" 110 150
  tier_step 300 "-k 'not late' $2" tier.txt 40
  python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 12 "${step[@]}" "${steps[@]}"
}

case $part in
  gqa) checks "" tests/test_dynamic_schedule_gpu.py ;;
  mla) checks mla- tests/test_mla_dynamic_schedule_gpu.py ;;
  ab)
    tool_step 260 "python tools/ab_policy.py dynamic_schedule --pages 64 1 --iters 50 --json $out/ab_gqa.json" \
      ab_gqa.txt 24
    gqa=("${step[@]}")
    tool_step 300 "python tools/ab_policy.py mla_dynamic_schedule --iters 50 --json $out/ab_mla.json" ab_mla.txt 24
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 24 "${gqa[@]}" "${step[@]}" ;;
  late)
    cases=late-claim-p64,late-claim-p1,mla-late-claim-p64,mla-late-claim-p1
    sanitizer_steps "$cases" 70 90
    tier_step 200 "-k late tests/test_dynamic_schedule_gpu.py tests/test_mla_dynamic_schedule_gpu.py" tier.txt 40
    tier=("${step[@]}")
    tool_step 200 "python tools/ab_policy.py late_claim --iters 50 --json $out/ab_late.json" ab_late.txt 24
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 24 "${tier[@]}" "${steps[@]}" "${step[@]}" ;;
  route)  # the kernels are the route's (already validated): the new part is the host plan's launch path
    tier_step 150 "-k route_plan tests/test_dynamic_schedule_gpu.py tests/test_mla_dynamic_schedule_gpu.py" tier.txt 40
    tier=("${step[@]}")
    tool_step 330 "python tools/ab_policy.py route_plans --iters 50 --json $out/ab_route.json" ab_route.txt 40
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${tier[@]}" "${step[@]}" ;;
  line)  # the planned decode tiers last: a regression check, the step a short budget may cut
    cases=line-schedule-p64,line-schedule-p16,line-schedule-fault,line-schedule-p1,mla-line-schedule-p1
    cases+=,mla-line-schedule-p64
    sanitizer_steps "$cases" 60 80
    tier_step 210 "tests/test_line_schedule_gpu.py tests/test_mla_line_schedule_gpu.py" tier.txt 40
    tier=("${step[@]}")
    tool_step 100 "python tools/ab_policy.py line_schedule --iters 50 --json $out/ab_line.json" ab_line.txt 30
    ab=("${step[@]}")
    tier_step 110 "tests/test_gqa_decode_gpu.py tests/test_multi_token_decode_gpu.py tests/test_mla_decode_gpu.py" \
      planned.txt 20
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${tier[@]}" "${steps[@]}" "${ab[@]}" \
      "${step[@]}" ;;
  scan)
    cases=line-scan-p1,mla-line-scan-p1
    sanitizer_steps "$cases" 50 60
    tier_step 200 tests/test_line_scan_gpu.py tier.txt 40
    tier=("${step[@]}")
    tool_step 220 "python tools/ab_policy.py line_scan --iters 50 --json $out/ab_scan.json" ab_scan.txt 40
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${tier[@]}" "${steps[@]}" "${step[@]}" ;;
  uniform)
    cases=line-uniform-p64,line-uniform-even,line-uniform-fault,mla-line-uniform-p1
    sanitizer_steps "$cases" 60 80
    tier_step 230 tests/test_line_uniform_gpu.py tier.txt 40
    tier=("${step[@]}")
    tool_step 200 "python tools/ab_policy.py line_uniform --iters 50 --json $out/ab_uniform.json" ab_uniform.txt 50
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 50 "${tier[@]}" "${steps[@]}" "${step[@]}" ;;
  mla-default)  # the planned MLA decode tiers' default-call tests now take the line build
    tier_step 330 "tests/test_mla_decode_gpu.py tests/test_mla_device_cluster_gpu.py tests/test_reliability_gpu.py" \
      tier.txt 40
    tier=("${step[@]}")
    tier_step 120 "-k mla_paged_decode tests/test_fib_definitions_gpu.py" fibdefs.txt 20
    fibdefs=("${step[@]}")
    tier_step 100 "-k route_plan tests/test_dynamic_schedule_gpu.py tests/test_mla_dynamic_schedule_gpu.py" route.txt 20
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${tier[@]}" "${fibdefs[@]}" "${step[@]}" ;;
  line-peers)
    tool_step 540 "python tools/bench.py --kernel decode mla_decode --compile-jobs 12 --iters 50 --png= \
--policy gqa_decode.LINE_SCHEDULE=True --policy mla_decode.SM90_LINE_SCHEDULE=True --json $out/bench_line.json" \
      bench_line.txt 30
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${step[@]}" ;;
  mla-line)  # the A/B of the MLA decode's line build (run after line, on the same warm machine)
    tool_step 200 "python tools/ab_policy.py mla_line_schedule --iters 50 --json $out/ab_mla_line.json" \
      ab_mla_line.txt 30
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${step[@]}" ;;
  mla-short)
    cases=mla-short-stages-p1,mla-short-stages-p64
    sanitizer_steps "$cases" 45 60
    tier_step 150 tests/test_mla_short_stages_gpu.py tier.txt 40
    tier=("${step[@]}")
    tool_step 250 "python tools/ab_policy.py mla_short_stages --iters 50 --json $out/ab_short.json" ab_short.txt 30
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${tier[@]}" "${steps[@]}" "${step[@]}" ;;
  rank-major)
    cases=rank-major-p64,rank-major-p1,mla-rank-major-p64,mla-rank-major-p1,rank-major-fault
    sanitizer_steps "$cases" 70 100
    tier_step 180 tests/test_rank_major_gpu.py tier.txt 40
    tier=("${step[@]}")
    tool_step 200 "python tools/ab_policy.py rank_major --iters 50 --json $out/ab_rank.json --only n8_q992_h5kv1 \
n8_q992_h6kv1 n4_q512_kv4096 n8_q128_kv2048 n8_q992" ab_rank.txt 30  # the rows it moves, and a control
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${tier[@]}" "${steps[@]}" "${step[@]}" ;;
  peers)
    tool_step 560 "python tools/bench.py --kernel family --compile-jobs 12 --iters 50 --png= \
--json $out/bench_family.json" bench_family.txt 12
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${step[@]}" ;;
  fib)
    if ! ls .fibdefs/*.json > /dev/null 2>&1; then
      echo "fib: no .fibdefs/ here: cp -r ../shared/spec/fib-definitions .fibdefs and carry it" >&2
      exit 2
    fi
    tool_step 200 "python tools/fib_bench.py --json $out/h200-fib.json" fib.txt 20
    fib=("${step[@]}")
    tool_step 330 "python -m pytest -q -rf --tb=short tests/test_flashinfer_compat_gpu.py \
tests/test_flashinfer_graphs_gpu.py" wrappers.txt 10  # one worker: FlashInfer's JIT
    python tools/gpu_steps.py --out "$out" --budget "$budget" --tail 40 "${fib[@]}" "${step[@]}" ;;
  *) echo "part must be gqa, mla, ab, late, route, line, mla-line, mla-short, rank-major, scan, uniform, mla-default, \
line-peers, peers or fib, got $part" >&2
     exit 2 ;;
esac

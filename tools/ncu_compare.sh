#!/usr/bin/env bash
# Side-by-side Nsight Compute metrics of cute_attn and FA4 on identical cases (GPU machine only).
#
#   bash tools/ncu_compare.sh OUT_DIR [workload ...]     (default: prefill_n1_q992 prefill_n32_q992 decode_n16_kv2048)
#
# Per workload and implementation: duration, tensor (wgmma) pipe activity, issue-slot use, warp stall
# reasons, DRAM bytes and L2 hit rate, as CSV (`--csv --page raw`) so tools can read them back.
# Clocks are left alone (`--clock-control none`): the device notes say locked clocks misreport here.
set -u
out=${1:?usage: ncu_compare.sh OUT_DIR [workload ...]}
shift
workloads=${*:-prefill_n1_q992 prefill_n32_q992 decode_n16_kv2048}
mkdir -p "$out"
metrics="gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__inst_executed_pipe_tensor_op_gmma.sum,smsp__issue_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,lts__t_sector_hit_rate.pct"
metrics+=",launch__registers_per_thread,launch__grid_size"
metrics+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
for w in $workloads; do
  for impl in cute_attn fa4; do
    peer=""
    [ "$impl" = fa4 ] && peer="--peer fa4"
    # -c 3: the attention kernel (and combine, when there is one) of the first call
    timeout 100 ncu --clock-control none --csv --page raw -k regex:cutlass -c 3 --metrics "$metrics" \
      python tools/kernel_breakdown.py --once "$w" $peer > "$out/ncu_${w}_${impl}.csv" 2> "$out/ncu_${w}_${impl}.err"
    echo "$w $impl rc=$?"
  done
done

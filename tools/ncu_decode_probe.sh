#!/usr/bin/env bash
# Two Nsight Compute probes of the GQA decode (GPU machine only; clocks left alone, `--clock-control none`):
#
#   bash tools/ncu_decode_probe.sh OUT_DIR ours    # our h32/kv16 plan-once kernel (pages 64, 1), the line build
#   bash tools/ncu_decode_probe.sh OUT_DIR peer    # FlashInfer's CUDA-core decode on the same h32/kv16 cases
#   bash tools/ncu_decode_probe.sh OUT_DIR prologue  # the line builds' prologue without / with the uniform closed
#       form: MLA decode 1 x 4096 page 64 (a row the closed form made slower) and GQA decode 64 x 2048 (faster)
#
# Parity: the two FIB representatives behind FlashInfer (h32/kv16 64 x 2048, pages 64 and 1, 0.99x) side by side:
# duration, DRAM bytes and throughput, L2 hit rate, occupancy (CSV, `--page raw`). Stalls: the default call's line
# build (h20/kv4 64 x 2048 page 64) under `--set full`, its warp states and hottest SASS (`tools/ncu_stalls.py`),
# for the prologue's no-instruction stalls (perf-notes, Next 2 (v)).
set -u
out=${1:?usage: ncu_decode_probe.sh OUT_DIR ours|peer}
part=${2:?usage: ncu_decode_probe.sh OUT_DIR ours|peer}
mkdir -p "$out"
metrics="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
metrics+=",lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size"
metrics+=",launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic"
metrics+=",sm__cycles_active.avg,sm__cycles_elapsed.max,smsp__issue_active.avg.pct_of_peak_sustained_active"
metrics+=",lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_write.sum"
if [ "$part" = prologue ]; then
  for w in mla_decode_default_n1_kv4096_p64 decode_n64_kv2048; do
    for u in 0 1; do
      name="${w}_u$u"
      timeout 200 ncu --clock-control none --set full --import-source no -k regex:cutlass -c 1 -o "$out/$name" \
        python tools/kernel_breakdown.py --once "$w" --line-uniform "$u" > "$out/$name.log" 2>&1
      echo "$name rc=$?"
      ncu -i "$out/$name.ncu-rep" --csv --page source --print-source sass > "$out/$name.csv" 2>/dev/null
      for marker in UTMALDG LDGSTS; do
        python tools/ncu_stalls.py --prologue "$marker" "$out/$name.csv" > "$out/${name}_$marker.txt" 2>&1
      done
      ncu -i "$out/$name.ncu-rep" --csv --page raw --metrics gpu__time_duration.sum > "$out/$name.time.csv" 2>&1
      rm -f "$out/$name.ncu-rep"
      gzip -f "$out/$name.csv"
    done
  done
  exit 0
fi
for w in decode_h32kv16_n64_kv2048 decode_h32kv16_n64_kv2048_p1; do
  peer=""
  [ "$part" = peer ] && peer="--peer flashinfer_cuda_cores"
  timeout 200 ncu --clock-control none --csv --page raw -k "regex:cutlass|Decode" -c 3 --metrics "$metrics" \
    python tools/kernel_breakdown.py --once "$w" $peer > "$out/ncu_${w}_${part}.csv" 2> "$out/ncu_${w}_${part}.err"
  echo "$w $part rc=$?"
done
if [ "$part" = ours ]; then
  timeout 200 ncu --clock-control none --set full --import-source no -k regex:cutlass -c 1 -o "$out/line_build" \
    python tools/kernel_breakdown.py --once decode_n64_kv2048 > "$out/line_build.log" 2>&1
  echo "line build rc=$?"
  python tools/ncu_stalls.py "$out/line_build.ncu-rep" --top 60 > "$out/line_build_stalls.txt" 2>&1
  ncu -i "$out/line_build.ncu-rep" --csv --page source --print-source sass > "$out/line_build_sass.csv" 2>/dev/null
  python tools/ncu_stalls.py --blocks 20 "$out/line_build_sass.csv" > "$out/line_build_blocks.txt" 2>&1
  python tools/ncu_stalls.py --prologue UTMALDG "$out/line_build_sass.csv" > "$out/line_build_prologue.txt" 2>&1
  rm -f "$out/line_build.ncu-rep"
  gzip -f "$out/line_build_sass.csv"
fi

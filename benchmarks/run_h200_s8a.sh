#!/usr/bin/env bash
# Session 8, device call 1 (diagnostics, no code change since session 7):
# 1. ncu of the Mosaic decode kernel at 8 x 131072, bf16 then fp8 q+k, two launches each
#    (--launch-skip 3 skips check()'s three calls): kernel durations without the timer's
#    host-side noise, stall reasons, occupancy (issue 2: fp8 >= 1.7x bf16 at this shape);
# 2. the top-K stages for one row at 32K / 128K / 1M (issue 4: where the single-row call's
#    time goes; the 5x lax.top_k target fails only for B=1);
# 3. the public top-K at the two row lengths session 7 did not time (32K, 512K).
source benchmarks/h200_env.sh
timeout 150 ncu --clock-control none --csv --print-units base -k regex:jaxsparse_decode_mgpu \
  --launch-skip 3 --launch-count 4 --section SpeedOfLight --section WarpStateStats \
  --section Occupancy --section LaunchStats python3 benchmarks/decode_mgpu.py --no-triton \
  --dtypes "bf16,fp8 q+k" --shapes 8x131072 --configs 32:4 --profile 2 \
  --out "$L/ncu_dummy.json" > "$L/ncu_decode_8x128k.csv" 2>&1
grep -E '"(Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Grid Size|Block Limit Shared Mem)"' \
  "$L/ncu_decode_8x128k.csv" | cut -d, -f1,5,13- | head -40
timeout 200 python3 benchmarks/topk_stages.py --shapes 1x32768,1x131072,1x1048576 \
  --only "group_max,threshold (bisect 20),compact, one pass,16 warps,whole topk,lax" \
  --out "$L/topk_stages_b1.json" > "$L/topk_stages_b1.log" 2>&1
grep "│" "$L/topk_stages_b1.log" | grep -v "^│    "
timeout 200 python3 benchmarks/bench_topk.py --default-config-only \
  --batches 64,8,1 --n 32768,524288 --k 2048,512 \
  --out "$L/topk_api_32k_512k.json" > "$L/topk_api_32k_512k.log" 2>&1
grep "│" "$L/topk_api_32k_512k.log" | head -60
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

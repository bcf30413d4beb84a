#!/usr/bin/env bash
# Session 2, call 2: decode tiling sweep at the small shapes, fp8 tilings, ncu of decode kernels.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl" JAXSPARSE_IN_GRAPH=1
CF=2:8:4:4,2:4:4:4,1:16:4:4,1:8:4:6,2:8:4:3,2:8:4:6,2:16:4:4,4:4:4:3,2:8:8:4
for s in 1:1048576 8:131072 64:32768; do
  b=${s%%:*}; n=${s##*:}
  timeout 100 python3 benchmarks/bench_indexer.py --what decode --key-dtypes bfloat16 --no-baseline \
    --decode-batches $b --decode-slots $n --decode-configs $CF --out "$OUT/decode_sweep_b${b}_n${n}.json" \
    > "$OUT/decode_sweep_b${b}_n${n}.log" 2>&1; grep "│" "$OUT/decode_sweep_b${b}_n${n}.log"
done
CF8=2:8:4:4,4:4:4:4,4:8:4:4,2:8:4:6,4:4:8:3,8:2:8:3,1:16:4:6
timeout 120 python3 benchmarks/bench_indexer.py --what decode --key-dtypes "float8_e4m3fn,fp8 q+k" \
  --no-baseline --decode-batches 64 --decode-slots 131072 --decode-configs $CF8 \
  --out "$OUT/decode_sweep_fp8.json" > "$OUT/decode_sweep_fp8.log" 2>&1; grep "│" "$OUT/decode_sweep_fp8.log"
which ncu && for w in decode-bf16 decode-fp8 decode-fp8qk; do
  timeout 90 ncu --clock-control none -k regex:jaxsparse --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats \
    python3 benchmarks/profile_one.py $w > "$OUT/ncu_$w.txt" 2>&1
  grep -E "Duration|Throughput|Registers|Achieved Occupancy|Stall|Shared Memory Config|One or More|Theoretical Occ" "$OUT/ncu_$w.txt" | head -30
done

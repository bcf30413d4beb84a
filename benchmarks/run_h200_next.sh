#!/usr/bin/env bash
# The next device call (one call, < 10 min): what session 5 left open.
# 0. first `bash benchmarks/run_h200_s5e.sh` (the set-then-sort top-K finish: GPU tests, timing
#    against the buffer sort, the SPIN step with it): written in session 5, never run;
#    and the SPIN step with reduction A2 (updates only block states; not yet timed), below;
# 1. why mid-size fp8 decode calls (8 x 128K: ~46-51 us, floor ~33) are slower than their bytes:
#    ncu stall reasons and occupancy for bf16 vs fp8 q+k at 8 x 131072 (kernel alone);
# 2. the top-K per kernel at B=64 x 128K (sorted and set), the baseline for the next attempt at
#    the 50 us target (session 5's group compaction was slower, NOTES.md);
# 3. SPIN's stages at B=64 x 128K, 40% (prediction, update, compaction: ~65 us together, the
#    gap to the <= 0.70 target).
source benchmarks/h200_env.sh
timeout 120 ncu --clock-control none --csv --print-units base -k regex:jaxsparse_decode_mgpu \
  --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
  python3 benchmarks/decode_mgpu.py --no-triton --dtypes "bf16,fp8 q+k" --shapes 8x131072 \
  --configs 32:4 --profile 2 --out "$L/ncu_dummy.json" > "$L/ncu_fp8_mid.csv" 2>&1
for w in topk-set topk; do
  timeout 60 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
    python3 benchmarks/profile_one.py $w --calls 3 > "$L/ncu_$w.csv" 2>&1
done
timeout 150 python3 benchmarks/bench_spin.py --batches 64 --slots 131072 --sparsities 0.4 \
  --out "$L/spin_parts.json" > "$L/spin_parts.log" 2>&1; grep "│" "$L/spin_parts.log"
timeout 90 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --step-only --reduction A2 --out "$L/spin_step_a2.json" > "$L/spin_step_a2.log" 2>&1
grep "│" "$L/spin_step_a2.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

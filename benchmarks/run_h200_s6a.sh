#!/usr/bin/env bash
# Session 6, device call 1: what session 5 left untimed (run_h200_next.sh, trimmed to < 10 min).
# 0. the set-then-sort top-K finish: GPU tests, timing against the buffer sort, SPIN step with it;
# 1. the SPIN step under reduction A2 (updates only block states), with its parts at 128K;
# 2. ncu stall reasons / occupancy for bf16 vs fp8 q+k decode at 8 x 131072 (kernel alone);
# 3. the shipped top-K per kernel at B=64 x 128K (sorted and set).
source benchmarks/h200_env.sh
timeout 60 python3 -m pytest -q -m gpu tests/test_gpu.py -k "topk" > "$L/gpu_tests_setsort.log" 2>&1
tail -2 "$L/gpu_tests_setsort.log"
timeout 70 python3 benchmarks/bench_topk.py --finish sort,set-sort --k 2048 --batches 64,8 \
  --n 131072,1048576 --no-approx --out "$L/topk_setsort.json" > "$L/topk_setsort.log" 2>&1
grep "│" "$L/topk_setsort.log" | grep -v approx || tail -20 "$L/topk_setsort.log"
timeout 120 python3 benchmarks/bench_spin.py --batches 64 --slots 131072 --sparsities 0.4 \
  --reduction A2 --out "$L/spin_parts_a2.json" > "$L/spin_parts_a2.log" 2>&1
grep "│" "$L/spin_parts_a2.log"
timeout 90 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --step-only --reduction A2 --topk-finish set-sort --out "$L/spin_step_a2_setsort.json" \
  > "$L/spin_step_a2_setsort.log" 2>&1
grep "│" "$L/spin_step_a2_setsort.log"
timeout 100 ncu --clock-control none --csv --print-units base -k regex:jaxsparse_decode_mgpu \
  --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
  python3 benchmarks/decode_mgpu.py --no-triton --dtypes "bf16,fp8 q+k" --shapes 8x131072 \
  --configs 32:4 --profile 2 --out "$L/ncu_dummy.json" > "$L/ncu_fp8_mid.csv" 2>&1
for w in topk-set topk; do
  timeout 45 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
    python3 benchmarks/profile_one.py $w --calls 3 > "$L/ncu_$w.csv" 2>&1
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

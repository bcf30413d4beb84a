#!/usr/bin/env bash
# The next device call (one call, < 10 min): what session 6 left open.
# 1. the top-K filter-pass sweep (chunk / warps / bisection steps), if session 6's call 5 did not
#    run (benchmarks/results/session6/topk_stages_configs.json absent);
# 2. the SPIN A2 step at B=64 x 128K, 40%, three more times (session 6: 0.678-0.703x in 4 runs);
# 3. ncu of the fp8 q+k decode kernel alone at 8 x 131072 (session 6's attempt profiled only a
#    warm-up call of the correctness check, then failed: --launch-skip 1 skips the check).
source benchmarks/h200_env.sh
[ -f benchmarks/results/session6/topk_stages_configs.json ] || \
  timeout 230 python3 benchmarks/topk_stages.py --shapes 64x131072,8x1048576 \
    --configs 4096:4:20,4096:4:12,2048:4:12,8192:8:12 \
    --out "$L/topk_stages_configs.json" > "$L/topk_stages_configs.log" 2>&1
for i in 1 2 3; do
  timeout 60 python3 benchmarks/bench_spin.py --step-only --reduction A2 --batches 64 \
    --slots 131072 --sparsities 0.4 --out "$L/spin_a2_128k_$i.json" > "$L/spin_a2_128k_$i.log" 2>&1
  grep "│" "$L/spin_a2_128k_$i.log" | grep -v "^│    "
done
timeout 120 ncu --clock-control none --csv --print-units base -k regex:jaxsparse_decode_mgpu \
  --launch-skip 1 --launch-count 4 --section WarpStateStats --section Occupancy \
  --section MemoryWorkloadAnalysis python3 benchmarks/decode_mgpu.py --no-triton \
  --dtypes "bf16,fp8 q+k" --shapes 8x131072 --configs 32:4 --profile 2 \
  --out "$L/ncu_dummy.json" > "$L/ncu_fp8_mid.csv" 2>&1
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

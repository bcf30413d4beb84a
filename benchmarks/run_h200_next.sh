#!/usr/bin/env bash
# The next device call (one call, < 10 min): what session 7 left open.
# 1. ncu of the fp8 q+k decode kernel alone at 8 x 131072 (issue 2: why the fp8 call's time
#    varies by ~35% between runs; --launch-skip 1 skips the correctness check's call);
# 2. the SPIN step at B=64 x 128K, 40%, A2 and A1, three times each with the bitonic top-K
#    default (session 7: one run each, 0.705x / 0.754x);
# 3. the top-K stages at 1 x 131072 with the bitonic default (where the five launches go).
source benchmarks/h200_env.sh
timeout 120 ncu --clock-control none --csv --print-units base -k regex:jaxsparse_decode_mgpu \
  --launch-skip 1 --launch-count 4 --section WarpStateStats --section Occupancy \
  --section MemoryWorkloadAnalysis python3 benchmarks/decode_mgpu.py --no-triton \
  --dtypes "bf16,fp8 q+k" --shapes 8x131072 --configs 32:4 --profile 2 \
  --out "$L/ncu_dummy.json" > "$L/ncu_fp8_mid.csv" 2>&1
for i in 1 2 3; do
  for r in A2 A1; do
    timeout 75 python3 benchmarks/bench_spin.py --step-only --reduction $r --batches 64 \
      --slots 131072 --sparsities 0.4 --out "$L/spin_${r}_128k_$i.json" > "$L/spin_${r}_$i.log" 2>&1
    grep "│" "$L/spin_${r}_$i.log" | grep -v "^│    "
  done
done
timeout 120 python3 benchmarks/topk_stages.py --shapes 1x131072 \
  --only "group_max,threshold,compact,bitonic,whole topk,lax" \
  --out "$L/topk_stages_b1.json" > "$L/topk_stages_b1.log" 2>&1
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

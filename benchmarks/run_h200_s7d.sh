#!/usr/bin/env bash
# Session 7, device call 4 (run inline on the still-warm machine right after call 3, recorded
# here): the SPIN step at B=64 x 128K, 40%, under A2 and A1, both steps' top-K finished by the
# bitonic kernel at 16 warps.
source benchmarks/h200_env.sh
for r in A2 A1; do
  timeout 75 python3 benchmarks/bench_spin.py --step-only --reduction $r --batches 64 \
    --slots 131072 --sparsities 0.4 --topk-finish bitonic --out "$OUT/spin_${r}_128k_bitonic16.json" \
    > "$L/spin_$r.log" 2>&1
  grep "│" "$L/spin_$r.log" | grep -v "^│    "
done

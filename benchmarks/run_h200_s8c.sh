#!/usr/bin/env bash
# Session 8, device call 3: the SPIN step against the full step with the device trace's kernel
# time beside the in-graph time (issue 5; call 2 showed the wall-clock timer adding 3-70 us of
# spread to single kernels). B=64, 40% target sparsity: A2 and A1 (the default) at 128K with the
# stage times, then both at 512K, step only.
source benchmarks/h200_env.sh
for r in A2 A1; do
  timeout 140 python3 benchmarks/bench_spin.py --reduction $r --batches 64 --slots 131072 \
    --sparsities 0.4 --out "$L/spin_${r}_128k_ktime.json" > "$L/spin_${r}_128k.log" 2>&1
  grep "│" "$L/spin_${r}_128k.log" | grep -v "^│    "
done
for r in A2 A1; do
  timeout 110 python3 benchmarks/bench_spin.py --step-only --reduction $r --batches 64 \
    --slots 524288 --sparsities 0.4 --out "$L/spin_${r}_512k_ktime.json" > "$L/spin_${r}_512k.log" 2>&1
  grep "│" "$L/spin_${r}_512k.log" | grep -v "^│    "
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# The next device call: what session 3 could not fit in its device time (one call, < 10 min):
# the SPIN sweep over B x N x sparsity with the final code (bf16 state, sorted and as a set),
# and the top-K at K=512 for B in {8, 1} with the default finish and sorted=False.
source benchmarks/h200_env.sh
for m in "" --unsorted; do
  timeout 200 python3 benchmarks/bench_spin.py --batches 64,8,1 --slots 131072,524288,32768 \
    --sparsities 0.2,0.4,0.5 --step-only $m --out "$L/spin_sweep${m/--/_}.json" \
    > "$L/spin_sweep${m/--/_}.log" 2>&1; grep "│" "$L/spin_sweep${m/--/_}.log"
done
timeout 170 python3 benchmarks/bench_topk.py --k 512 --batches 8,1 --no-approx --unsorted \
  --default-config-only --out "$L/topk_k512.json" > "$L/topk_k512.log" 2>&1
grep "│" "$L/topk_k512.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

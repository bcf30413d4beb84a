#!/usr/bin/env bash
# Session 4, device call 2: the first Mosaic GPU prefill kernel (check + tiling sweep against
# the Triton kernel), then the SPIN sweep over B x N x sparsity with the final code.
source benchmarks/h200_env.sh
timeout 240 python3 benchmarks/prefill_mgpu.py --out "$L/prefill_mgpu.json" \
  > "$L/prefill_mgpu.log" 2>&1; grep "│" "$L/prefill_mgpu.log" || tail -30 "$L/prefill_mgpu.log"
timeout 250 python3 benchmarks/bench_spin.py --batches 64,8,1 --slots 131072,524288,32768 \
  --sparsities 0.2,0.4,0.5 --step-only --out "$L/spin_sweep.json" > "$L/spin_sweep.log" 2>&1
grep "│" "$L/spin_sweep.log" | head -80
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

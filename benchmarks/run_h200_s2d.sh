#!/usr/bin/env bash
# Session 2, call 4: GPU tests (new kernels), SPIN step with the full update in the timing
# (state threaded through the calls), parts at 40%, and the B x N x sparsity sweep.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAXSPARSE_IN_GRAPH=unrolled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
L=$OUT/logs
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$L/gpu_tests.log" | tail -3
timeout 170 python3 benchmarks/bench_spin.py --batches 64,8 --slots 131072,524288 \
  --sparsities 0.4 --out "$OUT/spin_parts_h200.json" > "$L/spin_parts.log" 2>&1
grep "│" "$L/spin_parts.log"
timeout 270 python3 benchmarks/bench_spin.py --batches 64,8,1 --slots 131072,524288,32768 \
  --sparsities 0.2,0.4,0.5 --step-only --out "$OUT/spin_sweep_h200.json" > "$L/spin_sweep.log" 2>&1
grep "│" "$L/spin_sweep.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

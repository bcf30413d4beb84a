#!/usr/bin/env bash
# Session 4, device call 1: the GPU tests of SPIN's new kernels (EMA update fused into the
# block-sparse scoring kernel; the batched prediction kernel), the sparse-vs-dense scoring
# tiling sweep, then the SPIN step and its stages at B=64 x {128K, 512K}, 40%, sorted and
# as a set.
# The fused update and the prediction kernel measured slower (benchmarks/NOTES.md, Session 4)
# and were reverted; this script ran at commit 50221ae, which holds them.
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k spin > "$L/gpu_tests_spin.log" 2>&1
tail -3 "$L/gpu_tests_spin.log"
timeout 150 python3 benchmarks/sparse_tiling.py --out "$L/sparse_tiling.json" \
  > "$L/sparse_tiling.log" 2>&1; grep "│" "$L/sparse_tiling.log"
timeout 170 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --out "$L/spin_parts.json" > "$L/spin_parts.log" 2>&1; grep "│" "$L/spin_parts.log"
timeout 90 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --step-only --unsorted --out "$L/spin_step_unsorted.json" > "$L/spin_step_unsorted.log" 2>&1
grep "│" "$L/spin_step_unsorted.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

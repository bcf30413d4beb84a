#!/usr/bin/env bash
# Session 6, device call 4: the final code (A2 update with 16 blocks per program): SPIN GPU tests,
# the A2 step's stages at B=64 x 128K, and the A2 step at B=64 x {128K, 512K}, 40%.
source benchmarks/h200_env.sh
timeout 100 python3 -m pytest -q -m gpu tests/test_gpu.py -k "spin" > "$L/gpu_tests_spin_final.log" 2>&1
tail -1 "$L/gpu_tests_spin_final.log"
timeout 100 python3 benchmarks/bench_spin.py --batches 64 --slots 131072 --sparsities 0.4 \
  --reduction A2 --out "$L/spin_parts_a2_final.json" > "$L/spin_parts_a2_final.log" 2>&1
grep "│" "$L/spin_parts_a2_final.log" | grep -v "^│    "
timeout 150 python3 benchmarks/bench_spin.py --step-only --reduction A2 --batches 64 \
  --sparsities 0.4 --out "$L/spin_step_a2_final.json" > "$L/spin_step_a2_final.log" 2>&1
grep "│" "$L/spin_step_a2_final.log" | grep -v "^│    "
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

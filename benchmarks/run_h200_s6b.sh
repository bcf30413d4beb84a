#!/usr/bin/env bash
# Session 6, device call 2: the SPIN kernels (one-launch selection + compaction; in-place update
# with the top-K group maxima fused): GPU tests, the step's stages at B=64 x 128K (A2 and A1),
# the step grid (B in {1, 8, 64} x {128K, 512K} x 20/40/50%) under A2; decode run lengths for
# fp8 at the mid-size shapes (64-page runs: one wave at 8 x 128K).
source benchmarks/h200_env.sh
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k "spin" > "$L/gpu_tests_spin.log" 2>&1
tail -2 "$L/gpu_tests_spin.log"
for r in A2 A1; do
  timeout 100 python3 benchmarks/bench_spin.py --batches 64 --slots 131072 --sparsities 0.4 \
    --reduction $r --out "$L/spin_parts_$r.json" > "$L/spin_parts_$r.log" 2>&1
  grep "│" "$L/spin_parts_$r.log" | grep -v "^│    "
done
timeout 200 python3 benchmarks/bench_spin.py --step-only --reduction A2 \
  --out "$L/spin_grid_a2.json" > "$L/spin_grid_a2.log" 2>&1
grep "│" "$L/spin_grid_a2.log" | grep -v "^│    "
timeout 100 python3 benchmarks/decode_mgpu.py --no-triton --dtypes "bf16,fp8 q+k" \
  --shapes 8x131072,64x131072,1x1048576 --configs 64:4,32:4,16:4 \
  --out "$L/decode_runs_fp8.json" > "$L/decode_runs_fp8.log" 2>&1
grep "│" "$L/decode_runs_fp8.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

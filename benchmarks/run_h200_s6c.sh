#!/usr/bin/env bash
# Session 6, device call 3: the SPIN step grid at B=64 (128K, 512K x 20/40/50%) under A2 (call 2
# timed out after B in {1, 8}); A1 at B=64 x {128K, 512K}, 40%; blocks per program of the update
# kernel; three back-to-back runs of 8 x 128K decode (bf16 vs fp8 q+k) for the run-to-run spread.
source benchmarks/h200_env.sh
timeout 240 python3 benchmarks/bench_spin.py --step-only --reduction A2 --batches 64 \
  --out "$L/spin_grid_a2_b64.json" > "$L/spin_grid_a2_b64.log" 2>&1
grep "│" "$L/spin_grid_a2_b64.log" | grep -v "^│    "
timeout 120 python3 benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 \
  --sparsities 0.4 --out "$L/spin_grid_a1_b64.json" > "$L/spin_grid_a1_b64.log" 2>&1
grep "│" "$L/spin_grid_a1_b64.log" | grep -v "^│    "
timeout 60 python3 benchmarks/spin_update_bpp.py --out "$L/spin_update_bpp.json" \
  > "$L/spin_update_bpp.log" 2>&1; grep "│" "$L/spin_update_bpp.log"
timeout 60 python3 benchmarks/decode_mgpu.py --no-triton --dtypes "bf16,fp8 q+k" \
  --shapes 8x131072,8x131072,8x131072 --configs 32:4 \
  --out "$L/decode_spread_8x128k.json" > "$L/decode_spread_8x128k.log" 2>&1
grep "│" "$L/decode_spread_8x128k.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

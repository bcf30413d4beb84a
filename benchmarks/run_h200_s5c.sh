#!/usr/bin/env bash
# Session 5, device call 3 (final code): the whole GPU suite in one log; the decode table through
# the public API (Mosaic defaults with the run length picked by CTA count) with the plain-jnp
# baseline in the same run, B in {64, 8, 1} x {32K, 128K, 1M}; the SPIN step against the full step.
source benchmarks/h200_env.sh
timeout 230 python3 -m pytest -q -m gpu tests/test_gpu.py > "$L/gpu_tests_all.log" 2>&1
tail -3 "$L/gpu_tests_all.log"
timeout 210 python3 benchmarks/bench_indexer.py --what decode --best-only \
  --key-dtypes "bfloat16,float8_e4m3fn,fp8 q+k" --decode-batches 64,8,1 \
  --decode-slots 32768,131072,1048576 --out "$L/decode_table.json" > "$L/decode_table.log" 2>&1
grep "│" "$L/decode_table.log" || tail -20 "$L/decode_table.log"
timeout 80 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --step-only --out "$L/spin_step.json" > "$L/spin_step.log" 2>&1
grep "│" "$L/spin_step.log" || tail -20 "$L/spin_step.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

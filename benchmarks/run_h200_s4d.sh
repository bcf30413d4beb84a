#!/usr/bin/env bash
# Session 4, device call 4: the GPU tests with the Mosaic kernels as defaults (decode: bf16,
# fp8 q+k, bf16 q + fp8 cache; prefill: bf16, fp8 q+k), the decode and prefill tables through
# the public API, and the SPIN step against the (now faster) full step.
source benchmarks/h200_env.sh
timeout 110 python3 -m pytest -q -m gpu tests/test_gpu.py > "$L/gpu_tests.log" 2>&1
tail -3 "$L/gpu_tests.log"
timeout 130 python3 benchmarks/bench_indexer.py --what decode --best-only --no-baseline \
  --key-dtypes "bfloat16,float8_e4m3fn,fp8 q+k" --decode-batches 64,8,1 \
  --decode-slots 131072,1048576 --out "$L/decode_default.json" > "$L/decode_default.log" 2>&1
grep "│" "$L/decode_default.log" || tail -20 "$L/decode_default.log"
timeout 70 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --step-only --out "$L/spin_step_mosaic.json" > "$L/spin_step_mosaic.log" 2>&1
grep "│" "$L/spin_step_mosaic.log" || tail -20 "$L/spin_step_mosaic.log"
timeout 60 python3 benchmarks/bench_indexer.py --what prefill --best-only \
  --key-dtypes "bfloat16,fp8 q+k" --prefill-keys 65536,1048576 --out "$L/prefill_default.json" \
  > "$L/prefill_default.log" 2>&1; grep "│" "$L/prefill_default.log" || tail -20 "$L/prefill_default.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

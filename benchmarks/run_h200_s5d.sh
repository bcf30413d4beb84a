#!/usr/bin/env bash
# Session 5, device call 4: fp8 pages in flight (4 vs 8; kernel alone), then the decode table
# through the public API with the final defaults (8 fp8 pages in flight) and the jnp baseline.
source benchmarks/h200_env.sh
timeout 80 python3 benchmarks/decode_mgpu.py --no-triton --dtypes "fp8 q+k,fp8 keys" \
  --shapes 64x131072,8x131072,1x1048576 --configs 32:4,32:8 \
  --out "$L/decode_fp8_steps.json" > "$L/decode_fp8_steps.log" 2>&1
grep "│" "$L/decode_fp8_steps.log" || tail -20 "$L/decode_fp8_steps.log"
timeout 170 python3 benchmarks/bench_indexer.py --what decode --best-only \
  --key-dtypes "bfloat16,float8_e4m3fn,fp8 q+k" --decode-batches 64,8,1 \
  --decode-slots 131072,1048576 --out "$L/decode_table_final.json" > "$L/decode_table_final.log" 2>&1
grep "│" "$L/decode_table_final.log" || tail -20 "$L/decode_table_final.log"
timeout 60 python3 -m pytest -q -m gpu tests/test_gpu.py -k "decode or spin" > "$L/gpu_tests_decode.log" 2>&1
tail -2 "$L/gpu_tests_decode.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

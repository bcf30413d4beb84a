#!/usr/bin/env bash
# Session 4, device call 3: GPU tests of the Mosaic kernels (prefill now the bf16 default),
# the first Mosaic decode kernel (check + tiling sweep against Triton, bf16 and fp8 q+k), and
# the prefill benchmark over 64K-1M keys with the new default.
source benchmarks/h200_env.sh
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k "prefill or mosaic" \
  > "$L/gpu_tests_mosaic.log" 2>&1; tail -3 "$L/gpu_tests_mosaic.log"
timeout 200 python3 benchmarks/decode_mgpu.py --out "$L/decode_mgpu.json" \
  > "$L/decode_mgpu.log" 2>&1; grep "│" "$L/decode_mgpu.log" || tail -40 "$L/decode_mgpu.log"
timeout 200 python3 benchmarks/bench_indexer.py --what prefill --best-only --key-dtypes \
  bfloat16,float8_e4m3fn --prefill-keys 65536,131072,262144,524288,1048576 \
  --out "$L/prefill_mosaic_default.json" > "$L/prefill_mosaic_default.log" 2>&1
grep "│" "$L/prefill_mosaic_default.log" || tail -20 "$L/prefill_mosaic_default.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

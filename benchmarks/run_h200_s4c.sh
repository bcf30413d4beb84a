#!/usr/bin/env bash
# Session 4, device call 3: GPU tests of the Mosaic kernels (prefill now the bf16 default), the
# first Mosaic decode kernel (check + tiling sweep against Triton, bf16 and fp8 q+k), and the
# Mosaic prefill over 64K-1M keys (bf16, and fp8 q+k with fp8 wgmma) next to Triton.
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k "prefill or mosaic" \
  > "$L/gpu_tests_mosaic.log" 2>&1; tail -3 "$L/gpu_tests_mosaic.log"
timeout 200 python3 benchmarks/decode_mgpu.py --out "$L/decode_mgpu.json" \
  > "$L/decode_mgpu.log" 2>&1; grep "│" "$L/decode_mgpu.log" || tail -40 "$L/decode_mgpu.log"
timeout 200 python3 benchmarks/prefill_mgpu.py --keys 65536,524288,1048576 \
  --configs 4:64:2,8:64:2,8:128:2 --fp8-configs 4:64:2,8:64:2,8:128:2 \
  --out "$L/prefill_mgpu_keys.json" > "$L/prefill_mgpu_keys.log" 2>&1
grep "│" "$L/prefill_mgpu_keys.log" || tail -30 "$L/prefill_mgpu_keys.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

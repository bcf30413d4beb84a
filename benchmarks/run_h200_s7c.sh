#!/usr/bin/env bash
# Session 7, device call 3: the public top-K with the bitonic finish (split / join form, 16 warps)
# against the default finish, lax.top_k and torch.topk, K in {512, 2048}.
source benchmarks/h200_env.sh
timeout 60 python3 -m pytest -q -x tests/test_gpu.py -k "topk_gpu and bitonic and 131072" \
  > "$L/gpu_tests_bitonic16.log" 2>&1
tail -1 "$L/gpu_tests_bitonic16.log"
timeout 320 python3 benchmarks/bench_topk.py --finish auto,bitonic --no-approx \
  --batches 64,8,1 --n 131072,1048576 --k 2048,512 \
  --out "$L/topk_bitonic_api.json" > "$L/topk_bitonic_api.log" 2>&1
grep "│" "$L/topk_bitonic_api.log" | head -80
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

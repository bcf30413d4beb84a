#!/usr/bin/env bash
# Session 8, device call 5 (the last ~4.5 min of device time): the bitonic finish now writes
# only the first next_pow2(k) sorted slots (no [R, cap] -> [R, k] slices after it).
# 1. the compiled GPU top-K tests of the bitonic path;
# 2. the whole call's kernels at 64 x 131072, K=2048 (device trace) and in-graph.
source benchmarks/h200_env.sh
timeout 90 python3 -m pytest -q -x tests/test_gpu.py -k "topk_gpu and bitonic" \
  > "$L/gpu_tests_bitonic_out.log" 2>&1
tail -1 "$L/gpu_tests_bitonic_out.log"
timeout 75 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels \
  --only "whole topk,lax.top_k" --out "$L/topk_kernels_b64.json" > "$L/topk_kernels_b64.log" 2>&1
grep "│" "$L/topk_kernels_b64.log" | grep -v "^│    " | grep -v "lax"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

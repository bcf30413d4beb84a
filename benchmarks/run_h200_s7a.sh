#!/usr/bin/env bash
# Session 7, device call 1: the bitonic finish and the one-pass atomic compaction of the top-K.
# 1. GPU top-K tests (compiled: the atomic's chunk order is real here, unlike interpret mode);
# 2. every stage alone and the whole call at 64 / 8 / 1 x 128K (default config).
source benchmarks/h200_env.sh
timeout 200 python3 -m pytest -q -x tests/test_gpu.py -k "topk" > "$L/gpu_tests_topk.log" 2>&1
tail -3 "$L/gpu_tests_topk.log"
timeout 300 python3 benchmarks/topk_stages.py --shapes 64x131072,8x131072,1x131072 \
  --out "$L/topk_stages_bitonic.json" > "$L/topk_stages_bitonic.log" 2>&1
grep "│" "$L/topk_stages_bitonic.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

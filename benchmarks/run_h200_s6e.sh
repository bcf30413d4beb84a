#!/usr/bin/env bash
# Session 6, device call 5: the top-K filter passes under chunk / warps / bisection-step variants.
source benchmarks/h200_env.sh
timeout 150 python3 benchmarks/topk_stages.py --shapes 64x131072 \
  --configs 4096:4:20,4096:4:12,2048:4:12,8192:8:12 \
  --out "$L/topk_stages_configs.json" > "$L/topk_stages_configs.log" 2>&1
grep "│" "$L/topk_stages_configs.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

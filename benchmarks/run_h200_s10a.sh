#!/usr/bin/env bash
# The next device call (not yet run; written in session 9 after its machine was lost), < 9 min,
# all in kernel time (device trace) unless the row says in-graph:
# 0. the compiled GPU tests of the two untimed top-K options (TopkConfig.scan_block: a
#    two-level scan in the compactions; TopkConfig.bitonic_run: the bitonic finish split
#    into parallel sorted runs and a per-row merge) and of kernel_time;
# 1. at 64 x 131072 x 2048 (issue 4's 50 us target; 65.4 us at the default in session 9):
#    each option alone, together, and with 14 bisection steps;
# 2. the same variants at one row (128K, 1M): 5x lax.top_k there needs ~10-20 us.
# Predictions: benchmarks/NOTES.md, session 9, "Prepared for the next device session".
# topk_stages.py rewrites its JSON after every (shape, config), so a timeout keeps the rest
# (session 9 lost three JSON files to timeouts: each brief config with --kernels takes ~25 s).
source benchmarks/h200_env.sh
timeout 100 python3 -m pytest -q -x tests/test_gpu.py -k "blocked_scan_split_bitonic or kernel_time" \
  > "$L/gpu_tests_variants.log" 2>&1
tail -1 "$L/gpu_tests_variants.log"
timeout 220 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels --only "=whole topk" \
  --configs 2048:4:20,2048:4:20:16:0,2048:4:20:64:0,2048:4:20:0:256,2048:4:20:0:512,2048:4:14,2048:4:14:16:512 \
  --out "$L/topk_variants_b64.json" > "$L/topk_variants_b64.log" 2>&1
timeout 160 python3 benchmarks/topk_stages.py --shapes 1x131072,1x1048576 --kernels --only "=whole topk" \
  --configs 2048:4:20,2048:4:20:0:512,2048:4:14:16:512 \
  --out "$L/topk_variants_b1.json" > "$L/topk_variants_b1.log" 2>&1
python3 benchmarks/kernel_rows.py "$OUT/rows.jsonl" bitonic compact threshold
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

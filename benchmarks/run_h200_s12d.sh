#!/usr/bin/env bash
# Session 12, call 4 (< 3 min). Predictions: benchmarks/NOTES.md, session 12 ("Call 4").
# SPIN's kernels alone at 64 x 128K, 40%, kernel time: the update kernel per
# blocks_per_program:num_warps (A2 and A1), A1's block scores per blocks_per_program:num_warps,
# the selection kernel (with A1's block scores) per num_warps.
source benchmarks/h200_env.sh
timeout 150 python3 benchmarks/spin_update_bpp.py --kernel-time \
  --bpp 8:4,8:2,4:2,4:1,16:4,16:2,8:1 --score-tiles 64:4,64:2,32:2,128:4 \
  --select-warps 4,8,16 --out "$L/spin_tiles.json" > "$L/spin_tiles.log" 2>&1
grep "│" "$L/spin_tiles.log" | cut -c1-140
tail -3 "$L/spin_tiles.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 10, call 5 (< 3 min): tiles of A1's block-score kernel (15.1 us at 64 x 128K in
# call 4 with 32 blocks per program, 4 warps: 32 MB at 2.1 TB/s) and the update kernel's
# blocks per program again (kernel time for the scores; in-graph for the update).
source benchmarks/h200_env.sh
timeout 150 python3 benchmarks/spin_update_bpp.py --bpp 4,8,16 \
  --score-tiles 16:4,32:4,32:8,64:4,64:8,128:8,128:16 \
  --out "$L/spin_tiles.json" > "$L/spin_tiles.log" 2>&1
grep "│" "$L/spin_tiles.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

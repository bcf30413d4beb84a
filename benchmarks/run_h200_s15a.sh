#!/usr/bin/env bash
# Session 15, call 1 (< 9 min). Predictions: benchmarks/NOTES.md, session 15 ("Call 1").
# 1. compiled GPU tests of the new small-call paths: the one-program-per-row filter
#    (TopkConfig.fused_max_n) and the two-kernel rank-counting finish (finish="rank");
# 2. kernel time of the whole call at the small shapes that miss 5x lax.top_k, at the
#    session 14 default (bitonic finish), the rank finish, the fused filter, rank tilings.
source benchmarks/h200_env.sh
B=2048:4:14:512:0:3:4:2
timeout 170 python3 -m pytest -q -x tests/test_gpu.py -k "fused_rows or (test_topk_gpu and rank)" \
  > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
timeout 150 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x32768,8x32768 --out "$L/topk_small_32k_s15a.json" \
  --configs "$B,$B+finish=rank,$B+finish=rank+fused_max_n=32768,$B+finish=bitonic+fused_max_n=32768,$B+finish=rank+fused_max_n=32768+rank_block_i=32,$B+finish=rank+fused_max_n=32768+rank_warps=8" \
  > "$L/topk_small_32k.log" 2>&1
timeout 130 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x131072,1x1048576,8x131072 --out "$L/topk_small_long_s15a.json" \
  --configs "$B,$B+finish=rank,$B+finish=rank+rank_block_i=32,$B+finish=rank+rank_block_i=128+rank_block_j=128" \
  > "$L/topk_small_long.log" 2>&1
timeout 90 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 512 \
  --shapes 1x32768,1x131072,1x1048576 --out "$L/topk_small_k512_s15a.json" \
  --configs "$B,$B+finish=rank+fused_max_n=32768,$B+finish=bitonic+fused_max_n=32768" \
  > "$L/topk_small_k512.log" 2>&1
python3 - "$L" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/topk_small_*_s15a.json")):
  for r in json.load(open(f))["rows"]:
    if r["op"] == "topk kernel":
      print(r["B"], r["N"], r["K"], r["config"][22:], r["kernel"][15:], round(r["us"], 2))
PY
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

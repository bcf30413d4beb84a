#!/usr/bin/env bash
# Session 15, call 2 (< 8 min). Predictions: benchmarks/NOTES.md, session 15 ("Call 2").
# 1. compiled GPU tests of the rank finish (tilings; single rows at the new default, where
#    finish="auto" ranks) and of the block-mapped finishes;
# 2. the threshold kernel's warps and bisection steps at one row (and 64 rows) of 128K / 1M;
# 3. the public top-K table's single-row shapes at the new defaults.
source benchmarks/h200_env.sh
B=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_block_i=32
timeout 170 python3 -m pytest -q -x tests/test_gpu.py \
  -k "rank_finish or (test_topk_gpu and rank) or block_map" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
B12=${B/:14:/:12:}; B10=${B/:14:/:10:}
timeout 120 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x131072,1x1048576 --out "$L/topk_thr_b1_s15b.json" \
  --configs "$B,$B+threshold_warps=4,$B+threshold_warps=16,$B12,$B10" > "$L/topk_thr_b1.log" 2>&1
timeout 60 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 64x131072 --out "$L/topk_thr_b64_s15b.json" \
  --configs "$B,$B+threshold_warps=4,$B+threshold_warps=16" > "$L/topk_thr_b64.log" 2>&1
timeout 150 python3 benchmarks/bench_topk.py --default-config-only --kernels \
  --batches 1 --k 2048,512 --out "$L/topk_table_b1_s15b.json" > "$L/topk_table_b1.log" 2>&1
python3 - "$L" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/topk_thr_*_s15b.json")):
  for r in json.load(open(f))["rows"]:
    if r["op"] == "topk kernel" and r["kernel"] in ("all kernels", "jaxsparse_topk_threshold"):
      print(r["B"], r["N"], r["config"][:14], r["config"][22:], r["kernel"][15:], round(r["us"], 2))
for r in json.load(open(sys.argv[1] + "/topk_table_b1_s15b.json"))["rows"]:
  print(r["B"], r["N"], r["K"], r["impl"], round(r.get("kernel_us", float("nan")), 1),
        round(r["us"], 1), round(r["vs_lax_top_k"], 2))
PY
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

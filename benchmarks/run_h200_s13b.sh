#!/usr/bin/env bash
# Session 13, call 2 (< 7 min). Predictions: benchmarks/NOTES.md, session 13 ("Call 2").
# 1. compiled GPU tests of the top-K split bitonic path, three placements;
# 2. kernel time, compaction and whole call: scan / rows (chunk, warps) at 64 x 128K; scan /
#    rows at 8 x 32K, 1 x 128K; scan / lane / rows at 64 x 512K, 8 x 1M, 1 x 1M (K=2048) and
#    64 x 1M (K=512).
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q -x tests/test_gpu.py -k "split_bitonic" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
show() { python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'], r['stage'][:26], r.get('kernel', r['timing'])[:34], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r.get('kernel', '') in ('all kernels', 'jaxsparse_topk_compact_atomic')]" "$1"; }
timeout 140 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels \
  --configs 2048:4:14:512:0,2048:4:14:512:0:2,1024:4:14:512:0:2,4096:4:14:512:0:2,2048:8:14:512:0:2 \
  --only "compact, one pass,=whole topk" --out "$L/topk_rows_b64.json" > "$L/topk_rows_b64.log" 2>&1
show "$L/topk_rows_b64.json"
timeout 80 python3 benchmarks/topk_stages.py --shapes 8x32768,1x131072 --kernels \
  --configs 2048:4:14:512:0,2048:4:14:512:0:2 \
  --only "=whole topk" --out "$L/topk_rows_small.json" > "$L/topk_rows_small.log" 2>&1
show "$L/topk_rows_small.json"
timeout 150 python3 benchmarks/topk_stages.py --shapes 64x524288,8x1048576,1x1048576 --kernels \
  --configs 2048:4:14:512:0,2048:4:14:512:0:1,2048:4:14:512:0:2 \
  --only "=whole topk" --out "$L/topk_place_long.json" > "$L/topk_place_long.log" 2>&1
show "$L/topk_place_long.json"
timeout 80 python3 benchmarks/topk_stages.py --shapes 64x1048576 --k 512 --kernels \
  --configs 2048:4:14:512:0,2048:4:14:512:0:1,2048:4:14:512:0:2 \
  --only "=whole topk" --out "$L/topk_place_k512.json" > "$L/topk_place_k512.log" 2>&1
show "$L/topk_place_k512.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 13, call 3 (< 6 min). Predictions: benchmarks/NOTES.md, session 13 ("Call 3").
# 1. compiled GPU tests of every top-K path (dead runs unsorted, no lengths input);
# 2. kernel time of the whole call: runs of 512 (4 warps) / 1024 (4, 8 warps), 14 or 12
#    bisection steps, at 64 x 128K x 2048; the run variants at 8 x 32K, 1 x 128K, 1 x 1M.
source benchmarks/h200_env.sh
timeout 170 python3 -m pytest -q -x tests/test_gpu.py -k "topk" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
show() { python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'], r['stage'][:26], r.get('kernel', r['timing'])[:34], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows']]" "$1"; }
timeout 120 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels \
  --configs 2048:4:14:512:0,2048:4:14:1024:0,2048:4:14:1024:0:0:8,2048:4:12:512:0,2048:4:12:1024:0:0:8 \
  --only "=whole topk" --out "$L/topk_finish_b64.json" > "$L/topk_finish_b64.log" 2>&1
show "$L/topk_finish_b64.json"
timeout 100 python3 benchmarks/topk_stages.py --shapes 8x32768,1x131072,1x1048576 --kernels \
  --configs 2048:4:14:512:0,2048:4:14:1024:0,2048:4:14:1024:0:0:8 \
  --only "=whole topk" --out "$L/topk_finish_small.json" > "$L/topk_finish_small.log" 2>&1
show "$L/topk_finish_small.json" | grep -E "all kernels|unrolled"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

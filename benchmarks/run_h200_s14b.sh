#!/usr/bin/env bash
# Session 14, call 2 (< 8 min): call 1 again after its fix. Predictions: benchmarks/NOTES.md, session 14 ("Call 1").
# 1. compiled GPU tests of every top-K path, with the gathering compaction (gather=True);
# 2. kernel time of the whole call, the row compaction (defaults) against the gathering one
#    (auto placement, and "lane"), at 64 x 128K x 2048, then at the other table shapes.
source benchmarks/h200_env.sh
timeout 200 python3 -m pytest -q -x tests/test_gpu.py -k "topk" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
show() { python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'], r['stage'][:12], r.get('kernel', r['timing'])[:34], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows']]" "$1"; }
timeout 90 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels \
  --configs 2048:4:14:512:0:3,2048:4:14:512:0:3:4:1,2048:4:14:512:0:1:4:1,1024:4:14:512:0:3:4:1 \
  --only "=whole topk" --out "$L/topk_gather_b64.json" > "$L/topk_gather_b64.log" 2>&1
show "$L/topk_gather_b64.json"
timeout 150 python3 benchmarks/topk_stages.py \
  --shapes 64x1048576,64x524288,8x1048576,8x131072,8x32768,1x131072,1x1048576,1x32768 --kernels \
  --configs 2048:4:14:512:0:3,2048:4:14:512:0:3:4:1 \
  --only "=whole topk" --out "$L/topk_gather_shapes.json" > "$L/topk_gather_shapes.log" 2>&1
show "$L/topk_gather_shapes.json" | grep -E "all kernels|compact"
timeout 90 python3 benchmarks/topk_stages.py --k 512 \
  --shapes 64x1048576,64x131072,8x32768,1x131072 --kernels \
  --configs 2048:4:14:512:0:3,2048:4:14:512:0:3:4:1 \
  --only "=whole topk" --out "$L/topk_gather_k512.json" > "$L/topk_gather_k512.log" 2>&1
show "$L/topk_gather_k512.json" | grep -E "all kernels|compact"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 15, call 5 (< 4.5 min). Predictions: benchmarks/NOTES.md, session 15 ("Call 5").
# 1. compiled GPU tests of the rank finish with 16 x 256 tiles at 2 warps;
# 2. rank count tilings and warps at one row of 32K and 128K, k = 2048 (kernel time).
source benchmarks/h200_env.sh
timeout 60 python3 -m pytest -q -x tests/test_gpu.py -k "rank_finish and 16-256-2" \
  > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
B=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_block_i=32
timeout 170 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x131072,1x32768 --out "$L/topk_rank_tiles_s15e.json" \
  --configs "$B,$B+rank_block_i=16,$B+rank_warps=2,$B+rank_block_i=16+rank_warps=2,$B+rank_block_j=128,$B+rank_block_i=16+rank_block_j=512" \
  > "$L/topk_rank_tiles.log" 2>&1
python3 -c "import json,sys; [print(r['N'], r['config'][50:], r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel' and ('rank' in r['kernel'] or r['kernel'] == 'all kernels')]" "$L/topk_rank_tiles_s15e.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

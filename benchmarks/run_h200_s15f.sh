#!/usr/bin/env bash
# Session 15, call 6 (< 2.5 min): compiled GPU tests of the rank finish with 16 x 512 and
# 16 x 1024 tiles; those tilings and 2 warps at one row of 128K, k = 2048. Predictions:
# benchmarks/NOTES.md, session 15 ("Call 6").
source benchmarks/h200_env.sh
timeout 45 python3 -m pytest -q -x tests/test_gpu.py -k "rank_finish and (16-512-4 or 16-1024-4)" \
  > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
B=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_block_i=16
timeout 60 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x131072 --out "$L/topk_rank_tiles_s15f.json" \
  --configs "$B+rank_block_j=512,$B+rank_block_j=1024,$B+rank_block_j=512+rank_warps=2,$B+rank_block_j=1024+rank_warps=2" \
  > "$L/topk_rank_tiles.log" 2>&1
python3 -c "import json,sys; [print(r['N'], r['config'][50:], r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel' and ('rank' in r['kernel'] or r['kernel'] == 'all kernels')]" "$L/topk_rank_tiles_s15f.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

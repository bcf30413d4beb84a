#!/usr/bin/env bash
# Session 16, call 1 (< 9 min). Predictions: benchmarks/NOTES.md, session 16 ("Call 1").
# 1. compiled GPU tests: threshold multisection, the whole call with it, rank finish 16 x 512;
# 2. whole call (kernel time) at one row and 8 x 32K, k = 2048: bisection against p = 4, 8, 16;
# 3. k = 512 at one row (with the rank finish from k = 512); chunks of 1024 / 512 at one row;
#    64 x 128K x 2048.
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q -x tests/test_gpu.py \
  -k "threshold_gpu or multisection or (rank_finish and 16-512-4)" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
T=512:0:3:4:2+finish=auto+rank_max_rows=1+rank_block_i=16+rank_block_j=512
B=2048:4:14:$T; P4=2048:4:6:$T+bisect_points=4; P8=2048:4:5:$T+bisect_points=8
P16=2048:4:4:$T+bisect_points=16
timeout 220 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x32768,1x131072,1x1048576,8x32768 --configs "$B,$P4,$P8,$P16" \
  --out "$L/topk_thr_s16a.json" > "$L/topk_thr.log" 2>&1
timeout 80 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 512 \
  --shapes 1x32768,1x131072 --configs "$B,$P8,$P8+rank_min_k=512" \
  --out "$L/topk_k512_s16a.json" > "$L/topk_k512.log" 2>&1
timeout 80 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x32768,1x131072 --configs "1024:4:5:$T+bisect_points=8,512:4:5:$T+bisect_points=8" \
  --out "$L/topk_chunk_s16a.json" > "$L/topk_chunk.log" 2>&1
timeout 40 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 64x131072 --configs "$B,$P8" --out "$L/topk_b64_s16a.json" > "$L/topk_b64.log" 2>&1
for f in "$L"/topk_*_s16a.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'T'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel' and r['kernel'] in ('all kernels', 'jaxsparse_topk_threshold', 'jaxsparse_topk_rank_place')]" "$f" "$T"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

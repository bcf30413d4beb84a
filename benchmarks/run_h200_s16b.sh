#!/usr/bin/env bash
# Session 16, call 2 (< 8 min). Predictions: benchmarks/NOTES.md, session 16 ("Call 2").
# 1. compiled GPU tests: regula falsi threshold and the whole call with it; rank finish;
# 2. whole call (kernel time): bisection against regula falsi (slack 64, 16), chunks of 512,
#    k = 2048 and 512 (rank finish from k = 512 at one row), one row, 8 and 64 rows.
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q -x tests/test_gpu.py \
  -k "threshold_gpu or falsi or (rank_finish and 16-512-4)" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
T=512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16+rank_block_j=512
F=+threshold=falsi
timeout 200 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x32768,1x131072,1x1048576 \
  --configs "2048:4:14:$T,2048:4:14:$T$F,2048:4:14:$T$F+falsi_slack=16,512:4:14:$T$F" \
  --out "$L/topk_falsi_b1_s16b.json" > "$L/topk_falsi_b1.log" 2>&1
timeout 100 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 512 \
  --shapes 1x32768,1x131072 --configs "2048:4:14:$T,2048:4:14:$T$F,512:4:14:$T$F" \
  --out "$L/topk_falsi_k512_s16b.json" > "$L/topk_falsi_k512.log" 2>&1
timeout 100 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 8x32768,64x131072 --configs "2048:4:14:$T,2048:4:14:$T$F,512:4:14:$T$F" \
  --out "$L/topk_falsi_rows_s16b.json" > "$L/topk_falsi_rows.log" 2>&1
for f in "$L"/topk_*_s16b.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'T'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel' and r['kernel'] in ('all kernels', 'jaxsparse_topk_threshold', 'jaxsparse_topk_rank_count')]" "$f" "$T"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

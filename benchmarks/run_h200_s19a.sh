#!/usr/bin/env bash
# Session 19, call 1 (< 10 min): compiled tests of the per-block rank finish (rank_rows, at
# one and 8 rows), then its kernel time and label sweeps against the current defaults (C).
# Predictions: benchmarks/NOTES.md, session 19 ("Call 1 predictions").
source benchmarks/h200_env.sh
timeout 170 python3 -m pytest -q -x tests/test_gpu.py -k "finish_repairs and True" > "$L/gpu_tests.log" 2>&1
tail -3 "$L/gpu_tests.log"
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
C=$D+fused_rank=True+repair_in_finish=True+bitonic_mid=2048
W=$C+rank_rows=True
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only)
timeout 150 "${S[@]}" --k 2048 --shapes 1x32768,1x131072 \
  --configs "$C,$W,$W+rank_warps=8,$W+rank_block_i=32,$C+groups_per_k=2,$C+falsi_slack=256" \
  --out "$L/topk_rows_k2048_s19a.json" > "$L/topk_rows_k2048.log" 2>&1
timeout 60 "${S[@]}" --k 512 --shapes 1x32768,1x131072 --configs "$C,$W" \
  --out "$L/topk_rows_k512_s19a.json" > "$L/topk_rows_k512.log" 2>&1
timeout 90 "${S[@]}" --k 2048 --shapes 8x32768,1x524288 \
  --configs "$C,$W+rank_max_rows=8,$C+bitonic_mid=1024" \
  --out "$L/topk_rows_b8_s19a.json" > "$L/topk_rows_b8.log" 2>&1
for f in "$L"/topk_*_s19a.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'C'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$C"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

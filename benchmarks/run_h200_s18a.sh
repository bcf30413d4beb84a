#!/usr/bin/env bash
# Session 18, call 1 (< 10 min): compiled tests of the last-arriver fusions (fused repair,
# one-kernel rank finish, search_compact) and the rank kernels' refactor, then the kernel
# time of the whole call at one row (k = 2048 and 512) and at 8 x 32K x 2048, session 16's
# defaults (D) against each fusion added in turn.
# Predictions: benchmarks/NOTES.md, session 18 ("Call 1 predictions").
source benchmarks/h200_env.sh
timeout 170 python3 -m pytest -q -x tests/test_gpu.py -k "topk_gpu_fused or (test_topk_gpu and rank and not rank_finish) or (rank_finish and 16-512)" > "$L/gpu_tests.log" 2>&1
tail -3 "$L/gpu_tests.log"
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
F1=$D+fused_repair=True; F2=$F1+fused_rank=True
timeout 190 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x32768,1x131072,1x524288,1x1048576 \
  --configs "$D,$F1,$F2,$F2+fused_threshold_rows=1" \
  --out "$L/topk_fused_k2048_s18a.json" > "$L/topk_fused_k2048.log" 2>&1
timeout 90 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 512 \
  --shapes 1x32768,1x131072 --configs "$D,$F2+fused_threshold_rows=1" \
  --out "$L/topk_fused_k512_s18a.json" > "$L/topk_fused_k512.log" 2>&1
timeout 70 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 8x32768 --configs "$D,$F1,$F1+fused_threshold_rows=8" \
  --out "$L/topk_fused_b8_s18a.json" > "$L/topk_fused_b8.log" 2>&1
for f in "$L"/topk_*_s18a.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'D'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$D"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

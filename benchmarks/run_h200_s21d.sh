#!/usr/bin/env bash
# Session 21, call 4: the new default rank_block_j=256 compiled and at the table's one-row
# shapes of 32K and 128K, and the finish's warps / block_j around it. Predictions:
# benchmarks/NOTES.md, session 21 ("Call 4 predictions").
source benchmarks/h200_env.sh
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
D=$D+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
D=$D+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
D=$D+falsi_slack_entries=1024
timeout 110 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider \
  -k "finish_repairs and (1-32768-2048-auto-0-True or 1-131072-512-auto-0-True)" \
  > "$L/gpu_tests_s21d.log" 2>&1
tail -1 "$L/gpu_tests_s21d.log"
if grep -q "2 passed" "$L/gpu_tests_s21d.log"; then
  timeout 230 python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 1 \
    --n 32768,131072 --k 2048,512 --out "$L/topk_table_s21d.json" > "$L/topk_table.log" 2>&1
  python3 -c "import json,sys; [print(r['impl'], r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 2), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows']]" "$L/topk_table_s21d.json"
fi
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only)
timeout 80 "${S[@]}" --k 2048 --shapes 1x32768 --out "$L/topk_finish_s21d.json" \
  --configs "$D+rank_warps=2,$D+rank_block_j=128" > "$L/topk_finish.log" 2>&1
timeout 80 "${S[@]}" --k 512 --shapes 1x32768 --out "$L/topk_finish512_s21d.json" \
  --configs "$D,$D+rank_block_j=512" > "$L/topk_finish512.log" 2>&1
for f in "$L"/topk_finish*_s21d.json; do
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'D'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$D"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

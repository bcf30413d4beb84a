#!/usr/bin/env bash
# Session 22, call 1: the opt-in rank merge (bitonic_rank_merge) compiled, then timed against
# the defaults at 8 and 64 rows of 32K x 2048, and the table's one row of 128K x 2048 at the
# current defaults. Predictions: benchmarks/NOTES.md, session 22 ("Call 1 predictions").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
timeout 150 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider -k rank_merge \
  > "$L/gpu_tests_s22a.log" 2>&1
tail -3 "$L/gpu_tests_s22a.log"
timeout 120 python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 1 \
  --n 131072 --k 2048 --out "$L/topk_table_s22a.json" > "$L/topk_table_s22a.log" 2>&1
python3 -c "import json,sys; [print(r['impl'], r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 2), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows']]" "$L/topk_table_s22a.json"
if grep -q "3 passed" "$L/gpu_tests_s22a.log"; then
  S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
  timeout 280 "${S[@]}" --shapes 8x32768,64x32768 --out "$L/topk_merge_s22a.json" \
    --configs "$N,$N+bitonic_rank_merge=256,$N+bitonic_rank_merge=128" > "$L/topk_merge.log" 2>&1
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'N'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_merge_s22a.json" "$N"
fi
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 21, call 5: the table's one-row shapes of 512K and 1M at the new default
# (rank_block_j=256), and chunks of 1024 for the bucketed compaction at 64K-256K x 2048.
# Predictions: benchmarks/NOTES.md, session 21 ("Call 5 predictions").
source benchmarks/h200_env.sh
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
D=$D+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
D=$D+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
D=$D+falsi_slack_entries=1024
timeout 230 python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 1 \
  --n 524288,1048576 --k 2048,512 --out "$L/topk_table_s21e.json" > "$L/topk_table.log" 2>&1
python3 -c "import json,sys; [print(r['impl'], r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 2), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows']]" "$L/topk_table_s21e.json"
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
timeout 200 "${S[@]}" --shapes 1x65536,1x131072,1x262144 --out "$L/topk_chunk_s21e.json" \
  --configs "$D,$D+small_chunk=1024" > "$L/topk_chunk.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'D'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_chunk_s21e.json" "$D" | sed -E 's/2048:4:14:512:0:3:4:2\+finish.*small_chunk=1024.*falsi_slack_entries=1024/D+small_chunk=1024/'
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

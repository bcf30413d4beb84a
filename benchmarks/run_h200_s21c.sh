#!/usr/bin/env bash
# Session 21, call 3: the last unswept knobs before the finish (chunk 256, a wider slack, 16
# threshold warps) and the finish's block_j / warps, at one row of 32K and 128K x 2048.
# Predictions: benchmarks/NOTES.md, session 21 ("Call 3 predictions").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
timeout 200 "${S[@]}" --shapes 1x32768 --out "$L/topk_knobs32k_s21c.json" \
  --configs "$N,$N+small_chunk=256,$N+falsi_slack_entries=2048,$N+threshold_warps=16,$N+rank_block_j=256,$N+rank_warps=2" \
  > "$L/topk_knobs32k.log" 2>&1
timeout 150 "${S[@]}" --shapes 1x131072 --out "$L/topk_knobs128k_s21c.json" \
  --configs "$N,$N+threshold_warps=16,$N+rank_block_j=256,$N+small_chunk=256" \
  > "$L/topk_knobs128k.log" 2>&1
for f in "$L"/topk_*_s21c.json; do
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'][len(sys.argv[2]) - 60:], r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$N"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

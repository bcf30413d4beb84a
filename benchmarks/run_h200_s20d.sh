#!/usr/bin/env bash
# Session 20, call 4: the threshold kernel's share at one row of 32K / 128K x 2048 (fewer
# maxima, a wider stopping slack, fewer warps) and at 8 x 32K x 2048, at the new defaults.
# Predictions: benchmarks/NOTES.md, session 20 ("Call 4 predictions").
source benchmarks/h200_env.sh
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
R=$D+fused_rank=True+repair_in_finish=True+bitonic_mid=2048+rank_rows=True
N=$R+rank_block_i=8+rank_buckets=True
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
timeout 300 "${S[@]}" --shapes 1x32768,1x131072 --out "$L/topk_threshold_s20d.json" \
  --configs "$N,$N+groups_per_k=2,$N+falsi_slack=256,$N+groups_per_k=2+falsi_slack=256,$N+threshold_warps=4" \
  > "$L/topk_threshold.log" 2>&1
timeout 90 "${S[@]}" --shapes 8x32768 --out "$L/topk_threshold8_s20d.json" \
  --configs "$N,$N+groups_per_k=2" > "$L/topk_threshold8.log" 2>&1
for f in "$L"/topk_threshold*_s20d.json; do
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'N'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$N"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 22, call 6: the rank merge reading a probe's index only where the keys tie (call
# 5: blocks of 32 took 4.84 us, the call 15.85; its time follows the elements gathered).
# 8 x 32K x 2048, blocks of 16-128 with the separate repair, 32 with the repair inside.
# Predictions: benchmarks/NOTES.md, session 22 ("Call 6").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
R=${N/+repair_in_finish=True/+repair_in_finish=False}
C="$N,$R+bitonic_rank_merge=32,$R+bitonic_rank_merge=16,$R+bitonic_rank_merge=64"
C="$C,$R+bitonic_rank_merge=128,$N+bitonic_rank_merge=32"
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
timeout 300 "${S[@]}" --shapes 8x32768 --out "$L/topk_merge_s22f.json" \
  --configs "$C" > "$L/topk_merge.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], 'N' if r['config'] == sys.argv[2] else ('in' if 'repair_in_finish=True' in r['config'] else 'sep') + r['config'][-24:], r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_merge_s22f.json" "$N"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

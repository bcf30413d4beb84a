#!/usr/bin/env bash
# Session 22, call 2: call 1's compiled rank-merge test finished no case in 150 s. Where it
# stops (benchmarks/diag_rank_merge.py: each step's lowering, compile and first run, a
# process each, stacks dumped at 70 s), then, if the rank merge runs, its kernel time at 8 x
# 32K x 2048. Predictions: benchmarks/NOTES.md, session 22 ("Call 2 predictions").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
python3 benchmarks/diag_rank_merge.py --watchdog 70 --steps split,merge256,topk,merge128,merge256w8 \
  > "$L/diag_s22b.log" 2>&1
grep -E "^[a-z0-9]+: " "$L/diag_s22b.log"
if grep -q "topk: correct" "$L/diag_s22b.log"; then
  S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
  timeout 150 "${S[@]}" --shapes 8x32768 --out "$L/topk_merge_s22b.json" \
    --configs "$N,$N+bitonic_rank_merge=256" > "$L/topk_merge.log" 2>&1
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'N'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_merge_s22b.json" "$N"
fi
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

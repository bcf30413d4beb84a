#!/usr/bin/env bash
# Session 22, call 4: the rank merge's searches as one [runs, block] gather a step (call 3:
# a gather per run and step, the kernel 11.3 us). Whether the whole call compiles with the
# repair inside the rank merge kernel now (benchmarks/diag_rank_merge.py), then kernel time
# at 8 and 64 x 32K x 2048. Predictions: benchmarks/NOTES.md, session 22 ("Call 4").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
python3 benchmarks/diag_rank_merge.py --watchdog 60 --steps merge256,topk > "$L/diag_s22d.log" 2>&1
grep -E "^[a-z0-9_]+: " "$L/diag_s22d.log"
C="$N,$N+bitonic_rank_merge=256+repair_in_finish=False,$N+bitonic_rank_merge=128+repair_in_finish=False"
grep -q "topk: correct" "$L/diag_s22d.log" && C="$C,$N+bitonic_rank_merge=256"
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
timeout 330 "${S[@]}" --shapes 8x32768,64x32768 --out "$L/topk_merge_s22d.json" \
  --configs "$C" > "$L/topk_merge.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], 'N' if r['config'] == sys.argv[2] else ('in' if 'repair_in_finish=True' in r['config'] else 'sep') + r['config'][-24:], r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_merge_s22d.json" "$N"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

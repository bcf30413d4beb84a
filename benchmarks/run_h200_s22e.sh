#!/usr/bin/env bash
# Session 22, call 5: the rank merge's per-lane work at 8 x 32K x 2048 (call 4: blocks of
# 256 took 7.33 us, of 128 5.74): blocks of 64 and 32, 8 warps at 128, and runs of 1024
# (4 runs to search, one more merge size in the runs kernel). Each with the separate repair
# kernel. Predictions: benchmarks/NOTES.md, session 22 ("Call 5").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
R=${N/+repair_in_finish=True/+repair_in_finish=False}
R1=${R/2048:4:14:512:/2048:4:14:1024:}
C="$N,$R+bitonic_rank_merge=64,$R+bitonic_rank_merge=32"
C="$C,$R+bitonic_rank_merge=128+rank_merge_warps=8,$R1+bitonic_rank_merge=64,$R1+bitonic_rank_merge=128"
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
timeout 300 "${S[@]}" --shapes 8x32768 --out "$L/topk_merge_s22e.json" \
  --configs "$C" > "$L/topk_merge.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], 'N' if r['config'] == sys.argv[2] else r['config'][:21] + r['config'][-45:], r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_merge_s22e.json" "$N"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 22, call 3: call 2 found the rank merge compiling in ~5 s alone and the whole call
# (its kernel repairing overflowing rows inside) not compiled in 70 s. Whether 8 or 16 warps,
# or no repair inside, compile (benchmarks/diag_rank_merge.py), then the kernel time at 8 x
# 32K x 2048 of those that did. Predictions: benchmarks/NOTES.md, session 22 ("Call 3").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
python3 benchmarks/diag_rank_merge.py --watchdog 60 --steps topk_norepair,topk_w16,topk_w8 \
  > "$L/diag_s22c.log" 2>&1
grep -E "^[a-z0-9_]+: " "$L/diag_s22c.log"
C=$N
grep -q "topk_norepair: correct" "$L/diag_s22c.log" && \
  C="$C,$N+bitonic_rank_merge=256+repair_in_finish=False,$N+repair_in_finish=False"
grep -q "topk_w16: correct" "$L/diag_s22c.log" && C="$C,$N+bitonic_rank_merge=256+rank_merge_warps=16"
grep -q "topk_w8: correct" "$L/diag_s22c.log" && C="$C,$N+bitonic_rank_merge=256+rank_merge_warps=8"
if [ "$C" != "$N" ]; then
  S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
  timeout 240 "${S[@]}" --shapes 8x32768 --out "$L/topk_merge_s22c.json" \
    --configs "$C" > "$L/topk_merge.log" 2>&1
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'N'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_merge_s22c.json" "$N"
fi
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

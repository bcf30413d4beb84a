#!/usr/bin/env bash
# Session 17, call 4 (< 6 min): the persistent kernel's rank step without lax.cond ("masked")
# and as a loop over live blocks ("loop"). Predictions: benchmarks/NOTES.md, session 17
# ("Call 4").
source benchmarks/h200_env.sh
P=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
P=$P+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
for m in masked loop; do
  timeout 80 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
    --shapes 1x32768,1x131072 --configs "$P+persist_max_rows=1+persist_rank=$m" \
    --out "$L/topk_rank_${m}_s17d.json" > "$L/topk_rank_$m.log" 2>&1
done
timeout 60 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 8x32768 --configs "$P+persist_max_rows=8+persist_rank=masked" \
  --out "$L/topk_b8_s17d.json" > "$L/topk_b8.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['config'][-40:], r['stage'], r.get('kernel', '')[15:], round(r['us'], 2)) for r in map(json.loads, open(sys.argv[1]))]" "$OUT/rows.jsonl"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

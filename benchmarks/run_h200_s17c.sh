#!/usr/bin/env bash
# Session 17, call 3 (< 5 min): the persistent kernel's steps timed (cut after each) at
# 1 x 32K x 2048, and the whole call at 1 x 128K x 2048 and 8 x 32K x 2048. Predictions:
# benchmarks/NOTES.md, session 17 ("Call 3").
source benchmarks/h200_env.sh
P=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
P=$P+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
timeout 150 python3 benchmarks/topk_stages.py --only "persistent,=whole topk" --kernels \
  --k 2048 --shapes 1x32768 --configs "$P+persist_max_rows=1" \
  --out "$L/topk_steps_s17c.json" > "$L/topk_steps.log" 2>&1
timeout 60 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x131072 --configs "$P+persist_max_rows=1" \
  --out "$L/topk_128k_s17c.json" > "$L/topk_128k.log" 2>&1
timeout 60 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 8x32768 --configs "$P+persist_max_rows=8" \
  --out "$L/topk_b8_s17c.json" > "$L/topk_b8.log" 2>&1
for f in "$L"/topk_*_s17c.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'P'), r['stage'], r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$P"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

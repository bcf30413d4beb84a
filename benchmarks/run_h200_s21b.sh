#!/usr/bin/env bash
# Session 21, call 2: the rank_rows finish's tile shapes at 8 x 32K x 2048 (fewer, wider
# programs with the accumulator's registers held at 32 per thread) and at one row; chunks
# of 1024 at the small-call shapes. Predictions: benchmarks/NOTES.md, session 21.
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024
B=$N+rank_max_rows=8
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only)
timeout 230 "${S[@]}" --k 2048 --shapes 8x32768 --out "$L/topk_rows8_s21b.json" \
  --configs "$N,$N+small_chunk=1024,$B,$B+rank_block_i=32+rank_block_j=128,$B+rank_block_i=64+rank_block_j=64,$B+rank_block_i=16+rank_block_j=256" \
  > "$L/topk_rows8.log" 2>&1
timeout 110 "${S[@]}" --k 2048 --shapes 1x32768 --out "$L/topk_tiles1_s21b.json" \
  --configs "$N,$N+rank_block_i=16+rank_block_j=256,$N+rank_block_i=32+rank_block_j=128" \
  > "$L/topk_tiles1.log" 2>&1
timeout 120 "${S[@]}" --k 512 --shapes 1x32768,1x131072 --out "$L/topk_chunk512_s21b.json" \
  --configs "$N,$N+small_chunk=1024" > "$L/topk_chunk512.log" 2>&1
for f in "$L"/topk_*_s21b.json; do
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'N'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$N"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 20, call 1: the per-block rank finish's variants (blocks of 8, packed ties, value
# buckets) timed at one row of 32K x 2048 and 32K x 512, then their compiled tests.
# Predictions: benchmarks/NOTES.md, session 20 ("Call 1 predictions").
source benchmarks/h200_env.sh
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
R=$D+fused_rank=True+repair_in_finish=True+bitonic_mid=2048+rank_rows=True
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --shapes 1x32768)
timeout 200 "${S[@]}" --k 2048 --out "$L/topk_variants2048_s20a.json" --configs \
  "$R,$R+rank_block_i=8,$R+rank_split_ties=True+rank_block_i=8,$R+rank_buckets=True+rank_block_i=8,$R+rank_split_ties=True+rank_buckets=True+rank_block_i=8" \
  > "$L/topk_variants2048.log" 2>&1
timeout 250 python3 -m pytest -q -x tests/test_gpu.py -k rank_rows_variants -p no:cacheprovider \
  > "$L/gpu_tests_s20a.log" 2>&1
tail -3 "$L/gpu_tests_s20a.log"
timeout 90 "${S[@]}" --k 512 --out "$L/topk_variants512_s20a.json" --configs \
  "$R,$R+rank_split_ties=True+rank_buckets=True+rank_block_i=8" > "$L/topk_variants512.log" 2>&1
for f in "$L"/topk_variants*_s20a.json; do
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'R'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$R"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

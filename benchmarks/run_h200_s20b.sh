#!/usr/bin/env bash
# Session 20, call 2: the bucket compaction's one scan and two-lane atomic, compiled tests
# first, then blocks of 8 and buckets against the default finish at one row (32K-512K) and
# at 8 x 32K x 2048. Predictions: benchmarks/NOTES.md, session 20 ("Call 2 predictions").
source benchmarks/h200_env.sh
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
R=$D+fused_rank=True+repair_in_finish=True+bitonic_mid=2048+rank_rows=True
C="$R,$R+rank_block_i=8,$R+rank_block_i=8+rank_buckets=True"
timeout 100 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider \
  -k "rank_rows_variants and (False-True- or True-True-)" > "$L/gpu_tests_s20b.log" 2>&1
tail -1 "$L/gpu_tests_s20b.log"
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only)
timeout 300 "${S[@]}" --k 2048 --shapes 1x32768,1x131072,1x524288 --configs "$C" \
  --out "$L/topk_onerow2048_s20b.json" > "$L/topk_onerow2048.log" 2>&1
timeout 100 "${S[@]}" --k 512 --shapes 1x32768 --configs "$C" \
  --out "$L/topk_onerow512_s20b.json" > "$L/topk_onerow512.log" 2>&1
timeout 50 "${S[@]}" --k 2048 --shapes 8x32768 \
  --configs "$R+rank_max_rows=8+rank_block_i=8+rank_buckets=True" \
  --out "$L/topk_rows8_s20b.json" > "$L/topk_rows8.log" 2>&1
for f in "$L"/topk_*_s20b.json; do
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'R'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$R"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

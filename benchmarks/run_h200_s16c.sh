#!/usr/bin/env bash
# Session 16, call 3 (< 8 min). Predictions: benchmarks/NOTES.md, session 16 ("Call 3").
# 1. every compiled top-K GPU test at the new defaults (rank tilings: the default only);
# 2. groups_per_k 8 against 4 at one row; chunks of 512 against 2048 at 512K and 1M.
source benchmarks/h200_env.sh
timeout 240 python3 -m pytest -q tests/test_gpu.py \
  -k "topk and not (rank_finish and not 16-512-4)" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144
timeout 100 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x32768,1x131072 --configs "$D,$D+groups_per_k=8" \
  --out "$L/topk_groups_s16c.json" > "$L/topk_groups.log" 2>&1
timeout 60 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 512 \
  --shapes 1x32768 --configs "$D,$D+groups_per_k=8" \
  --out "$L/topk_groups_k512_s16c.json" > "$L/topk_groups_k512.log" 2>&1
timeout 120 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 512 \
  --shapes 1x524288,1x1048576 --configs "$D,$D+small_chunk_entries=1048576" \
  --out "$L/topk_long_k512_s16c.json" > "$L/topk_long_k512.log" 2>&1
timeout 60 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x524288 --configs "$D,$D+small_chunk_entries=1048576" \
  --out "$L/topk_long_s16c.json" > "$L/topk_long.log" 2>&1
for f in "$L"/topk_*_s16c.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'D'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel' and r['kernel'] in ('all kernels', 'jaxsparse_topk_threshold', 'jaxsparse_topk_rank_count')]" "$f" "$D"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

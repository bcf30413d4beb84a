#!/usr/bin/env bash
# Session 16, call 5 (< 5 min). Predictions: benchmarks/NOTES.md, session 16 ("Call 5").
# 1. compiled tests of groups up to 256 entries (TopkConfig.max_group);
# 2. max_group 256 against 64 on long rows (kernel time of the whole call).
source benchmarks/h200_env.sh
timeout 90 python3 -m pytest -q tests/test_gpu.py -k "large_groups" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144
timeout 120 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 512 \
  --shapes 1x524288,1x1048576,8x1048576,64x524288,64x1048576 \
  --configs "$D,$D+max_group=256" --out "$L/topk_groups_k512_s16e.json" > "$L/topk_k512.log" 2>&1
timeout 40 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x1048576 --configs "$D,$D+max_group=256" \
  --out "$L/topk_groups_k2048_s16e.json" > "$L/topk_k2048.log" 2>&1
for f in "$L"/topk_*_s16e.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'D'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel' and r['kernel'] in ('all kernels', 'jaxsparse_topk_threshold', 'jaxsparse_topk_rank_count')]" "$f" "$D"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

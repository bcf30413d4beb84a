#!/usr/bin/env bash
# Session 18, call 2 (< 10 min): compiled tests of repair_in_finish (the fused rank and split
# bitonic finishes repair overflowing rows; no repair kernel) and bitonic_mid (a middle merge
# kernel), then the kernel time of the whole call against session 16's defaults (D).
# Predictions: benchmarks/NOTES.md, session 18 ("Call 2 predictions").
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q -x tests/test_gpu.py -k "finish_repairs or block_map" > "$L/gpu_tests.log" 2>&1
tail -3 "$L/gpu_tests.log"
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
R=$D+fused_rank=True+repair_in_finish=True
timeout 120 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 1x32768,1x131072,1x524288,1x1048576 --configs "$D,$R" \
  --out "$L/topk_rif_k2048_s18b.json" > "$L/topk_rif_k2048.log" 2>&1
timeout 60 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 512 \
  --shapes 1x32768,1x131072 --configs "$D,$R" \
  --out "$L/topk_rif_k512_s18b.json" > "$L/topk_rif_k512.log" 2>&1
timeout 130 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 8x32768,8x131072,64x131072 \
  --configs "$D,$R,$R+bitonic_mid=2048,$R+bitonic_mid=1024" \
  --out "$L/topk_mid_s18b.json" > "$L/topk_mid.log" 2>&1
for f in "$L"/topk_*_s18b.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'D'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$D"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 19, call 2 (< 10 min): how many blocks the per-block rank finish loads before its
# first compare (rank_preload) at one row of 32K x 2048, rank_rows at 128K x 2048, then the
# public table's 8-row shapes from 128K at the defaults (not measured since session 16).
# Predictions: benchmarks/NOTES.md, session 19 ("Call 2 predictions").
source benchmarks/h200_env.sh
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
C=$D+fused_rank=True+repair_in_finish=True+bitonic_mid=2048
R=$C+rank_rows=True
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
timeout 130 "${S[@]}" --shapes 1x32768 --configs "$R+rank_preload=1,$R+rank_preload=2,$R+rank_block_j=256+rank_preload=2,$R+rank_warps=8+rank_preload=1" \
  --out "$L/topk_preload_s19b.json" > "$L/topk_preload.log" 2>&1
timeout 70 "${S[@]}" --shapes 1x131072 --configs "$C,$R" \
  --out "$L/topk_rows128k_s19b.json" > "$L/topk_rows128k.log" 2>&1
timeout 300 python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 8 \
  --n 131072,524288,1048576 --k 2048,512 --out "$L/topk_table_s19b.json" > "$L/topk_table.log" 2>&1
for f in "$L"/topk_p*_s19b.json "$L"/topk_r*_s19b.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'R').replace(sys.argv[3], 'C'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$R" "$C"
done
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows'] if r['impl'] == 'jaxsparse']" "$L/topk_table_s19b.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

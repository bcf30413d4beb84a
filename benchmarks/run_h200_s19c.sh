#!/usr/bin/env bash
# Session 19, call 3 (< 7.5 min; little device time left): the public table's one-row shapes
# at the defaults (rank_rows), then the per-block rank finish with blocks of 8 candidates at
# one row of 32K x 2048. Predictions: benchmarks/NOTES.md, session 19 ("Call 3 predictions").
source benchmarks/h200_env.sh
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
R=$D+fused_rank=True+repair_in_finish=True+bitonic_mid=2048+rank_rows=True
timeout 370 python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 1 \
  --k 2048,512 --out "$L/topk_table_s19c.json" > "$L/topk_table.log" 2>&1
timeout 50 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048 \
  --shapes 1x32768 --configs "$R+rank_block_i=8" \
  --out "$L/topk_block8_s19c.json" > "$L/topk_block8.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows'] if r['impl'] == 'jaxsparse']" "$L/topk_table_s19c.json"
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'R'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_block8_s19c.json" "$R"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

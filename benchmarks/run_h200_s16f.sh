#!/usr/bin/env bash
# Session 16, call 6 (< 6.5 min): compiled tests of the new group rule on long rows, then the
# public top-K table at the final defaults. Predictions: benchmarks/NOTES.md, session 16
# ("Call 6").
source benchmarks/h200_env.sh
timeout 50 python3 -m pytest -q tests/test_gpu.py -k "large_groups or (gather and 1048576)" \
  > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
timeout 320 python3 benchmarks/bench_topk.py --default-config-only --kernels \
  --batches 64,8,1 --k 2048,512 --out "$L/topk_table_s16f.json" > "$L/topk_table.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1), round(r['vs_lax_top_k'], 2), round(r['vs_torch'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['impl'] == 'jaxsparse']" "$L/topk_table_s16f.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 18, call 4 (< 5 min): the rest of call 3's table (B = 8 and 1; call 3's ran out of
# time after 8 x 32K) at the same defaults. Predictions: NOTES session 18, "Call 3".
source benchmarks/h200_env.sh
timeout 280 python3 benchmarks/bench_topk.py --default-config-only --kernels \
  --batches 1,8 --k 2048,512 --out "$L/topk_table_s18d.json" > "$L/topk_table.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows'] if r['impl'] == 'jaxsparse']" "$L/topk_table_s18d.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 21, call 6 (~370 s of device time left): the new default bucket_chunk=1024
# compiled, then the table's one-row 32K and 128K x 2048 at it. Predictions:
# benchmarks/NOTES.md, session 21 ("Call 6 predictions").
source benchmarks/h200_env.sh
timeout 70 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider \
  -k "finish_repairs and 1-32768-2048-auto-0-True" > "$L/gpu_tests_s21f.log" 2>&1
tail -1 "$L/gpu_tests_s21f.log"
if grep -q "1 passed" "$L/gpu_tests_s21f.log"; then
  timeout 130 python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 1 \
    --n 32768,131072 --k 2048 --out "$L/topk_table_s21f.json" > "$L/topk_table_s21f.log" 2>&1
  python3 -c "import json,sys; [print(r['impl'], r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 2), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows']]" "$L/topk_table_s21f.json"
fi
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

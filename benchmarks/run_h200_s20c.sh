#!/usr/bin/env bash
# Session 20, call 3: compiled tests of the new defaults (blocks of 8, value buckets from
# k = 1024), then the public table's one-row shapes at them, 1M first (its own file, so the
# step's time limit cannot cut it). Predictions: benchmarks/NOTES.md, session 20 ("Call 3").
source benchmarks/h200_env.sh
timeout 120 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider \
  -k "finish_repairs and (0-True or 2048-True)" > "$L/gpu_tests_s20c.log" 2>&1 \
  || { tail -30 "$L/gpu_tests_s20c.log"; cd "$OUT" && tar czf logs.tgz logs; exit 1; }
tail -1 "$L/gpu_tests_s20c.log"
B=(python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 1 --k 2048,512)
timeout 135 "${B[@]}" --n 1048576 --out "$L/topk_table1m_s20c.json" > "$L/topk_table1m.log" 2>&1
timeout 320 "${B[@]}" --n 32768,131072,524288 --out "$L/topk_table_s20c.json" \
  > "$L/topk_table.log" 2>&1
for f in "$L"/topk_table*_s20c.json; do
python3 -c "import json,sys; [print(r['impl'], r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows'] if r['impl'] in ('jaxsparse', 'lax.top_k')]" "$f"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 22, call 7: the rank merge (blocks of 32, the repair inside) as the default for
# calls of <= 8 rows with k >= 1024: its compiled test, then the table's B = 8, k = 2048
# rows. Predictions: benchmarks/NOTES.md, session 22 ("Call 7").
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider -k rank_merge \
  > "$L/gpu_tests_s22g.log" 2>&1
tail -1 "$L/gpu_tests_s22g.log"
if grep -q "3 passed" "$L/gpu_tests_s22g.log"; then
  timeout 300 python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 8 \
    --n 32768,131072,524288,1048576 --k 2048 --out "$L/topk_table_s22g.json" \
    > "$L/topk_table_s22g.log" 2>&1
  python3 -c "import json,sys; [print(r['impl'], r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 2), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows']]" "$L/topk_table_s22g.json"
fi
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

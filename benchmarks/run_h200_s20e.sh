#!/usr/bin/env bash
# Session 20, call 5 (~300 s of device time left): the slack rule (falsi_slack_entries) at
# the table's shapes it changes, B in {1, 8, 64} x 32K x 2048, after its compiled test.
# Predictions: benchmarks/NOTES.md, session 20 ("Call 5 predictions").
source benchmarks/h200_env.sh
timeout 70 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider \
  -k "finish_repairs and 1-32768-2048-auto-0-True" > "$L/gpu_tests_s20e.log" 2>&1
tail -1 "$L/gpu_tests_s20e.log"
timeout 170 python3 benchmarks/bench_topk.py --default-config-only --kernels --batches 1,8,64 \
  --n 32768 --k 2048 --out "$L/topk_table32k_s20e.json" > "$L/topk_table32k.log" 2>&1
python3 -c "import json,sys; [print(r['impl'], r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows']]" "$L/topk_table32k_s20e.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

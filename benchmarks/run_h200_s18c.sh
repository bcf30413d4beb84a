#!/usr/bin/env bash
# Session 18, call 3 (< 10 min): the public top-K table at the new defaults (fused_rank,
# repair_in_finish, bitonic_mid=2048), then compiled tests of the default path.
# Predictions: benchmarks/NOTES.md, session 18 ("Call 3 predictions").
source benchmarks/h200_env.sh
timeout 340 python3 benchmarks/bench_topk.py --default-config-only --kernels \
  --batches 64,8,1 --k 2048,512 --out "$L/topk_table_s18c.json" > "$L/topk_table.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1), round(r['vs_lax_top_k'], 2), round(r['vs_torch'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['impl'] == 'jaxsparse']" "$L/topk_table_s18c.json"
timeout 200 python3 -m pytest -q tests/test_gpu.py -k "test_topk_gpu[ or test_topk_gpu_gather or test_topk_gpu_falsi" > "$L/gpu_tests.log" 2>&1
tail -3 "$L/gpu_tests.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

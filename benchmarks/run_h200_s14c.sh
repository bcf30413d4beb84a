#!/usr/bin/env bash
# Session 14, call 3 (< 7 min). Predictions: benchmarks/NOTES.md, session 14 ("Call 3").
# 1. compiled GPU tests of the top-K paths at the new defaults (compact="auto");
# 2. the public top-K table at this session's defaults: lax.top_k, lax.approx_max_k,
#    torch.topk and jaxsparse at B in {64, 8, 1} x N in {32K, 128K, 512K, 1M} x K in
#    {2048, 512}, in-graph, with kernel time for lax.top_k and jaxsparse.
source benchmarks/h200_env.sh
timeout 100 python3 -m pytest -q -x tests/test_gpu.py -k "test_topk_gpu and not split" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
timeout 360 python3 benchmarks/bench_topk.py --default-config-only --kernels \
  --batches 64,8,1 --k 2048,512 --out "$L/topk_table.json" > "$L/topk_table.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1), round(r['vs_lax_top_k'], 2), round(r['vs_torch'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['impl'] == 'jaxsparse']" "$L/topk_table.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

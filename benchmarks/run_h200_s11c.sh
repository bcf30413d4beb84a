#!/usr/bin/env bash
# Session 11, call 3 (< 6.5 min). Predictions: benchmarks/NOTES.md, session 11 ("Call 3").
# 1. the public top-K table at the current defaults: lax.top_k, lax.approx_max_k, torch.topk
#    and jaxsparse at B in {64, 8, 1} x N in {32K, 128K, 512K, 1M} x K in {2048, 512},
#    in-graph, with kernel time for lax.top_k and jaxsparse (rows stream to rows.jsonl);
# 2. the SPIN A1 step against the full step at 64 x 128K, 40% (step counter written by the
#    first update program only, warm filled again);
# 3. compiled GPU tests of the SPIN update kernel and step.
source benchmarks/h200_env.sh
timeout 270 python3 benchmarks/bench_topk.py --default-config-only --kernels \
  --batches 64,8,1 --k 2048,512 --out "$L/topk_table.json" > "$L/topk_table.log" 2>&1
grep "│" "$L/topk_table.log" | head -120
timeout 70 python3 benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 \
  --slots 131072 --sparsities 0.4 --out "$L/spin_A1_final.json" > "$L/spin_A1_final.log" 2>&1
python3 -c "import json,sys; [print(r['N'], r['impl'], round(r['kernel_us'], 1), round(r['kernel_vs_full'], 3), {k: round(v, 2) for k, v in r.get('kernels_us', {}).items() if not k.startswith('jaxsparse_decode')}) for r in json.load(open(sys.argv[1]))['rows']]" "$L/spin_A1_final.json"
timeout 50 python3 -m pytest -q -x tests/test_gpu.py -k "spin_update or spin_step" \
  > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

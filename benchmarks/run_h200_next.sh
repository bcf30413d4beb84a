#!/usr/bin/env bash
# For the next session with device time: re-measure what changed after the last H200 run, and
# run the CPU suite under the device's jax (0.11.x). One call, ~7 minutes. Output in $OUT.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
JAXSPARSE_IN_GRAPH=1 timeout 200 python3 benchmarks/bench_spin.py --batches 1,8,64 \
  --slots 32768,131072,524288 --sparsities 0.2,0.4,0.5 --out "$OUT/spin_ingraph_h200.json" \
  > "$OUT/bench_spin.log" 2>&1; grep "^{" "$OUT/bench_spin.log" | cut -c1-200
JAXSPARSE_IN_GRAPH=1 timeout 150 python3 benchmarks/bench_topk.py --k 512 --no-approx \
  --default-config-only --out "$OUT/topk512_ingraph_h200.json" > "$OUT/bench_topk.log" 2>&1
grep "^{" "$OUT/bench_topk.log" | cut -c1-120
JAX_PLATFORMS=cpu timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 tests \
  2>&1 | tee "$OUT/cpu_tests_jax011.log" | tail -3

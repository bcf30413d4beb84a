#!/usr/bin/env bash
# One device call: GPU tests, then the chosen benchmark(s). Logs and JSON land in $OUT.
#   bash benchmarks/run_h200.sh indexer|topk|all
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
if [ "$what" != topk ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  python3 benchmarks/bench_indexer.py --out "$OUT/indexer_h200.json" 2>&1 | tee "$OUT/bench_indexer.log"
fi
if [ "$what" = topk ] || [ "$what" = all ]; then
  # the CPU suite under the device's jax (0.11.x), interpret mode: checks the version difference
  JAX_PLATFORMS=cpu python3 -m pytest -q -p no:cacheprovider -n 8 tests 2>&1 | tee "$OUT/cpu_tests_jax011.log" | tail -5
fi
if [ "$what" != indexer ]; then
  python3 benchmarks/bench_topk.py --out "$OUT/topk_h200.json" 2>&1 | tee "$OUT/bench_topk.log"
fi

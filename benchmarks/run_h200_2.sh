#!/usr/bin/env bash
# Second device call: GPU tests, fp8 q+k subset, top-K sweep, SPIN step sweep. Output in $OUT.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl"  # every row as produced, even if a step is cut
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|^E  |FAILED" | head -20
python3 benchmarks/bench_indexer.py --best-only --decode-batches 8,64 --decode-slots 131072,1048576 --prefill-keys 65536,1048576 --out "$OUT/indexer_fp8qk_h200.json" > "$OUT/bench_fp8qk.log" 2>&1
grep "'fp8 q+k'\|jnp" "$OUT/bench_fp8qk.log" | cut -c1-230
timeout 250 python3 benchmarks/bench_topk.py --out "$OUT/topk_h200.json" > "$OUT/bench_topk.log" 2>&1
grep "^{" "$OUT/bench_topk.log" | grep "jaxsparse\|decode+topk" | cut -c1-200 | tail -40
timeout 150 python3 benchmarks/bench_spin.py --out "$OUT/spin_h200.json" > "$OUT/bench_spin.log" 2>&1
grep "^{" "$OUT/bench_spin.log" | cut -c1-260

#!/usr/bin/env bash
# Session 2, call 1: GPU tests, top-K stage breakdown, SPIN step (in-graph) at the target shapes.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
timeout 200 python3 benchmarks/topk_stages.py --out "$OUT/topk_stages_h200.json" > "$OUT/topk_stages.log" 2>&1
grep "│" "$OUT/topk_stages.log"
JAXSPARSE_IN_GRAPH=1 timeout 200 python3 benchmarks/bench_spin.py --batches 8,64 \
  --slots 131072,524288 --sparsities 0.4 --out "$OUT/spin_ingraph_h200.json" \
  > "$OUT/bench_spin.log" 2>&1; grep "│" "$OUT/bench_spin.log"

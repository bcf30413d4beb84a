#!/usr/bin/env bash
# Session 2, call 5 (last of the session's device time): tiled update kernel check, SPIN at the
# target shapes, top-K K=2048 and K=512 in-graph (unrolled) against lax.top_k and torch.topk.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAXSPARSE_IN_GRAPH=unrolled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "update_kernel or topk_gpu" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -2
timeout 75 python3 benchmarks/bench_spin.py --batches 64 --slots 131072 --sparsities 0.4 \
  --out "$OUT/spin_final_128k.json" > "$OUT/spin.log" 2>&1
timeout 40 python3 benchmarks/bench_spin.py --batches 64 --slots 524288 --sparsities 0.4 --step-only \
  --out "$OUT/spin_final_512k.json" >> "$OUT/spin.log" 2>&1; grep "│" "$OUT/spin.log"
timeout 190 python3 benchmarks/bench_topk.py --k 2048,512 --no-approx --default-config-only \
  --out "$OUT/topk_final.json" > "$OUT/topk.log" 2>&1; grep "│" "$OUT/topk.log" | grep jaxsparse

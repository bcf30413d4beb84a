#!/usr/bin/env bash
# Third device call: SPIN step after the dense-update rewrite, and top-K with in-graph timing.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAXSPARSE_IN_GRAPH=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl"
timeout 130 python3 benchmarks/bench_spin.py --batches 8,64 --slots 131072,524288 --sparsities 0.4 --out "$OUT/spin_ingraph_h200.json" > "$OUT/bench_spin.log" 2>&1
grep "^{" "$OUT/bench_spin.log" | cut -c1-260
timeout 150 python3 benchmarks/bench_topk.py --k 2048 --no-approx --default-config-only --out "$OUT/topk_ingraph_h200.json" > "$OUT/bench_topk.log" 2>&1
grep "^{" "$OUT/bench_topk.log" | cut -c1-120

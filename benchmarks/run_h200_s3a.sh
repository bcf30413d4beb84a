#!/usr/bin/env bash
# Session 3, device call 1: GPU tests (bitonic + rank finishes compiled), top-K finishes
# sort / bitonic / rank against lax.top_k and torch.topk at K in {2048, 512}.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAXSPARSE_IN_GRAPH=unrolled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"; L=$OUT/logs
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl" JAXSPARSE_GIT=${JAXSPARSE_GIT:-unknown}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$L/gpu_tests.log" | tail -4
timeout 330 python3 benchmarks/bench_topk.py --k 2048,512 --no-approx --finish sort,bitonic,rank \
  --out "$L/topk_finish.json" > "$L/topk_finish.log" 2>&1; grep "│" "$L/topk_finish.log" | grep -v "lax\|torch"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

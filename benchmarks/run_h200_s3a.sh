#!/usr/bin/env bash
# Session 3, device call 1: GPU tests (bitonic + rank finishes compiled), top-K finishes
# sort / bitonic / rank against lax.top_k and torch.topk at K in {2048, 512}.
source benchmarks/h200_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$L/gpu_tests.log" | tail -4
timeout 330 python3 benchmarks/bench_topk.py --k 2048,512 --no-approx --finish sort,bitonic,rank \
  --out "$L/topk_finish.json" > "$L/topk_finish.log" 2>&1; grep "│" "$L/topk_finish.log" | grep -v "lax\|torch"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

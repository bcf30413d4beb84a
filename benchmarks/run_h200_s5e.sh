#!/usr/bin/env bash
# Session 5, device call 5: the set-then-sort top-K finish (k winners by the set kernel, then a
# sort of k entries) against the buffer sort; its GPU tests; the SPIN step with it (the
# default-finish step is in spin_step.json of the same session).
source benchmarks/h200_env.sh
timeout 60 python3 -m pytest -q -m gpu tests/test_gpu.py -k "topk" > "$L/gpu_tests_setsort.log" 2>&1
tail -2 "$L/gpu_tests_setsort.log"
timeout 70 python3 benchmarks/bench_topk.py --finish sort,set-sort --k 2048 --batches 64,8 \
  --n 131072,1048576 --no-approx --out "$L/topk_setsort.json" > "$L/topk_setsort.log" 2>&1
grep "│" "$L/topk_setsort.log" | grep -v approx || tail -20 "$L/topk_setsort.log"
for f in set-sort; do
  timeout 45 python3 benchmarks/bench_spin.py --batches 64 --slots 131072 --sparsities 0.4 \
    --step-only --topk-finish $f --out "$L/spin_step_$f.json" > "$L/spin_step_$f.log" 2>&1
  grep "│" "$L/spin_step_$f.log" | grep -v "^│    "
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

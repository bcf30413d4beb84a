#!/usr/bin/env bash
# Session 3, device call 4: the top-K without fill passes or slice copies (consumers mask by the
# count): GPU tests, top-K at N in {128K, 1M}, K=2048, sorted and set; SPIN step sorted and set;
# per-kernel durations of the set path (ncu).
source benchmarks/h200_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "topk or spin" 2>&1 \
  | tee "$L/gpu_tests.log" | tail -2
timeout 170 python3 benchmarks/bench_topk.py --k 2048 --batches 64,8,1 --n 131072,1048576 \
  --no-approx --unsorted --default-config-only --out "$L/topk_nofill.json" > "$L/topk_nofill.log" 2>&1
grep "│" "$L/topk_nofill.log" | grep "jaxsparse\|torch.topk  "
for m in "" --unsorted; do
  timeout 60 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
    --step-only $m --out "$L/spin_step_nofill${m/--/_}.json" > "$L/spin_step_nofill${m/--/_}.log" 2>&1
  grep "│ 64" "$L/spin_step_nofill${m/--/_}.log"
done
timeout 40 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
  python3 benchmarks/profile_one.py topk-set --calls 2 > "$L/ncu_topk-set_nofill.csv" 2>/dev/null
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

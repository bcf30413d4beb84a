#!/usr/bin/env bash
# Session 3, device call 3: per-kernel durations (ncu) of a top-K call (sorted / set) and a SPIN
# step at B=64 x 128K; SPIN step sorted vs set in back-to-back processes; top-K at B in {8, 1}.
source benchmarks/h200_env.sh
for w in topk topk-set spin; do
  timeout 100 ncu --clock-control none --csv --print-units base \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/profile_one.py $w --calls 3 > "$L/ncu_$w.csv" 2> "$L/ncu_$w.err"
  echo "ncu $w rc=$? lines=$(wc -l < $L/ncu_$w.csv)"
done
for m in "" --unsorted; do
  timeout 80 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
    --step-only $m --out "$L/spin_step${m/--/_}.json" > "$L/spin_step${m/--/_}.log" 2>&1
  grep "│" "$L/spin_step${m/--/_}.log"
done
timeout 200 python3 benchmarks/bench_topk.py --k 2048 --batches 8,1 --no-approx --unsorted \
  --default-config-only --out "$L/topk_b8_b1.json" > "$L/topk_b8_b1.log" 2>&1
grep "│" "$L/topk_b8_b1.log" | grep -v "lax.top_k\|torch.topk  "
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

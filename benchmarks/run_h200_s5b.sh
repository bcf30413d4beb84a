#!/usr/bin/env bash
# Session 5, device call 2: the group compaction for top-K (one pass over the qualifying groups,
# atomic chunk ranges, reorder) on the GPU: the top-K GPU tests, both compactions timed against
# lax.top_k and torch.topk (sorted and as a set), and the per-kernel times at B=64 x 128K;
# SPIN's stages with the batched block-score kernel.
source benchmarks/h200_env.sh
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k "topk or spin" > "$L/gpu_tests_topk.log" 2>&1
tail -3 "$L/gpu_tests_topk.log"
timeout 240 python3 benchmarks/bench_topk.py --k 2048 --batches 64,8,1 --n 32768,131072,1048576 \
  --unsorted --no-approx --compaction groups,scan --out "$L/topk_compaction.json" \
  > "$L/topk_compaction.log" 2>&1
grep "│" "$L/topk_compaction.log" || tail -30 "$L/topk_compaction.log"
for w in topk-set topk; do
  timeout 60 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
    python3 benchmarks/profile_one.py $w --calls 3 > "$L/ncu_$w.csv" 2>&1
  grep -v "^==PROF==" "$L/ncu_$w.csv" | awk -F'","' '{print $5, $NF}' | tail -14
done
timeout 150 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --out "$L/spin_parts.json" > "$L/spin_parts.log" 2>&1
grep "│" "$L/spin_parts.log" || tail -30 "$L/spin_parts.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# The next device call (one call, < 10 min): what session 8 left open, measured in kernel time
# (the device trace; ncu segfaults on the Mosaic kernels, and the in-graph wall-clock timer
# has a ~10% spread on 40-80 us calls, benchmarks/NOTES.md session 8).
# 1. top-K filter-pass configs at 64 x 131072 x 2048, each kernel's time (issue 4: session 6's
#    config sweep was drowned by the wall-clock spread; the compaction, 27.6 us for a 32 MB
#    read, is the largest pass);
# 2. the bitonic finish at 8 / 16 / 32 warps and the whole call, kernel time, 64 and 1 rows;
# 3. the SPIN step at B=64 x 128K, 40%, A2 and A1, twice each (issue 5).
source benchmarks/h200_env.sh
timeout 200 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels --only "whole topk" \
  --configs 4096:4:20,2048:4:20,8192:8:20,4096:8:20,2048:2:12,4096:4:12 \
  --out "$L/topk_configs_ktime.json" > "$L/topk_configs_ktime.log" 2>&1
grep "│" "$L/topk_configs_ktime.log" | grep -v "^│    " | grep "all kernels\|compact\|group_max\|threshold"
timeout 150 python3 benchmarks/topk_stages.py --shapes 64x131072,1x131072 --kernels \
  --only "bitonic,whole topk" --out "$L/topk_finish_ktime.json" > "$L/topk_finish_ktime.log" 2>&1
grep "│" "$L/topk_finish_ktime.log" | grep -v "^│    "
for i in 1 2; do
  for r in A2 A1; do
    timeout 75 python3 benchmarks/bench_spin.py --step-only --reduction $r --batches 64 \
      --slots 131072 --sparsities 0.4 --out "$L/spin_${r}_128k_$i.json" > "$L/spin_${r}_$i.log" 2>&1
    grep "│" "$L/spin_${r}_$i.log" | grep -v "^│    "
  done
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

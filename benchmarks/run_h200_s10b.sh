#!/usr/bin/env bash
# Session 10, call 2 (< 9 min; was run_h200_next2.sh, updated after call 1): top-K defaults now
# bitonic_run=512 and bisect_iters=14 (call 1: 58.8 us at 64 x 128K x 2048 against 67.1).
# 1. the new defaults against the old ones (chunk 2048 and 4096) at 8 x 32K and 64 x 1M;
# 2. the SPIN step against the full step at 64 x {128K, 512K}, 40%, A2 and A1, kernel time
#    with the state donated, each kernel listed (issue 5).
source benchmarks/h200_env.sh
timeout 150 python3 benchmarks/topk_stages.py --shapes 8x32768,64x1048576 --kernels \
  --only "=whole topk" --configs 2048:4:14:0:512,2048:4:20:0:0,4096:4:20:0:0 \
  --out "$L/topk_defaults_more.json" > "$L/topk_defaults_more.log" 2>&1
python3 benchmarks/kernel_rows.py "$OUT/rows.jsonl" compact_atomic
for r in A2 A1; do
  timeout 170 python3 benchmarks/bench_spin.py --step-only --reduction $r --batches 64 \
    --slots 131072,524288 --sparsities 0.4 --out "$L/spin_${r}_donated.json" > "$L/spin_${r}.log" 2>&1
  grep "│" "$L/spin_${r}.log" | grep -v "^│    "
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# The device call after run_h200_next.sh (not yet run; written in session 9), < 9 min:
# 1. chunk 4096 vs 2048 at 8 x 32K and 64 x 1M (kernel time; session 9 covered 64 x 128K,
#    1 x 128K and 1 x 1M);
# 2. the SPIN step against the full step at 64 x {128K, 512K}, 40%, A2 and A1 with the
#    default chunk of 2048: in-graph and kernel time with the state donated and threaded,
#    each kernel's time listed (issue 5).
source benchmarks/h200_env.sh
timeout 130 python3 benchmarks/topk_stages.py --shapes 8x32768,64x1048576 --kernels \
  --only "=whole topk" --configs 2048:4:20,4096:4:20 \
  --out "$L/topk_chunks_more.json" > "$L/topk_chunks_more.log" 2>&1
python3 benchmarks/kernel_rows.py "$OUT/rows.jsonl" compact_atomic
for r in A2 A1; do
  timeout 170 python3 benchmarks/bench_spin.py --step-only --reduction $r --batches 64 \
    --slots 131072,524288 --sparsities 0.4 --out "$L/spin_${r}_donated.json" > "$L/spin_${r}.log" 2>&1
  grep "│" "$L/spin_${r}.log" | grep -v "^│    "
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

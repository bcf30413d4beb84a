#!/usr/bin/env bash
# Session 8, device call 2: kernel time from the profiler's device trace (benchtools.kernel_time)
# next to the in-graph wall-clock time (ncu segfaulted on the Mosaic decode kernel in call 1).
# 1. the GPU test of the trace timer;
# 2. Mosaic decode at 8 x 128K and 1 x 1M, bf16 and fp8 q+k, runs of 16 / 32 / 64 pages and
#    8 gathers in flight (issue 2: is fp8 >= 1.7x bf16 at 8 x 128K in kernel time, and which
#    tiling is best once the timer's spread is gone);
# 3. one-row and 64-row top-K: each kernel's device time (issue 4: launch gaps vs kernel time);
# 4. the public decode table, all issue shapes, bf16 and fp8 q+k, with the jnp baseline.
source benchmarks/h200_env.sh
timeout 90 python3 -m pytest -q -x tests/test_gpu.py -k "kernel_time" > "$L/gpu_tests_ktime.log" 2>&1
tail -1 "$L/gpu_tests_ktime.log"
timeout 200 python3 benchmarks/decode_mgpu.py --no-triton --dtypes "bf16,fp8 q+k" \
  --shapes 8x131072,1x1048576 --configs 16:4,32:4,64:4,32:8 \
  --out "$L/decode_tilings_ktime.json" > "$L/decode_tilings_ktime.log" 2>&1
grep "│" "$L/decode_tilings_ktime.log"
timeout 100 python3 benchmarks/topk_stages.py --shapes 1x131072,64x131072 --kernels \
  --only "whole topk,lax.top_k" --out "$L/topk_kernels.json" > "$L/topk_kernels.log" 2>&1
grep "│" "$L/topk_kernels.log" | grep -v "^│    "
timeout 190 python3 benchmarks/bench_indexer.py --what decode --best-only \
  --key-dtypes "bfloat16,fp8 q+k" --out "$L/decode_table_ktime.json" > "$L/decode_table_ktime.log" 2>&1
grep "│" "$L/decode_table_ktime.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 3, device call 2: GPU tests of the top-K / SPIN kernels (incl. the no-sort set finish),
# the SPIN step and its stages with sorted=False (B=64, 128K / 512K, float32 state), and the
# top-K at B=64 with the default (finish="auto") and sorted=False, against lax.top_k and
# torch.topk (sorted and not).
source benchmarks/h200_env.sh
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "topk or spin" 2>&1 \
  | tee "$L/gpu_tests.log" | tail -3
timeout 110 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --unsorted --out "$L/spin_parts_unsorted.json" > "$L/spin_parts_unsorted.log" 2>&1
grep "│" "$L/spin_parts_unsorted.log"
timeout 280 python3 benchmarks/bench_topk.py --k 2048,512 --batches 64 --no-approx --unsorted \
  --default-config-only --out "$L/topk_b64.json" > "$L/topk_b64.log" 2>&1
grep "│" "$L/topk_b64.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# Session 12, call 6 (< 4 min). Predictions: benchmarks/NOTES.md, session 12 ("Call 6").
# 1. compiled GPU tests of every SPIN kernel and the step;
# 2. the SPIN A1 step against the full step at 64 x 128K (twice) and 512K, 40%, kernel time,
#    the compacted width aligned to 32 blocks.
source benchmarks/h200_env.sh
timeout 80 python3 -m pytest -q -x tests/test_gpu.py -k "spin" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
show() { python3 -c "import json,sys; [print(r['N'], r['impl'], round(r['kernel_us'], 1), round(r['kernel_vs_full'], 4), {k: round(v, 2) for k, v in r.get('kernels_us', {}).items()}) for r in json.load(open(sys.argv[1]))['rows']]" "$1"; }
timeout 150 python3 benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 \
  --slots 131072,524288 --sparsities 0.4 --out "$L/spin_A1.json" > "$L/spin_A1.log" 2>&1
show "$L/spin_A1.json"
timeout 70 python3 benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 \
  --slots 131072 --sparsities 0.4 --out "$L/spin_A1_again.json" > "$L/spin_A1_again.log" 2>&1
show "$L/spin_A1_again.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

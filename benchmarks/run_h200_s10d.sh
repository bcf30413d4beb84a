#!/usr/bin/env bash
# Session 10, call 4 (< 8 min): SPIN's selection with one block-score kernel for A1 (max
# pooling) and random exploration keys made in the selection kernel (16-bit counter hashes,
# no threefry kernels), predictions in benchmarks/NOTES.md (session 10).
# 0. the compiled SPIN GPU tests (block scores, selection, update, step);
# 1. A1 at 64 x 128K, 40%: the stages (select, update, ...) and the step, kernel time donated;
# 2. A1 at 64 x 512K and A2 at 64 x {128K, 512K}: the step, kernel time donated.
source benchmarks/h200_env.sh
timeout 120 python3 -m pytest -q -x tests/test_gpu.py -k "spin" > "$L/gpu_tests_spin.log" 2>&1
tail -1 "$L/gpu_tests_spin.log"
timeout 110 python3 benchmarks/bench_spin.py --reduction A1 --batches 64 --slots 131072 \
  --sparsities 0.4 --out "$L/spin_A1_128k_stages.json" > "$L/spin_A1_128k.log" 2>&1
timeout 100 python3 benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 \
  --slots 524288 --sparsities 0.4 --out "$L/spin_A1_512k.json" > "$L/spin_A1_512k.log" 2>&1
timeout 130 python3 benchmarks/bench_spin.py --step-only --reduction A2 --batches 64 \
  --slots 131072,524288 --sparsities 0.4 --out "$L/spin_A2.json" > "$L/spin_A2.log" 2>&1
for f in spin_A1_128k_stages spin_A1_512k spin_A2; do
  python3 -c "import json,sys; [print(r['N'], r['impl'], round(r['us'], 1), round(r['kernel_us'], 1), round(r['kernel_vs_full'], 3), r.get('predict_update_frac'), {k: v for k, v in r.get('kernels_us', {}).items() if 'spin' in k or 'reduce' in k}) for r in json.load(open(sys.argv[1]))['rows']]" "$L/$f.json"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

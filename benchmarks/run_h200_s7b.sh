#!/usr/bin/env bash
# Session 7, device call 2: the bitonic network as pair sums over a [2]*12 view ("cube") and as
# sorted runs merged by rank, against call 1's split / join form; the SPIN A2 step with the
# bitonic finish; then (if time is left) the filter-pass config sweep.
source benchmarks/h200_env.sh
timeout 100 python3 -m pytest -q -x tests/test_gpu.py -k "topk_gpu and bitonic" \
  > "$L/gpu_tests_bitonic_cube.log" 2>&1
tail -2 "$L/gpu_tests_bitonic_cube.log"
timeout 180 python3 benchmarks/topk_stages.py --shapes 64x131072,8x131072 \
  --only "bitonic,compact,whole topk" \
  --out "$L/topk_stages_cube.json" > "$L/topk_stages_cube.log" 2>&1
grep "│" "$L/topk_stages_cube.log"
for f in bitonic auto; do
  timeout 60 python3 benchmarks/bench_spin.py --step-only --reduction A2 --batches 64 \
    --slots 131072 --sparsities 0.4 --topk-finish $f --out "$L/spin_a2_128k_$f.json" \
    > "$L/spin_a2_128k_$f.log" 2>&1
  grep "│" "$L/spin_a2_128k_$f.log" | grep -v "^│    "
done
(cd "$OUT" && tar czf logs.tgz logs)
timeout 120 python3 benchmarks/topk_stages.py --shapes 64x131072 \
  --configs 4096:4:12,2048:4:12,2048:8:12 \
  --out "$L/topk_stages_configs.json" > "$L/topk_stages_configs.log" 2>&1
grep "│" "$L/topk_stages_configs.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

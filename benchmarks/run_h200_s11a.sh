#!/usr/bin/env bash
# Session 11, call 1 (written in session 10 as run_h200_next.sh, whose device time ran out; < 8 min).
# Predictions: benchmarks/NOTES.md, session 10 ("Call 6" and "Prepared for the next device
# session").
# 0. compiled GPU tests: the top-K with and without group skipping, and SPIN's kernels with
#    the VM state (block scores from VM and D, the update writing V in whole rows and VM);
# 1. TopkConfig.skip_groups (the compactions read only groups that reach the threshold) at
#    64 x 128K and 64 x 1M, K=2048, on / off (kernel time);
# 2. A1's block-score kernel alone per tile (it now reads D and VM, not V);
# 3. the SPIN A1 step against the full step at 64 x {128K, 512K}, 40% (kernel time donated),
#    both steps' top-K with group skipping on, then off (the default).
source benchmarks/h200_env.sh
timeout 110 python3 -m pytest -q -x tests/test_gpu.py -k "split_bitonic or spin or threshold" \
  > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
timeout 130 python3 benchmarks/topk_stages.py --shapes 64x131072,64x1048576 --kernels \
  --only "=whole topk" --configs 2048:4:14:512:1,2048:4:14:512:0 \
  --out "$L/topk_skip.json" > "$L/topk_skip.log" 2>&1
python3 benchmarks/kernel_rows.py "$OUT/rows.jsonl" compact_atomic
timeout 60 python3 benchmarks/spin_update_bpp.py --skip-update --score-tiles 32:4,64:4,128:8 \
  --out "$L/spin_tiles_vm.json" > "$L/spin_tiles_vm.log" 2>&1
grep "│" "$L/spin_tiles_vm.log"
for mode in on off; do
  flag=$([ $mode = on ] && echo --skip-groups)
  timeout 90 python3 benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 $flag \
    --slots 131072,524288 --sparsities 0.4 --out "$L/spin_A1_skip_$mode.json" \
    > "$L/spin_A1_skip_$mode.log" 2>&1
  python3 -c "import json,sys; [print(sys.argv[2], r['N'], r['impl'], round(r['kernel_us'], 1), round(r['kernel_vs_full'], 3), {k: v for k, v in r.get('kernels_us', {}).items() if 'spin' in k or 'compact' in k}) for r in json.load(open(sys.argv[1]))['rows']]" "$L/spin_A1_skip_$mode.json" "skip $mode"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

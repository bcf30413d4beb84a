#!/usr/bin/env bash
# Session 9, device call 1 (< 10 min): what session 8 left open, measured in kernel time
# (the device trace; ncu segfaults on the Mosaic kernels but ran on the Triton top-K kernels in
# session 6; the in-graph wall-clock timer has a ~10% spread on 40-80 us calls,
# benchmarks/NOTES.md session 8).
# 0. the compiled GPU tests of the rank and bitonic finishes (the rank kernel now breaks ties
#    by the candidates' indices, so it takes the one-pass compaction; not yet run on a GPU);
# 1. ncu stall reasons of the one-pass compaction and the bitonic finish at 64 x 131072 x 2048
#    (issue 4: the compaction reads 32 MB in 27.6 us, 1.2 TB/s; what stalls it);
# 2. top-K filter-pass configs at 64 x 131072 x 2048, each kernel's time (session 6's config
#    sweep was drowned by the wall-clock spread);
# 3. the finishes in kernel time: bitonic at 8 / 16 / 32 warps, and the rank kernel (now
#    order-free, so it takes the one-pass compaction) alone and in the whole call, at 64 rows
#    and one row (one row's bitonic sort is 24 of its 41 us; the rank kernel spreads a row
#    over cap / 64 programs);
# 4. the SPIN step at B=64 x 128K, 40%, A2 and A1, once more each with both timers, and now
#    each kernel's time in the full and the SPIN step (issue 5: where A1's extra ~40 us beyond
#    its selection and update stages goes).
source benchmarks/h200_env.sh
timeout 60 python3 -m pytest -q -x tests/test_gpu.py -k "topk_gpu and (rank or bitonic)" \
  > "$L/gpu_tests_topk.log" 2>&1
tail -1 "$L/gpu_tests_topk.log"
timeout 80 ncu --clock-control none --csv --print-units base \
  -k regex:"jaxsparse_topk_(compact_atomic|bitonic)" --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
  python3 benchmarks/profile_one.py topk --calls 3 > "$L/ncu_topk_stalls.csv" 2>&1
grep -E '"(Duration|Achieved Occupancy|Registers Per Thread|Stall [A-Za-z ]+)"' \
  "$L/ncu_topk_stalls.csv" | cut -d, -f5,12- | head -40
timeout 130 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels --only "whole topk" \
  --configs 4096:4:20,2048:4:20,8192:8:20,4096:8:12 \
  --out "$L/topk_configs_ktime.json" > "$L/topk_configs_ktime.log" 2>&1
grep "│" "$L/topk_configs_ktime.log" | grep -v "^│    " | grep "all kernels\|compact\|group_max\|threshold"
timeout 120 python3 benchmarks/topk_stages.py --shapes 64x131072,1x131072,1x1048576 --kernels \
  --only "16 warps,8 warps,32 warps,rank" \
  --out "$L/topk_finish_ktime.json" > "$L/topk_finish_ktime.log" 2>&1
grep "│" "$L/topk_finish_ktime.log" | grep -v "^│    "
for r in A2 A1; do
  timeout 70 python3 benchmarks/bench_spin.py --step-only --reduction $r --batches 64 \
    --slots 131072 --sparsities 0.4 --out "$L/spin_${r}_128k.json" > "$L/spin_${r}.log" 2>&1
  grep "│" "$L/spin_${r}.log" | grep -v "^│    "
  python3 -c "import json,sys; [print(r['impl'], json.dumps(r.get('kernels_us'))) for r in json.load(open(sys.argv[1]))['rows']]" "$L/spin_${r}_128k.json"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

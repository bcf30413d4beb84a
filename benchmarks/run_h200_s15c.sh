#!/usr/bin/env bash
# Session 15, call 3 (< 9 min). Predictions: benchmarks/NOTES.md, session 15 ("Call 3").
# 1. every compiled top-K GPU test at the final defaults (finish="auto": rank for one row);
# 2. ncu (launch, occupancy, warp state, instructions) of the rank count and threshold
#    kernels at one row of 128K, k = 2048, for whoever takes the single-row target next;
# 3. the public top-K table at the final defaults.
source benchmarks/h200_env.sh
timeout 170 python3 -m pytest -q -x tests/test_gpu.py -k "topk" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
timeout 60 ncu --clock-control none --section LaunchStats --section Occupancy \
  --section WarpStateStats --section InstructionStats --section SpeedOfLight \
  -k regex:"rank_count|threshold" --launch-skip 2 --launch-count 2 \
  python3 benchmarks/profile_one.py topk --batch 1 > "$L/ncu_rank_b1.txt" 2>&1
grep -E "^  jaxsparse|Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Executed Ipc A|Issued Warp|Block Limit Reg" "$L/ncu_rank_b1.txt" | head -30
timeout 330 python3 benchmarks/bench_topk.py --default-config-only --kernels \
  --batches 64,8,1 --k 2048,512 --out "$L/topk_table_s15c.json" > "$L/topk_table.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], round(r.get('kernel_us', float('nan')), 1), round(r['us'], 1), round(r['vs_lax_top_k'], 2), round(r['vs_torch'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['impl'] == 'jaxsparse']" "$L/topk_table_s15c.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

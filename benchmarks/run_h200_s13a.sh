#!/usr/bin/env bash
# Session 13, call 1 (< 7 min). Predictions: benchmarks/NOTES.md, session 13 ("Call 1").
# 1. compiled GPU tests of the top-K split bitonic path, both compactions (scan / lane);
# 2. kernel time of the one-pass compaction and the whole call, scan against lane, chunk and
#    warps variants of lane, at 64 x 128K; scan / lane at 8 x 32K, 1 x 128K, 64 x 1M;
# 3. ncu launch, occupancy and warp-state sections of both compaction kernels at 64 x 128K.
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q -x tests/test_gpu.py -k "split_bitonic" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
show() { python3 -c "import json,sys; [print(r['B'], r['N'], r['config'], r['stage'][:26], r.get('kernel', r['timing'])[:34], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows']]" "$1"; }
timeout 150 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels \
  --configs 2048:4:14:512:0,2048:4:14:512:0:1,1024:4:14:512:0:1,2048:2:14:512:0:1,4096:8:14:512:0:1 \
  --only "compact, one pass,=whole topk" --out "$L/topk_lane_b64.json" > "$L/topk_lane_b64.log" 2>&1
show "$L/topk_lane_b64.json"
timeout 150 python3 benchmarks/topk_stages.py --shapes 8x32768,1x131072,64x1048576 --kernels \
  --configs 2048:4:14:512:0,2048:4:14:512:0:1 \
  --only "compact, one pass,=whole topk" --out "$L/topk_lane_shapes.json" > "$L/topk_lane_shapes.log" 2>&1
show "$L/topk_lane_shapes.json"
for c in scan lane; do
  timeout 60 ncu --clock-control none --section LaunchStats --section Occupancy \
    --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:compact_atomic \
    --launch-skip 2 --launch-count 1 python3 benchmarks/profile_one.py topk --compact $c \
    > "$L/ncu_compact_$c.txt" 2>&1
  grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Warp Cycles|Memory Throughput|L2 Hit" "$L/ncu_compact_$c.txt" | head -30
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

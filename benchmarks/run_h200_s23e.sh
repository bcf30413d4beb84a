#!/usr/bin/env bash
# Session 23, call 5 (after the fix of the all-probes path): the rank merge loading no probe past a run's live count
# (TopkConfig.rank_merge_live_probes) and 8 warps for its runs kernel
# (TopkConfig.rank_merge_run_warps), both new defaults: compiled tests at the defaults, then
# each alone and both at 8 x 32K x 2048. Predictions: benchmarks/NOTES.md, session 23.
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
N=$N+bitonic_rank_merge=32
timeout 200 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider \
  -k "rank_merge and not 2048-16" > "$L/gpu_tests_s23e.log" 2>&1
tail -1 "$L/gpu_tests_s23e.log"
C="$N,$N+rank_merge_live_probes=True,$N+rank_merge_run_warps=8"
C="$C,$N+rank_merge_live_probes=True+rank_merge_run_warps=8"
timeout 240 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048 \
  --shapes 8x32768 --out "$L/topk_live_s23e.json" --configs "$C" > "$L/topk_live_e.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'][len(sys.argv[2]):] or 'N', r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_live_s23e.json" "$N"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

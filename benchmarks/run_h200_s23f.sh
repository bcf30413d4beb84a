#!/usr/bin/env bash
# Session 23, call 6: the rank merge's searches in 4 or 8 parts a step
# (TopkConfig(rank_merge_arity=a), opt-in): compiled at 8 x 32K x 2048, then timed there
# against the defaults. Predictions: benchmarks/NOTES.md, session 23 ("Call 6").
source benchmarks/h200_env.sh
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
D=$D+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
D=$D+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
D=$D+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
D=$D+bitonic_rank_merge=32+rank_merge_live_probes=True+rank_merge_run_warps=8
timeout 150 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider \
  -k "rank_merge and (2048-0-4 or 2048-0-8)" > "$L/gpu_tests_s23f.log" 2>&1
tail -1 "$L/gpu_tests_s23f.log"
C="$D,$D+rank_merge_arity=4,$D+rank_merge_arity=8"
timeout 180 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048 \
  --shapes 8x32768 --out "$L/topk_arity_s23f.json" --configs "$C" > "$L/topk_arity.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'][len(sys.argv[2]):] or 'D', r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_arity_s23f.json" "$D"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

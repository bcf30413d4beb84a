#!/usr/bin/env bash
# Session 23, call 1 (written in session 22, after its device time was spent): the rank
# merge's searches starting against sampled keys (TopkConfig(rank_merge_samples=m), opt-in),
# compiled, then timed at 8 x 32K x 2048 against the defaults, with two config-only tries
# (blocks of 16 with the repair inside; 8 warps for the runs kernel).
# Predictions: benchmarks/NOTES.md, session 22 ("Next call's predictions").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024+bucket_chunk=1024+bucket_chunk_min_entries=65536
N=$N+bitonic_rank_merge=32
timeout 200 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider -k rank_merge \
  > "$L/gpu_tests_s23a.log" 2>&1
tail -1 "$L/gpu_tests_s23a.log"
C="$N,$N+bitonic_rank_merge=16,${N/2048:4:14:512:0:3:4:2/2048:4:14:512:0:3:8:2}"
grep -q "4 passed" "$L/gpu_tests_s23a.log" && C="$C,$N+rank_merge_samples=16,$N+rank_merge_samples=32"
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only --k 2048)
timeout 300 "${S[@]}" --shapes 8x32768 --out "$L/topk_samples_s23a.json" \
  --configs "$C" > "$L/topk_samples.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], 'N' if r['config'] == sys.argv[2] else r['config'][:21] + r['config'][-24:], r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$L/topk_samples_s23a.json" "$N"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

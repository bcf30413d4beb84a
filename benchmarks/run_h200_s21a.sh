#!/usr/bin/env bash
# Session 21, call 1: the pivot refined by counts (rank_pivot_probes) at one row of 32K x 2048
# after its compiled test, and fewer, longer compaction programs at one row of 128K.
# Predictions: benchmarks/NOTES.md, session 21 ("Call 1 predictions").
source benchmarks/h200_env.sh
N=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=8
N=$N+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256+fused_rank=True
N=$N+repair_in_finish=True+bitonic_mid=2048+rank_rows=True+rank_buckets=True
N=$N+falsi_slack_entries=1024
timeout 120 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider -k pivot_probes \
  > "$L/gpu_tests_s21a.log" 2>&1
tail -1 "$L/gpu_tests_s21a.log"
P=""
grep -q " passed" "$L/gpu_tests_s21a.log" && ! grep -q "failed" "$L/gpu_tests_s21a.log" \
  && P=",$N+rank_pivot_probes=1,$N+rank_pivot_probes=2"
S=(python3 benchmarks/topk_stages.py --only "=whole topk" --kernels-only)
timeout 140 "${S[@]}" --k 2048 --shapes 1x32768 --out "$L/topk_pivot_s21a.json" \
  --configs "$N$P,$N+small_chunk=1024" > "$L/topk_pivot.log" 2>&1
timeout 140 "${S[@]}" --k 2048 --shapes 1x131072 --out "$L/topk_chunk2048_s21a.json" \
  --configs "$N,$N+small_chunk_entries=65536,$N+small_chunk=1024${P%,*}" > "$L/topk_chunk2048.log" 2>&1
timeout 80 "${S[@]}" --k 512 --shapes 1x131072 --out "$L/topk_chunk512_s21a.json" \
  --configs "$N,$N+small_chunk_entries=65536" > "$L/topk_chunk512.log" 2>&1
for f in "$L"/topk_*_s21a.json; do
python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'N'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$N"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

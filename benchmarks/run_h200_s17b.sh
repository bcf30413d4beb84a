#!/usr/bin/env bash
# Session 17, call 2 (< 7 min; call 1 again after a fix: persistent_select failed without lengths): compiled tests of the persistent top-K kernel, then its kernel
# time against session 16's defaults at one row (k = 2048, 512) and at 8 x 32K x 2048.
# Predictions: benchmarks/NOTES.md, session 17 ("Call 1"; call 2 repeats it).
source benchmarks/h200_env.sh
python3 -c "import jax; from jax.experimental.pallas import triton as t; print(jax.__version__, hasattr(t, 'debug_barrier'), jax.devices()[0].core_count)"
timeout 200 python3 -m pytest -q -x tests/test_gpu.py -k "persistent" > "$L/gpu_tests.log" 2>&1
tail -3 "$L/gpu_tests.log"
D=2048:4:14:512:0:3:4:2+finish=auto+rank_max_rows=1+rank_min_k=512+rank_block_i=16
D=$D+rank_block_j=512+threshold=falsi+small_chunk_entries=262144+max_group=256
for k in 2048 512; do
  timeout 130 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k $k \
    --shapes 1x32768,1x131072,1x524288,1x1048576 --configs "$D,$D+persist_max_rows=1" \
    --out "$L/topk_persist_k${k}_s17b.json" > "$L/topk_persist_k$k.log" 2>&1
done
timeout 40 python3 benchmarks/topk_stages.py --only "=whole topk" --kernels --k 2048 \
  --shapes 8x32768 --configs "$D+persist_max_rows=8" \
  --out "$L/topk_persist_b8_s17b.json" > "$L/topk_persist_b8.log" 2>&1
for f in "$L"/topk_*_s17b.json; do
  python3 -c "import json,sys; [print(r['B'], r['N'], r['K'], r['config'].replace(sys.argv[2], 'D'), r['kernel'][15:], round(r['us'], 2)) for r in json.load(open(sys.argv[1]))['rows'] if r['op'] == 'topk kernel']" "$f" "$D"
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

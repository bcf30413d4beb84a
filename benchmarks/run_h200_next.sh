#!/usr/bin/env bash
# The next device call (~10 minutes: split it in two if the limit is near): the runs session 2 could not fit in its device time.
#  - decode bf16 at the small shapes with the unrolled timing (B=1 x 1M, B=8 x 128K), 6 stages;
#  - SPIN sweep (B in {1, 8, 64} x 32K-512K x 20-50%) with the tiled update kernel;
#  - SPIN parts at B=64 x 512K with the honest (threaded) predict + update timing;
#  - top-K with the rank-counting finish against the sort finish, K in {512, 2048}.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAXSPARSE_IN_GRAPH=unrolled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
L=$OUT/logs
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl" JAXSPARSE_GIT=${JAXSPARSE_GIT:-unknown}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$L/gpu_tests.log" | tail -2
for s in 1:1048576 8:131072; do
  b=${s%%:*}; n=${s##*:}
  timeout 60 python3 benchmarks/bench_indexer.py --what decode --key-dtypes bfloat16 --no-baseline \
    --decode-batches $b --decode-slots $n --decode-configs 2:8:4:6,1:8:4:6 \
    --out "$OUT/decode_small_b${b}.json" > "$L/decode_b${b}.log" 2>&1; grep "│" "$L/decode_b${b}.log"
done
timeout 100 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
  --out "$OUT/spin_parts.json" > "$L/spin_parts.log" 2>&1; grep "│" "$L/spin_parts.log"
timeout 240 python3 benchmarks/bench_spin.py --batches 64,8,1 --slots 131072,524288,32768 \
  --sparsities 0.2,0.4,0.5 --step-only --out "$OUT/spin_sweep.json" > "$L/spin_sweep.log" 2>&1
grep "│" "$L/spin_sweep.log"
timeout 200 python3 benchmarks/bench_topk.py --k 2048,512 --no-approx --finish sort,rank \
  --out "$OUT/topk_rank.json" > "$L/topk_rank.log" 2>&1; grep "│" "$L/topk_rank.log" | grep jaxsparse
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

#!/usr/bin/env bash
# The next device calls: what session 2 could not fit in its device time. Two calls (each under
# the 10-minute limit):  bash benchmarks/run_h200_next.sh a   then   bash benchmarks/run_h200_next.sh b
#  a: GPU tests (incl. the rank finish, compiled), top-K rank vs sort finish, K in {512, 2048};
#  b: decode bf16 at every B x N >= 1M shape not yet timed unrolled with 6 stages; SPIN parts at B=64 with
#     the threaded predict + update timing, float32 and bfloat16 state; the SPIN sweep.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAXSPARSE_IN_GRAPH=unrolled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
L=$OUT/logs
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl" JAXSPARSE_GIT=${JAXSPARSE_GIT:-unknown}
if [ "${1:-a}" = a ]; then
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$L/gpu_tests.log" | tail -2
  timeout 300 python3 benchmarks/bench_topk.py --k 2048,512 --no-approx --finish sort,rank \
    --out "$L/topk_rank.json" > "$L/topk_rank.log" 2>&1; grep "│" "$L/topk_rank.log" | grep jaxsparse
else
  for s in 1:1048576 8:131072 8:524288 8:1048576 64:524288; do
    b=${s%%:*}; n=${s##*:}
    timeout 45 python3 benchmarks/bench_indexer.py --what decode --key-dtypes bfloat16 --no-baseline \
      --decode-batches $b --decode-slots $n --decode-configs 2:8:4:6,1:8:4:6 \
      --out "$L/decode_b${b}_n${n}.json" > "$L/decode_b${b}_n${n}.log" 2>&1; grep "│" "$L/decode_b${b}_n${n}.log"
  done
  for dt in float32 bfloat16; do
    timeout 90 python3 benchmarks/bench_spin.py --batches 64 --slots 131072,524288 --sparsities 0.4 \
      --state-dtype $dt --out "$L/spin_parts_$dt.json" > "$L/spin_parts_$dt.log" 2>&1
    grep "│" "$L/spin_parts_$dt.log"
  done
  timeout 200 python3 benchmarks/bench_spin.py --batches 64,8,1 --slots 131072,524288,32768 \
    --sparsities 0.2,0.4,0.5 --step-only --out "$L/spin_sweep.json" > "$L/spin_sweep.log" 2>&1
  grep "│" "$L/spin_sweep.log"
fi
# every result file is inside logs.tgz (the device returns at most 8 files)
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

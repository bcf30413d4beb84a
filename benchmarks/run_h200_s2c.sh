#!/usr/bin/env bash
# Session 2, call 3: GPU tests; top-K stages (unrolled vs loop timing, cond cost); SPIN step
# with the ranking kernel and warm=True; decode at 6 stages; XLA command-buffer flags.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
L=$OUT/logs
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$L/gpu_tests.log" | tail -3
timeout 120 python3 benchmarks/topk_stages.py --shapes 64x131072,8x131072 \
  --out "$OUT/topk_stages_unrolled_h200.json" > "$L/topk_stages.log" 2>&1; grep "│" "$L/topk_stages.log"
JAXSPARSE_IN_GRAPH=unrolled timeout 240 python3 benchmarks/bench_spin.py --batches 64,8 \
  --slots 131072,524288 --sparsities 0.4 --out "$OUT/spin_unrolled_h200.json" \
  > "$L/bench_spin.log" 2>&1; grep "│" "$L/bench_spin.log"
JAXSPARSE_IN_GRAPH=unrolled timeout 100 python3 benchmarks/bench_indexer.py --what decode \
  --key-dtypes bfloat16,float8_e4m3fn --no-baseline --decode-batches 64 --decode-slots 131072,1048576 \
  --decode-configs 2:8:4:6,2:8:4:4 --out "$OUT/decode_stages_h200.json" > "$L/decode.log" 2>&1
grep "│" "$L/decode.log"
XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE \
  timeout 90 python3 benchmarks/topk_stages.py --shapes 64x131072 --out "$L/topk_stages_cmdbuf.json" \
  > "$L/topk_cmdbuf.log" 2>&1; grep -E "│|rror" "$L/topk_cmdbuf.log" | head -20
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

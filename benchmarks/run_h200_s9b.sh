#!/usr/bin/env bash
# Session 9, device call 2 (< 8 min), all in kernel time (device trace):
# 0. the GPU test of kernel_time with a donated, threaded state (no copy kernels);
# 1. top-K chunk / warps at 64 x 131072 x 2048 below call 1's best (2048:4, 65.4 us);
# 2. chunk 4096 / 2048 / 1024 at one row (128K, 1M), 8 x 32K and 64 x 1M (the default must not
#    lose elsewhere);
# 3. the order-free rank finish's whole call at one row and 8 x 32K (call 1 timed out there);
# 4. the SPIN step at 64 x 128K, 40%, A1 and A2, kernel time with the state donated and
#    threaded (call 1: 17-18 us of memcpy128 per step without donation), and the A1 step's
#    optimised HLO (which XLA fusions make up its ~25 us of small kernels).
source benchmarks/h200_env.sh
timeout 60 python3 -m pytest -q -x tests/test_gpu.py -k "kernel_time" > "$L/gpu_test_ktime.log" 2>&1
tail -1 "$L/gpu_test_ktime.log"
timeout 100 python3 benchmarks/topk_stages.py --shapes 64x131072 --kernels --only "=whole topk" \
  --configs 1024:4:20,1024:2:20,2048:2:20,2048:8:20,2048:4:20 \
  --out "$L/topk_chunks_b64.json" > "$L/topk_chunks_b64.log" 2>&1
timeout 130 python3 benchmarks/topk_stages.py --shapes 1x131072,1x1048576,8x32768,64x1048576 \
  --kernels --only "=whole topk" --configs 4096:4:20,2048:4:20,1024:4:20 \
  --out "$L/topk_chunks_shapes.json" > "$L/topk_chunks_shapes.log" 2>&1
timeout 80 python3 benchmarks/topk_stages.py --shapes 1x131072,1x1048576,8x32768 --kernels \
  --only "=whole topk, rank,=whole topk" --out "$L/topk_rank_rows.json" > "$L/topk_rank_rows.log" 2>&1
python3 - "$OUT/rows.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  if r.get("op") == "topk kernel" and r.get("kernel") in ("all kernels", "jaxsparse_topk_compact_atomic", "jaxsparse_topk_group_max", "jaxsparse_topk_rank", "jaxsparse_topk_bitonic"):
    print(r["B"], r["N"], r["stage"][:18], r["config"], r["kernel"][-14:], round(r["us"], 1))
PY
for r in A1 A2; do
  timeout 70 python3 benchmarks/bench_spin.py --step-only --reduction $r --batches 64 \
    --slots 131072 --sparsities 0.4 --out "$L/spin_${r}_128k_donated.json" > "$L/spin_${r}.log" 2>&1
  grep "│" "$L/spin_${r}.log" | grep -v "^│    "
  python3 -c "import json,sys; [print(r['impl'], json.dumps(r.get('kernels_us'))) for r in json.load(open(sys.argv[1]))['rows']]" "$L/spin_${r}_128k_donated.json"
done
timeout 60 python3 benchmarks/profile_one.py spin --reduction A1 --calls 1 --hlo "$L/spin_A1_step.hlo" \
  > "$L/spin_hlo.log" 2>&1
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

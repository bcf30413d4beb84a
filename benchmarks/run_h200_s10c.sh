#!/usr/bin/env bash
# The third next device call (not yet run; written in session 9), < 8 min: the exact n-best
# search 1, 2 or 4 bits per step (JAXSPARSE_RANK_RADIX_BITS, read when kernels are traced).
# It runs in SPIN's selection kernel (48 counting steps per request today: 11.9 us of the
# A1 step at 64 x 128K), in the top-K's no-sort set finish (13.4 us at 64 x 128K) and in the
# block-ranking kernel.
# 0. the compiled GPU tests of those kernels with 2 and 4 bits per step;
# 1. SPIN A1 at 64 x 128K, 40%, with 1, 2 and 4 bits per step (kernel time, state donated);
# 2. the top-K as a set at 64 x 128K x 2048 with 1, 2 and 4 bits per step.
source benchmarks/h200_env.sh
for rb in 2 4; do
  JAXSPARSE_RANK_RADIX_BITS=$rb timeout 70 python3 -m pytest -q -x tests/test_gpu.py \
    -k "spin_block_ranking or spin_select or spin_step or (topk_gpu and sort)" \
    > "$L/gpu_tests_radix$rb.log" 2>&1
  tail -1 "$L/gpu_tests_radix$rb.log"
done
for rb in 1 2 4; do
  JAXSPARSE_RANK_RADIX_BITS=$rb timeout 80 python3 benchmarks/bench_spin.py --step-only \
    --reduction A1 --batches 64 --slots 131072 --sparsities 0.4 \
    --out "$L/spin_A1_radix$rb.json" > "$L/spin_A1_radix$rb.log" 2>&1
  python3 -c "import json,sys; [print('radix $rb', r['impl'], round(r['kernel_us'], 1), r.get('kernels_us', {}).get('jaxsparse_spin_select')) for r in json.load(open(sys.argv[1]))['rows']]" "$L/spin_A1_radix$rb.json"
  JAXSPARSE_RANK_RADIX_BITS=$rb timeout 40 python3 benchmarks/topk_stages.py --shapes 64x131072 \
    --kernels --only "=whole topk, set" --out "$L/topk_set_radix$rb.json" > "$L/topk_set_radix$rb.log" 2>&1
done
python3 benchmarks/kernel_rows.py "$OUT/rows.jsonl" index_order
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

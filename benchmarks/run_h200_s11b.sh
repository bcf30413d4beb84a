#!/usr/bin/env bash
# Session 11, call 2 (< 6 min). Predictions: benchmarks/NOTES.md, session 11 ("Call 2").
# 0. compiled GPU tests: top-K (split bitonic, block map into slots, threshold with the
#    counter output, repair with the live output) and SPIN (update kernel writing step);
# 1. the public top-K, default config, kernel time and in-graph, at 64 x 128K, 8 x 32K,
#    1 x 128K, 64 x 1M (K=2048): the three XLA fill / select kernels gone;
# 2. the SPIN A1 step against the full step at 64 x {128K, 512K}, 40%, and A2 at 128K
#    (slot mapping in the merge kernel, step in the update kernel, warm passed through).
source benchmarks/h200_env.sh
timeout 150 python3 -m pytest -q -x tests/test_gpu.py \
  -k "split_bitonic or block_map or spin or threshold or topk_gpu" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
timeout 120 python3 benchmarks/topk_stages.py --shapes 64x131072,8x32768,1x131072,64x1048576 \
  --kernels --only "=whole topk" --out "$L/topk_glue.json" > "$L/topk_glue.log" 2>&1
python3 -c "import json,sys; [print(r['B'], r['N'], r.get('kernel', r.get('timing')), round(r['us'], 1)) for r in json.load(open(sys.argv[1]))['rows'] if r.get('kernel', 'all kernels') == 'all kernels' or 'loop' in r.get('kernel', '') or 'wrapped' in r.get('kernel', '')]" "$L/topk_glue.json"
for red in A1 A2; do
  slots=$([ $red = A1 ] && echo 131072,524288 || echo 131072)
  timeout 90 python3 benchmarks/bench_spin.py --step-only --reduction $red --batches 64 \
    --slots $slots --sparsities 0.4 --out "$L/spin_${red}_glue.json" > "$L/spin_${red}_glue.log" 2>&1
  python3 -c "import json,sys; [print(sys.argv[2], r['N'], r['impl'], round(r['kernel_us'], 1), round(r['kernel_vs_full'], 3), {k: round(v, 2) for k, v in r.get('kernels_us', {}).items() if not k.startswith('jaxsparse_decode')}) for r in json.load(open(sys.argv[1]))['rows']]" "$L/spin_${red}_glue.json" $red
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

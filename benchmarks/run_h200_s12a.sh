#!/usr/bin/env bash
# Session 12, call 1 (< 5 min). Predictions: benchmarks/NOTES.md, session 12 ("Call 1").
# 1. compiled GPU tests of the SPIN update kernel (loads now issued before stores) and step;
# 2. the update kernel alone under A1 / A2 at 8 and 16 blocks per program (in-graph);
# 3. the SPIN A1 step against the full step at 64 x 128K, 40%, in kernel time, with the
#    optimised HLO dumped: which ops are the copy (memcpy32_post) and the small fusions.
source benchmarks/h200_env.sh
timeout 60 python3 -m pytest -q -x tests/test_gpu.py -k "spin_update or spin_step" \
  > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
timeout 60 python3 benchmarks/spin_update_bpp.py --bpp 8,16 --out "$L/spin_update_bpp.json" \
  > "$L/spin_update_bpp.log" 2>&1
grep "│" "$L/spin_update_bpp.log"
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" timeout 90 python3 \
  benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 --slots 131072 \
  --sparsities 0.4 --out "$L/spin_A1.json" > "$L/spin_A1.log" 2>&1
python3 -c "import json,sys; [print(r['N'], r['impl'], round(r['kernel_us'], 1), round(r['kernel_vs_full'], 3), {k: round(v, 2) for k, v in r.get('kernels_us', {}).items() if not k.startswith('jaxsparse_decode')}) for r in json.load(open(sys.argv[1]))['rows']]" "$L/spin_A1.json"
for f in $(grep -l "jaxsparse_spin_update" /tmp/hlo/*after_optimizations.txt 2>/dev/null); do
  echo "== $f"; grep -n -E " copy\(| copy-start| (loop|input|wrapped)_[a-z_0-9]*fusion[.0-9]* = " "$f" | cut -c1-400 | head -40
done > "$L/hlo_glue.txt"
head -c 6000 "$L/hlo_glue.txt"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

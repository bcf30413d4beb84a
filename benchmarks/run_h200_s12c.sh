#!/usr/bin/env bash
# Session 12, call 3 (< 6 min). Predictions: benchmarks/NOTES.md, session 12 ("Call 3").
# 1. compiled GPU tests of every SPIN kernel and the step;
# 2. the SPIN A1 step against the full step at 64 x 128K and 512K, 40%, kernel time, and A2 at
#    128K; the optimised HLO's copies and small fusions;
# 3. A1 at 128K with the block-sparse scoring at 16 and 64 pages per CTA (default 32).
source benchmarks/h200_env.sh
timeout 80 python3 -m pytest -q -x tests/test_gpu.py -k "spin" > "$L/gpu_tests.log" 2>&1
tail -1 "$L/gpu_tests.log"
show() { python3 -c "import json,sys; [print(r['N'], r['impl'], round(r['kernel_us'], 1), round(r['kernel_vs_full'], 3), {k: round(v, 2) for k, v in r.get('kernels_us', {}).items() if not k.startswith('jaxsparse_decode')}) for r in json.load(open(sys.argv[1]))['rows']]" "$1"; }
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" timeout 150 python3 \
  benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 --slots 131072,524288 \
  --sparsities 0.4 --out "$L/spin_A1.json" > "$L/spin_A1.log" 2>&1
show "$L/spin_A1.json"
for f in $(grep -l "jaxsparse_spin_update" /tmp/hlo/*jit_step_fn*after_optimizations.txt 2>/dev/null); do
  echo "== $f"; grep -n -E " copy\(|%(loop|input|wrapped)_[a-z_0-9]*fusion[.0-9]* = " "$f" | cut -c1-300 | head -30
done > "$L/hlo_glue.txt"
head -c 2000 "$L/hlo_glue.txt"
for mp in 16 64; do
  timeout 70 python3 benchmarks/bench_spin.py --step-only --reduction A1 --batches 64 \
    --slots 131072 --sparsities 0.4 --spin-mosaic-pages $mp --out "$L/spin_A1_pages$mp.json" \
    > "$L/spin_A1_pages$mp.log" 2>&1
  show "$L/spin_A1_pages$mp.json"
done
timeout 70 python3 benchmarks/bench_spin.py --step-only --reduction A2 --batches 64 \
  --slots 131072 --sparsities 0.4 --out "$L/spin_A2.json" > "$L/spin_A2.log" 2>&1
show "$L/spin_A2.json"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

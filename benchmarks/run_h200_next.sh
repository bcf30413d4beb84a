#!/usr/bin/env bash
# The next device call (one call, < 10 min): what session 4 could not fit in its device time.
# 1. the whole GPU suite in one log (session 4 ran 30 of 36 with the Mosaic defaults before its
#    time limit; the other 6 passed in a separate run);
# 2. the decode table with the plain-jnp baseline in the same run as the Mosaic rows;
# 3. the block-sparse Mosaic kernel alone under ncu (why ~0.72x of dense time for 0.6x bytes);
# 4. the SPIN sweep with the Mosaic kernels, and the top-K at K=512 for B in {8, 1}.
source benchmarks/h200_env.sh
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py > "$L/gpu_tests.log" 2>&1
tail -3 "$L/gpu_tests.log"
timeout 150 python3 benchmarks/bench_indexer.py --what decode --best-only \
  --key-dtypes "bfloat16,fp8 q+k" --decode-batches 64,8,1 --decode-slots 131072,1048576 \
  --out "$L/decode_jnp.json" > "$L/decode_jnp.log" 2>&1; grep "│" "$L/decode_jnp.log"
timeout 60 ncu --clock-control none --csv --print-units base -k regex:jaxsparse_decode_mgpu \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum \
  python3 benchmarks/decode_mgpu.py --shapes 64x131072 --configs 32:4 --out "$L/ncu_dummy.json" \
  > "$L/ncu_decode_mgpu.csv" 2>&1
timeout 120 python3 benchmarks/bench_spin.py --batches 64,8 --slots 131072,524288 \
  --sparsities 0.4,0.5 --step-only --out "$L/spin_sweep_mosaic.json" > "$L/spin_sweep_mosaic.log" 2>&1
grep "│" "$L/spin_sweep_mosaic.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

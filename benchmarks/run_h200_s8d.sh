#!/usr/bin/env bash
# Session 8, device call 4: the public decode table again (a second run of call 2's), now with
# the plain-jnp baseline also timed by the device trace (its wall-clock column stays the host
# loop over rotating input copies), so the "vs jnp" ratio exists in kernel time too (issue 2).
source benchmarks/h200_env.sh
timeout 300 python3 benchmarks/bench_indexer.py --what decode --best-only \
  --key-dtypes "bfloat16,fp8 q+k" --out "$L/decode_table_ktime2.json" > "$L/decode_table_ktime2.log" 2>&1
grep "│" "$L/decode_table_ktime2.log"
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

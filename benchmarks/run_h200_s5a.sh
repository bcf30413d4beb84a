#!/usr/bin/env bash
# Session 5, device call 1: the Mosaic decode kernel's run length (8/16/32 pages per CTA) at
# small and large B x N; where the block-sparse kernel's time goes (random vs contiguous 60%
# selection vs dense with 60% lengths, same bytes), timed and under ncu.
source benchmarks/h200_env.sh
timeout 300 python3 benchmarks/decode_mgpu.py --no-triton --dtypes "bf16,fp8 q+k" \
  --shapes 1x131072,8x131072,1x1048576,64x131072,8x1048576 --configs 32:4,16:4,8:4,16:2 \
  --sparse-controls --out "$L/decode_pages.json" > "$L/decode_pages.log" 2>&1
grep "│" "$L/decode_pages.log" || tail -30 "$L/decode_pages.log"
timeout 120 ncu --clock-control none --csv --print-units base -k regex:jaxsparse_decode_mgpu \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,dram__throughput.avg.pct_of_peak_sustained_elapsed \
  python3 benchmarks/decode_mgpu.py --no-triton --dtypes bf16 --shapes 64x131072 --configs 32:4 \
  --sparse-controls --profile 2 --out "$L/ncu_dummy.json" > "$L/ncu_sparse.csv" 2>&1
grep -v "^==PROF==" "$L/ncu_sparse.csv" | tail -40 | cut -c1-400
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs

"""Indexer scoring benchmark (decode over a paged cache; causal prefill) -> results JSON.

  python benchmarks/bench_indexer.py                 # full H200 sweep
  python benchmarks/bench_indexer.py --quick         # small shapes (CPU-friendly)
"""
from __future__ import annotations

import argparse

from jaxsparse._bench import cases as bench, shapes
from jaxsparse._bench.timing import environment, print_table, write_json
from pallas_kernels.indexer_decode import DecodeConfig
from pallas_kernels.indexer_prefill import PrefillConfig

DECODE_CONFIGS = (
    DecodeConfig(pages_per_step=4, steps_per_program=4, num_warps=8, num_stages=3),
    DecodeConfig(pages_per_step=2, steps_per_program=8, num_warps=4, num_stages=4),
    DecodeConfig(pages_per_step=4, steps_per_program=8, num_warps=8, num_stages=4),
)
PREFILL_CONFIGS = (
    PrefillConfig(block_t=2, block_n=128, tiles_per_program=4, num_warps=8, num_stages=3),
    PrefillConfig(block_t=4, block_n=128, tiles_per_program=4, num_warps=8, num_stages=3),
    PrefillConfig(block_t=2, block_n=256, tiles_per_program=2, num_warps=8, num_stages=3),
    PrefillConfig(block_t=4, block_n=64, tiles_per_program=8, num_warps=4, num_stages=3),
)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="small shapes, one config (CPU-friendly)")
  p.add_argument("--what", choices=("decode", "prefill", "both"), default="both")
  p.add_argument("--out", default="benchmarks/results/indexer_h200.json")
  p.add_argument("--key-dtypes", default="bfloat16,float8_e4m3fn,fp8 q+k",
                 help="comma list of: bfloat16, float8_e4m3fn, 'fp8 q+k'")
  p.add_argument("--decode-batches", default="", help="comma list (default: shapes.DECODE_BATCHES)")
  p.add_argument("--decode-slots", default="", help="comma list (default: shapes.DECODE_SLOTS)")
  p.add_argument("--prefill-keys", default="", help="comma list (default: shapes.PREFILL_KEYS)")
  p.add_argument("--best-only", action="store_true", help="time only the default tilings")
  p.add_argument("--decode-configs", default="",
                 help="comma list of pages_per_step:steps_per_program:num_warps:num_stages "
                      "(replaces the built-in decode tilings)")
  p.add_argument("--no-baseline", action="store_true", help="skip the plain-jnp decode rows")
  a = p.parse_args(argv)
  ints = lambda s, d: tuple(int(v) for v in s.split(",")) if s else d
  kds = tuple(v.strip() for v in a.key_dtypes.split(","))
  s = shapes.DEEPSEEK_V32
  rows = []
  dcfgs = (None,) if a.best_only else DECODE_CONFIGS
  if a.decode_configs:
    dcfgs = tuple(DecodeConfig(*(int(v) for v in c.split(":"))) for c in a.decode_configs.split(","))
  if a.quick:
    dec = dict(batches=(1, 2), slots_list=(4096,), heads=8, head_dim=64, configs=(None,),
               key_dtypes=("bfloat16", "float8_e4m3fn", "fp8 q+k"), reps=2, calls=3)
    pre = dict(keys_list=(1024,), chunk=128, heads=8, head_dim=64, configs=(None,), reps=2, calls=2)
  else:
    dec = dict(batches=ints(a.decode_batches, shapes.DECODE_BATCHES),
               slots_list=ints(a.decode_slots, shapes.DECODE_SLOTS), heads=s.heads,
               head_dim=s.head_dim, configs=dcfgs, key_dtypes=kds,
               baseline=not a.no_baseline)
    pre = dict(keys_list=ints(a.prefill_keys, shapes.PREFILL_KEYS), chunk=shapes.PREFILL_CHUNK,
               heads=s.heads, head_dim=s.head_dim,
               configs=(None,) if a.best_only else PREFILL_CONFIGS, key_dtypes=kds)
  if a.what in ("decode", "both"):
    rows += bench.bench_decode(**dec)
    print_table([r for r in rows if r["op"] == "decode"],
                ["B", "N", "keys", "impl", "config", "us", "tbps", "roofline", "speedup_vs_jnp",
                 "kernel_us", "kernel_tbps", "kernel_speedup_vs_jnp", "error"])
  if a.what in ("prefill", "both"):
    prow = bench.bench_prefill(**pre)
    rows += prow
    print_table(prow, ["T", "N", "keys", "impl", "config", "ms", "tflops", "roofline",
                       "speedup_vs_jnp", "error"])
  write_json(a.out, dict(environment=environment(), shape=vars(s), rows=rows))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

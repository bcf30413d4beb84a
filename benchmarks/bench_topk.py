"""Exact top-K benchmark: lax.top_k, lax.approx_max_k, torch.topk and jaxsparse; fused decode.

  python benchmarks/bench_topk.py            # full H200 sweep
  python benchmarks/bench_topk.py --quick    # small shapes (CPU-friendly)
"""
from __future__ import annotations

import argparse

from jaxsparse._bench import cases as bench, shapes
from jaxsparse._bench.timing import environment, print_table, write_json
from pallas_kernels.topk import TopkConfig

CONFIGS = (TopkConfig(), TopkConfig(threshold="sort"))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--out", default="benchmarks/results/topk_h200.json")
  p.add_argument("--k", default="", help="comma list of K (default: shapes.TOPK_K)")
  p.add_argument("--no-approx", action="store_true", help="skip lax.approx_max_k")
  p.add_argument("--default-config-only", action="store_true")
  p.add_argument("--finish", default="",
                 help="comma list of TopkConfig.finish values to time (e.g. sort,rank); "
                      "implies one config per value")
  p.add_argument("--unsorted", action="store_true",
                 help="also time the top-k as a set: jaxsparse and torch.topk with sorted=False")
  p.add_argument("--batches", default="", help="comma list of B (default: shapes.TOPK_BATCHES)")
  p.add_argument("--n", default="", help="comma list of row lengths (default: shapes.TOPK_N)")
  p.add_argument("--kernels", action="store_true",
                 help="also record kernel time (device trace) of lax.top_k and jaxsparse")
  a = p.parse_args(argv)
  batches = tuple(int(v) for v in a.batches.split(",")) if a.batches else shapes.TOPK_BATCHES
  n_list = tuple(int(v) for v in a.n.split(",")) if a.n else shapes.TOPK_N
  ks = tuple(int(v) for v in a.k.split(",")) if a.k else shapes.TOPK_K
  cfgs = (TopkConfig(),) if a.default_config_only else CONFIGS
  if a.finish:
    cfgs = tuple(TopkConfig(finish=f.strip()) for f in a.finish.split(","))
  if a.quick:
    rows = bench.bench_topk((1, 2), (8192,), (64,), configs=(None,), reps=2, calls=3,
                            unsorted=True)
    fused = bench.bench_decode_topk((1,), (8192,), 64, heads=8, head_dim=64, reps=2, calls=3)
  else:
    rows, env = [], environment()
    for b in batches:  # the JSON is rewritten after every shape: a timeout keeps the rest
      for n in n_list:
        rows += bench.bench_topk((b,), (n,), ks, configs=cfgs, approx=not a.no_approx,
                                 unsorted=a.unsorted, kernels=a.kernels)
        write_json(a.out, dict(environment=env, rows=rows, fused=[]))
    fused = [] if (a.default_config_only or a.finish) else bench.bench_decode_topk(
        shapes.DECODE_BATCHES, (128 * 1024, 512 * 1024), 2048)
  print_table(rows, ["B", "N", "K", "impl", "config", "us", "kernel_us", "tbps",
                     "speedup_vs_lax_top_k", "speedup_vs_torch", "error"])
  print_table(fused, ["B", "N", "K", "impl", "us", "speedup_vs_jnp", "error"])
  write_json(a.out, dict(environment=environment(), rows=rows, fused=fused))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

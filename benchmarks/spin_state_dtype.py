"""Does storing SPIN's EMAs in bfloat16 change what it selects? Replays the shipped SmolLM2
decode trace (every layer) with float32 and bfloat16 state at several target sparsities.

  python benchmarks/spin_state_dtype.py --out benchmarks/results/spin_state_dtype.json
  python benchmarks/spin_state_dtype.py --quick --out r.json        (CPU check)
"""
from __future__ import annotations

import argparse

import numpy as np

from jaxsparse import spin, traces
from jaxsparse._bench.timing import environment, print_table, write_json


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--trace", default=None, help="decode trace (.npz); default: the shipped one")
  p.add_argument("--out", default="benchmarks/results/spin_state_dtype.json")
  p.add_argument("--k", type=int, default=64)
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--sparsities", default="0.2,0.4,0.5")
  p.add_argument("--quick", action="store_true", help="two layers, 64 steps, one sparsity")
  a = p.parse_args(argv)
  tr = traces.load(a.trace or traces.default_trace_path())
  layers, steps = range(len(tr.layers)), len(tr.lengths)
  if a.quick:
    layers, steps, a.sparsities = range(min(2, len(tr.layers))), min(64, steps), "0.4"
  rows = []
  for rho in (float(v) for v in a.sparsities.split(",")):
    for dt in spin.STATE_DTYPES:
      cfg = spin.SpinConfig(block_size=a.block_size, topk=a.k, sparsity=rho, state_dtype=dt)
      miss, p99, spars = [], [], []
      for layer in layers:
        q, k, w = tr.layer(layer)
        r = spin.replay(q[:steps, 0], k, w[:steps, 0], tr.lengths[:steps], cfg)
        miss.append(r["mean_miss"]), p99.append(r["p99_miss"]), spars.append(r["mean_sparsity"])
      rows.append(dict(sparsity=rho, state_dtype=dt, mean_miss=float(np.mean(miss)),
                       p99_miss=float(np.mean(p99)), realized=float(np.mean(spars)),
                       per_layer_mean_miss=[float(m) for m in miss]))
  print_table(rows, ["sparsity", "state_dtype", "mean_miss", "p99_miss", "realized"])
  write_json(a.out, dict(environment=environment(), trace=a.trace or "shipped default",
                         k=a.k, block_size=a.block_size, rows=rows))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

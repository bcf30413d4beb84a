"""How evenly the rank finish's pivot (`pallas_kernels.topk.gpu._pivot`) splits a row's
candidates into its two value buckets, on rows drawn from several distributions.

The bucketed rank finish (`TopkConfig(rank_buckets=True)`) compares each block of candidates
only with its own bucket, so its busiest programs do work in proportion to the larger bucket:
an even split halves the compares, a 90 / 10 split saves 10%. The split is a count, not a
time, so this runs the GPU kernels in interpret mode on any machine (CPU is fine): group
maxima, the threshold kernel with its pivot, and the two-bucket compaction, at the defaults'
group size and stopping slack, with the pivot's model alone and refined by counts
(`TopkConfig.rank_pivot_probes`).

  python benchmarks/pivot_split.py --out benchmarks/results/session20/pivot_split.json
"""
from __future__ import annotations

import argparse
import itertools

import jax.numpy as jnp
import numpy as np

from jaxsparse.benchtools import environment, print_table, write_json
from pallas_kernels.topk import TopkConfig, gpu_chunk, group_size
from pallas_kernels.topk import gpu as kg

DISTRIBUTIONS = {
    "normal": lambda rng, n: rng.standard_normal(n),
    "uniform": lambda rng, n: rng.uniform(size=n),
    "exponential": lambda rng, n: rng.exponential(size=n),
    "gumbel": lambda rng, n: rng.gumbel(size=n),
    "student_t3": lambda rng, n: rng.standard_t(3, size=n),
    # DSA-like: a weighted sum of 4 heads' ReLU'd dot products, most of them zero
    "relu_heads": lambda rng, n: (np.maximum(rng.standard_normal((4, n)) - 0.5, 0)
                                  * rng.uniform(0.5, 1.5, (4, 1))).sum(0),
}


def split(x: np.ndarray, k: int, config: TopkConfig, probes: int) -> tuple[int, int]:
  """x [N] float32 -> (upper, lower): the candidates at or above the pivot and below it."""
  n = x.shape[0]
  g = group_size(n, k, config, "gpu", rows=1)
  chunk, _ = gpu_chunk(config, 1, n, k, g, "rank")
  xr = jnp.asarray(x[None].astype(np.float32))
  gm = kg.group_max(xr, None, chunk=chunk, group=g, num_warps=4, interpret=True)
  thr, ctr, piv = kg.threshold(gm, k, iters=config.bisect_iters, num_warps=4, interpret=True,
                               counter=jnp.float32, slack=config.slack_for(g), pivot=True,
                               pivot_probes=probes)
  cap = 2 * k
  _, _, c = kg.compact_atomic(xr, None, thr, capacity=cap, chunk=chunk, num_warps=4,
                              interpret=True, counter=ctr, pivot=piv)
  return int(c[0, 1]), int(c[0, 2])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="benchmarks/results/pivot_split.json")
  p.add_argument("--n", default="32768,131072", help="comma list of row lengths")
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--probes", default="0,1,2", help="comma list of TopkConfig.rank_pivot_probes")
  a = p.parse_args(argv)
  config = TopkConfig()
  rows = []
  for n in (int(v) for v in a.n.split(",")):
    for name, draw in DISTRIBUTIONS.items():
      for seed, probes in itertools.product(range(a.seeds), map(int, a.probes.split(","))):
        up, low = split(draw(np.random.default_rng(seed), n), a.k, config, probes)
        rows.append(dict(N=n, K=a.k, distribution=name, seed=seed, probes=probes, upper=up,
                         lower=low,
                         candidates=up + low, upper_share=round(up / max(up + low, 1), 3),
                         larger_share=round(max(up, low) / max(up + low, 1), 3)))
        write_json(a.out, dict(environment=environment(), rows=rows))
  print_table(rows, ["N", "distribution", "seed", "probes", "candidates", "upper", "lower",
                     "larger_share"])


if __name__ == "__main__":
  main()

"""AttentionIndex prefill time against full DSA's, 64K-1M tokens (the indexer stage only).

For each context N: `ivf.prefill_topk` (index maintenance, representative ranking, candidate
gathering and scoring, top-K; Pallas kernels on a GPU/TPU) against full DSA's exact top-K for
every query (`jaxsparse.prefill_topk`, keys streamed in blocks, no [T, N] buffer) and their
recall of full DSA's top-K on sampled queries. Random clustered keys (DeepSeek-V3.2 shapes:
H 64, D 128 by default); wall-clock seconds of one whole prefill after a warm-up at the
smallest N; each N runs --repeats times and the fastest counts (the first compiles for the
new shapes). Writes JSON.

  python benchmarks/bench_ivf_prefill.py --tokens 65536,262144,1048576 --out r.json
  python benchmarks/bench_ivf_prefill.py --quick --out r.json      (CPU check)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jaxsparse  # noqa: E402
from jaxsparse import ivf  # noqa: E402
from jaxsparse._bench.timing import environment, print_table, write_json  # noqa: E402


def case(n, h, d, seed=0):
  rng = np.random.default_rng(seed)
  centers = rng.standard_normal((max(n // 512, 8), d)).astype(np.float32)
  k = centers[rng.integers(0, len(centers), n)] + 0.5 * rng.standard_normal((n, d))
  q = rng.standard_normal((n, h, d)).astype(np.float32)
  w = rng.uniform(0, 1, (n, h)).astype(np.float32)
  return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(w), jnp.asarray(k, jnp.bfloat16))


def full_topk(q, w, k, topk, chunk):
  """Exact top-K of every query, a chunk of queries at a time (no [N, N] buffer)."""
  n = k.shape[0]
  out = []
  for lo in range(0, n, chunk):
    pos = jnp.arange(lo, min(lo + chunk, n), dtype=jnp.int32)
    out.append(jaxsparse.prefill_topk(q[lo:lo + chunk], k, w[lo:lo + chunk], topk,
                                      query_positions=pos)[1])
  return jax.block_until_ready(jnp.concatenate(out))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--tokens", default="65536,262144,1048576")
  p.add_argument("--heads", type=int, default=64)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--topk", type=int, default=2048)
  p.add_argument("--budget", type=int, default=24576)
  p.add_argument("--seal-window", type=int, default=1024)
  p.add_argument("--cluster-size", type=int, default=128)
  p.add_argument("--refit-interval", type=int, default=16384)
  p.add_argument("--chunk", type=int, default=2048, help="full DSA's queries per call")
  p.add_argument("--recall-queries", type=int, default=64)
  p.add_argument("--repeats", type=int, default=2,
                 help="runs per N; the fastest is reported (the first compiles)")
  p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU check")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  if a.quick:
    a.tokens, a.heads, a.dim, a.topk, a.budget = "512,1024", 4, 16, 16, 160
    a.seal_window, a.cluster_size, a.refit_interval, a.chunk = 64, 16, 256, 256
    a.repeats = 1
  cfg = ivf.IVFConfig(topk=a.topk, budget=a.budget, seal_window=a.seal_window,
                      cluster_size=a.cluster_size, refit_interval=a.refit_interval)
  rows = []
  tokens = [int(t) for t in a.tokens.split(",")]
  warm = case(tokens[0], a.heads, a.dim)
  ivf.prefill_topk(*warm, cfg)
  full_topk(*warm, a.topk, a.chunk)
  for n in tokens:
    q, w, k = case(n, a.heads, a.dim, seed=n)
    t_ivf = t_full = float("inf")
    for _ in range(a.repeats):  # the first run at a new N compiles for its shapes
      t0 = time.perf_counter()
      sel, num = ivf.prefill_topk(q, w, k, cfg)
      t_ivf = min(t_ivf, time.perf_counter() - t0)
      t0 = time.perf_counter()
      ref = np.asarray(full_topk(q, w, k, a.topk, a.chunk))
      t_full = min(t_full, time.perf_counter() - t0)
    qs = np.linspace(4 * a.seal_window, n - 1, a.recall_queries).astype(int)
    rec = float(np.mean([np.isin(ref[t][ref[t] >= 0], sel[t]).mean() for t in qs]))
    rows.append(dict(tokens=n, ivf_s=t_ivf, full_s=t_full, speedup=t_full / t_ivf,
                     recall=rec, mean_candidates=float(num.mean())))
    print(f"{n}: IVF {t_ivf:.2f} s, full DSA {t_full:.2f} s ({t_full / t_ivf:.2f}x), "
          f"recall {rec:.3f}", flush=True)
    write_json(a.out, {"environment": {**environment(), "command": " ".join(sys.argv)},
                       "config": vars(a), "rows": rows})  # rows so far, if a later N fails
  print_table(rows, ["tokens", "ivf_s", "full_s", "speedup", "recall"])
  write_json(a.out, {"environment": {**environment(), "command": " ".join(sys.argv)},
                     "config": vars(a), "rows": rows})


if __name__ == "__main__":
  main()

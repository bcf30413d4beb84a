"""Where a prefill query's reference keys lie: near the query, or in short runs over the prefix.

For each layer of a prefill trace and queries spread over its second half or more, the exact
causal top-K of the indexer scores, and of those keys: the share within 1,024 / 2,048 / 8,192
positions of the query, and the share with another reference key within `--gap` positions (a
run). Layers whose keys are in runs but not recent favour contiguous blocks (HiSA) over content
groups (NOTES).

  python benchmarks/ivf_reference_runs.py --trace prefill_32k.npz --topk 512 \
      --out benchmarks/results/ivf_reference_runs.json
"""
from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_ivf_recall import load_prefill_trace  # noqa: E402
from jaxsparse._bench.timing import environment, write_json  # noqa: E402
from jaxsparse.ivf.prefill import exact_scores  # noqa: E402

DISTANCES = (1024, 2048, 8192)


def layer_stats(q, w, k, positions, topk: int, gap: int) -> dict:
  """{"within_<d>": share of reference keys within d positions, "in_runs": share with another
  reference key at most `gap` positions away} for one layer (positions [Q] int)."""
  pj = jnp.asarray(positions, jnp.int32)
  _, ref = exact_scores(jnp.asarray(q)[pj], jnp.asarray(k), jnp.asarray(w)[pj], pj, topk)
  ref = np.asarray(ref)
  live = ref >= 0
  dist = positions[:, None] - ref
  out = {f"within_{d}": float(((dist < d) & live).sum() / live.sum()) for d in DISTANCES}
  s = np.sort(np.where(live, ref, np.iinfo(np.int32).max), axis=1).astype(np.int64)
  step = np.diff(s, axis=1)
  near = np.zeros_like(s, bool)
  near[:, 1:] |= step <= gap
  near[:, :-1] |= step <= gap
  srt_live = s < np.iinfo(np.int32).max
  out["in_runs"] = float((near & srt_live).sum() / srt_live.sum())
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--trace", required=True, help="prefill trace .npz")
  p.add_argument("--topk", type=int, default=512)
  p.add_argument("--queries", type=int, default=64)
  p.add_argument("--gap", type=int, default=4)
  p.add_argument("--out", default="benchmarks/results/ivf_reference_runs.json")
  p.add_argument("--quick", action="store_true", help="two layers, 8 queries")
  a = p.parse_args(argv)
  tr = load_prefill_trace(p, a.trace)
  n = tr.k.shape[1]
  if not 0 < a.topk <= n // 4:
    p.error(f"--topk={a.topk} must lie in [1, {n // 4}] for a {n}-token trace")
  layers = range(2 if a.quick else tr.q.shape[0])
  pos = np.linspace(n // 4, n - 1, 8 if a.quick else a.queries).astype(np.int64)
  rows = []
  for i in layers:
    rows.append({"layer": int(tr.layers[i]), **layer_stats(tr.q[i], tr.w[i], tr.k[i], pos,
                                                           a.topk, a.gap)})
    print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                   for k, v in rows[-1].items()))
  write_json(a.out, {"environment": environment(), "trace": os.path.basename(a.trace),
                     "meta": tr.meta, "topk": a.topk, "gap": a.gap,
                     "query_positions": pos.tolist(), "rows": rows})
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

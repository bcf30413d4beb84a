"""How much consecutive queries share the groups they take (AttentionIndex, real prefill trace).

For blocks of B consecutive queries of one version, the members a block would score if it
scored the union of its queries' taken groups (each group up to the most members any query in
the block takes), as a multiple of what one query of the block scores on average. A kernel
that scores a whole block as one matrix product reads a block's keys once, at this multiple of
one query's FLOPs. Versions before the first refit are skipped (their prefix is short).

  python benchmarks/ivf_block_union.py --trace prefill_8k.npz --out benchmarks/results/ivf_block_union.json
"""
from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_ivf_recall import add_index_options, load_prefill_trace  # noqa: E402
from jaxsparse import ivf  # noqa: E402
from jaxsparse._bench.timing import environment, write_json  # noqa: E402
from jaxsparse.ivf import candidates, index, prefill  # noqa: E402


def block_unions(q, w, k, cfg, blocks, *, every: int = 1):
  """{B: [union / mean own take] per block} over the versions of one trace layer (every
  `every`-th version after the first refit)."""
  q, w, k = jnp.asarray(q), jnp.asarray(w), jnp.asarray(k)
  n, wnd = k.shape[0], cfg.seal_window
  state = index.init_state(n, k.shape[1], cfg)
  out = {b: [] for b in blocks}
  for v in range(1, n // wnd + 1):
    p = v * wnd
    state = index.seal(state, k, p, config=cfg)
    if cfg.refit_interval and p % cfg.refit_interval == 0:
      state = index.refit(state, k, p, config=cfg)
    lo, hi = p - 1, min(p - 1 + wnd, n)
    if hi - lo < max(blocks) or p < (cfg.refit_interval or wnd) or v % every:
      continue
    pos = jnp.arange(lo, hi, dtype=jnp.int32)
    gend = jnp.full((hi - lo,), state["grouped_end"], jnp.int32)
    gs = prefill._group_scores(q[lo:hi], w[lo:hi], index.representatives(state, k),
                               state["sizes"], state["last"], gend)
    room = cfg.budget - (candidates.fixed_slots(pos, gend, sink=cfg.sink, window=wnd) >= 0).sum(1)
    order = np.asarray(jnp.argsort(-gs, axis=1, stable=True))
    take = np.asarray(candidates.ranked_groups(gs, state["sizes"],
                                               jnp.zeros_like(state["sizes"]), room)[1])
    per_group = np.zeros_like(take)  # [Q, G] members each query takes of each group
    np.put_along_axis(per_group, order, take, axis=1)
    for b in blocks:
      for b0 in range(0, (hi - lo) // b * b, b):
        blk = per_group[b0:b0 + b]
        out[b].append(float(blk.max(0).sum() / max(blk.sum(1).mean(), 1)))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--trace", required=True, help="prefill trace .npz")
  p.add_argument("--out", default="benchmarks/results/ivf_block_union.json")
  p.add_argument("--budgets", default="512,1024")
  p.add_argument("--blocks", default="8,16,32,64")
  p.add_argument("--layer-step", type=int, default=3, help="every n-th stored layer")
  add_index_options(p)
  p.add_argument("--quick", action="store_true", help="one layer, one budget, blocks 8 and 16")
  a = p.parse_args(argv)
  tr = load_prefill_trace(p, a.trace)
  budgets = [int(v) for v in a.budgets.split(",")]
  blocks = [int(v) for v in a.blocks.split(",")]
  layers = list(range(0, tr.q.shape[0], a.layer_step))
  if a.quick:
    budgets, blocks, layers = budgets[:1], [8, 16], layers[:1]
  rows = []
  for b in budgets:
    cfg = ivf.IVFConfig(topk=a.topk, budget=b, seal_window=a.seal_window,
                        cluster_size=a.cluster_size, refit_interval=a.refit_interval, sink=a.sink)
    acc = {x: [] for x in blocks}
    for li in layers:
      for x, v in block_unions(tr.q[li], tr.w[li], tr.k[li], cfg, blocks).items():
        acc[x] += v
    for x in blocks:
      v = np.asarray(acc[x])
      rows.append(dict(budget=b, block=x, blocks_measured=len(v), mean=float(v.mean()),
                       p90=float(np.percentile(v, 90))))
      print(f"budget {b}, block {x}: union {v.mean():.2f}x one query's (p90 "
            f"{np.percentile(v, 90):.2f}), {len(v)} blocks", flush=True)
  write_json(a.out, dict(environment=environment(), trace=os.path.basename(a.trace),
                         meta=tr.meta, layers=[int(tr.layers[i]) for i in layers], rows=rows))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

"""SPIN studies on the real SmolLM2 traces (CPU is enough): writes JSON and plots.

  python benchmarks/spin_studies.py [--indexers FILE.npz] [--quick]

1. The paper's Table 1: random, prev-layer, prev-layer best-of-5, prev-iter and prev-iter
   offset 1 as predictors of the current indexer scores (Pearson r and top-K recall), per
   layer and averaged, on a 64-step decode trace of all 30 layers at 3.6-3.7K slots recorded
   on the fly (held-out text, the shipped long-context indexers unless --indexers).
2. Mean and p99 miss against target sparsity 10-50%, with and without exploration, for A0,
   A1 (max, top-4, mean pooling) and A2 (max) on the shipped 4K-slot decode trace, averaged
   and per layer.
3. MTP policy ablation (mask union / row-0 x update prefix / row-0) on the shipped R=4 trace.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import spin, traces
from jaxsparse._bench.timing import environment, write_json
from jaxsparse.indexer import indexer_scores_xla

SPARSITIES = (0.1, 0.2, 0.3, 0.4, 0.5)
VARIANTS = (("A0", "max"), ("A1", "max"), ("A1", "top4"), ("A1", "mean"), ("A2", "max"))


def full_scores(tr, layer, row=0):
  q, k, w = tr.layer(layer)
  lens = tr.lengths - tr.rows + 1 + row
  f = jax.jit(jax.vmap(lambda qq, ww, ll: indexer_scores_xla(qq[None], jnp.asarray(k), ww[None],
                                                             None, ll[None] - 1)[0]))
  return np.asarray(f(jnp.asarray(q[:, row]), jnp.asarray(w[:, row]), jnp.asarray(lens)))


def table1(tr, k):
  z = np.stack([full_scores(tr, l) for l in range(tr.q.shape[0])])
  per_layer = []
  for l in range(z.shape[0]):
    lo = max(0, l - 5)
    per_layer.append(spin.predictor_study(z[lo:l + 1], tr.lengths, k))
  avg = spin.predictor_study(z, tr.lengths, k)
  return {"layers": tr.layers.tolist(), "average": avg,
          "per_layer": [{n: v for n, v in p.items()} for p in per_layer]}


def sweep(tr, k, block):
  out = []
  scores = [full_scores(tr, l) for l in range(tr.q.shape[0])]
  for red, pool in VARIANTS:
    for explore in ("none", "random"):
      for rho in SPARSITIES:
        cfg = spin.SpinConfig(block_size=block, topk=k, sparsity=rho, reduction=red, pooling=pool,
                              explore=explore, explore_fraction=0.05 if explore != "none" else 0)
        miss, spars = [], []
        for l in range(tr.q.shape[0]):
          q, kk, w = tr.layer(l)
          r = spin.replay(q[:, 0], kk, w[:, 0], tr.lengths, cfg, scores=scores[l])
          miss.append(r["miss_rate"][1:, 0])
          spars.append(r["realized_sparsity"][1:])
        m = np.concatenate(miss)
        out.append(dict(reduction=red, pooling=pool, explore=explore, target=rho,
                        realized=float(np.concatenate(spars).mean()), mean_miss=float(m.mean()),
                        p99_miss=float(np.percentile(m, 99)),
                        per_layer=[dict(layer=int(tr.layers[l]), mean_miss=float(x.mean()),
                                        p99_miss=float(np.percentile(x, 99)))
                                   for l, x in enumerate(miss)]))
  return out


def _head(tr, steps, layers):
  """The first `steps` steps of the first `layers` layers of a decode trace (quick mode)."""
  import dataclasses
  return dataclasses.replace(tr, q=tr.q[:layers, :steps], w=tr.w[:layers, :steps],
                             k=tr.k[:layers], lengths=tr.lengths[:steps],
                             accepted=tr.accepted[:steps], layers=tr.layers[:layers])


def mtp(tr, k, block):
  out = []
  for mp in ("union", "row0"):
    for up in ("prefix", "row0"):
      for rho in SPARSITIES:
        cfg = spin.SpinConfig(block_size=block, topk=k, sparsity=rho, mask_policy=mp,
                              update_policy=up)
        miss, spars = [], []
        for l in range(tr.q.shape[0]):
          q, kk, w = tr.layer(l)
          r = spin.replay(q, kk, w, tr.lengths, cfg, accepted=tr.accepted)
          # misses count on the rows that were accepted (rows past acceptance are discarded)
          valid = np.arange(tr.rows)[None, :] <= tr.accepted[:, None]
          miss.append(r["miss_rate"][1:][valid[1:]])
          spars.append(r["realized_sparsity"][1:])
        m = np.concatenate(miss)
        out.append(dict(mask=mp, update=up, target=rho,
                        realized=float(np.concatenate(spars).mean()),
                        mean_miss=float(m.mean()), p99_miss=float(np.percentile(m, 99))))
  return out


def plots(res, path_prefix):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for red, pool in VARIANTS:
    for explore, ls in (("none", "--"), ("random", "-")):
      rows = [r for r in res["sweep"] if r["reduction"] == red and r["pooling"] == pool
              and r["explore"] == explore]
      x = [r["realized"] for r in rows]
      axes[0].plot(x, [r["mean_miss"] for r in rows], ls, marker="o", ms=3,
                   label=f"{red}-{pool}, explore={explore}")
      axes[1].plot(x, [r["p99_miss"] for r in rows], ls, marker="o", ms=3)
  for ax, t in zip(axes, ("mean miss", "p99 miss")):
    ax.set_xlabel("realized block sparsity")
    ax.set_ylabel(t)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=6)
  fig.suptitle("SPIN on SmolLM2-135M decode trace (7 layers, 256 steps, K=64, b=16)")
  fig.tight_layout()
  fig.savefig(path_prefix + "_sparsity.png", dpi=120)
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for mp in ("union", "row0"):
    for up in ("prefix", "row0"):
      rows = [r for r in res["mtp"] if r["mask"] == mp and r["update"] == up]
      ax.plot([r["realized"] for r in rows], [r["p99_miss"] for r in rows], marker="o", ms=3,
              label=f"mask={mp}, update={up}")
  ax.set_xlabel("realized block sparsity")
  ax.set_ylabel("p99 miss (accepted rows)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  ax.set_title("MTP policy ablation (R=4, self-speculation)")
  fig.tight_layout()
  fig.savefig(path_prefix + "_mtp.png", dpi=120)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--indexers", default="", help="indexers.npz (default: the shipped ones)")
  p.add_argument("--k", type=int, default=256)
  p.add_argument("--block-size", type=int, default=64)
  p.add_argument("--out", default="benchmarks/results/spin_studies")
  p.add_argument("--quick", action="store_true", help="a few steps and layers (a smoke test)")
  a = p.parse_args(argv)
  global SPARSITIES
  dec = traces.load(traces.default_trace_path())
  mtp_tr = traces.load(os.path.join(os.path.dirname(traces.default_trace_path()),
                                    "smollm2_mtp.npz"))
  from jaxsparse.model import lightning, llama, make_assets, record
  idx = lightning.load_indexers(a.indexers or None)
  ids = make_assets.held_out_ids()[-(make_assets.PROMPT + 64):]
  if a.quick:
    SPARSITIES = (0.4,)
    dec = _head(dec, 16, 2)
    mtp_tr = _head(mtp_tr, 8, 1)
    t1_trace = _head(dec, 8, 2)
  else:
    t1_trace = record.record_decode(llama.load_model(), idx, ids, prompt_len=make_assets.PROMPT,
                                    steps=64, source="held-out python docs")
  res = {"environment": environment(), "k": a.k, "block_size": a.block_size,
         "table1": table1(t1_trace, a.k), "sweep": sweep(dec, a.k, a.block_size),
         "mtp": mtp(mtp_tr, a.k, a.block_size)}
  write_json(a.out + ".json", res)
  plots(res, a.out)
  avg = res["table1"]["average"]
  print("Table 1 (mean Pearson r, top-K recall):")
  for name, (r, rec) in avg.items():
    print(f"  {name:24s} r={r:.3f} recall={rec:.3f}")
  print(f"wrote {a.out}.json and plots")


if __name__ == "__main__":
  main()

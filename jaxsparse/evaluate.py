"""Replay decode traces through full DSA and the selection methods; recall, miss, sparsity, speed."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import indexer as _indexer
from jaxsparse import selection
from jaxsparse.traces import DecodeTrace


__all__ = [
    "full_topk", "decode_baselines"
]


def full_topk(q, k, w, lengths, topk: int, implementation=None):
  """Exact DSA selection of every step of one layer, as one batched paged call.

  q [S, H, D], k [N, D], w [S, H], lengths [S] (the query sits at slot lengths - 1)
  -> (indices [S, topk] int32 (-1 tail), scores [S, N] float32, seconds per step).
  """
  from jaxsparse import _checks
  _checks.check_kw_order(np.asarray(q), np.asarray(k), np.asarray(w))
  s, _, d = q.shape
  kc, table = _indexer.pack_dense_as_paged(jnp.asarray(k, jnp.bfloat16))
  table = jnp.broadcast_to(table, (s, table.shape[1]))
  qj = jnp.asarray(q, jnp.bfloat16)
  wj = jnp.asarray(w, jnp.float32)
  lens = jnp.asarray(lengths, jnp.int32)
  f = jax.jit(lambda q, kc, t, l, w: selection.indexer_topk(
      q, kc, t, l, w, topk, implementation=implementation))
  jax.block_until_ready(f(qj, kc, table, lens, wj))
  t0 = time.perf_counter()
  _, idx = jax.block_until_ready(f(qj, kc, table, lens, wj))
  sec = (time.perf_counter() - t0) / s
  z = _indexer.paged_indexer_scores(qj, kc, table, lens, wj, implementation="xla")
  return np.asarray(idx), np.asarray(z)[:, : k.shape[0]], sec


def _recall(pred_sets, truth):
  """pred_sets: list of index arrays per step; truth [S, K] (-1 tail) -> recall per step."""
  out = np.zeros(len(truth))
  for s, (p, t) in enumerate(zip(pred_sets, truth)):
    t = t[t >= 0]
    out[s] = np.isin(t, p).mean() if len(t) else 1.0
  return out


def _spin_skipped(block_masks, lengths, block_size):
  """Share of each step's visible slots outside SPIN's scored blocks. -> [S]."""
  nb = block_masks.shape[1]
  starts = np.arange(nb) * block_size
  per_block = np.clip(lengths[:, None] - starts[None, :], 0, block_size)  # visible per block
  scored = (per_block * block_masks).sum(1)
  return 1 - scored / lengths


def decode_baselines(trace: DecodeTrace, topk: int, implementation=None,
                     spin_configs=()) -> dict:
  """Replay row 0 of every step of every layer through exact DSA and the cheaper methods.

  Methods: full DSA (exact: every visible key scored), a recent window of topk slots, the
  previous step's top-K reused, and SPIN for each (name, SpinConfig) in spin_configs.
  Returns {"rows": [{method, recall, mean_miss, p99_miss, skipped}], "us_per_step": exact
  DSA's host time per step and layer, "device": platform, "miss_by_step": {method: [S] mean
  miss over layers}}. skipped: share of visible slots not scored.
  """
  recs = {"full DSA": [], "recent window": [], "prev-iter top-K": []}
  skip = {"full DSA": [], "recent window": [], "prev-iter top-K": []}
  secs = []
  lens = trace.lengths - trace.rows + 1  # row 0's visible slots
  for li in range(trace.q.shape[0]):
    q, k, w = trace.layer(li)
    idx, _, sec = full_topk(q[:, 0], k, w[:, 0], lens, topk, implementation)
    secs.append(sec)
    recs["full DSA"].append(np.ones(len(idx)))
    skip["full DSA"].append(np.zeros(len(idx)))
    recent = [np.arange(max(0, n - topk), n) for n in lens]
    recs["recent window"].append(_recall(recent, idx)[1:])
    skip["recent window"].append((1 - np.minimum(topk, lens) / lens)[1:])
    prev = [idx[0]] + [idx[s - 1] for s in range(1, len(idx))]
    recs["prev-iter top-K"].append(_recall(prev, idx)[1:])
    skip["prev-iter top-K"].append((1 - np.minimum(topk, lens) / lens)[1:])
  recs["full DSA"] = [r[1:] for r in recs["full DSA"]]
  skip["full DSA"] = [r[1:] for r in skip["full DSA"]]
  from jaxsparse import spin
  for name, cfg in spin_configs:
    recs[name], skip[name] = [], []
    for li in range(trace.q.shape[0]):
      q, k, w = trace.layer(li)
      r = spin.replay(q[:, 0], k, w[:, 0], lens, cfg)
      recs[name].append(1 - r["miss_rate"][1:, 0])
      skip[name].append(_spin_skipped(r["block_masks"], lens, cfg.block_size)[1:])
  rows, by_step = [], {}
  for name in recs:
    r = np.concatenate(recs[name])
    miss = 1 - r
    by_step[name] = (1 - np.mean(recs[name], axis=0)).tolist()
    rows.append(dict(method=name, recall=float(r.mean()), mean_miss=float(miss.mean()),
                     p99_miss=float(np.percentile(miss, 99)),
                     skipped=float(np.concatenate(skip[name]).mean())))
  return {"rows": rows, "us_per_step": float(np.mean(secs) * 1e6),
          "device": jax.default_backend(), "miss_by_step": by_step}

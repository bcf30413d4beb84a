"""Trace replay (the evaluation API) and the predictor study (the paper's Table 1)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse.spin.algorithm import (init_state, realized_sparsity, select_rows, slot_mask,
                                      update_rows)
from jaxsparse.spin.config import NEG_INF, SpinConfig

__all__ = [
    "replay", "predictor_study"
]


def _full_topk_sets(z, lengths_rows, k):
  """Ground-truth top-K slot masks per step and row from full scores z [S, R, N]."""
  from jaxsparse.selection import topk
  s, r, n = z.shape
  lens = lengths_rows.reshape(s * r).astype(jnp.int32)
  _, idx = topk(z.reshape(s * r, n), k, lengths=lens)
  rows = jnp.broadcast_to(jnp.arange(s * r)[:, None], idx.shape)
  hit = jnp.zeros((s * r, n), bool).at[rows, jnp.where(idx >= 0, idx, n)].set(True, mode="drop")
  return hit.reshape(s, r, n)


def replay(q, k, w, lengths, config: SpinConfig, *, seed: int = 0, accepted=None,
           scores=None):
  """Replay a decode trace through SPIN (the evaluation API).

  Args:
    q: [S, H, D] (or [S, R, H, D] verifier rows) float queries; k: [N, D] keys by slot;
    w: [S, H] (or [S, R, H]) float head weights; lengths: [S] non-decreasing; at step s keys 0..lengths[s]-1 are
      visible and the (last row's) query sits at slot lengths[s] - 1; row r of R sits at slot
      lengths[s] - R + r.
    config: SpinConfig; seed: exploration RNG seed.
    accepted: [S] int drafts accepted per step (multi-row traces; default all).
    scores: optional precomputed full scores [S, (R,) N] (else computed with the reference).

  Returns a dict of numpy arrays: block_masks [S, num_blocks] bool (the shared mask),
  miss_rate [S, R] (fraction of the full top-K outside the scored slots), counted [S, R] bool
  (the full top-K is not empty), realized_sparsity [S], row_masks [S, R, num_blocks], and
  mean_miss, p99_miss, mean_sparsity (floats, over steps after the first, which scores
  everything by design) with n_counted (int, the (step, row) entries mean_miss and p99_miss
  average). A step whose full top-K is empty (an all-NaN query, every score -inf) has nothing
  to miss: its miss_rate is 0 and it is not counted; with none counted both are 0.

  q, k, w (and scores) must be real: complex arrays raise ValueError naming the argument.
  """
  from jaxsparse import _checks
  for name, x in (("q", q), ("k", k), ("w", w)) + ((("scores", scores),) if scores is not None
                                                   else ()):
    _checks.check_real_dtype(name, x)
  q, w = jnp.asarray(q), jnp.asarray(w)
  _checks.check_kw_order(q, jnp.asarray(k), w)
  if q.ndim == 3:
    q, w = q[:, None], w[:, None]
  if q.ndim != 4 or w.shape != q.shape[:3]:
    raise ValueError(f"q.shape={tuple(q.shape)} / w.shape={tuple(w.shape)} must be "
                     "[S, H, D] / [S, H] or [S, R, H, D] / [S, R, H]")
  lengths = np.asarray(lengths)
  s, r = q.shape[:2]
  if lengths.shape != (s,):
    raise ValueError(f"lengths.shape={lengths.shape} must be ({s},)")
  if (np.diff(lengths) < 0).any():
    raise ValueError("lengths must be non-decreasing")
  if lengths.min() < r or lengths.max() > k.shape[0]:
    raise ValueError(f"lengths must lie in [{r}, {k.shape[0]}] (R={r}, N={k.shape[0]})")
  b = config.block_size
  cap = -(-k.shape[0] // b) * b
  lrows = jnp.asarray(lengths[:, None] - (r - 1) + np.arange(r)[None, :], jnp.int32)  # [S, R]
  if scores is None:
    from jaxsparse.indexer import indexer_scores_xla
    kf = jnp.asarray(k, jnp.float32)
    scores = jax.vmap(lambda qq, ww, ll: indexer_scores_xla(
        qq.astype(jnp.float32), kf, ww.astype(jnp.float32), None, ll - 1))(q, w, lrows)
  z = jnp.asarray(scores, jnp.float32).reshape(s, r, -1)
  z = jnp.pad(z, ((0, 0), (0, 0), (0, cap - z.shape[-1])), constant_values=NEG_INF)
  acc = jnp.full((s,), r - 1, jnp.int32) if accepted is None else jnp.asarray(accepted, jnp.int32)
  prio = None
  if config.explore == "query":  # each row's query on the block mean keys
    from jaxsparse.spin.algorithm import query_priorities
    kp = jnp.pad(jnp.asarray(k, jnp.float32), ((0, cap - k.shape[0]), (0, 0)))
    km = kp.reshape(cap // b, b, -1).mean(1)
    prio = jax.vmap(jax.vmap(lambda qq, ww: query_priorities(qq, ww, km)))(q, w)
  out = _replay_scan(z, lrows, acc, config, seed, prio)
  masks, rows, miss, counted, spars = [np.asarray(x) for x in out]
  tail = slice(1, None) if s > 1 else slice(None)
  tail_miss = miss[tail][counted[tail]]
  return {"block_masks": masks, "row_masks": rows, "miss_rate": miss, "counted": counted,
          "realized_sparsity": spars,
          "mean_miss": float(tail_miss.mean()) if tail_miss.size else 0.0,
          "p99_miss": float(np.percentile(tail_miss, 99)) if tail_miss.size else 0.0,
          "n_counted": int(tail_miss.size),
          "mean_sparsity": float(spars[1:].mean() if s > 1 else spars.mean())}


def _replay_scan_impl(z, lrows, acc, config, seed, prio=None):
  s, r, cap = z.shape
  truth = _full_topk_sets(z, lrows, config.topk)
  state = init_state(cap, config)
  prio = jnp.zeros((s, r, 0)) if prio is None else prio

  def step(carry, xs):
    st, key = carry
    zs, ls, a, tr, pr = xs
    key, sub = jax.random.split(key)
    mask, rows = select_rows(st, ls, config, sub, pr if config.explore == "query" else None)
    slots = slot_mask(mask, config.block_size)
    observed = jnp.where(slots[None, :], zs, NEG_INF)
    st = update_rows(st, observed, mask, ls, a, config)
    kept = (tr & slots[None, :]).sum(-1)
    total = tr.sum(-1)
    miss = jnp.where(total > 0, 1.0 - kept / jnp.maximum(total, 1), 0.0)  # empty: nothing missed
    return (st, key), (mask, rows, miss, total > 0,
                       realized_sparsity(mask, ls[-1], config.block_size))

  _, out = jax.lax.scan(step, (state, jax.random.PRNGKey(seed)), (z, lrows, acc, truth, prio))
  return out


_replay_scan = jax.jit(_replay_scan_impl, static_argnums=(3, 4))


def predictor_study(z_layers, lengths, k: int, *, offset_shift: int = 1, best_of: int = 5):
  """The paper's Table 1 on a trace: how well simple signals predict the current scores.

  z_layers: [L, S, N] full scores per layer (row 0), lengths [S]. Predictors of step s, layer l:
  random; prev-layer (layer l-1, same step); prev-layer best-of-5 (best of layers l-1..l-5,
  an oracle); prev-iter (same layer, step s-1); prev-iter offset 1 (step s-1 shifted by one
  slot, the diagonal). Returns {name: (mean Pearson r, mean top-k recall)} over the steps and
  layers where the predictor exists.
  """
  z = np.asarray(z_layers, np.float64)
  nl, s, n = z.shape
  rng = np.random.default_rng(0)
  res = {name: ([], []) for name in ("random", "prev-layer", "prev-layer best-of-5",
                                     "prev-iter", "prev-iter offset 1")}

  def score(pred, cur, length):
    a, b = pred[:length], cur[:length]
    ok = np.isfinite(a) & np.isfinite(b)
    r = np.corrcoef(a[ok], b[ok])[0, 1] if ok.sum() > 2 and a[ok].std() > 0 else 0.0
    kk = min(k, length)
    top_pred = np.argsort(-np.where(np.isfinite(a), a, -np.inf), kind="stable")[:kk]
    top_cur = np.argsort(-np.where(np.isfinite(b), b, -np.inf), kind="stable")[:kk]
    return r, np.isin(top_cur, top_pred).mean()

  for l in range(nl):
    for t in range(1, s):
      n_t = int(lengths[t])
      cur = z[l, t]
      res["random"][0].append(0.0)
      res["random"][1].append(score(rng.standard_normal(n), cur, n_t)[1])
      prev = z[l, t - 1].copy()
      prev[int(lengths[t - 1]):] = np.nan
      prev = np.where(np.isnan(prev), np.nanmin(prev[:int(lengths[t - 1])]), prev)
      for name, pred in (("prev-iter", prev),
                         ("prev-iter offset 1", np.concatenate([np.full(offset_shift, prev.min()),
                                                                prev[:-offset_shift]]))):
        rr, rc = score(pred, cur, n_t)
        res[name][0].append(rr)
        res[name][1].append(rc)
      if l >= 1:
        rr, rc = score(z[l - 1, t], cur, n_t)
        res["prev-layer"][0].append(rr)
        res["prev-layer"][1].append(rc)
        cands = [score(z[j, t], cur, n_t) for j in range(max(0, l - best_of), l)]
        best = max(cands, key=lambda x: x[1])
        res["prev-layer best-of-5"][0].append(best[0])
        res["prev-layer best-of-5"][1].append(best[1])
  return {name: (float(np.mean(v[0])) if v[0] else math.nan,
                 float(np.mean(v[1])) if v[1] else math.nan) for name, v in res.items()}

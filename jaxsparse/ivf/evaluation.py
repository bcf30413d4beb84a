"""Offline evaluation of AttentionIndex, HiSA and full DSA on a prefill trace (recall)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _checks
from jaxsparse.ivf import candidates, index
from jaxsparse.ivf._shared import block_means, hisa_structure
from jaxsparse.ivf.prefill import exact_scores, map_queries, prefill_inputs
from jaxsparse.selection import topk_xla

__all__ = ["evaluate", "METHODS"]

METHODS = ("ivf", "hisa", "full")


def _check(q, k, w, config, method, positions):
  for _name, _x in (("q", q), ("k", k), ("w", w)):
    _checks.check_real_dtype(_name, _x)
  if not np.issubdtype(np.asarray(positions).dtype, np.integer):
    raise ValueError(f"query_positions.dtype={np.asarray(positions).dtype} must be an integer "
                     "type")
  if method not in METHODS:
    raise ValueError(f"method={method!r} must be one of {METHODS}")
  _checks.check_kw_order(q, k, w)
  if q.ndim != 3 or w.shape != q.shape[:2] or k.ndim != 2 or k.shape != (q.shape[0], q.shape[2]):
    raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)} must be "
                     f"[N, H, D], [N, D], [N, H]")
  n = k.shape[0]
  if positions.ndim != 1 or positions.size == 0:
    raise ValueError(f"query_positions must be a non-empty [Q] array; got {positions.shape}")
  if positions.min() < 0 or positions.max() >= n:
    raise ValueError(f"query_positions must lie in [0, {n - 1}]; got "
                     f"[{positions.min()}, {positions.max()}]")


@functools.partial(jax.jit, static_argnames=("topk", "budget", "sink", "oracle"))
def _select(z, ref, q, w, reps, sizes, last, assign, rank, grouped_end, positions, *, topk,
            budget, sink, oracle):
  valid = (sizes[None, :] > 0) & (last[None, :] < grouped_end[:, None])
  if oracle:  # rank groups by their true share of reference keys (the partition's ceiling)
    g = sizes.shape[0]
    hit = jnp.where(ref >= 0, assign[jnp.maximum(ref, 0)], -1)
    cnt = jax.vmap(lambda h: jax.ops.segment_sum((h >= 0).astype(jnp.float32),
                                                 jnp.where(h >= 0, h, g), g + 1)[:g])(hit)
    gs = jnp.where(valid, cnt / jnp.maximum(sizes, 1)[None, :], -jnp.inf)
  else:
    gs = candidates.representative_scores(q, w, reps, valid)
  mask, num = candidates.candidate_mask(gs, sizes, assign, rank, grouped_end, positions,
                                        budget=budget, sink=sink)
  return topk_xla(jnp.where(mask, z, -jnp.inf), topk)[1], num


@functools.partial(jax.jit, static_argnames=("topk", "budget", "sink"))
def _select_blocks(z, qb, wb, bvalid, reps, sizes, last, assign, rank, grouped_end, block_last,
                   positions, *, topk, budget, sink):
  """`_select` for queries that share their block's candidates: qb [Q, B, H, D], wb [Q, B, H]
  the queries that rank each query's block (`query_blocks`), bvalid [Q, B] which exist,
  block_last [Q] the block's last position. The block ranks groups by their maximum
  representative score and takes the candidates of its last position; each query keeps those
  at or before its own position."""
  nq, b = bvalid.shape
  valid = (sizes[None, :] > 0) & (last[None, :] < grouped_end[:, None])  # [Q, G]
  gs = candidates.representative_scores(
      qb.reshape(nq * b, *qb.shape[2:]), wb.reshape(nq * b, wb.shape[2]), reps,
      jnp.repeat(valid, b, axis=0)).reshape(nq, b, -1)
  agg = jnp.max(jnp.where(bvalid[:, :, None], gs, -jnp.inf), axis=1)
  mask, _ = candidates.candidate_mask(agg, sizes, assign, rank, grouped_end, block_last,
                                      budget=budget, sink=sink)
  mask &= jnp.arange(z.shape[1])[None, :] <= positions[:, None]
  return topk_xla(jnp.where(mask, z, -jnp.inf), topk)[1], mask.sum(1).astype(jnp.int32)


def query_blocks(positions, n: int, block: int):
  """Each query's block (`block` consecutive positions from first = b * block - 1): (rows
  [Q, B] int: the queries that rank the block's groups, the B ending at its first position,
  so no query's choice depends on a later one; inside [Q, B] bool: rows at or after 0;
  last [Q] int: the block's last position in the sequence)."""
  first = (np.asarray(positions) + 1) // block * block - 1
  rows = first[:, None] - block + 1 + np.arange(block)[None, :]
  return np.clip(rows, 0, n - 1), rows >= 0, np.minimum(first + block - 1, n - 1)


def _recall(sel, ref):
  hit = (sel[:, :, None] == ref[:, None, :]) & (ref[:, None, :] >= 0)
  want = (ref >= 0).sum(1)
  return np.where(want > 0, hit.any(1).sum(1) / np.maximum(want, 1), 1.0)


@_checks.array_args("q", "k", "w", optional=("k_scale", "query_positions"))
def evaluate(q, k, w, config, *, method: str = "ivf", query_positions, oracle: bool = False,
             corrector=None, layer: int | None = None, metric=None, k_scale=None) -> dict:
  """Recall of the causal full top-K by AttentionIndex ("ivf"), HiSA ("hisa") or full DSA.

  q [N, H, D], k [N, D], w [N, H] float (a prefill trace layer: query n sits at position n and
  sees keys 0..n); k_scale [N] float32 or None: each key's scale, required for
  float8_e4m3fn keys (DeepSeek-V3.2's fp8 format, fp8 q with its scale in w), taken as
  `prefill_topk` takes it: the reference and the candidates score
  sum_h w relu(q . k) * k_scale, the index groups the dequantised keys k * k_scale.
  config: IVFConfig (`query_block` > 1: blocks of queries share candidates,
  method "ivf"); query_positions [Q] int. oracle=True ranks the same groups by their true share
  of reference keys, per query (ivf and hisa): whether the partition or the representative
  loses keys. corrector: the learned representative correction added to the
  member means: a path to a file from `jaxsparse train corrector` (with `layer`, the model
  layer this trace layer is), a `corrector.Corrector`, or a callable(state, keys, mean) ->
  correction [G, D]. metric: the grouping metric (`jaxsparse.ivf.metric`, method "ivf"): an
  A [D, D] array or a metric file path (with `layer`); the index groups keys @ A and ranks its
  groups with q @ A^-1, candidates are scored as always.
  Returns {"recall" [Q] float, "topk_indices" [Q, topk] int32 (-1 padded), "num_candidates"
  [Q] int32, "refit_compared" (keys each refit compared with every center, and its prefix)}.
  """
  from jaxsparse.ivf import IVFConfig
  _checks.check_instance("config", config, IVFConfig)
  positions = np.asarray(query_positions)
  q, k, w = jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)
  _check(q, k, w, config, method, positions)
  positions = positions.astype(np.int64)
  if method != "ivf" and metric is not None:
    raise ValueError(f"metric applies to method='ivf' only; got method={method!r}")
  x = prefill_inputs(q, k, w, k_scale=k_scale, metric=metric, layer=layer, corrector=corrector)
  q, k, corrector, kx, a = x.q, x.k, x.corrector, x.index_keys, x.metric
  qx = q if x.qmap is None else map_queries(q, x.qmap)  # the ranking queries
  n = k.shape[0]
  topk = min(config.topk, n)
  pj = jnp.asarray(positions, jnp.int32)
  z, ref = exact_scores(q[pj], k, w[pj], pj, topk, x.k_scale)
  out_idx = np.full((len(positions), topk), -1, np.int32)
  out_num = np.zeros(len(positions), np.int32)
  compared = []
  kw = dict(topk=topk, budget=config.budget, sink=config.sink, oracle=oracle)
  if method == "full":
    out_idx = np.asarray(ref)
    out_num = (positions + 1).astype(np.int32)
  elif method == "hisa":
    assign, rank, sizes, last = hisa_structure(n, config)
    reps = block_means(x.keys, assign, len(sizes))
    gend = config.sink + ((positions + 1 - config.sink) // config.cluster_size) * \
        config.cluster_size
    gend = np.maximum(gend, config.sink)
    idx, num = _select(z, ref, q[pj], w[pj], reps, jnp.asarray(sizes), jnp.asarray(last),
                       jnp.asarray(assign), jnp.asarray(rank), jnp.asarray(gend, jnp.int32), pj,
                       **kw)
    out_idx, out_num = np.asarray(idx), np.asarray(num)
  else:
    wnd = config.seal_window
    version = (positions + 1) // wnd  # seals done when query n runs
    state = index.init_state(n, k.shape[1], config)
    for v in range(int(version.max()) + 1):
      if v >= 1:
        p = v * wnd
        state = index.seal(state, kx, p, config=config)
        if config.refit_interval and p % config.refit_interval == 0:
          state = index.refit(state, kx, p, config=config)
          compared.append({"prefix": p, "compared": int(state["compared"]),
                           "keys": p - config.sink})
      sel = np.nonzero(version == v)[0]
      if not len(sel):
        continue
      if v == 0:  # before the first seal a query scores every key
        out_idx[sel] = np.asarray(ref)[sel]
        out_num[sel] = positions[sel] + 1
        continue
      reps = index.representatives(state, x.keys, corrector, a)
      gend = jnp.full((len(sel),), state["grouped_end"], jnp.int32)
      sj = jnp.asarray(sel)
      if config.query_block > 1 and not oracle:
        rows, inside, blast = query_blocks(positions[sel], n, config.query_block)
        idx, num = _select_blocks(
            z[sj], qx[jnp.asarray(rows)], w[jnp.asarray(rows)], jnp.asarray(inside), reps,
            state["sizes"], state["last"], state["assign"], state["rank"], gend,
            jnp.asarray(blast, jnp.int32), pj[sj], topk=topk, budget=config.budget,
            sink=config.sink)
      else:
        idx, num = _select(z[sj], ref[sj], qx[pj[sj]], w[pj[sj]], reps, state["sizes"],
                           state["last"], state["assign"], state["rank"], gend, pj[sj], **kw)
      out_idx[sel], out_num[sel] = np.asarray(idx), np.asarray(num)
  return {"recall": _recall(out_idx, np.asarray(ref)), "topk_indices": out_idx,
          "num_candidates": out_num, "refit_compared": compared}
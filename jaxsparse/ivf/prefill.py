"""A chunked AttentionIndex prefill: every query's top-K from gathered candidates.

Queries run in version order (the chunk of queries between two seals shares one version);
each gathers its candidates from the inverted lists, so no [T, N] array is formed: memory per
chunk is [chunk, budget + seal_window] indices and scores. The lists come from the stored
ranks (`candidates.lists_by_rank`, one scatter) and the representatives are the stored centers,
so a window does no O(N) work beyond them. On a GPU a kernel walks each query's ranked groups
through the lists (`pallas_kernels.ivf.ranked_scores`); elsewhere `candidates.candidate_indices`
packs the slots and `gathered_scores` scores them. Both fill the same slots.

DeepSeek-V3.2's fp8 format (float8_e4m3fn q and keys, a float32 scale per key in `k_scale`)
splits in two (`prefill_inputs`): the index (k-means, representatives, HiSA's block means)
groups the dequantised keys k * k_scale in float32, and every candidate is scored as
`jaxsparse.indexer_scores(q, k, w, k_scale=)` scores it: q and k upcast exactly (to bfloat16,
which holds every float8_e4m3fn value), the head sum in float32, times the key's scale.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _checks
from jaxsparse.ivf import candidates, index
from jaxsparse.ivf._shared import (block_means, hisa_structure, metric_inputs,
                                   resolve_corrector)
from jaxsparse.selection import keyed_topk_xla, topk_xla
from pallas_kernels._util import flush_zero
from pallas_kernels._util import masked_relu

__all__ = ["prefill_topk", "prefill_inputs", "PrefillInputs", "chunk_topk", "exact_scores",
           "exact_before_first_seal", "map_queries"]


class PrefillInputs(NamedTuple):
  """What each part of an AttentionIndex prefill reads (`prefill_inputs`).

  q [N, H, D], k [N, D]: the queries and keys that score candidates (float8_e4m3fn upcast to
    bfloat16, exactly; other dtypes as given); w [N, H] as given.
  k_scale [N] float32 or None: each key's scale, applied after the head sum.
  keys [N, D]: the keys as the index sees them: k * k_scale in float32 when k_scale is given
    (dequantised), else k. A corrector reads these.
  index_keys [N, D]: the keys the index groups: keys @ A under a grouping metric, else keys.
  qmap [D, D] float32 or None: A^-1, which maps the ranking queries (`map_queries`).
  metric [D, D] float32 or None: the grouping metric A.
  corrector: the resolved representative correction, or None.
  """
  q: jax.Array
  k: jax.Array
  w: jax.Array
  k_scale: jax.Array | None
  keys: jax.Array
  index_keys: jax.Array
  qmap: jax.Array | None
  metric: jax.Array | None
  corrector: object


def prefill_inputs(q, k, w, *, k_scale=None, metric=None, layer=None, corrector=None,
                   host: bool = False) -> PrefillInputs:
  """Check an AttentionIndex prefill's inputs and split them into what scores and what the
  index groups (the one-device and the sharded prefill and the evaluation all start here).

  q [N, H, D], k [N, D], w [N, H] real arrays (query n at position n); k_scale [N] float32 or
  None, required when k is float8_e4m3fn (DeepSeek-V3.2's format: fp8 q needs fp8 k, q's scale
  folded into w); metric, layer, corrector as `prefill_topk`. host=True keeps q, k, w, k_scale
  and the dequantised keys numpy arrays (for a driver that places them on devices itself);
  else jax arrays. ValueError names the argument. Returns a `PrefillInputs`.
  """
  for _name, _x in (("q", q), ("k", k), ("w", w)):
    _checks.check_real_dtype(_name, _x)
  xp = np if host else jnp
  q, k, w = xp.asarray(q), xp.asarray(k), xp.asarray(w)
  _checks.check_kw_order(q, k, w)
  n = k.shape[0]
  if q.ndim != 3 or w.shape != q.shape[:2] or k.shape != (n, q.shape[2]) or q.shape[0] != n:
    raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)} must be "
                     f"[N, H, D], [N, D], [N, H]")
  if n == 0:
    raise ValueError("k is empty: the sequence needs at least one token")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"w.dtype={w.dtype} must be a float type")
  if k_scale is not None:
    _checks.check_real_dtype("k_scale", k_scale)
    k_scale = xp.asarray(k_scale)
  _checks.check_key_scale(k, k_scale, (n,))
  _checks.check_fp8_pairing(q, k, "k")
  keys = k if k_scale is None else k.astype(np.float32) * k_scale[:, None]
  up = lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float8_e4m3fn else x  # noqa: E731
  corrector = resolve_corrector(corrector, layer)
  ki, qmap, a = metric_inputs(q, keys, metric, layer, map_queries=False)
  return PrefillInputs(up(q), up(k), w, k_scale, keys, ki, None if a is None else qmap, a,
                       corrector)


@functools.partial(jax.jit, static_argnames=("topk",))
def exact_scores(q, k, w, positions, topk, k_scale=None):
  """Exact causal indexer scores and their top-k: q [Q, H, D], k [N, D], w [Q, H],
  positions [Q] int, k_scale [N] float32 or None -> (z [Q, N] float32: sum_h w relu(q . k)
  (* k_scale) in float32, -inf after each query's position; indices [Q, topk] int32, ties to
  the lower index, -1 where fewer are visible). The reference the evaluation measures recall
  against, and what queries before the first seal take."""
  s = jnp.einsum("qhd,nd->qhn", q.astype(jnp.float32), k.astype(jnp.float32))
  wf = w.astype(jnp.float32)
  z = jnp.einsum("qhn,qh->qn", masked_relu(s, wf[..., None]), wf)
  if k_scale is not None:
    z = z * k_scale[None, :].astype(jnp.float32)
  z = jnp.where(jnp.arange(k.shape[0])[None, :] <= positions[:, None], z, -jnp.inf)
  return z, topk_xla(z, topk)[1]


def _group_scores(q, w, reps, sizes, last, grouped_end, platform=None):
  """[Q, G] representative scores, -inf for groups a query may not use."""
  valid = (sizes[None, :] > 0) & (last[None, :] < grouped_end[:, None])
  if platform is None:
    return candidates.representative_scores(q, w, reps, valid)
  from pallas_kernels import ivf as kivf
  return kivf.representative_scores(q, w, reps, valid, platform=platform)


def _scaled(z, idx, k_scale):
  """Scores z [..., S] of keys idx [..., S] (-1: empty) times each key's scale, after the head
  sum as `indexer_scores` applies it (-inf where empty); z itself without scales."""
  if k_scale is None:
    return z
  return jnp.where(idx >= 0, z * k_scale[jnp.maximum(idx, 0)], -jnp.inf)


def _candidate_scores(q, w, k, idx, platform=None, k_scale=None):
  """[Q, S] indexer scores of the candidates idx [Q, S] (-1: empty slot, scored -inf), times
  k_scale [N] of each candidate when given."""
  if platform is None:
    kc = k[jnp.maximum(idx, 0)].astype(jnp.float32)  # [Q, S, D]
    s = jnp.einsum("qhd,qsd->qhs", q.astype(jnp.float32), kc)
    wf = w.astype(jnp.float32)
    z = jnp.einsum("qhs,qh->qs", masked_relu(s, wf[..., None]), wf)
    return _scaled(jnp.where(idx >= 0, z, -jnp.inf), idx, k_scale)
  from pallas_kernels import ivf as kivf  # keys gathered inside the kernel: no [Q, S, D]
  return _scaled(kivf.gathered_scores(q, w, k, idx, platform=platform), idx, k_scale)


def _select(z, idx, topk, platform=None, block=1):
  """The top-K candidates' key indices [Q, topk] of scores z [Q, S]; idx [Q / block, S]: the
  key index of each column (-1: empty), shared by `block` rows. The README's input rules:
  values descending, ties to the lower key index (not the lower column), NaN and -inf never
  chosen, -1 where fewer are left."""
  nb = idx.shape[0]
  ids = jnp.repeat(idx, z.shape[0] // nb, axis=0) if nb != z.shape[0] else idx
  if platform is None:
    return keyed_topk_xla(z, ids, topk)[1]
  # the top-K kernels rank by column; their result is the rule's unless a tie crosses the
  # K-th entry or sits inside the top-K (then the columns' order may not be the keys'): only
  # then, for the whole batch, the exact two-key sort
  from pallas_kernels import topk as ktopk
  v, j = ktopk.topk_rows(z, None, topk, ktopk.TopkConfig(), platform)
  picked = jnp.where(j >= 0, jnp.take_along_axis(ids, jnp.maximum(j, 0), 1), -1)
  zf = flush_zero(z.astype(jnp.float32))
  live = (ids >= 0) & (zf > -jnp.inf)
  tau = v[:, -1:]
  at_tau = jnp.sum(live & (zf == tau), 1) > jnp.sum(v == tau, 1)
  inner = jnp.any((v[:, 1:] == v[:, :-1]) & (v[:, 1:] > -jnp.inf), 1)
  tied = jnp.any((at_tau & (tau[:, 0] > -jnp.inf)) | inner)
  return jax.lax.cond(tied, lambda: keyed_topk_xla(z, ids, topk)[1],
                      lambda: jnp.where(v > -jnp.inf, picked, -1))


def _walks(platform) -> bool:
  """Whether the GPU kernel walks the ranked groups itself (else the slots are packed)."""
  return platform is not None and platform.kind == "gpu"


def _pack(gs, sizes, members, offsets, grouped_end, positions, *, budget, sink, window,
          platform=None):
  """What the scoring reads: on a GPU the fixed slots [Q, sink + window] and the ranked groups
  (`candidates.ranked_groups`); elsewhere every slot's key index [Q, budget + window]."""
  if not _walks(platform):
    return candidates.candidate_indices(gs, sizes, members, offsets, grouped_end, positions,
                                        budget=budget, sink=sink, window=window)[0]
  fixed = candidates.fixed_slots(positions, grouped_end, sink=sink, window=window)
  return fixed, candidates.ranked_groups(gs, sizes, offsets, budget - (fixed >= 0).sum(1))


def _score_packed(q, w, k, members, packed, *, budget, sink, platform=None, k_scale=None):
  """(scores [Q, S] float32, key indices [Q, S] int32) of `_pack`'s candidates (times their
  k_scale when given)."""
  if not _walks(platform):
    return _candidate_scores(q, w, k, packed, platform, k_scale), packed
  from pallas_kernels import ivf as kivf
  fixed, (start, take, slot, used) = packed
  zg, ig = kivf.ranked_scores(q, w, k, members, start, take, slot, used, slots=budget - sink,
                              platform=platform)
  return (jnp.concatenate([_candidate_scores(q, w, k, fixed, platform, k_scale),
                           _scaled(zg, ig, k_scale)], axis=1),
          jnp.concatenate([fixed, ig], axis=1))


def _block_scores(qb, wb, kc, platform=None, sc=None):
  """[nb, B, S] scores of each block's queries qb [nb, B, H, D] (weights wb [nb, B, H]) against
  its gathered candidates kc [nb, S, D] (their scales sc [nb, S] float32, applied after the
  head sum, or None), every key visible: one dense product per block (the prefill scoring
  kernel on a GPU/TPU, no causal mask; it takes the scales itself)."""
  if platform is None:
    s = jnp.einsum("nbhd,nsd->nbhs", qb.astype(jnp.float32), kc.astype(jnp.float32))
    wf = wb.astype(jnp.float32)
    z = jnp.einsum("nbhs,nbh->nbs", masked_relu(s, wf[..., None]), wf)
    return z if sc is None else z * sc[:, None, :]
  from pallas_kernels import indexer_prefill
  cfg = (indexer_prefill.TPU_DEFAULT if platform.kind == "tpu"
         else indexer_prefill.PrefillConfig())
  return jax.lax.map(lambda a: indexer_prefill.prefill_scores(
      a[0], a[2], a[1], k_scale=a[3], config=cfg, platform=platform), (qb, wb, kc, sc))


def _shared_candidates(gs, sizes, members, offsets, grouped_end, positions, *, budget, sink,
                       window, block):
  """The candidate sets of `_shared_topk`'s blocks: (idx [nb, S] key ids, -1 where empty;
  pos [nb, block] each block's query positions, the last block padded by repeating its last).
  gs, grouped_end and positions hold block - 1 rows before the chunk's first query."""
  t = gs.shape[0] - (block - 1)
  nb = -(-t // block)  # nb * block <= t + block - 1 rows of gs
  agg = jnp.max(gs[:nb * block].reshape(nb, block, -1), axis=1)
  pos = jnp.pad(positions[block - 1:], (0, nb * block - t), mode="edge").reshape(nb, block)
  idx, _ = candidates.candidate_indices(agg, sizes, members, offsets,
                                        grouped_end[block - 1:][::block], pos[:, -1],
                                        budget=budget, sink=sink, window=window)
  return idx, pos


def _shared_scores(q, w, k, idx, pos, *, block, platform=None, k_scale=None):
  """Each block's queries against its candidates, densely: (z [nb * block, S] float32, -inf
  where a candidate is empty or after the query; seen [nb * block] candidates each query may
  use). q, w hold block - 1 rows before the chunk's first query, as in `_shared_candidates`;
  k_scale [N]: the keys' scales, or None."""
  q, w = q[block - 1:], w[block - 1:]
  nb = idx.shape[0]
  pad = nb * block - q.shape[0]
  padq = lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
  kc = k[jnp.maximum(idx, 0)]  # [nb, S, D]: one gather per block
  sc = None if k_scale is None else k_scale[jnp.maximum(idx, 0)]  # [nb, S]
  z = _block_scores(padq(q).reshape(nb, block, *q.shape[1:]),
                    padq(w).reshape(nb, block, w.shape[1]), kc, platform, sc)
  seen = (idx[:, None, :] >= 0) & (idx[:, None, :] <= pos[:, :, None])  # [nb, B, S]
  return (jnp.where(seen, z, -jnp.inf).reshape(nb * block, -1),
          seen.sum(2).reshape(-1).astype(jnp.int32))


def _shared_topk(q, w, k, gs, sizes, members, offsets, grouped_end, positions, *, topk, budget,
                 sink, window, block, platform=None, k_scale=None):
  """`chunk_topk` for blocks of `block` queries sharing candidates (IVFConfig.query_block).
  q, w, gs, positions, grouped_end hold block - 1 rows before the chunk's first query (they
  rank the first block's groups), then the chunk's. A block's groups are ranked by the
  maximum score of the `block` queries ending at its first position (so no query's choice
  depends on a later query), its slots are those of its last position, scored densely, then
  each query's keys after it masked."""
  t = q.shape[0] - (block - 1)
  idx, pos = _shared_candidates(gs, sizes, members, offsets, grouped_end, positions,
                                budget=budget, sink=sink, window=window, block=block)
  z, num = _shared_scores(q, w, k, idx, pos, block=block, platform=platform, k_scale=k_scale)
  sel = _select(z, idx, topk, platform, block)
  return sel[:t], num[:t]


def _chunk_topk_impl(q, w, k, reps, sizes, last, members, offsets, grouped_end, positions, *,
                     topk, budget, sink, window, platform=None, block=1, rank_q=None,
                     k_scale=None):
  """`chunk_topk`'s computation (arguments in the index internals' (q, w, k) order)."""
  gs = _group_scores(q if rank_q is None else rank_q, w, reps, sizes, last, grouped_end,
                     platform)
  if block > 1:
    return _shared_topk(q, w, k, gs, sizes, members, offsets, grouped_end, positions,
                        topk=topk, budget=budget, sink=sink, window=window, block=block,
                        platform=platform, k_scale=k_scale)
  packed = _pack(gs, sizes, members, offsets, grouped_end, positions, budget=budget, sink=sink,
                 window=window, platform=platform)
  z, idx = _score_packed(q, w, k, members, packed, budget=budget, sink=sink, platform=platform,
                         k_scale=k_scale)
  return _select(z, idx, topk, platform), (idx >= 0).sum(1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("topk", "budget", "sink", "window", "platform",
                                             "block"))
def chunk_topk(q, k, w, reps, sizes, last, members, offsets, grouped_end, positions, *, topk,
               budget, sink, window, platform=None, block=1, rank_q=None, k_scale=None):
  """One index version's queries (jitted): rank the groups, gather candidates from the
  inverted lists, score them and take the top-K.

  q [Q, H, D], k [N, D] (the scoring inputs of `prefill_inputs`), w [Q, H]; reps [G, D] the
  groups' representatives; sizes, last [G] int32 (members, newest member's position);
  members [N], offsets [G] int32: the inverted lists (`candidates.lists_by_rank` or
  `inverted_lists`); grouped_end [Q], positions [Q] int32. topk, budget, sink, window
  (seal_window): the `IVFConfig` values; block > 1: blocks of that many queries share
  candidates (`IVFConfig.query_block`; q, w, grouped_end and positions then hold block - 1
  rows before the first query). platform: a `KernelPlatform` for the kernels, None for XLA.
  rank_q [Q, H, D]: the queries that rank the groups when they differ from q (a grouping
  metric's q @ A^-1). k_scale [N] float32 or None: each key's scale, applied to its score
  after the head sum. Returns (indices [Q', topk] int32, -1 where fewer; num_candidates [Q']
  int32), Q' the queries after the block - 1 leading rows.
  """
  return _chunk_topk_impl(q, w, k, reps, sizes, last, members, offsets, grouped_end, positions,
                          topk=topk, budget=budget, sink=sink, window=window, platform=platform,
                          block=block, rank_q=rank_q, k_scale=k_scale)


def _maintain(state, k, clusters, p, *, config, refit, platform=None):
  """The version for the queries from p - 1 on: seal the window ending at p (its k-means from
  `index.cluster_windows`), then refit when `refit`; k: the index keys."""
  state = index.seal(state, k, p, config=config, platform=platform, clusters=clusters)
  return index.refit(state, k, p, config=config, platform=platform) if refit else state


def map_queries(q, qmap):
  """The ranking queries under a grouping metric: q [Q, H, D] @ qmap [D, D] (A^-1) in
  float32, back in q's dtype (pass `prefill_inputs`' q: fp8 queries have no room for the
  mapped values)."""
  return jnp.einsum("nhd,de->nhe", q.astype(jnp.float32), qmap.astype(jnp.float32)).astype(
      q.dtype)


def _queries(state, reps, q, w, k, p, *, config, size, topk, platform=None, qmap=None,
             k_scale=None):
  """`chunk_topk` for the `size` queries from position p - 1 on, under `state`'s version
  (their q, w sliced here, with the query_block - 1 before them that rank the first shared
  block; the inverted lists from the stored ranks; qmap [D, D]: the ranking queries are
  q @ qmap, a grouping metric's A^-1, mapped here a window at a time; k_scale: the keys'
  scales or None). Returns (indices [size, topk], num_candidates [size])."""
  blk = config.query_block
  rows = size + blk - 1
  qlo = p - blk  # = (p - 1) - (blk - 1)
  members, offsets = candidates.lists_by_rank(state["assign"], state["rank"], state["sizes"])
  qs = jax.lax.dynamic_slice_in_dim(q, qlo, rows)
  rank_q = None if qmap is None else map_queries(qs, qmap)
  return _chunk_topk_impl(
      qs, jax.lax.dynamic_slice_in_dim(w, qlo, rows), k,
      reps, state["sizes"], state["last"], members, offsets,
      jnp.full((rows,), state["grouped_end"], jnp.int32),
      qlo + jnp.arange(rows, dtype=jnp.int32), topk=topk, budget=config.budget,
      sink=config.sink, window=config.seal_window, platform=platform, block=blk, rank_q=rank_q,
      k_scale=k_scale)


@functools.partial(jax.jit, static_argnames=("config", "refit", "size", "topk", "platform"))
def _window(state, q, w, k, clusters, p, *, config, refit, size, topk, platform=None, ki=None,
            qmap=None, k_scale=None):
  """One window in one dispatch: `_maintain` (on the index keys ki, default k), then
  `_queries` ranking the stored centers (with q @ qmap when given; scores times k_scale when
  given). Returns (state, indices, num_candidates)."""
  state = _maintain(state, k if ki is None else ki, clusters, p, config=config, refit=refit,
                    platform=platform)
  return (state,) + _queries(state, state["centers"], q, w, k, p, config=config, size=size,
                             topk=topk, platform=platform, qmap=qmap, k_scale=k_scale)


_maintain_jit = jax.jit(_maintain, static_argnames=("config", "refit", "platform"))
_queries_jit = jax.jit(_queries, static_argnames=("config", "size", "topk", "platform"))


@functools.partial(jax.jit, static_argnames=("config", "windows", "topk", "platform"),
                   donate_argnames=("out_idx", "out_num"))
def _full_windows(state, q, w, k, clusters, out_idx, out_num, *, config, windows, topk,
                  platform=None, ki=None, qmap=None, k_scale=None):
  """Windows 1 .. `windows` (each serving a whole seal window of queries) in one program: a
  scan whose step does `_window`'s work (`_maintain`, its refit under `lax.cond` where p is a
  multiple of the refit interval, then `_queries`), each window's results written in place
  into out_idx [N, topk] and out_num [N] (donated) at rows p - 1 ... ki, qmap: the index keys
  and ranking queries when they differ from k, q; k_scale: the keys' scales or None. Returns
  (state, out_idx, out_num)."""
  wnd, every = config.seal_window, config.refit_interval
  ki = k if ki is None else ki

  def step(carry, v):
    state, oi, on = carry
    p = v * wnd
    state = _maintain(state, ki, clusters, p, config=config, refit=False, platform=platform)
    if every:
      state = jax.lax.cond(p % every == 0, lambda s: index.refit(s, ki, p, config=config,
                                                                 platform=platform),
                           lambda s: s, state)
    idx, num = _queries(state, state["centers"], q, w, k, p, config=config, size=wnd,
                        topk=topk, platform=platform, qmap=qmap, k_scale=k_scale)
    return (state, jax.lax.dynamic_update_slice_in_dim(oi, idx, p - 1, 0),
            jax.lax.dynamic_update_slice_in_dim(on, num, p - 1, 0)), None

  (state, out_idx, out_num), _ = jax.lax.scan(
      step, (state, out_idx, out_num), jnp.arange(1, windows + 1, dtype=jnp.int32))
  return state, out_idx, out_num


@functools.partial(jax.jit, static_argnames=("topk", "first"))
def _exact_head(q, w, k, k_scale=None, *, topk, first):
  """The output buffers (indices [N, topk] int32, num_candidates [N] int32) with the `first`
  queries (before the first seal) scoring every key they see ([first, first] scores, times
  k_scale when given) and the other rows -1 / 0."""
  n = k.shape[0]
  out_idx = jnp.full((n, topk), -1, jnp.int32)
  out_num = jnp.zeros((n,), jnp.int32)
  if not first:
    return out_idx, out_num
  pos = jnp.arange(first, dtype=jnp.int32)
  head = exact_scores(q[:first], k[:first], w[:first], pos, min(topk, first),
                      None if k_scale is None else k_scale[:first])[1]
  head = head.astype(jnp.int32)
  return (out_idx.at[:first, :head.shape[1]].set(head), out_num.at[:first].set(pos + 1))


def exact_before_first_seal(q, k, w, config, *, k_scale=None):
  """The prefill's output buffers as writable numpy arrays, for drivers that fill the later
  rows on the host: indices [N, min(topk, N)] int32 and num_candidates [N] int32, where the
  queries before the first seal (positions < seal_window - 1) hold their exact top-K over
  every key they see and every other row -1 / 0. q [N, H, D], k [N, D], w [N, H] (the scoring
  inputs of `prefill_inputs`), k_scale [N] float32 or None; config: `IVFConfig`."""
  n = k.shape[0]
  head = _exact_head(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k),
                     None if k_scale is None else jnp.asarray(k_scale), topk=min(config.topk, n),
                     first=min(config.seal_window - 1, n))
  return tuple(np.array(a) for a in head)


@_checks.array_args("q", "k", "w", optional=("k_scale",))
def prefill_topk(q, k, w, config, *, method: str | None = None, corrector=None, layer=None,
                 implementation=None, metric=None, k_scale=None, plan=None):
  """Every query's AttentionIndex (or HiSA) top-K over one sequence (query n at position n).

  q [N, H, D] bfloat16, float32 or float8_e4m3fn; k [N, D] likewise; w [N, H] float32;
  config: IVFConfig. k_scale [N] float32 or None: each key's scale (required when k is
  float8_e4m3fn; fp8 q needs fp8 k, its own scale folded into w: DeepSeek-V3.2's format, as
  `jaxsparse.prep.prepare_indexer_inputs` makes it). Every candidate scores as
  `jaxsparse.indexer_scores(q, k, w, k_scale=)` scores it: sum_h w relu(q . k) with q and k
  upcast exactly (fp8 to bfloat16, on every path and kernel) and float32 sums, times k_scale
  after the head sum; the index (k-means, representatives, HiSA's block means, a corrector's
  input) groups the dequantised keys k * k_scale in float32. Before the first seal queries
  score every key. method="hisa" runs the HiSA baseline through the same candidate and
  scoring path: contiguous blocks of `cluster_size` keys after the sinks, each usable once
  complete, ranked by their mean key (the candidates of `evaluate(method="hisa")`).
  implementation: None (the kernels on a GPU/TPU, XLA on a CPU), "xla", or
  "pallas" (the k-means assignment, representative scoring and gathered-candidate scoring
  kernels of `pallas_kernels.ivf` and the top-K kernels; interpret mode without an
  accelerator). config.query_block > 1 (method "ivf"): blocks of queries share candidates
  (`IVFConfig`), scored by one dense product per block (the prefill scoring kernel on a
  GPU/TPU). Without a corrector the whole sequence is one jitted program (a scan over the seal
  windows; HiSA's a scan over query chunks), so the host dispatches a few calls, not one per
  window. metric: a grouping metric (`jaxsparse.ivf.metric`; an A [D, D] array, or a file with
  `layer`): the index groups k @ A (a mapped copy of the keys, [N, D] in k's dtype, float32
  when scaled) and each window's queries rank with q @ A^-1; candidates are scored with k and
  q. Returns jax arrays (indices [N, topk] int32, -1 where fewer keys are visible;
  num_candidates [N] int32). Ties go to the lower key index and NaN scores are never chosen
  (README "Input rules").

  method: "ivf" (the default) or "hisa". plan: a per-layer plan (`jaxsparse.ivf.plan`: a dict,
  a file, or `plan.shipped(tokens, budget)`) with `layer`, instead of method: the layer runs
  the partition the plan gives it; on a layer planned "hisa" metric and corrector are not
  used (they shape content groups). The plan must have been calibrated at config's topk,
  budget, seal_window and cluster_size (ValueError naming the field otherwise).
  """
  from jaxsparse.ivf import IVFConfig
  _checks.check_instance("config", config, IVFConfig)
  if plan is not None:
    from jaxsparse.ivf import plan as plan_mod
    if method is not None:
      raise ValueError(f"method={method!r}: give method or plan, not both")
    if layer is None:
      raise ValueError("plan needs layer= (the model layer whose planned partition runs)")
    if isinstance(plan, (str, os.PathLike)):
      plan = plan_mod.load(os.fspath(plan))
    plan_mod.check_config(plan, config)
    method = plan_mod.method(plan, layer)
    if method == "hisa":
      metric = corrector = None
  method = "ivf" if method is None else method
  if method not in ("ivf", "hisa"):
    raise ValueError(f"method={method!r} must be 'ivf' or 'hisa'")
  if method == "hisa" and corrector is not None:
    raise ValueError("corrector applies to method='ivf' only")
  if method == "hisa" and metric is not None:
    raise ValueError("metric applies to method='ivf' only")
  from jaxsparse import backend
  _checks.check_implementation(implementation)
  x = prefill_inputs(q, k, w, k_scale=k_scale, metric=metric, layer=layer, corrector=corrector)
  q, k, w, ks = x.q, x.k, x.w, x.k_scale
  n = k.shape[0]
  plat = backend.kernel_platform() if backend.resolve(implementation) == "pallas" else None
  if method == "hisa":
    return _hisa_prefill(q, w, k, config, plat, keys=x.keys, k_scale=ks)
  extra = {} if x.index_keys is k else dict(ki=x.index_keys)
  if x.qmap is not None:
    extra["qmap"] = x.qmap
  if ks is not None:
    extra["k_scale"] = ks
  topk, wnd = min(config.topk, n), config.seal_window
  state = index.init_state(n, k.shape[1], config)
  # every window's k-means at once
  clusters = index.cluster_windows(x.index_keys, config, platform=plat)
  if x.corrector is not None:  # corrected representatives come from each sealed state
    return _corrected_prefill(q, w, k, config, x.corrector, state, clusters, plat, x.metric,
                              keys=x.keys, **extra)
  out_idx, out_num = _exact_head(q, w, k, ks, topk=topk, first=min(wnd - 1, n))
  full = max((n + 1) // wnd - 1, 0)  # windows whose queries [p - 1, p - 1 + W) all exist
  if full:
    state, out_idx, out_num = _full_windows(state, q, w, k, clusters, out_idx, out_num,
                                            config=config, windows=full, topk=topk,
                                            platform=plat, **extra)
  for v in range(full + 1, n // wnd + 1):  # at most one window, serving fewer queries
    p = v * wnd
    refit = bool(config.refit_interval and p % config.refit_interval == 0)
    lo, hi = p - 1, min(p - 1 + wnd, n)
    state, idx, num = _window(state, q, w, k, clusters, p, config=config, refit=refit,
                              size=hi - lo, topk=topk, platform=plat, **extra)
    out_idx, out_num = out_idx.at[lo:hi].set(idx), out_num.at[lo:hi].set(num)
  return out_idx, out_num


def _corrected_prefill(q, w, k, config, corrector, state, clusters, plat, metric=None, ki=None,
                       qmap=None, keys=None, k_scale=None):
  """`prefill_topk` with a corrector: a window at a time, the corrected representatives of
  each sealed state computed between its maintenance and its queries (from `keys`, default k:
  the dequantised keys when scaled; under a grouping metric A: the index on ki = keys @ A,
  ranking with q @ qmap)."""
  n, wnd = k.shape[0], config.seal_window
  topk = min(config.topk, n)
  keys = k if keys is None else keys
  out_idx, out_num = exact_before_first_seal(q, k, w, config, k_scale=k_scale)
  pending = []
  for v in range(1, n // wnd + 1):
    p = v * wnd
    refit = bool(config.refit_interval and p % config.refit_interval == 0)
    lo, hi = p - 1, min(p - 1 + wnd, n)
    if lo >= hi:  # no query left: the last version serves none
      continue
    kw = dict(config=config, platform=plat)
    state = _maintain_jit(state, k if ki is None else ki, clusters, p, refit=refit, **kw)
    idx, num = _queries_jit(state, index.representatives(state, keys, corrector, metric), q, w,
                            k, p, size=hi - lo, topk=topk, qmap=qmap, k_scale=k_scale, **kw)
    _queue(pending, (lo, hi, idx, num), out_idx, out_num)
  for item in pending:
    _drain(item, out_idx, out_num)
  return jnp.asarray(out_idx), jnp.asarray(out_num)


def _hisa_prefill(q, w, k, config, plat, keys=None, k_scale=None):
  """HiSA's prefill: a fixed block partition (block g holds keys sink + g * cs ..., its mean
  the representative: of `keys`, default k, the dequantised keys when scaled), each query
  using the blocks complete at its position, in chunks of `seal_window` queries through
  `chunk_topk`'s computation (ungrouped area: at most cs - 1 keys) in `_hisa_chunks`."""
  n = k.shape[0]
  topk = min(config.topk, n)
  assign, rank, sizes, last = (jnp.asarray(a) for a in hisa_structure(n, config))
  reps = block_means(k if keys is None else keys, assign, sizes.shape[0])
  members, offsets = candidates.lists_by_rank(assign, rank, sizes)
  return _hisa_chunks(q, w, k, reps, sizes, last, members, offsets, k_scale, config=config,
                      topk=topk, platform=plat)


@functools.partial(jax.jit, static_argnames=("config", "topk", "platform"))
def _hisa_chunks(q, w, k, reps, sizes, last, members, offsets, k_scale=None, *, config, topk,
                 platform=None):
  """`_hisa_prefill`'s chunks: (indices [N, topk] int32, num_candidates [N] int32)."""
  n = k.shape[0]
  cs, sink, chunk = config.cluster_size, config.sink, config.seal_window

  def run(lo, size):
    pos = lo + jnp.arange(size, dtype=jnp.int32)
    gend = jnp.maximum(sink + ((pos + 1 - sink) // cs) * cs, sink).astype(jnp.int32)
    sl = lambda a: jax.lax.dynamic_slice_in_dim(a, lo, size)  # noqa: E731
    return _chunk_topk_impl(sl(q), sl(w), k, reps, sizes, last, members, offsets, gend, pos,
                            topk=topk, budget=config.budget, sink=sink, window=cs,
                            platform=platform, k_scale=k_scale)

  whole = n // chunk
  if whole:
    idx, num = jax.lax.map(lambda c: run(c * chunk, chunk),
                           jnp.arange(whole, dtype=jnp.int32))
    idx, num = idx.reshape(whole * chunk, topk), num.reshape(whole * chunk)
  else:  # N < seal_window: one short chunk
    idx, num = jnp.zeros((0, topk), jnp.int32), jnp.zeros((0,), jnp.int32)
  if n % chunk:
    ti, tn = run(whole * chunk, n % chunk)
    idx, num = jnp.concatenate([idx, ti]), jnp.concatenate([num, tn])
  return idx, num


def _queue(pending, item, out_idx, out_num):
  """Start copying a window's result (lo, hi, idx, num) to the host; the host reads the window
  two behind the one being dispatched."""
  for a in item[2:]:
    a.copy_to_host_async()
  pending.append(item)
  if len(pending) > 2:
    _drain(pending.pop(0), out_idx, out_num)


def _drain(item, out_idx, out_num):
  lo, hi, idx, num = item
  out_idx[lo:hi], out_num[lo:hi] = np.asarray(idx), np.asarray(num)

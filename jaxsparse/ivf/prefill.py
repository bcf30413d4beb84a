"""A chunked AttentionIndex prefill: every query's top-K from gathered candidates.

Queries run in version order (the chunk of queries between two seals shares one version);
each gathers its candidates from the inverted lists, so no [T, N] array is formed: memory per
chunk is [chunk, budget + seal_window] indices and scores. The lists come from the stored
ranks (`candidates.lists_by_rank`, one scatter) and the representatives are the stored centers,
so a window does no O(N) work beyond them. On a GPU a kernel walks each query's ranked groups
through the lists (`pallas_kernels.ivf.ranked_scores`); elsewhere `candidates.candidate_indices`
packs the slots and `gathered_scores` scores them. Both fill the same slots.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse.ivf import candidates, index
from jaxsparse.ivf._shared import (block_means, exact_scores, hisa_structure, metric_inputs,
                                   resolve_corrector)
from jaxsparse.selection import keyed_topk_xla
from pallas_kernels._util import flush_zero
from pallas_kernels._util import masked_relu

__all__ = ["prefill_topk"]


def _group_scores(q, w, reps, sizes, last, grouped_end, platform=None):
  """[Q, G] representative scores, -inf for groups a query may not use."""
  valid = (sizes[None, :] > 0) & (last[None, :] < grouped_end[:, None])
  if platform is None:
    return candidates.representative_scores(q, w, reps, valid)
  from pallas_kernels import ivf as kivf
  return kivf.representative_scores(q, w, reps, valid, platform=platform)


def _candidate_scores(q, w, k, idx, platform=None):
  """[Q, S] indexer scores of the candidates idx [Q, S] (-1: empty slot, scored -inf)."""
  if platform is None:
    kc = k[jnp.maximum(idx, 0)].astype(jnp.float32)  # [Q, S, D]
    s = jnp.einsum("qhd,qsd->qhs", q.astype(jnp.float32), kc)
    wf = w.astype(jnp.float32)
    z = jnp.einsum("qhs,qh->qs", masked_relu(s, wf[..., None]), wf)
    return jnp.where(idx >= 0, z, -jnp.inf)
  from pallas_kernels import ivf as kivf  # keys gathered inside the kernel: no [Q, S, D]
  return kivf.gathered_scores(q, w, k, idx, platform=platform)


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


def _score_packed(q, w, k, members, packed, *, budget, sink, platform=None):
  """(scores [Q, S] float32, key indices [Q, S] int32) of `_pack`'s candidates."""
  if not _walks(platform):
    return _candidate_scores(q, w, k, packed, platform), packed
  from pallas_kernels import ivf as kivf
  fixed, (start, take, slot, used) = packed
  zg, ig = kivf.ranked_scores(q, w, k, members, start, take, slot, used, slots=budget - sink,
                              platform=platform)
  return (jnp.concatenate([_candidate_scores(q, w, k, fixed, platform), zg], axis=1),
          jnp.concatenate([fixed, ig], axis=1))


def _block_scores(qb, wb, kc, platform=None):
  """[nb, B, S] scores of each block's queries qb [nb, B, H, D] (weights wb [nb, B, H]) against
  its gathered candidates kc [nb, S, D], every key visible: one dense product per block (the
  prefill scoring kernel on a GPU/TPU, no causal mask)."""
  if platform is None:
    s = jnp.einsum("nbhd,nsd->nbhs", qb.astype(jnp.float32), kc.astype(jnp.float32))
    wf = wb.astype(jnp.float32)
    return jnp.einsum("nbhs,nbh->nbs", masked_relu(s, wf[..., None]), wf)
  from pallas_kernels import indexer_prefill
  cfg = (indexer_prefill.TPU_DEFAULT if platform.kind == "tpu"
         else indexer_prefill.PrefillConfig())
  return jax.lax.map(lambda a: indexer_prefill.prefill_scores(
      a[0], a[2], a[1], config=cfg, platform=platform), (qb, wb, kc))


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


def _shared_scores(q, w, k, idx, pos, *, block, platform=None):
  """Each block's queries against its candidates, densely: (z [nb * block, S] float32, -inf
  where a candidate is empty or after the query; seen [nb * block] candidates each query may
  use). q, w hold block - 1 rows before the chunk's first query, as in `_shared_candidates`."""
  q, w = q[block - 1:], w[block - 1:]
  nb = idx.shape[0]
  pad = nb * block - q.shape[0]
  padq = lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
  kc = k[jnp.maximum(idx, 0)]  # [nb, S, D]: one gather per block
  z = _block_scores(padq(q).reshape(nb, block, *q.shape[1:]),
                    padq(w).reshape(nb, block, w.shape[1]), kc, platform)
  seen = (idx[:, None, :] >= 0) & (idx[:, None, :] <= pos[:, :, None])  # [nb, B, S]
  return (jnp.where(seen, z, -jnp.inf).reshape(nb * block, -1),
          seen.sum(2).reshape(-1).astype(jnp.int32))


def _shared_topk(q, w, k, gs, sizes, members, offsets, grouped_end, positions, *, topk, budget,
                 sink, window, block, platform=None):
  """`_chunk_topk` for blocks of `block` queries sharing candidates (IVFConfig.query_block).
  q, w, gs, positions, grouped_end hold block - 1 rows before the chunk's first query (they
  rank the first block's groups), then the chunk's. A block's groups are ranked by the
  maximum score of the `block` queries ending at its first position (so no query's choice
  depends on a later query), its slots are those of its last position, scored densely, then
  each query's keys after it masked."""
  t = q.shape[0] - (block - 1)
  idx, pos = _shared_candidates(gs, sizes, members, offsets, grouped_end, positions,
                                budget=budget, sink=sink, window=window, block=block)
  z, num = _shared_scores(q, w, k, idx, pos, block=block, platform=platform)
  sel = _select(z, idx, topk, platform, block)
  return sel[:t], num[:t]


def _chunk_topk_impl(q, w, k, reps, sizes, last, members, offsets, grouped_end, positions, *,
                     topk, budget, sink, window, platform=None, block=1, rank_q=None):
  """One version's queries: rank the groups, gather candidates from the inverted lists
  (members, offsets), score them and take the top-K (block > 1: `_shared_topk`). rank_q [Q, H,
  D]: the queries that rank the groups when they differ from q (a grouping metric's q @ A^-1).
  Returns (indices [Q, topk], num_candidates [Q])."""
  gs = _group_scores(q if rank_q is None else rank_q, w, reps, sizes, last, grouped_end,
                     platform)
  if block > 1:
    return _shared_topk(q, w, k, gs, sizes, members, offsets, grouped_end, positions,
                        topk=topk, budget=budget, sink=sink, window=window, block=block,
                        platform=platform)
  packed = _pack(gs, sizes, members, offsets, grouped_end, positions, budget=budget, sink=sink,
                 window=window, platform=platform)
  z, idx = _score_packed(q, w, k, members, packed, budget=budget, sink=sink, platform=platform)
  return _select(z, idx, topk, platform), (idx >= 0).sum(1).astype(jnp.int32)


_chunk_topk = jax.jit(_chunk_topk_impl, static_argnames=("topk", "budget", "sink", "window",
                                                         "platform", "block"))


def _maintain(state, k, clusters, p, *, config, refit, platform=None):
  """The version for the queries from p - 1 on: seal the window ending at p (its k-means from
  `index.cluster_windows`), then refit when `refit`."""
  state = index._seal(state, k, p, config, platform=platform, clusters=clusters)
  return index._refit(state, k, p, config, platform=platform) if refit else state


def map_queries(q, qmap):
  """The ranking queries under a grouping metric: q [Q, H, D] @ qmap [D, D] (A^-1) in
  float32, back in q's dtype."""
  return jnp.einsum("nhd,de->nhe", q.astype(jnp.float32), qmap.astype(jnp.float32)).astype(
      q.dtype)


def _queries(state, reps, q, w, k, p, *, config, size, topk, platform=None, qmap=None):
  """`_chunk_topk` for the `size` queries from position p - 1 on, under `state`'s version
  (their q, w sliced here, with the query_block - 1 before them that rank the first shared
  block; the inverted lists from the stored ranks; qmap [D, D]: the ranking queries are
  q @ qmap, a grouping metric's A^-1, mapped here a window at a time). Returns (indices
  [size, topk], num_candidates [size])."""
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
      sink=config.sink, window=config.seal_window, platform=platform, block=blk, rank_q=rank_q)


@functools.partial(jax.jit, static_argnames=("config", "refit", "size", "topk", "platform"))
def _window(state, q, w, k, clusters, p, *, config, refit, size, topk, platform=None, ki=None,
            qmap=None):
  """One window in one dispatch: `_maintain` (on the index keys ki, default k), then
  `_queries` ranking the stored centers (with q @ qmap when given). Returns (state, indices,
  num_candidates)."""
  state = _maintain(state, k if ki is None else ki, clusters, p, config=config, refit=refit,
                    platform=platform)
  return (state,) + _queries(state, state["centers"], q, w, k, p, config=config, size=size,
                             topk=topk, platform=platform, qmap=qmap)


_maintain_jit = jax.jit(_maintain, static_argnames=("config", "refit", "platform"))
_queries_jit = jax.jit(_queries, static_argnames=("config", "size", "topk", "platform"))


@functools.partial(jax.jit, static_argnames=("config", "windows", "topk", "platform"),
                   donate_argnames=("out_idx", "out_num"))
def _full_windows(state, q, w, k, clusters, out_idx, out_num, *, config, windows, topk,
                  platform=None, ki=None, qmap=None):
  """Windows 1 .. `windows` (each serving a whole seal window of queries) in one program: a
  scan whose step does `_window`'s work (`_maintain`, its refit under `lax.cond` where p is a
  multiple of the refit interval, then `_queries`), each window's results written in place
  into out_idx [N, topk] and out_num [N] (donated) at rows p - 1 ... ki, qmap: the index keys
  and ranking queries when they differ from k, q. Returns (state, out_idx, out_num)."""
  wnd, every = config.seal_window, config.refit_interval
  ki = k if ki is None else ki

  def step(carry, v):
    state, oi, on = carry
    p = v * wnd
    state = _maintain(state, ki, clusters, p, config=config, refit=False, platform=platform)
    if every:
      state = jax.lax.cond(p % every == 0, lambda s: index._refit(s, ki, p, config,
                                                                  platform=platform),
                           lambda s: s, state)
    idx, num = _queries(state, state["centers"], q, w, k, p, config=config, size=wnd,
                        topk=topk, platform=platform, qmap=qmap)
    return (state, jax.lax.dynamic_update_slice_in_dim(oi, idx, p - 1, 0),
            jax.lax.dynamic_update_slice_in_dim(on, num, p - 1, 0)), None

  (state, out_idx, out_num), _ = jax.lax.scan(
      step, (state, out_idx, out_num), jnp.arange(1, windows + 1, dtype=jnp.int32))
  return state, out_idx, out_num


@functools.partial(jax.jit, static_argnames=("topk", "first"))
def _exact_head(q, w, k, *, topk, first):
  """The output buffers (indices [N, topk] int32, num_candidates [N] int32) with the `first`
  queries (before the first seal) scoring every key they see ([first, first] scores) and the
  other rows -1 / 0."""
  n = k.shape[0]
  out_idx = jnp.full((n, topk), -1, jnp.int32)
  out_num = jnp.zeros((n,), jnp.int32)
  if not first:
    return out_idx, out_num
  pos = jnp.arange(first, dtype=jnp.int32)
  head = exact_scores(q[:first], w[:first], k[:first], pos, min(topk, first))[1]
  head = head.astype(jnp.int32)
  return (out_idx.at[:first, :head.shape[1]].set(head), out_num.at[:first].set(pos + 1))


def exact_before_first_seal(q, k, w, config):
  """`_exact_head` as writable numpy arrays (indices [N, topk] int32 -1, num_candidates [N]
  int32), for drivers that fill the later rows on the host."""
  n = k.shape[0]
  head = _exact_head(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), topk=min(config.topk, n),
                     first=min(config.seal_window - 1, n))
  return tuple(np.array(a) for a in head)


def prefill_topk(q, k, w, config, *, method: str = "ivf", corrector=None, layer=None,
                 implementation=None, metric=None):
  """Every query's AttentionIndex (or HiSA) top-K over one sequence (query n at position n).

  q [N, H, D], k [N, D], w [N, H] float; config: IVFConfig. Before the first seal queries
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
  `layer`): the index groups k @ A (a mapped copy of the keys, [N, D] in k's dtype) and each
  window's queries rank with q @ A^-1; candidates are scored with k and q. Returns jax arrays
  (indices [N, topk] int32, -1 where fewer keys are visible; num_candidates [N] int32).
  Ties go to the lower key index and NaN scores are never chosen (README "Input rules").
  """
  if method not in ("ivf", "hisa"):
    raise ValueError(f"method={method!r} must be 'ivf' or 'hisa'")
  if method == "hisa" and corrector is not None:
    raise ValueError("corrector applies to method='ivf' only")
  if method == "hisa" and metric is not None:
    raise ValueError("metric applies to method='ivf' only")
  from jaxsparse import _checks, backend
  for _name, _x in (("q", q), ("k", k), ("w", w)):
    _checks.check_real_dtype(_name, _x)
  q, k, w = jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)
  _checks.check_kw_order(q, k, w)
  n = k.shape[0]
  if q.ndim != 3 or w.shape != q.shape[:2] or k.shape != (n, q.shape[2]) or q.shape[0] != n:
    raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)} must be "
                     f"[N, H, D], [N, D], [N, H]")
  _checks.check_implementation(implementation)
  plat = backend.kernel_platform() if backend.resolve(implementation) == "pallas" else None
  if method == "hisa":
    return _hisa_prefill(q, w, k, config, plat)
  corrector = resolve_corrector(corrector, layer)
  ki, qmap, a = metric_inputs(q, k, metric, layer, map_queries=False)
  mapped = dict(ki=ki, qmap=qmap) if a is not None else {}
  topk, wnd = min(config.topk, n), config.seal_window
  state = index.init_state(n, k.shape[1], config)
  clusters = index.cluster_windows(ki, config, platform=plat)  # every window's k-means at once
  if corrector is not None:  # corrected representatives come from each sealed state
    return _corrected_prefill(q, w, k, config, corrector, state, clusters, plat, a, **mapped)
  out_idx, out_num = _exact_head(q, w, k, topk=topk, first=min(wnd - 1, n))
  full = max((n + 1) // wnd - 1, 0)  # windows whose queries [p - 1, p - 1 + W) all exist
  if full:
    state, out_idx, out_num = _full_windows(state, q, w, k, clusters, out_idx, out_num,
                                            config=config, windows=full, topk=topk,
                                            platform=plat, **mapped)
  for v in range(full + 1, n // wnd + 1):  # at most one window, serving fewer queries
    p = v * wnd
    refit = bool(config.refit_interval and p % config.refit_interval == 0)
    lo, hi = p - 1, min(p - 1 + wnd, n)
    state, idx, num = _window(state, q, w, k, clusters, p, config=config, refit=refit,
                              size=hi - lo, topk=topk, platform=plat, **mapped)
    out_idx, out_num = out_idx.at[lo:hi].set(idx), out_num.at[lo:hi].set(num)
  return out_idx, out_num


def _corrected_prefill(q, w, k, config, corrector, state, clusters, plat, metric=None, ki=None,
                       qmap=None):
  """`prefill_topk` with a corrector: a window at a time, the corrected representatives of
  each sealed state computed between its maintenance and its queries (under a grouping metric
  A: the index on ki = k @ A, ranking with q @ qmap)."""
  n, wnd = k.shape[0], config.seal_window
  topk = min(config.topk, n)
  out_idx, out_num = exact_before_first_seal(q, k, w, config)
  pending = []
  for v in range(1, n // wnd + 1):
    p = v * wnd
    refit = bool(config.refit_interval and p % config.refit_interval == 0)
    lo, hi = p - 1, min(p - 1 + wnd, n)
    if lo >= hi:  # no query left: the last version serves none
      continue
    kw = dict(config=config, platform=plat)
    state = _maintain_jit(state, k if ki is None else ki, clusters, p, refit=refit, **kw)
    idx, num = _queries_jit(state, index.representatives(state, k, corrector, metric), q, w, k,
                            p, size=hi - lo, topk=topk, qmap=qmap, **kw)
    _queue(pending, (lo, hi, idx, num), out_idx, out_num)
  for item in pending:
    _drain(item, out_idx, out_num)
  return jnp.asarray(out_idx), jnp.asarray(out_num)


def _hisa_prefill(q, w, k, config, plat):
  """HiSA's prefill: a fixed block partition (block g holds keys sink + g * cs ..., its mean
  the representative), each query using the blocks complete at its position, in chunks of
  `seal_window` queries through `_chunk_topk`'s computation (ungrouped area: at most cs - 1
  keys) in `_hisa_chunks`."""
  n = k.shape[0]
  topk = min(config.topk, n)
  assign, rank, sizes, last = (jnp.asarray(a) for a in hisa_structure(n, config))
  reps = block_means(k, assign, sizes.shape[0])
  members, offsets = candidates.lists_by_rank(assign, rank, sizes)
  return _hisa_chunks(q, w, k, reps, sizes, last, members, offsets, config=config, topk=topk,
                      platform=plat)


@functools.partial(jax.jit, static_argnames=("config", "topk", "platform"))
def _hisa_chunks(q, w, k, reps, sizes, last, members, offsets, *, config, topk, platform=None):
  """`_hisa_prefill`'s chunks: (indices [N, topk] int32, num_candidates [N] int32)."""
  n = k.shape[0]
  cs, sink, chunk = config.cluster_size, config.sink, config.seal_window

  def run(lo, size):
    pos = lo + jnp.arange(size, dtype=jnp.int32)
    gend = jnp.maximum(sink + ((pos + 1 - sink) // cs) * cs, sink).astype(jnp.int32)
    sl = lambda a: jax.lax.dynamic_slice_in_dim(a, lo, size)  # noqa: E731
    return _chunk_topk_impl(sl(q), sl(w), k, reps, sizes, last, members, offsets, gend, pos,
                            topk=topk, budget=config.budget, sink=sink, window=cs,
                            platform=platform)

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

"""Exact top-K over indexer scores: reference, kernel dispatch, and fused decode scoring + top-K."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsparse import _checks
from jaxsparse import backend
from jaxsparse import indexer as _indexer
from pallas_kernels._util import flush_zero

__all__ = [
    "NEG_INF", "topk_xla", "keyed_topk_xla", "merge_topk", "topk", "indexer_topk", "prefill_topk",
    "causal_prefill_topk", "causal_segments", "default_query_chunk"
]


NEG_INF = float("-inf")


def topk_xla(scores, k: int, lengths=None):
  """Reference: [..., N] -> (values [..., k], indices [..., k] int32); see `topk`."""
  n = scores.shape[-1]
  x = scores.astype(jnp.float32)
  valid = ~jnp.isnan(x)
  if lengths is not None:
    valid &= jnp.arange(n) < lengths[..., None]
  x = jnp.where(valid, flush_zero(x), NEG_INF)  # -0.0, +0.0 and subnormals tie
  if k > n:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, k - n)], constant_values=NEG_INF)
  v, i = lax.top_k(x, k)  # ties: lower index first
  return v.astype(scores.dtype), jnp.where(v == NEG_INF, -1, i).astype(jnp.int32)


def keyed_topk_xla(scores, ids, k: int):
  """Top-k of rows whose columns hold keys in any order: scores [R, S] float, ids [R, S] int
  (the key id of each column, -1: empty) -> (values [R, k] float32, ids [R, k] int32).

  The README's input rules with ties to the lower key id (not the lower column): values
  descending; NaN, -inf and empty columns never chosen; -inf / -1 tail. One two-key sort.
  """
  x = flush_zero(scores.astype(jnp.float32))
  ids = ids.astype(jnp.int32)
  dead = (ids < 0) | jnp.isnan(x) | (x == NEG_INF)
  neg = jnp.where(dead, jnp.inf, -x)
  key = jnp.where(dead, jnp.iinfo(jnp.int32).max, ids)
  if k > x.shape[-1]:
    pad = [(0, 0)] * (x.ndim - 1) + [(0, k - x.shape[-1])]
    neg = jnp.pad(neg, pad, constant_values=jnp.inf)
    key = jnp.pad(key, pad, constant_values=jnp.iinfo(jnp.int32).max)
  neg, key = lax.sort((neg, key), dimension=x.ndim - 1, num_keys=2)
  neg, key = neg[..., :k], key[..., :k]
  dead = neg == jnp.inf
  return jnp.where(dead, NEG_INF, -neg), jnp.where(dead, -1, key)


def merge_topk(values_a, indices_a, values_b, indices_b, k: int | None = None):
  """Exact merge of two partial top-K results over disjoint key sets.

  values_* [..., ka] / [..., kb] float (descending, -inf tail), indices_* the same shapes
  int32 (-1 tail). Returns the top k (default ka) of their union: values descending, ties to
  the lower index, -inf / -1 where fewer than k entries exist, exactly what `topk` gives on
  the concatenated rows. The building block of sharded top-K (per-shard results merged).
  """
  values_a, values_b = (_checks.as_array(n, x) for n, x in (("values_a", values_a),
                                                             ("values_b", values_b)))
  indices_a, indices_b = (_checks.as_array(n, x) for n, x in (("indices_a", indices_a),
                                                              ("indices_b", indices_b)))
  for name, x in (("values_a", values_a), ("indices_a", indices_a), ("values_b", values_b),
                  ("indices_b", indices_b)):
    if x.ndim == 0:
      raise ValueError(f"{name} must be an array with at least one axis; got a 0-d value")
  for name, x in (("values_a", values_a), ("values_b", values_b)):
    _checks.check_real_dtype(name, x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name}.dtype={jnp.dtype(x.dtype).name} must be a float type "
                       "(scores: -inf pads a short result)")
  for name, x in (("indices_a", indices_a), ("indices_b", indices_b)):
    dt = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.integer):
      raise ValueError(f"{name}.dtype={dt.name} must be an integer type")
    v = _checks.concrete_values(x)
    if v is not None and v.size and (v.min() < -1 or v.max() > np.iinfo(np.int32).max):
      raise ValueError(f"{name} must lie in [-1, 2^31 - 1] (int32 key ids, -1 padding); got "
                       f"min={v.min()} max={v.max()}")
  k = values_a.shape[-1] if k is None else k
  _checks.check_int("k", k, 1)
  k = int(k)
  if values_a.shape[:-1] != values_b.shape[:-1] or indices_a.shape != values_a.shape or \
      indices_b.shape != values_b.shape:
    raise ValueError(f"values/indices shapes {values_a.shape}, {indices_a.shape}, "
                     f"{values_b.shape}, {indices_b.shape} do not pair up")
  if k > values_a.shape[-1] + values_b.shape[-1]:
    raise ValueError(f"k={k} exceeds the {values_a.shape[-1] + values_b.shape[-1]} entries")
  v, i = keyed_topk_xla(jnp.concatenate([values_a, values_b], -1),
                        jnp.concatenate([indices_a, indices_b], -1), k)
  return v.astype(jax.dtypes.canonicalize_dtype(values_a.dtype)), i


def _validate(scores, k, lengths):
  if not hasattr(scores, "dtype") or scores.ndim < 1:
    raise ValueError("scores must be an array of shape [..., N]")
  _checks.check_dtype("scores", scores, (jnp.float32, jnp.bfloat16))
  _checks.check_nonempty("scores", scores)
  _checks.check_int("k", k, 1)
  if lengths is not None:
    if tuple(lengths.shape) != tuple(scores.shape[:-1]):
      raise ValueError(f"lengths.shape={tuple(lengths.shape)} must be scores.shape[:-1]="
                       f"{tuple(scores.shape[:-1])}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(f"lengths.dtype={lengths.dtype} must be an integer type")


@_checks.array_args("scores", optional=("lengths",))
def topk(scores, k: int, *, lengths=None, implementation=None, config=None, sorted=True):  # noqa: A002
  """Exact top-k of each row of `scores`.

  Args:
    scores: [..., N] float32 or bfloat16.
    k: number of entries to keep (any positive int; k > N pads the tail).
    lengths: optional [...] int; entries at or past lengths[...] are never chosen.
    implementation: None, "xla" (sort-based `lax.top_k`) or "pallas" (threshold filter).
    config: optional `pallas_kernels.topk.TopkConfig`.
    sorted: True (default): values in descending order, ties broken by the lower index.
      False: the same k entries (same tie rule) in ascending index order, the form sparse
      attention consumes; on GPU this skips the final sort of the candidates.

  Returns:
    values [..., k] (scores.dtype) and indices [..., k] int32, ordered as `sorted` says.
    Entries past lengths, -inf entries and NaN entries are never chosen (NaN counts as "no
    score"); when fewer than k entries are valid the tail is index -1 with value -inf.
    Subnormal scores rank as 0. README "Input rules" states these rules for every path.
  """
  _checks.check_implementation(implementation)
  _validate(scores, k, lengths)
  k = int(k)
  if lengths is not None:  # clipped before the int32 cast: a length past 2^31 never wraps
    lengths = _checks.clip_lengths(lengths, scores.shape[-1])
  if not isinstance(sorted, bool):
    raise ValueError(f"sorted={sorted!r} must be a bool")
  impl = backend.resolve(implementation)
  if impl == "xla":
    v, i = _topk_xla_jit(scores, k, lengths)
    if sorted:
      return v, i
    from pallas_kernels.topk import index_order
    lead = v.shape[:-1]
    v, i = index_order(v.reshape(-1, k), i.reshape(-1, k))
    return v.reshape(*lead, k), i.reshape(*lead, k)
  from pallas_kernels import topk as ktopk
  config = config or ktopk.TopkConfig()
  if not isinstance(config, ktopk.TopkConfig):
    raise ValueError(f"config={config!r} must be a TopkConfig")
  lead, n = scores.shape[:-1], scores.shape[-1]
  x = scores.reshape(-1, n)
  # None for "whole rows": the GPU kernels then take no lengths input (a constant array would
  # still cost XLA a broadcast kernel)
  lens = None if lengths is None else lengths.reshape(-1).astype(jnp.int32)
  kk = min(k, n)
  v, i = ktopk.topk_rows(x, lens, kk, config, backend.kernel_platform(), ordered=sorted)
  if k > n:
    v = jnp.pad(v, ((0, 0), (0, k - n)), constant_values=NEG_INF)
    i = jnp.pad(i, ((0, 0), (0, k - n)), constant_values=-1)
  return v.astype(scores.dtype).reshape(*lead, k), i.reshape(*lead, k)


_topk_xla_jit = jax.jit(topk_xla, static_argnums=(1,))


@_checks.array_args("q", "k_cache", "block_table", "lengths", "w", optional=("k_scale",))
def indexer_topk(q, k_cache, block_table, lengths, w, k: int, *, k_scale=None,
                 implementation=None, decode_config=None, topk_config=None,
                 fuse_group_max: bool = False, sorted: bool = True):  # noqa: A002
  """Decode path: paged indexer scoring and exact top-k in one call (one jit).

  Shapes as `paged_indexer_scores` (q [B, H, D] or [B, R, H, D]); returns (values, indices)
  of shape [B, (R,) k]. With fuse_group_max=True (GPU) the scoring kernel also emits the group
  maxima that the top-k threshold needs, saving one 4-byte-per-slot pass over the scores; on
  the H200 that epilogue cost more than it saved (benchmarks/NOTES.md), so it is off by default.
  sorted: as in `topk` (False: the top-k set in ascending slot order, no final sort on GPU).
  Every path applies `sanitize_paged` under jit (README "Input rules": a request whose block
  table points outside the cache returns all -1).
  """
  _checks.check_implementation(implementation)
  impl = backend.resolve(implementation)
  _checks.check_int("k", k, 1)
  k = int(k)
  if not isinstance(sorted, bool):
    raise ValueError(f"sorted={sorted!r} must be a bool")
  plat = backend.kernel_platform()
  if impl == "xla" or plat.kind != "gpu":
    z = _indexer.paged_indexer_scores(q, k_cache, block_table, lengths, w, k_scale=k_scale,
                                      implementation=impl, config=decode_config)
    cap = block_table.shape[1] * k_cache.shape[1]  # clipped before the cast, as sanitize_paged
    lens = _indexer.row_lengths(_checks.clip_lengths(lengths, cap),
                                1 if q.ndim == 3 else q.shape[1])
    lens = lens[:, 0] if q.ndim == 3 else lens
    return topk(z, k, lengths=lens, implementation=impl, config=topk_config, sorted=sorted)
  _indexer._validate_paged(q, k_cache, block_table, lengths, w, k_scale)
  # the README's input rules: a traced length clamps, a request reading a page outside the
  # cache is void (length 0: every slot -inf, top-K all -1)
  lengths = _indexer.sanitize_paged(block_table, lengths, k_cache.shape[0], k_cache.shape[1])
  from pallas_kernels import indexer_decode, topk as ktopk
  topk_config = topk_config or ktopk.TopkConfig()
  decode_config = decode_config or indexer_decode.DecodeConfig()
  single = q.ndim == 3
  if single:
    q, w = q[:, None], w[:, None]
  return _fused(q, k_cache, block_table.astype(jnp.int32), lengths.astype(jnp.int32), w,
                k_scale, k, decode_config, topk_config, plat, single, fuse_group_max, sorted)


@functools.partial(jax.jit, static_argnums=(6, 7, 8, 9, 10, 11, 12))
def _fused(q, k_cache, block_table, lengths, w, k_scale, k, decode_config, topk_config, plat,
           single, fuse_group_max, ordered):
  from pallas_kernels import indexer_decode, topk as ktopk
  bsz, rows = q.shape[:2]
  slots = block_table.shape[1] * k_cache.shape[1]
  kk = min(k, slots)
  step = decode_config.pages_per_step * k_cache.shape[1]
  if fuse_group_max:  # groups the scoring kernel can emit
    topk_config = ktopk.fused_groups(topk_config, step)
  g = ktopk.group_size(slots, kk, topk_config, plat.kind, rows=bsz * rows)
  lens = _indexer.row_lengths(lengths, rows).reshape(-1)
  if fuse_group_max and g and step % g == 0:
    z, gm = indexer_decode.decode_scores(q, k_cache, block_table, lengths, w, k_scale=k_scale,
                                         config=decode_config, platform=plat, group_max=g)
    v, i = ktopk.topk_rows(z.reshape(bsz * rows, slots), lens, kk, topk_config, plat,
                           gm.reshape(bsz * rows, -1), ordered=ordered)
  else:
    z = indexer_decode.decode_scores(q, k_cache, block_table, lengths, w, k_scale=k_scale,
                                     config=decode_config, platform=plat)
    v, i = ktopk.topk_rows(z.reshape(bsz * rows, slots), lens, kk, topk_config, plat,
                           ordered=ordered)
  if k > kk:
    v = jnp.pad(v, ((0, 0), (0, k - kk)), constant_values=NEG_INF)
    i = jnp.pad(i, ((0, 0), (0, k - kk)), constant_values=-1)
  v, i = v.reshape(bsz, rows, k), i.reshape(bsz, rows, k)
  return (v[:, 0], i[:, 0]) if single else (v, i)


@_checks.array_args("q", "k", "w", optional=("k_scale", "query_positions"))
def prefill_topk(q, k, w, topk: int, *, k_scale=None, query_positions, sorted=True,  # noqa: A002
                 implementation=None, block: int = 1024, query_chunk: int | None = None,
                 prefill_config=None, topk_config=None):
  """Causal prefill scoring fused with exact top-K, without a [T, N] score buffer.

  q [T, H, D], k [N, D], w [T, H], k_scale, query_positions [T]: as `indexer_scores`.
  Returns (values [T, topk] float32, indices [T, topk] int32): the entries of
  `topk(indexer_scores(...), topk)` (ties to the lower index, -inf / -1 tail); sorted=False
  gives them in ascending index order.

  implementation:
    "xla" (CPU default): keys stream in blocks of `block`; each block's scores [T, block] give
      a block top-K that `merge_topk` folds into the running one: O(T x (topk + block)) memory.
    "pallas" (GPU/TPU default): queries run in chunks of `query_chunk` (default
      `default_query_chunk`: T / 16 rounded down to a multiple of 8, at least 8, and at most
      512 MiB of chunk scores). Per chunk, the scoring kernel writes the chunk's
      [query_chunk, N] scores and the top-K kernels (group maxima, exact threshold, candidate
      compaction, finish) select from them, so the extra memory is query_chunk x N x 4 bytes
      (1/16 of T x N x 4) plus the top-K's own buffers, and the scores make one round trip
      through HBM while the scoring's FLOPs dominate. On Hopper the Mosaic scoring kernel
      splits the keys over more CTAs when a chunk has too few query groups to fill the GPU.
      prefill_config / topk_config: `PrefillConfig` / `TopkConfig` for the two kernels.
  """
  _checks.check_implementation(implementation)
  _indexer._validate_dense(q, k, w, k_scale, query_positions)
  if query_positions is None:
    raise ValueError("query_positions is required (the prefill is causal)")
  _checks.check_int("topk", topk, 1)
  _checks.check_int("block", block, 1)
  topk, block = int(topk), int(block)
  if not isinstance(sorted, bool):
    raise ValueError(f"sorted={sorted!r} must be a bool")
  if query_chunk is not None:
    _checks.check_int("query_chunk", query_chunk, 1)
  if backend.resolve(implementation) == "xla":
    return _prefill_topk(q, k, w, k_scale, query_positions, topk, sorted, block)
  from pallas_kernels import indexer_prefill, topk as ktopk
  plat = backend.kernel_platform()
  if prefill_config is None:
    prefill_config = (indexer_prefill.TPU_DEFAULT if plat.kind == "tpu"
                      else indexer_prefill.PrefillConfig())
  if not isinstance(prefill_config, indexer_prefill.PrefillConfig):
    raise ValueError(f"prefill_config={prefill_config!r} must be a PrefillConfig")
  topk_config = topk_config or ktopk.TopkConfig()
  if not isinstance(topk_config, ktopk.TopkConfig):
    raise ValueError(f"topk_config={topk_config!r} must be a TopkConfig")
  t = q.shape[0]
  chunk = default_query_chunk(t, k.shape[0]) if query_chunk is None else min(query_chunk, t)
  return _prefill_topk_kernels(q, k, w, k_scale, query_positions, topk, sorted, chunk,
                               prefill_config, topk_config, plat)


def causal_segments(n: int, segments: int, align: int = 256) -> list[tuple[int, int]]:
  """`causal_prefill_topk`'s query segments of a sequence of n tokens: `segments` consecutive
  [lo, hi) ranges of about n / segments tokens, inner bounds rounded up to a multiple of
  `align`; empty ranges dropped."""
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"n={n!r} must be a positive int")
  if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1:
    raise ValueError(f"segments={segments!r} must be a positive int")
  ends = sorted({min(n, -(-(s * n // segments) // align) * align) for s in range(1, segments)}
                | {n})
  out, lo = [], 0
  for hi in ends:
    if hi > lo:
      out.append((lo, hi))
      lo = hi
  return out


@_checks.array_args("q", "k", "w", optional=("k_scale",))
def causal_prefill_topk(q, k, w, topk: int, *, start: int = 0, k_scale=None,
                        segments: int = 8, key_align: int = 1, sorted=True,  # noqa: A002
                        implementation=None, **options):
  """Every query's exact top-K for a contiguous run of causal queries (a whole prefill, or a
  chunk of one): query t sits at position start + t and sees keys 0..start + t. The causal
  part of the work is skipped by segments, not inside one call.

  q [T, H, D], k [N, D] with N >= start + T (keys in position order; later keys are never
  visible), w [T, H], k_scale [N] or None (as `prefill_topk`); start: a static int. The queries
  run in `segments` consecutive segments (`causal_segments`); segment [lo, hi) goes through
  `prefill_topk` against keys [0, start + hi) only: for a whole sequence (start 0, T = N) about
  (S + 1) / 2S of the N x N square instead of all of it (S = 8: 56%). Each call's shapes are
  static: S compilations; key_align rounds each segment's key count up to a multiple of it (at
  most N), so that calls with different starts share shapes and compilations, for a little
  more masked work. Returns (values [T, topk] float32, indices [T, topk] int32): the
  entries of `prefill_topk(q, k, w, topk, query_positions=start + arange(T))` (-inf / -1 where
  fewer than topk keys are visible). options: `prefill_topk`'s block, query_chunk,
  prefill_config, topk_config.
  """
  _checks.check_dtype("q", q, _checks.QUERY_DTYPES)  # as prefill_topk: never a silent cast
  _checks.check_dtype("k", k, _checks.KEY_DTYPES)
  if k_scale is not None:
    _checks.check_dtype("k_scale", k_scale, (jnp.float32,))
  q, k, w = jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)
  if not isinstance(start, int) or isinstance(start, bool) or start < 0:
    raise ValueError(f"start={start!r} must be a non-negative int")
  if not isinstance(key_align, int) or isinstance(key_align, bool) or key_align < 1:
    raise ValueError(f"key_align={key_align!r} must be a positive int")
  if q.ndim != 3 or k.ndim != 2 or k.shape[0] < start + q.shape[0]:
    raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D] and [N, D] "
                     f"with N >= start + T = {start + q.shape[0]} (query t at position "
                     f"start + t)")
  if k_scale is not None:  # checked whole here: the segments see slices of it
    _checks.check_key_scale(k, jnp.asarray(k_scale), (k.shape[0],))
  vs, ix = [], []
  for lo, hi in causal_segments(q.shape[0], segments):
    end = min(k.shape[0], -(-(start + hi) // key_align) * key_align)
    v, i = prefill_topk(q[lo:hi], k[:end], w[lo:hi], topk,
                        k_scale=None if k_scale is None else jnp.asarray(k_scale)[:end],
                        query_positions=jnp.arange(start + lo, start + hi, dtype=jnp.int32),
                        sorted=sorted, implementation=implementation, **options)
    vs.append(v)
    ix.append(i)
  return jnp.concatenate(vs), jnp.concatenate(ix)


CHUNK_SCORE_BYTES = 1 << 29  # at most 512 MiB of chunk scores by default


def default_query_chunk(t: int, n: int = 0) -> int:
  """`prefill_topk`'s default query chunk for T queries against N keys: T / 16 rounded down to
  a multiple of 8, and at most CHUNK_SCORE_BYTES of [chunk, N] float32 scores (so a whole
  1M-token sequence, T = N, still runs in 128-query chunks); at least 8, at most T."""
  c = (t // 16) // 8 * 8
  if n:
    c = min(c, CHUNK_SCORE_BYTES // (4 * n) // 8 * 8)
  return min(t, max(8, c))


@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8, 9, 10))
def _prefill_topk_kernels(q, k, w, k_scale, positions, topk, is_sorted, chunk, pcfg, tcfg, plat):
  from pallas_kernels import indexer_prefill, topk as ktopk
  t, h, d = q.shape
  n = k.shape[0]
  nc = -(-t // chunk)
  tp = nc * chunk
  pos = _checks.clip_positions(positions, n)
  qs = jnp.pad(q, ((0, tp - t), (0, 0), (0, 0))).reshape(nc, chunk, h, d)
  ws = jnp.pad(w, ((0, tp - t), (0, 0))).reshape(nc, chunk, h)
  ps = jnp.pad(pos, (0, tp - t), constant_values=-1).reshape(nc, chunk)
  kk = min(topk, n)

  def one(xs):
    qc, wc, pc = xs
    z = indexer_prefill.prefill_scores(qc, k, wc, k_scale=k_scale, query_positions=pc,
                                       config=pcfg, platform=plat)
    return ktopk.topk_rows(z, pc + 1, kk, tcfg, plat, ordered=is_sorted)

  v, i = lax.map(one, (qs, ws, ps))
  v, i = v.reshape(tp, kk)[:t], i.reshape(tp, kk)[:t]
  if topk > kk:
    v = jnp.pad(v, ((0, 0), (0, topk - kk)), constant_values=NEG_INF)
    i = jnp.pad(i, ((0, 0), (0, topk - kk)), constant_values=-1)
  return v.astype(jnp.float32), i


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _prefill_topk(q, k, w, k_scale, positions, topk, is_sorted, block):
  n, d = k.shape
  t = q.shape[0]
  b = min(block, n)
  nb = -(-n // b)
  pad = nb * b - n
  kb = jnp.pad(k, ((0, pad), (0, 0))).reshape(nb, b, d)
  sb = None if k_scale is None else jnp.pad(k_scale, (0, pad)).reshape(nb, b)
  kk = min(topk, b)
  pos = _checks.clip_positions(positions, n)

  def step(carry, xs):
    v, i = carry
    j, keys = xs[0], xs[1]
    z = _indexer.indexer_scores_xla(q, keys, w, None if sb is None else xs[2], None)
    idx = j * b + jnp.arange(b)
    ok = (idx[None, :] <= pos[:, None]) & (idx[None, :] < n)
    bv, bi = topk_xla(jnp.where(ok, z, NEG_INF), kk)
    bi = jnp.where(bi >= 0, j * b + bi, -1)
    return merge_topk(v, i, bv, bi, topk), None

  init = (jnp.full((t, topk), NEG_INF, jnp.float32), jnp.full((t, topk), -1, jnp.int32))
  xs = (jnp.arange(nb), kb) if sb is None else (jnp.arange(nb), kb, sb)
  (v, i), _ = lax.scan(step, init, xs)
  if not is_sorted:
    key = jnp.where(i >= 0, i, jnp.iinfo(jnp.int32).max)
    key, v = lax.sort((key, v), dimension=1, num_keys=1)
    i = jnp.where(key == jnp.iinfo(jnp.int32).max, -1, key)
  return v, i

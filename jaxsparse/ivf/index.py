"""AttentionIndex's causal, versioned inverted-file index over indexer keys (pure functions).

The index state is a static-shape pytree for a key capacity N and a group capacity G:

  assign   [N] int16    group of each key; -1 for sink keys and keys not yet grouped
  rank     [N] int16    a key's rank among its group's members, by position (saturating at
                        32767: only ranks below the budget matter)
  sizes    [G] int32    members per group (0 for unused group slots)
  last     [G] int32    position of each group's newest member (-1 when unused)
  centers  [G, D] bf16  k-means centers (= member means after every seal or refit, rounded)
  upper    [N] bf16     upper bound on a key's distance to its own center (rounded up)
  lower    [N] bf16     lower bound on its distance to every other center (rounded down;
                        Hamerly's single bound: the Elkan-style per-center bounds folded into
                        their minimum)

With config.compact=False the per-key arrays are int32 / float32 and the centers float32;
assign is int32 whenever G > 32767 and rank whenever budget > 32767. Compact, the state is
8 bytes a key plus 264 bytes a group of ~cluster_size keys (10.1 bytes a key at the default
128); every computation reads it back as int32 / float32, so only the stored bounds loosen
(by at most 2^-8 relative) and the centers round to bfloat16.
  groups   int32        groups in use
  grouped_end int32     every key before it (past the sinks) is grouped: a version holds
                        exactly the keys [0, grouped_end)
  refit_end int32       keys before it were grouped by the last refit (their bounds are live)
  refit_groups int32    groups in use right after the last refit (later ones came from seals)
  compared int32        keys the last refit compared with every center

Maintenance (paper, "How is the index built during computation?"):
  seal(state, k, p)   groups the window [p - W, p) into W / cluster_size new groups (a few
                      Lloyd steps on those keys alone) and appends them; old groups untouched.
                      Windows cluster independently, so `cluster_windows(k, config)` runs
                      every window's k-means in one batched call and `seal(..., clusters=)`
                      only appends its window's result.
  refit(state, k, p)  regroups the whole prefix [sink, p): warm start from every current
                      center (the last refit's and those the seals since added from recent
                      keys), one assign-and-update pass where only keys whose bounds do not
                      settle their membership are compared with every center.
Each call returns a new state: a version. A query at position n may use a version only when
its grouped_end <= n + 1, so no query ever ranks a group holding a key after its position.
`platform` (a `pallas_kernels.KernelPlatform`, optional) runs the assignment step as the
Pallas kernel (`pallas_kernels.ivf.assign_nearest`). `sink` (optional, may be traced)
overrides config.sink for one call: a shard of a sharded
index holds the sequence's sinks only if it holds its start (`jaxsparse.distributed.ivf`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["init_state", "seal", "cluster_windows", "refit", "group_capacity", "representatives",
           "member_means", "index_bytes", "state_dtypes"]


def group_capacity(num_keys: int, config) -> int:
  """Static group slots for `num_keys` keys: one per cluster_size keys plus one seal's worth."""
  per_seal = config.seal_window // config.cluster_size
  return -(-max(num_keys - config.sink, 0) // config.cluster_size) + per_seal + 1


def state_dtypes(num_keys: int, config) -> dict:
  """The dtypes `init_state` stores: {"assign", "rank", "float", "centers"}."""
  small = bool(config.compact)
  g = group_capacity(num_keys, config)
  return {"assign": jnp.int16 if small and g < 2 ** 15 else jnp.int32,
          "rank": jnp.int16 if small and config.budget < 2 ** 15 else jnp.int32,
          "float": jnp.bfloat16 if small else jnp.float32,
          "centers": jnp.bfloat16 if small else jnp.float32}


def init_state(num_keys: int, dim: int, config) -> dict:
  g = group_capacity(num_keys, config)
  dt = state_dtypes(num_keys, config)
  return {
      "assign": jnp.full((num_keys,), -1, dt["assign"]),
      "rank": jnp.zeros((num_keys,), dt["rank"]),
      "sizes": jnp.zeros((g,), jnp.int32),
      "last": jnp.full((g,), -1, jnp.int32),
      "centers": jnp.zeros((g, dim), dt["centers"]),
      "upper": jnp.zeros((num_keys,), dt["float"]),
      "lower": jnp.zeros((num_keys,), dt["float"]),
      "groups": jnp.int32(0),
      "grouped_end": jnp.int32(0),
      "refit_end": jnp.int32(0),
      "refit_groups": jnp.int32(0),  # groups in use right after the last refit
      "compared": jnp.int32(0),  # keys the last refit compared with every center
  }


def _store_bound(x, like, up: bool):
  """float32 bounds -> like.dtype, rounded so an upper bound stays above (up=True) and a lower
  bound below the float32 value."""
  if like.dtype == jnp.float32:
    return x
  y = x.astype(like.dtype)
  yf = y.astype(jnp.float32)
  bad = yf < x if up else yf > x
  return jnp.where(bad, jnp.nextafter(y, jnp.asarray(jnp.inf if up else -jnp.inf, y.dtype)), y)


def _store_rank(rank, like):
  return jnp.minimum(rank, jnp.iinfo(like.dtype).max).astype(like.dtype)


def _sqdist(x, c):
  """[M, D] x [G, D] -> [M, G] squared Euclidean distances (float32)."""
  x = x.astype(jnp.float32)
  return jnp.maximum((x * x).sum(-1)[:, None] - 2.0 * x @ c.T + (c * c).sum(-1)[None, :], 0.0)


def _members_rank(assign, num_groups_cap):
  """Rank of each key among the keys of its group, by position (-1 keys are ranked among
  themselves; nothing reads an ungrouped key's rank)."""
  n = assign.shape[0]
  key = jnp.where(assign >= 0, assign, num_groups_cap)
  order = jnp.lexsort((jnp.arange(n), key))  # by group, then position
  sorted_g = key[order]
  first = jnp.searchsorted(sorted_g, sorted_g, side="left")
  rank_sorted = jnp.arange(n) - first
  return jnp.zeros((n,), jnp.int32).at[order].set(rank_sorted.astype(jnp.int32))


def _group_stats(assign, keys, g):
  """sizes [G], sums [G, D], last member position [G] of an assignment."""
  valid = assign >= 0
  seg = jnp.where(valid, assign, g)
  sizes = jax.ops.segment_sum(valid.astype(jnp.int32), seg, num_segments=g + 1)[:g]
  sums = jax.ops.segment_sum(jnp.where(valid[:, None], _finite_rows(keys.astype(jnp.float32)),
                                       0.0), seg, num_segments=g + 1)[:g]
  last = jax.ops.segment_max(jnp.where(valid, jnp.arange(assign.shape[0]), -1), seg,
                             num_segments=g + 1)[:g]
  return sizes, sums, jnp.maximum(last, -1)


def _finite_rows(x):
  """Keys [M, D] float32 with every row holding a NaN or +-inf set to 0. The index groups such
  a key as the zero vector (k-means assignment in seals and refits, and the member means that
  become the centers and representatives), so XLA and the kernels build the same groups and
  every representative is finite; the key's own exact score (IEEE) still decides whether it
  is chosen as a candidate."""
  return jnp.where(jnp.isfinite(x).all(-1, keepdims=True), x, 0.0)


def _nearest(x, centers, used, platform):
  """(nearest used center, ties to the lower id; its squared distance; the second smallest)
  for keys x [M, D]: the Pallas kernel (`pallas_kernels.ivf.assign_nearest`) when platform is
  given, else XLA."""
  if platform is not None:
    from pallas_kernels.ivf import assign_nearest
    return assign_nearest(x, centers, used, platform=platform)
  d = jnp.where(used[None, :], _sqdist(x, centers.astype(jnp.float32)), jnp.inf)
  a = jnp.argmin(d, axis=1).astype(jnp.int32)
  d1 = jnp.take_along_axis(d, a[:, None], 1)[:, 0]
  d2 = jnp.min(jnp.where(jnp.arange(d.shape[1])[None, :] == a[:, None], jnp.inf, d), axis=1)
  return a, d1, d2


def _cluster_window(win, start, config, sink, platform):
  """k-means of one seal window: win [W, D] float32 keys at positions start..start + W - 1
  (those before `sink` take no part) -> (a [W] int32 local group ids, centers [W / cs, D]
  float32 (the final members' means), d1 [W] squared distance to the own center, d2 [W] to
  the nearest other)."""
  w, cs = config.seal_window, config.cluster_size
  gw = w // cs
  win = _finite_rows(win)
  pos = start + jnp.arange(w)
  valid = pos >= sink
  # init: gw keys evenly spaced over the window's valid part
  first = jnp.maximum(sink - start, 0)
  pick = first + (jnp.arange(gw) * (w - first)) // gw
  centers = win[pick]

  every = jnp.ones((gw,), bool)

  def lloyd(_, c):
    a = _nearest(win, c, every, platform)[0]
    oh = jax.nn.one_hot(a, gw, dtype=jnp.float32) * valid[:, None]
    cnt = oh.sum(0)
    return jnp.where(cnt[:, None] > 0, (oh.T @ win) / jnp.maximum(cnt, 1)[:, None], c)

  centers = jax.lax.fori_loop(0, config.seal_iters, lloyd, centers)
  # a last assignment, then the centers become exactly its members' means, and the bounds are
  # the distances to them (as stored: see _seal)
  a = _nearest(win, centers, every, platform)[0]
  oh = jax.nn.one_hot(a, gw, dtype=jnp.float32) * valid[:, None]
  cnt = oh.sum(0)
  centers = jnp.where(cnt[:, None] > 0, (oh.T @ win) / jnp.maximum(cnt, 1)[:, None], centers)
  return a, centers


def _window_clusters(keys, config, sink, platform, num_windows):
  """`_cluster_window` of windows 0 .. num_windows - 1 at once (their k-means are independent
  of each other and of the index): (a [V, W], centers [V, W / cs, D])."""
  w = config.seal_window
  wins = keys[:num_windows * w].astype(jnp.float32).reshape(num_windows, w, keys.shape[1])
  starts = jnp.arange(num_windows) * w
  one = lambda x, s: _cluster_window(x, s, config, sink, platform)  # noqa: E731
  if platform is not None and platform.kind == "tpu":
    # a loop inside one program: a TPU has no launches to save (and Pallas's TPU interpreter
    # cannot batch the kernel)
    return jax.lax.map(lambda xs: one(*xs), (wins, starts))
  return jax.vmap(one)(wins, starts)


def cluster_windows(keys, config, platform=None, sink=None):
  """The k-means of every complete seal window of keys [N, D] in one batched computation, for
  `seal(..., clusters=)`: on a GPU, one launch per Lloyd step for all windows instead of per
  window. Returns a pytree of [N // seal_window, ...] arrays."""
  sink = config.sink if sink is None else sink
  num = keys.shape[0] // config.seal_window
  if num == 0:  # shorter than one window: nothing seals (no kernel runs on an empty batch)
    one = jax.eval_shape(functools.partial(_window_clusters, config=config, sink=sink,
                                           platform=platform, num_windows=1),
                         jax.ShapeDtypeStruct((config.seal_window, keys.shape[1]), keys.dtype))
    return jax.tree.map(lambda s: jnp.zeros((0,) + s.shape[1:], s.dtype), one)
  return _cluster_windows(keys, config=config, sink=sink, platform=platform, num_windows=num)


_cluster_windows = jax.jit(_window_clusters, static_argnames=("config", "sink", "platform",
                                                              "num_windows"))


def _seal(state, keys, p, config, sink=None, platform=None, clusters=None):
  w, cs = config.seal_window, config.cluster_size
  sink = config.sink if sink is None else sink
  gw = w // cs
  start = p - w
  win = _finite_rows(jax.lax.dynamic_slice_in_dim(keys, start, w).astype(jnp.float32))
  pos = start + jnp.arange(w)
  valid = pos >= sink
  if clusters is None:
    a, centers = _cluster_window(win, start, config, sink, platform)
  else:  # precomputed by cluster_windows: window p / W - 1
    a, centers = (x[p // w - 1] for x in clusters)
  centers = centers.astype(state["centers"].dtype)
  dist = jnp.sum((win[:, None, :] - centers.astype(jnp.float32)[None]) ** 2, -1)  # [W, gw]
  mine = jnp.arange(gw)[None, :] == a[:, None]
  d1 = jnp.sum(jnp.where(mine, dist, 0.0), axis=1)
  d2 = jnp.min(jnp.where(mine, jnp.inf, dist), axis=1)
  gid = jnp.where(valid, state["groups"] + a, -1).astype(state["assign"].dtype)
  assign = jax.lax.dynamic_update_slice_in_dim(state["assign"], gid, start, 0)
  centers_all = jax.lax.dynamic_update_slice_in_dim(state["centers"], centers,
                                                    state["groups"], 0)
  # the new groups hold only window keys and old groups are untouched: sizes, newest members
  # and ranks come from the window alone (O(W), not O(N) per seal)
  oh = (jax.nn.one_hot(a, gw, dtype=jnp.int32) * valid[:, None])  # [W, gw]
  cnt = oh.sum(0)
  sizes = jax.lax.dynamic_update_slice_in_dim(state["sizes"], cnt, state["groups"], 0)
  newest = jnp.max(jnp.where(oh > 0, pos[:, None], -1), axis=0)
  last = jax.lax.dynamic_update_slice_in_dim(state["last"], newest, state["groups"], 0)
  wrank = jnp.take_along_axis(jnp.cumsum(oh, 0), a[:, None], 1)[:, 0] - 1
  rank = jax.lax.dynamic_update_slice_in_dim(
      state["rank"], _store_rank(jnp.where(valid, wrank, 0), state["rank"]), start, 0)
  own = _store_bound(jnp.sqrt(d1), state["upper"], up=True)
  other = _store_bound(jnp.sqrt(d2), state["lower"], up=False)
  upper = jax.lax.dynamic_update_slice_in_dim(state["upper"], own, start, 0)
  lower = jax.lax.dynamic_update_slice_in_dim(state["lower"], other, start, 0)
  return {**state, "assign": assign, "rank": rank, "sizes": sizes,
          "last": last, "centers": centers_all, "upper": upper, "lower": lower,
          "groups": state["groups"] + gw, "grouped_end": jnp.asarray(p, jnp.int32)}


def _refit(state, keys, p, config, sink=None, platform=None):
  sink = config.sink if sink is None else sink
  n = keys.shape[0]
  g = state["sizes"].shape[0]
  kf = _finite_rows(keys.astype(jnp.float32))
  pos = jnp.arange(n)
  grouped = (pos >= sink) & (pos < p)
  used = jnp.arange(g) < state["groups"]
  centers = state["centers"].astype(jnp.float32)
  assign = state["assign"].astype(jnp.int32)
  upper, lower = state["upper"].astype(jnp.float32), state["lower"].astype(jnp.float32)
  old = grouped & (pos < state["refit_end"])  # bounds live from the last refit
  # centers added since the last refit (by seals) may now be closer: tighten the lower bound
  # (they are the slots [refit_groups, groups): compared a block of `blk` at a time, so a
  # refit costs N x new centers here, not N x G)
  blk = min(g, max(config.refit_interval, config.seal_window) // config.cluster_size)

  def nearest_new(i, m):
    lo = state["refit_groups"] + i * blk
    start = jnp.minimum(lo, g - blk)
    ids = start + jnp.arange(blk)
    ok = (ids >= lo) & (ids < state["groups"])
    d = _sqdist(kf, jax.lax.dynamic_slice_in_dim(centers, start, blk))
    return jnp.minimum(m, jnp.min(jnp.where(ok[None, :], d, jnp.inf), axis=1))

  blocks = (state["groups"] - state["refit_groups"] + blk - 1) // blk
  d_new = jax.lax.fori_loop(0, blocks, nearest_new, jnp.full((n,), jnp.inf, jnp.float32))
  lower = jnp.where(old, jnp.minimum(lower, jnp.sqrt(d_new)), lower)
  settled = old & (upper <= lower)
  own = jnp.sqrt(jnp.sum((kf - centers[jnp.maximum(assign, 0)]) ** 2, -1))
  upper = jnp.where(old & ~settled, own, upper)
  settled = old & (upper <= lower)
  need = grouped & ~settled  # new keys, and old keys whose bounds do not settle membership
  cap = min(n, config.refit_batch)
  total = need.sum()

  def body(carry):
    assign, upper, lower, todo = carry
    idx = jnp.nonzero(todo, size=cap, fill_value=n)[0]
    ok = idx < n
    safe = jnp.minimum(idx, n - 1)
    # against every used center, as stored (bf16 keys and centers: exact products)
    a, d1, d2 = _nearest(_finite_rows(keys[safe].astype(jnp.float32)).astype(keys.dtype),
                         state["centers"], used, platform)
    tgt = jnp.where(ok, idx, n)
    assign = assign.at[tgt].set(a, mode="drop")
    upper = upper.at[tgt].set(jnp.sqrt(d1), mode="drop")
    lower = lower.at[tgt].set(jnp.sqrt(d2), mode="drop")
    todo = todo.at[tgt].set(False, mode="drop")
    return assign, upper, lower, todo

  assign, upper, lower, _ = jax.lax.while_loop(lambda c: c[3].any(), body,
                                               (assign, upper, lower, need))
  assign = jnp.where(grouped, assign, -1)
  # update: centers become their members' means; bounds follow the centers' moves
  sizes, sums, last = _group_stats(assign, keys, g)
  new_centers = jnp.where(sizes[:, None] > 0, sums / jnp.maximum(sizes, 1)[:, None], centers)
  new_centers = new_centers.astype(state["centers"].dtype)  # the moves of the stored centers
  delta = jnp.sqrt(jnp.sum((new_centers.astype(jnp.float32) - centers) ** 2, -1))
  upper = jnp.where(grouped, upper + delta[jnp.maximum(assign, 0)], upper)
  lower = jnp.where(grouped, lower - jnp.max(jnp.where(used, delta, 0.0)), lower)
  return {**state, "assign": assign.astype(state["assign"].dtype),
          "rank": _store_rank(_members_rank(assign, g), state["rank"]), "sizes": sizes,
          "last": last, "centers": new_centers,
          "upper": _store_bound(upper, state["upper"], up=True),
          "lower": _store_bound(lower, state["lower"], up=False),
          "grouped_end": jnp.asarray(p, jnp.int32), "refit_end": jnp.asarray(p, jnp.int32),
          "refit_groups": state["groups"], "compared": total.astype(jnp.int32)}


seal = jax.jit(_seal, static_argnames=("config", "platform"))
refit = jax.jit(_refit, static_argnames=("config", "platform"))


def member_means(assign, keys, num_groups: int):
  """[G, D] float32 mean of each group's member keys (0 for empty groups; a key holding NaN
  or +-inf counts as the zero vector, as the index groups it): assign [N] int (-1:
  ungrouped), keys [N, D]."""
  sizes, sums, _ = _group_stats(assign, keys, num_groups)
  return jnp.where(sizes[:, None] > 0, sums / jnp.maximum(sizes, 1)[:, None], 0.0)


def representatives(state, keys, corrector=None, metric=None):
  """Group representatives [G, D] at the centers' dtype (bfloat16 when compact): the member
  means, which every seal and refit leaves in `centers` (so without a corrector this reads
  nothing else), plus the learned correction of the float32 means when a corrector is given.
  Rows of empty groups are unspecified (no query may rank them).

  With a grouping metric A [D, D] (`jaxsparse.ivf.metric`) the index was built on keys @ A, so
  its centers live in that basis; a correction is then made from the original keys [N, D] and
  mapped the same way (queries rank these with q @ A^-1)."""
  if corrector is None:
    return state["centers"]
  mean = member_means(state["assign"], keys, state["sizes"].shape[0])
  rep = mean + corrector(state, keys, mean)
  if metric is not None:
    rep = rep @ jnp.asarray(metric, jnp.float32)
  return rep.astype(state["centers"].dtype)


def index_bytes(num_keys: int, dim: int, config) -> int:
  """Bytes the index state holds beside the key cache (every array of `init_state`), plus
  one representative per group at the centers' dtype (what a version's ranking reads)."""
  st = jax.eval_shape(lambda: init_state(num_keys, dim, config))
  g = group_capacity(num_keys, config)
  rep = jnp.dtype(state_dtypes(num_keys, config)["centers"]).itemsize
  return (sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(st))
          + g * dim * rep)

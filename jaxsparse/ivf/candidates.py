"""Candidate packing: fixed slots for sinks and ungrouped keys, then whole groups by rank."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._util import masked_relu

__all__ = ["representative_scores", "candidate_mask", "candidate_indices", "inverted_lists",
           "lists_by_rank", "fixed_slots", "ranked_groups", "usable_scores"]


def representative_scores(q, w, reps, valid):
  """Indexer score of every group representative: sum_h w_h relu(q_h . rep_g).

  q [Q, H, D], w [Q, H], reps [G, D] float32, valid [Q, G] bool -> [Q, G] float32 (-inf where
  a group is not usable by that query). A usable group never scores -inf or NaN: a mean
  holding NaN / inf (a NaN or inf key, or a negative weight times an infinite dot) ranks last
  as -float32 max, so its finite members stay candidates (README "Input rules").
  """
  s = jnp.einsum("qhd,gd->qhg", q.astype(jnp.float32), reps.astype(jnp.float32))
  wf = w.astype(jnp.float32)
  z = jnp.einsum("qhg,qh->qg", masked_relu(s, wf[..., None]), wf)
  return usable_scores(z, valid)


def usable_scores(z, valid):
  """Group scores z [Q, G] -> -inf where not `valid`, else z with NaN and -inf raised to
  -float32 max (ranked after every number, but still usable)."""
  low = jnp.float32(-jnp.finfo(jnp.float32).max)
  return jnp.where(valid, jnp.where(z > -jnp.inf, z, low), -jnp.inf)


def _nan_last(group_scores):
  """A NaN representative score (a group holding a NaN key) ranks after every number but the
  group stays usable (README "Input rules"); -inf still marks an unusable group."""
  return jnp.where(jnp.isnan(group_scores), -jnp.finfo(jnp.float32).max, group_scores)


def candidate_mask(group_scores, sizes, assign, rank, grouped_end, positions, *, budget: int,
                   sink: int):
  """Which keys each query scores exactly (paper: "How does a query choose candidates?").

  group_scores [Q, G] (-inf: unusable), sizes [G] int32, assign [N] int32 (-1: not grouped),
  rank [N] int32 (rank within its group), grouped_end [Q] and positions [Q] int32.
  Sink keys [0, sink) and the visible ungrouped keys [grouped_end, position] take fixed slots;
  the rest of `budget` takes every member of each group in rank order of its score, the last
  group cut to fit (its earliest members kept). Ties in score go to the lower group id.
  Returns (mask [Q, N] bool, num_candidates [Q] int32).
  """
  n = assign.shape[0]
  pos = jnp.arange(n)
  visible = pos[None, :] <= positions[:, None]
  fixed = visible & ((pos[None, :] < sink) | (pos[None, :] >= grouped_end[:, None]))
  room = budget - fixed.sum(1)
  group_scores = _nan_last(group_scores)
  order = jnp.argsort(-group_scores, axis=1, stable=True)
  usable = jnp.take_along_axis(group_scores, order, 1) > -jnp.inf
  sz = jnp.where(usable, sizes[order], 0)
  before = jnp.cumsum(sz, axis=1) - sz
  take_sorted = jnp.clip(room[:, None] - before, 0, sz)
  rows = jnp.arange(group_scores.shape[0])[:, None]
  take = jnp.zeros_like(take_sorted).at[rows, order].set(take_sorted)
  per_key = jnp.take_along_axis(take, jnp.broadcast_to(jnp.maximum(assign, 0)[None, :],
                                                       (take.shape[0], n)), 1)
  grouped = (assign[None, :] >= 0) & (rank[None, :] < per_key) & visible
  mask = fixed | grouped
  return mask, mask.sum(1).astype(jnp.int32)


def inverted_lists(assign, num_groups: int):
  """members [N] int32 (key ids sorted by group, then position; ungrouped keys last) and
  offsets [G] int32 (where each group's list starts): the index's inverted file."""
  n = assign.shape[0]
  key = jnp.where(assign >= 0, assign, num_groups)
  members = jnp.lexsort((jnp.arange(n), key)).astype(jnp.int32)
  offsets = jnp.searchsorted(key[members], jnp.arange(num_groups), side="left")
  return members, offsets.astype(jnp.int32)


@jax.jit
def lists_by_rank(assign, rank, sizes):
  """`inverted_lists` from an index state's stored ranks in one O(N) scatter, no sort: key i
  goes to slot offsets[assign[i]] + rank[i].

  assign [N] int (-1: not grouped), rank [N] int (a key's rank in its group by position;
  int16 ranks saturate at 32767), sizes [G] int32. Returns (members [N] int32, offsets [G]
  int32). Within each group's range the slots below the rank dtype's maximum hold exactly
  `inverted_lists`' members (all a query with budget < 32767 can read); slots past the
  grouped keys hold -1.
  """
  n = assign.shape[0]
  sizes = sizes.astype(jnp.int32)
  offsets = jnp.cumsum(sizes) - sizes
  a = assign.astype(jnp.int32)
  slot = jnp.where(a >= 0, offsets[jnp.maximum(a, 0)] + rank.astype(jnp.int32), n)
  members = jnp.full((n,), -1, jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32),
                                                       mode="drop")
  return members, offsets


def fixed_slots(positions, grouped_end, *, sink: int, window: int):
  """The fixed candidates [Q, sink + window] int32 (-1: none): the sink keys a query sees, then
  the visible ungrouped keys [grouped_end, position] (grouped_end + u, at most `window`)."""
  qn = positions.shape[0]
  s_idx = jnp.broadcast_to(jnp.arange(sink)[None, :], (qn, sink))
  s_idx = jnp.where(s_idx <= positions[:, None], s_idx, -1)
  u = grouped_end[:, None] + jnp.arange(window)[None, :]
  u_idx = jnp.where((u <= positions[:, None]) & (u >= sink), u, -1)
  return jnp.concatenate([s_idx, u_idx], axis=1).astype(jnp.int32)


def ranked_groups(group_scores, sizes, offsets, room):
  """Each query's groups in rank order with what it takes of them: group_scores [Q, G]
  (-inf: unusable; ties to the lower group id), sizes [G], offsets [G] (inverted-list
  starts), room [Q] (grouped slots). Returns, in rank order [Q, G] int32: start (where the
  group's members begin in the inverted lists), take (members taken, the earliest first:
  the last group is cut to fit), slot (the grouped slot its first member fills), and used
  [Q] int32 (ranked groups up to the last that takes members: the rest have take == 0)."""
  group_scores = _nan_last(group_scores)
  order = jnp.argsort(-group_scores, axis=1, stable=True)
  usable = jnp.take_along_axis(group_scores, order, 1) > -jnp.inf
  sz = jnp.where(usable, sizes[order], 0).astype(jnp.int32)
  cum = jnp.cumsum(sz, axis=1)
  slot = cum - sz
  take = jnp.clip(room[:, None] - slot, 0, sz)
  live = (slot < room[:, None]) & (sz > 0)
  used = jnp.max(jnp.where(live, jnp.arange(1, sz.shape[1] + 1)[None, :], 0), axis=1)
  return (offsets[order].astype(jnp.int32), take.astype(jnp.int32), slot.astype(jnp.int32),
          used.astype(jnp.int32))


def candidate_indices(group_scores, sizes, members, offsets, grouped_end, positions, *,
                      budget: int, sink: int, window: int):
  """The same candidates as `candidate_mask`, as key indices gathered from the inverted
  lists: what a prefill kernel reads, with no [Q, N] array.

  Layout per query (static, budget + window slots): sink slots [0, sink), then `window` slots
  for the ungrouped keys [grouped_end, position] (grouped_end + u), then budget - sink slots
  filled with group members in rank order, cut at the query's room. Unused slots hold -1.
  Returns (indices [Q, budget + window] int32, num_candidates [Q] int32).
  """
  fixed = fixed_slots(positions, grouped_end, sink=sink, window=window)
  room = budget - (fixed >= 0).sum(1)
  start, take, slot, _ = ranked_groups(group_scores, sizes, offsets, room)
  slots = jnp.arange(budget - sink)
  end = slot + take  # [Q, G] nondecreasing: the grouped slot after each ranked group
  r = jax.vmap(lambda c: jnp.searchsorted(c, slots, side="right"))(end)  # [Q, B]
  r = jnp.minimum(r, start.shape[1] - 1)
  member = (jnp.take_along_axis(start, r, 1) + slots[None, :]
            - jnp.take_along_axis(slot, r, 1))
  ok = slots[None, :] < take.sum(1, keepdims=True)
  g_idx = jnp.where(ok, members[jnp.clip(member, 0, members.shape[0] - 1)], -1)
  idx = jnp.concatenate([fixed, g_idx], axis=1).astype(jnp.int32)
  return idx, (idx >= 0).sum(1).astype(jnp.int32)

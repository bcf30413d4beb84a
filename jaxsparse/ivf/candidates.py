"""Candidate packing: fixed slots for sinks and ungrouped keys, then whole groups by rank."""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["representative_scores", "candidate_mask"]


def representative_scores(q, w, reps, valid):
  """Indexer score of every group representative: sum_h w_h relu(q_h . rep_g).

  q [Q, H, D], w [Q, H], reps [G, D] float32, valid [Q, G] bool -> [Q, G] float32 (-inf where
  a group is not usable by that query).
  """
  s = jnp.einsum("qhd,gd->qhg", q.astype(jnp.float32), reps.astype(jnp.float32))
  z = jnp.einsum("qhg,qh->qg", jnp.maximum(s, 0.0), w.astype(jnp.float32))
  return jnp.where(valid, z, -jnp.inf)


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
  order = jnp.argsort(-group_scores, axis=1, stable=True)
  usable = jnp.isfinite(jnp.take_along_axis(group_scores, order, 1))
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

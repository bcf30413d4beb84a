"""Helpers the AttentionIndex evaluation and prefill modules share: the grouping metric's
inputs, the corrector a caller names, and HiSA's fixed block partition (the exact causal
scores are `jaxsparse.ivf.prefill.exact_scores`; other packages reach these through
`jaxsparse.ivf.prefill.prefill_inputs`)."""
from __future__ import annotations

import os

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["metric_inputs", "resolve_corrector", "hisa_structure", "block_means"]


def metric_inputs(q, k, metric, layer, map_queries=True):
  """(index keys [N, D], ranking queries [N, H, D], A or None): k @ A and q @ A^-1 in the
  inputs' dtypes under a grouping metric, else k and q themselves. map_queries=False returns
  A^-1 [D, D] float32 in the queries' place (for callers that map a chunk at a time)."""
  from jaxsparse.ivf import metric as metric_mod
  a = metric_mod.resolve(metric, layer, k.shape[1])
  if a is None:
    return k, q, None
  inv = jnp.asarray(np.linalg.inv(a.astype(np.float64)).astype(np.float32))
  kx = (k.astype(jnp.float32) @ jnp.asarray(a)).astype(k.dtype)
  if not map_queries:
    return kx, inv, jnp.asarray(a)
  qx = jnp.einsum("nhd,de->nhe", q.astype(jnp.float32), inv).astype(q.dtype)
  return kx, qx, jnp.asarray(a)


def resolve_corrector(corrector, layer):
  """The representative correction `index.representatives` takes: None, a callable as given,
  a `corrector.Corrector` wrapped, or a corrector file's model for model layer `layer` (None
  where the file keeps plain means for that layer)."""
  from jaxsparse.ivf import corrector as corr_mod
  if corrector is None or callable(corrector) and not isinstance(corrector, corr_mod.Corrector):
    return corrector
  if isinstance(corrector, corr_mod.Corrector):
    return corr_mod.as_ivf_corrector(corrector)
  if not isinstance(corrector, (str, os.PathLike)):
    raise ValueError(f"corrector={corrector!r} must be None, a Corrector, a callable or a "
                     "corrector file's path")
  models = corr_mod.load(str(corrector))
  if layer is not None and layer in corr_mod.file_meta(str(corrector)).get("plain_layers", []):
    return None  # the file keeps plain means for this layer
  if layer is None or layer not in models:
    raise ValueError(f"layer={layer} must name a layer the corrector file holds: "
                     f"{sorted(models)}")
  return corr_mod.as_ivf_corrector(models[layer])


def hisa_structure(n, config):
  """HiSA's fixed partition of n keys: block g holds keys sink + g * cluster_size ... (numpy
  assign [N] int32, -1 for sinks; rank [N] int32 inside the block; sizes [G] int32; last [G]
  int32, the block's last position)."""
  cs, sink = config.cluster_size, config.sink
  pos = np.arange(n)
  assign = np.where(pos >= sink, (pos - sink) // cs, -1).astype(np.int32)
  g = max(1, -(-(n - sink) // cs))
  rank = np.where(pos >= sink, (pos - sink) % cs, 0).astype(np.int32)
  sizes = np.bincount(assign[assign >= 0], minlength=g).astype(np.int32)
  last = (sink + (np.arange(g) + 1) * cs - 1).astype(np.int32)
  return assign, rank, sizes, last


@functools.partial(jax.jit, static_argnums=2)
def block_means(k, assign, g):
  """[g, D] float32 mean key of each of the g groups of `assign` (-1: in no group)."""
  a = jnp.asarray(assign)
  seg = jnp.where(a >= 0, a, g)
  s = jax.ops.segment_sum(k.astype(jnp.float32), seg, g + 1)[:g]
  c = jax.ops.segment_sum(jnp.ones(k.shape[0]), seg, g + 1)[:g]
  return s / jnp.maximum(c, 1)[:, None]


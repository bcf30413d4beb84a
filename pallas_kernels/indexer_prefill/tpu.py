"""Causal prefill indexer scoring on TPU (Pallas, Mosaic TPU).

Grid (query tiles, key tiles). A per-query-tile "last needed key tile" is scalar-prefetched; the
key index map clamps to it, so tiles above the causal diagonal issue no DMA and only write -inf.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._util import masked_relu, tpu_interpret_params
from pallas_kernels.indexer_prefill.config import PrefillConfig

__all__ = [
    "NEG_INF", "prefill_scores_tpu"
]


NEG_INF = float("-inf")


def _prefill_kernel(last_ref, pos_ref, q_ref, w_ref, k_ref, *rest, heads: int, block_t: int,
                    block_n: int, has_scale: bool):
  """last_ref: [T / block_t] (SMEM); pos_ref: [block_t, 1]; q_ref: [block_t * H, D];
  w_ref: [block_t * H, 1]; k_ref: [block_n, D]; scale_ref: [1, block_n]; o_ref: [block_t, block_n]."""
  if has_scale:
    scale_ref, o_ref = rest
  else:
    (o_ref,) = rest
  i, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j <= last_ref[i])
  def _():
    cd = jnp.bfloat16 if q_ref.dtype == jnp.float8_e4m3fn else q_ref.dtype
    k = k_ref[...].astype(cd)
    s = lax.dot_general(q_ref[...].astype(cd), k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)  # [block_t*H, block_n]
    wv = w_ref[...]
    p = masked_relu(s, wv) * wv
    z = jnp.concatenate(
        [jnp.sum(p[r * heads:(r + 1) * heads], axis=0, keepdims=True) for r in range(block_t)],
        axis=0)
    if has_scale:
      z = z * scale_ref[...]
    key = j * block_n + lax.broadcasted_iota(jnp.int32, (block_t, block_n), 1)
    o_ref[...] = jnp.where(key <= pos_ref[...], z, NEG_INF)

  @pl.when(j > last_ref[i])
  def _():
    o_ref[...] = jnp.full((block_t, block_n), NEG_INF, jnp.float32)


def prefill_scores_tpu(q, k, w, k_scale, positions, *, config: PrefillConfig,
                       interpret: bool = False):
  """q [T, H, D] (T % block_t == 0, H % 8 == 0), k [N_pad, D] (N_pad % block_n == 0),
  positions [T] int32 (already clipped to N - 1) -> [T, N_pad] float32."""
  t, h, d = q.shape
  n = k.shape[0]
  bt, bn = config.block_t, config.block_n
  if bt % 8 or bn % 128:
    raise NotImplementedError(f"TPU prefill needs block_t % 8 == 0 and block_n % 128 == 0; "
                              f"got {config}")
  last = (jnp.max(positions.reshape(t // bt, bt), axis=1) // bn).astype(jnp.int32)
  has_scale = k_scale is not None
  in_specs = [
      pl.BlockSpec((bt, 1), lambda i, j, last: (i, 0)),
      pl.BlockSpec((bt * h, d), lambda i, j, last: (i, 0)),
      pl.BlockSpec((bt * h, 1), lambda i, j, last: (i, 0)),
      pl.BlockSpec((bn, d), lambda i, j, last: (jnp.maximum(jnp.minimum(j, last[i]), 0), 0)),
  ]
  args = [positions.reshape(t, 1), q.reshape(t * h, d), w.reshape(t * h, 1).astype(jnp.float32),
          k]
  if has_scale:
    in_specs.append(pl.BlockSpec((1, bn),
                                 lambda i, j, last: (0, jnp.maximum(jnp.minimum(j, last[i]), 0))))
    args.append(k_scale.reshape(1, n))
  kernel = functools.partial(_prefill_kernel, heads=h, block_t=bt, block_n=bn,
                             has_scale=has_scale)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(t // bt, n // bn),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((bt, bn), lambda i, j, last: (i, j)),
      ),
      out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=tpu_interpret_params() if interpret else False,
      name="jaxsparse_prefill_scores_tpu",
  )(last, *args)

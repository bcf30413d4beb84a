"""Causal prefill indexer scoring on GPU (Pallas, Triton backend).

Each program holds `block_t` queries (all heads: a [block_t * H, D] operand) and loops over
`tiles_per_program` key tiles: dot, ReLU, head weights and the head sum are fused so [T, H, N]
never reaches memory. Key tiles past the largest query position of the tile are not computed
(written -inf). Triton rather than Mosaic GPU: see indexer_decode/gpu.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import masked_relu
from pallas_kernels.indexer_prefill.config import PrefillConfig

__all__ = [
    "NEG_INF", "prefill_scores_gpu"
]


NEG_INF = float("-inf")


def _prefill_kernel(pos_ref, q_ref, w_ref, k_ref, *rest, heads: int, block_t: int,
                    block_n: int, tiles: int, n_keys: int, has_scale: bool):
  """pos_ref: [block_t] int32; q_ref: [block_t * H, D]; w_ref: [block_t * H];
  k_ref: [tiles * block_n, D]; scale_ref: [tiles * block_n]; o_ref: [block_t, tiles * block_n]."""
  if has_scale:
    scale_ref, o_ref = rest
  else:
    (o_ref,) = rest
  j = pl.program_id(1)
  pos = pos_ref[...]
  first_key = j * tiles * block_n
  # causal skip: tiles whose first key is past every query's position are all -inf
  active = jnp.clip(pl.cdiv(jnp.max(pos) + 1 - first_key, block_n), 0, tiles)
  q = q_ref[...]
  w = w_ref[...].astype(jnp.float32)

  def body(s, carry):
    k = k_ref[pl.ds(s * block_n, block_n), :].astype(q.dtype)
    sc = plgpu.dot(q, k, trans_b=True)  # [block_t*H, block_n] f32
    p = masked_relu(sc, w[:, None]) * w[:, None]
    z = p.reshape(block_t, heads, block_n).sum(axis=1)
    if has_scale:
      z = z * scale_ref[pl.ds(s * block_n, block_n)][None, :]
    key = first_key + s * block_n + lax.broadcasted_iota(jnp.int32, (block_t, block_n), 1)
    z = jnp.where((key <= pos[:, None]) & (key < n_keys), z, NEG_INF)
    o_ref[:, pl.ds(s * block_n, block_n)] = z
    return carry

  lax.fori_loop(0, active, body, 0)

  def fill(s, carry):
    o_ref[:, pl.ds(s * block_n, block_n)] = jnp.full((block_t, block_n), NEG_INF, jnp.float32)
    return carry

  lax.fori_loop(active, tiles, fill, 0)


def prefill_scores_gpu(q, k, w, k_scale, positions, *, config: PrefillConfig,
                       interpret: bool = False):
  """q [T, H, D] (T % block_t == 0, H power of two), k [N_pad, D] (N_pad % span == 0),
  positions [T] int32 -> [T, N_pad] float32."""
  t, h, d = q.shape
  n = k.shape[0]
  bt, bn, tiles = config.block_t, config.block_n, config.tiles_per_program
  span = bn * tiles
  has_scale = k_scale is not None
  kernel = functools.partial(_prefill_kernel, heads=h, block_t=bt, block_n=bn, tiles=tiles,
                             n_keys=n, has_scale=has_scale)
  in_specs = [
      pl.BlockSpec((bt,), lambda i, j: (i,)),
      pl.BlockSpec((bt * h, d), lambda i, j: (i, 0)),
      pl.BlockSpec((bt * h,), lambda i, j: (i,)),
      pl.BlockSpec((span, d), lambda i, j: (j, 0)),
  ]
  args = [positions, q.reshape(t * h, d), w.reshape(t * h).astype(jnp.float32), k]
  if has_scale:
    in_specs.append(pl.BlockSpec((span,), lambda i, j: (j,)))
    args.append(k_scale)
  return pl.pallas_call(
      kernel,
      grid=(t // bt, n // span),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bt, span), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((t, n), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="jaxsparse_prefill_scores",
  )(*args)

"""AttentionIndex kernels on GPU (Pallas Triton): k-means assignment and the scoring of
gathered candidate keys."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ivf.common import assign_call

__all__ = ["assign_gpu", "gathered_scores_gpu"]

NEG_INF = float("-inf")


def _dot(a, b):  # a [M, D] . b [N, D]^T in float32 (no TF32: distances decide assignments)
  return jnp.dot(a, b.T, precision=jax.lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)


def assign_gpu(x, c, cn, *, block_m: int, block_c: int, num_warps: int, interpret: bool):
  """x [M, D] (M % block_m == 0), c [Gp, D], cn [1, Gp] -> (a, d1, d2) [M, 1]."""
  return assign_call(x, c, cn, block_m=block_m, block_c=block_c, dot=_dot,
                     compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
                     interpret=interpret, name="jaxsparse_ivf_assign")


def _gathered_kernel(q_ref, w_ref, i_ref, k_ref, o_ref, *, dim: int):
  """One (query, block of candidates): gather the candidates' keys (one pointer gather of
  [block, D]) and score them: sum_h w_h relu(q_h . k) -> o_ref [block] (-inf for id -1)."""
  ids = i_ref[...]
  safe = jnp.maximum(ids, 0)
  off = safe[:, None] * dim + jax.lax.broadcasted_iota(jnp.int32, (ids.shape[0], dim), 1)
  keys = plgpu.load(k_ref.at[off]).astype(jnp.float32)  # [block, D]
  s = jnp.dot(q_ref[...].astype(jnp.float32), keys.T, precision=jax.lax.Precision.HIGHEST,
              preferred_element_type=jnp.float32)  # [H, block]
  z = jnp.sum(jnp.maximum(s, 0.0) * w_ref[...], axis=0)
  o_ref[...] = jnp.where(ids >= 0, z, NEG_INF)


def gathered_scores_gpu(q, w, k, idx, *, block: int, num_warps: int, interpret: bool):
  """q [Q, H, D] (H >= 16), w [Q, H, 1], k [N, D], idx [Q, S] (S % block == 0) -> [Q, S]."""
  nq, h, d = q.shape
  s = idx.shape[1]
  return pl.pallas_call(
      functools.partial(_gathered_kernel, dim=d),
      grid=(nq, s // block),
      in_specs=[pl.BlockSpec((None, h, d), lambda i, j: (i, 0, 0)),
                pl.BlockSpec((None, h, 1), lambda i, j: (i, 0, 0)),
                pl.BlockSpec((None, block), lambda i, j: (i, j)),
                pl.BlockSpec((k.shape[0] * d,), lambda i, j: (0,))],
      out_specs=pl.BlockSpec((None, block), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((nq, s), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_ivf_gathered_scores",
  )(q, w, idx, k.reshape(-1))

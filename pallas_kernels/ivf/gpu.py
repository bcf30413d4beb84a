"""AttentionIndex kernels on GPU (Pallas Triton): k-means assignment and the scoring of
gathered candidate keys."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import masked_relu
from pallas_kernels.ivf.common import assign_call

__all__ = ["assign_gpu", "gathered_scores_gpu", "ranked_scores_gpu"]

NEG_INF = float("-inf")


def _dot(a, b):
  """a [M, D] . b [N, D]^T with float32 accumulation: bf16 operands on the tensor cores (the
  products are exact), float32 operands in full float32 (no TF32: distances decide
  assignments)."""
  if a.dtype == jnp.bfloat16:
    return jnp.dot(a, b.T, preferred_element_type=jnp.float32)
  return jnp.dot(a, b.T, precision=jax.lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)


def assign_gpu(x, c, cn, *, block_m: int, block_c: int, num_warps: int, interpret: bool):
  """x [M, D] (M % block_m == 0), c [Gp, D], cn [1, Gp] -> (a, d1, d2) [M, 1]."""
  return assign_call(x, c, cn, block_m=block_m, block_c=block_c, dot=_dot,
                     compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
                     interpret=interpret, name="jaxsparse_ivf_assign")


def _gathered_kernel(q_ref, w_ref, i_ref, k_ref, o_ref, *, dim: int, block: int, steps: int):
  """One (query, run of candidates): q stays in registers while the run's candidates go by
  `block` at a time: gather their keys (one pointer gather of [block, D] from the flat key
  cache), score them, sum_h w_h relu(q_h . k) -> o_ref (-inf for id -1)."""
  q = q_ref[...]
  w = w_ref[...]
  cols = jax.lax.broadcasted_iota(jnp.int32, (block, dim), 1)

  def step(j, carry):
    ids = i_ref[pl.ds(j * block, block)]
    off = jnp.maximum(ids, 0)[:, None] * dim + cols
    keys = plgpu.load(k_ref.at[off])  # [block, D]
    z = jnp.sum(masked_relu(_dot(q, keys), w) * w, axis=0)  # [block]
    o_ref[pl.ds(j * block, block)] = jnp.where(ids >= 0, z, NEG_INF)
    return carry

  jax.lax.fori_loop(0, steps, step, 0)


def gathered_scores_gpu(q, w, k, idx, *, block: int, splits: int, num_warps: int,
                        interpret: bool):
  """q [Q, H, D] (H >= 16), w [Q, H, 1] float32, k [N, D] (q's dtype), idx [Q, S]
  (S % (splits * block) == 0) -> [Q, S] float32. One program per (query, S / splits run)."""
  nq, h, d = q.shape
  s = idx.shape[1]
  run = s // splits
  return pl.pallas_call(
      functools.partial(_gathered_kernel, dim=d, block=block, steps=run // block),
      grid=(nq, splits),
      in_specs=[pl.BlockSpec((None, h, d), lambda i, j: (i, 0, 0)),
                pl.BlockSpec((None, h, 1), lambda i, j: (i, 0, 0)),
                pl.BlockSpec((None, run), lambda i, j: (i, j)),
                pl.BlockSpec((k.shape[0] * d,), lambda i, j: (0,))],
      out_specs=pl.BlockSpec((None, run), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((nq, s), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_ivf_gathered_scores",
  )(q, w, idx, k.reshape(-1))


def _ranked_kernel(q_ref, w_ref, meta_ref, start_ref, take_ref, slot_ref, m_ref, k_ref, o_ref,
                   id_ref, *, dim: int, block: int, width: int):
  """One query: walk its ranked groups (meta_ref = [groups used, slots filled]); of group u
  take take_ref[u] members from the inverted lists at start_ref[u], `block` at a time (masked
  at the group's end), gather and score their keys and write scores and key ids at slot
  slot_ref[u] onwards. The slots past the filled ones get -inf / -1 (disjoint stores)."""
  q = q_ref[...]
  w = w_ref[...]
  lanes = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (block, dim), 1)
  used, filled = meta_ref[0], meta_ref[1]

  def group(u, carry):
    st, t, sl = start_ref[u], take_ref[u], slot_ref[u]

    def chunk(c, carry):
      m = (c * block + lanes < t) & (sl + c * block + lanes < width)  # never past the row
      ids = plgpu.load(m_ref.at[pl.ds(st + c * block, block)], mask=m, other=0)
      keys = plgpu.load(k_ref.at[ids[:, None] * dim + cols], mask=m[:, None], other=0)
      z = jnp.sum(masked_relu(_dot(q, keys), w) * w, axis=0)
      plgpu.store(o_ref.at[pl.ds(sl + c * block, block)], z, mask=m)
      plgpu.store(id_ref.at[pl.ds(sl + c * block, block)], ids, mask=m)
      return carry

    return jax.lax.fori_loop(0, (t + block - 1) // block, chunk, carry)

  jax.lax.fori_loop(0, used, group, 0)

  def tail(j, carry):
    m = j * block + lanes >= filled
    plgpu.store(o_ref.at[pl.ds(j * block, block)], jnp.full((block,), NEG_INF), mask=m)
    plgpu.store(id_ref.at[pl.ds(j * block, block)], jnp.full((block,), -1, jnp.int32), mask=m)
    return carry

  jax.lax.fori_loop(filled // block, width // block, tail, 0)


def ranked_scores_gpu(q, w, meta, start, take, slot, members, k, *, width: int, block: int,
                      num_warps: int, interpret: bool):
  """q [Q, H, D] (H >= 16), w [Q, H, 1] float32, meta [Q, 2] int32, start / take / slot
  [Q, G] int32 (rank order), members [N] int32, k [N, D] (q's dtype); width % block == 0 ->
  (scores [Q, width] float32, key ids [Q, width] int32). One program per query."""
  nq, h, d = q.shape
  g = start.shape[1]
  row = lambda i: (i, 0)
  return pl.pallas_call(
      functools.partial(_ranked_kernel, dim=d, block=block, width=width),
      grid=(nq,),
      in_specs=[pl.BlockSpec((None, h, d), lambda i: (i, 0, 0)),
                pl.BlockSpec((None, h, 1), lambda i: (i, 0, 0)),
                pl.BlockSpec((None, 2), row),
                pl.BlockSpec((None, g), row),
                pl.BlockSpec((None, g), row),
                pl.BlockSpec((None, g), row),
                pl.BlockSpec((members.shape[0],), lambda i: (0,)),
                pl.BlockSpec((k.shape[0] * d,), lambda i: (0,))],
      out_specs=[pl.BlockSpec((None, width), row), pl.BlockSpec((None, width), row)],
      out_shape=[jax.ShapeDtypeStruct((nq, width), jnp.float32),
                 jax.ShapeDtypeStruct((nq, width), jnp.int32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_ivf_ranked_scores",
  )(q, w, meta, start, take, slot, members, k.reshape(-1))

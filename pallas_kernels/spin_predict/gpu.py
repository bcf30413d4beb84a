"""SPIN's predicted block scores on GPU (Pallas, Triton backend): one pass over V and D.

For the query at slot `pos` seeing `length` slots, slot i's predicted score is
max(V[i], D[pos - i]) (i < length) and a block's score pools its slots (max or mean). The
kernel reads V in slot order and D at the reversed offsets directly, so nothing is flipped,
concatenated or written back at slot granularity; only [B, num_blocks] block scores leave it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG_INF = float("-inf")
POOLINGS = ("max", "mean")


def _kernel(pos_ref, len_ref, v_ref, d_ref, o_ref, *, page: int, blocks: int, pooling: str):
  c = pl.program_id(1)
  pos = pos_ref[0]
  length = len_ref[0]
  i = c * blocks * page + lax.broadcasted_iota(jnp.int32, (blocks, page), 0) * page + \
      lax.broadcasted_iota(jnp.int32, (blocks, page), 1)
  valid = i < length
  v = v_ref[...].reshape(blocks, page).astype(jnp.float32)
  o = jnp.where(valid, pos - i, 0)
  d = plgpu.load(d_ref.at[o], mask=valid, other=0.0).astype(jnp.float32)
  z = jnp.where(valid, jnp.maximum(v, d), NEG_INF)
  if pooling == "max":
    o_ref[...] = jnp.max(z, axis=1)
  else:
    cnt = jnp.sum(valid.astype(jnp.float32), axis=1)
    tot = jnp.sum(jnp.where(valid, z, 0.0), axis=1)
    o_ref[...] = jnp.where(cnt > 0, tot / jnp.maximum(cnt, 1.0), NEG_INF)


@functools.partial(jax.jit, static_argnames=("page", "pooling", "blocks_per_program",
                                             "interpret"))
def block_scores_gpu(v, d, pos, lengths, *, page: int, pooling: str = "max",
                     blocks_per_program: int = 32, interpret: bool = False):
  """v, d [B, cap] float32 or bfloat16 (slot- and offset-indexed EMAs); pos, lengths [B] int32
  -> [B, cap / page] float32 pooled predicted block scores, -inf for blocks past the context.
  pooling: "max" or "mean" (mean over the block's visible slots)."""
  if pooling not in POOLINGS:
    raise ValueError(f"pooling={pooling!r} must be one of {POOLINGS} for the kernel")
  bsz, cap = v.shape
  if cap % page:
    raise ValueError(f"capacity {cap} must be a multiple of page={page}")
  nb = cap // page
  bpp = blocks_per_program  # a power of two dividing nb
  while bpp > 1 and nb % bpp:
    bpp //= 2
  one = pl.BlockSpec((1,), lambda b, c: (b,))
  return pl.pallas_call(
      functools.partial(_kernel, page=page, blocks=bpp, pooling=pooling),
      grid=(bsz, nb // bpp),
      in_specs=[one, one, pl.BlockSpec((None, bpp * page), lambda b, c: (b, c)),
                pl.BlockSpec((None, cap), lambda b, c: (b, 0))],
      out_specs=pl.BlockSpec((None, bpp), lambda b, c: (b, c)),
      out_shape=jax.ShapeDtypeStruct((bsz, nb), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="jaxsparse_spin_predict",
  )(pos.astype(jnp.int32), lengths.astype(jnp.int32), v, d)

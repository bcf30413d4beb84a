"""AttentionIndex kernels on TPU (Pallas, Mosaic TPU): k-means assignment and the scoring of
gathered candidate keys (row DMAs from HBM by scalar-prefetched ids: no vector gather)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._util import masked_relu, tpu_interpret_params
from pallas_kernels.ivf.common import assign_call

__all__ = ["assign_tpu", "gathered_scores_tpu"]

NEG_INF = float("-inf")


def _interp(interpret: bool):
  return tpu_interpret_params() if interpret else False


def _dot(a, b):
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)


def assign_tpu(x, c, cn, *, block_m: int, block_c: int, interpret: bool):
  """x [M, D] (M % block_m == 0), c [Gp, D], cn [1, Gp] -> (a, d1, d2) [M, 1]."""
  return assign_call(x, c, cn, block_m=block_m, block_c=block_c, dot=_dot,
                     compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
                     interpret=_interp(interpret), name="jaxsparse_ivf_assign_tpu")


def _gathered_kernel(ids_ref, q_ref, w_ref, iv_ref, k_hbm, o_ref, buf, sem, *, block: int,
                     width: int):
  """One (query, block of candidates): one DMA per candidate row into buf [block, D] (all in
  flight together), then the [H, D] x [D, block] dot on the MXU."""
  i, j = pl.program_id(0), pl.program_id(1)
  base = i * width + j * block

  def copy(r):
    kid = jnp.maximum(ids_ref[base + r], 0)
    return pltpu.make_async_copy(k_hbm.at[pl.ds(kid, 1)], buf.at[pl.ds(r, 1)], sem.at[0])

  def start(r, c):
    copy(r).start()
    return c

  def wait(r, c):
    copy(r).wait()
    return c

  jax.lax.fori_loop(0, block, start, 0)
  jax.lax.fori_loop(0, block, wait, 0)
  s = _dot(q_ref[...].astype(jnp.float32), buf[...].astype(jnp.float32))  # [H, block]
  wv = w_ref[...]
  z = jnp.sum(masked_relu(s, wv) * wv, axis=0, keepdims=True)  # [1, block]
  o_ref[...] = jnp.where(iv_ref[...] >= 0, z, NEG_INF)  # the same ids, as a VMEM row


def gathered_scores_tpu(q, w, k, idx, *, block: int, interpret: bool):
  """q [Q, H, D] (H % 8 == 0), w [Q, H, 1], k [N, D], idx [Q, S] (S % block == 0) -> [Q, S]."""
  nq, h, d = q.shape
  s = idx.shape[1]
  out = pl.pallas_call(
      functools.partial(_gathered_kernel, block=block, width=s),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(nq, s // block),
          in_specs=[pl.BlockSpec((None, h, d), lambda i, j, *_: (i, 0, 0)),
                    pl.BlockSpec((None, h, 1), lambda i, j, *_: (i, 0, 0)),
                    pl.BlockSpec((None, 1, block), lambda i, j, *_: (i, 0, j)),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec((None, 1, block), lambda i, j, *_: (i, 0, j)),
          scratch_shapes=[pltpu.VMEM((block, d), k.dtype), pltpu.SemaphoreType.DMA((1,))]),
      out_shape=jax.ShapeDtypeStruct((nq, 1, s), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=_interp(interpret), name="jaxsparse_ivf_gathered_scores_tpu",
  )(idx.reshape(-1).astype(jnp.int32), q, w, idx.astype(jnp.int32)[:, None], k)
  return out[:, 0]

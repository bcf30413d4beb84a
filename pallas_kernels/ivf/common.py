"""Kernel bodies shared by the GPU (Triton) and TPU (Mosaic) builds: plain jnp on refs."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

__all__ = ["assign_body", "assign_call"]

INF = float("inf")


def assign_body(x_ref, c_ref, cn_ref, a_ref, d1_ref, d2_ref, *, num_centers: int,
                block_c: int, dot):
  """One program: keys x_ref [bm, D] against every center (c_ref [Gp, D], cn_ref [1, Gp]
  squared norms, +inf for unused slots) -> a_ref, d1_ref, d2_ref [bm, 1]: the nearest
  center (ties to the lower id), its squared distance and the second smallest (Hamerly's
  bounds), distances as |x|^2 - 2 x.c + |c|^2 clamped at 0, as the XLA path computes them.
  Centers are visited block_c at a time with a running minimum, second minimum and argmin."""
  x = x_ref[...]  # the dot's operand dtype (bf16 or float32)
  bm = x.shape[0]
  xf = x.astype(jnp.float32)
  xn = jnp.sum(xf * xf, axis=1, keepdims=True)
  big = jnp.int32(2 ** 30)

  def step(j, carry):
    best, arg, second = carry
    c = c_ref[pl.ds(j * block_c, block_c), :]
    cn = cn_ref[:, pl.ds(j * block_c, block_c)]
    d = jnp.maximum(xn - 2.0 * dot(x, c) + cn, 0.0)
    d = jnp.where(cn < INF, d, INF)  # unused slots
    col = j * block_c + lax.broadcasted_iota(jnp.int32, d.shape, 1)
    m = jnp.min(d, axis=1, keepdims=True)
    a = jnp.min(jnp.where(d == m, col, big), axis=1, keepdims=True)
    s = jnp.min(jnp.where(col == a, INF, d), axis=1, keepdims=True)
    better = m < best
    second = jnp.where(better, jnp.minimum(best, s), jnp.minimum(second, m))
    return jnp.where(better, m, best), jnp.where(better, a, arg), second

  init = (jnp.full((bm, 1), INF, jnp.float32), jnp.zeros((bm, 1), jnp.int32),
          jnp.full((bm, 1), INF, jnp.float32))
  best, arg, second = lax.fori_loop(0, num_centers // block_c, step, init)
  a_ref[...] = arg
  d1_ref[...] = best
  d2_ref[...] = second


def assign_call(x, c, cn, *, block_m: int, block_c: int, dot, compiler_params, interpret,
                name: str):
  """The assignment kernel over x [M, D] (M % block_m == 0), c [Gp, D], cn [1, Gp] ->
  (a, d1, d2) [M, 1]: one program per block_m keys; the platform gives its dot, compiler
  parameters and interpret setting."""
  m, d = x.shape
  gp = c.shape[0]
  col = pl.BlockSpec((block_m, 1), lambda i: (i, 0))
  return pl.pallas_call(
      functools.partial(assign_body, num_centers=gp, block_c=block_c, dot=dot),
      grid=(m // block_m,),
      in_specs=[pl.BlockSpec((block_m, d), lambda i: (i, 0)),
                pl.BlockSpec((gp, d), lambda i: (0, 0)),
                pl.BlockSpec((1, gp), lambda i: (0, 0))],
      out_specs=[col, col, col],
      out_shape=[jax.ShapeDtypeStruct((m, 1), jnp.int32),
                 jax.ShapeDtypeStruct((m, 1), jnp.float32),
                 jax.ShapeDtypeStruct((m, 1), jnp.float32)],
      compiler_params=compiler_params, interpret=interpret, name=name,
  )(x, c, cn)

"""Threshold-filter top-K passes on TPU (Pallas, Mosaic TPU).

A row is viewed as [N / 128, 128] (lane-dense). A group is one lane of one chunk (`chunk / 128`
entries strided by 128), so a group maximum is a sublane reduction: no cross-lane shuffles.
The candidate compaction runs in XLA (cumsum + scatter): Mosaic TPU has no vector scatter.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._util import tpu_interpret_params

__all__ = [
    "NEG_INF", "LANES", "group_max", "count"
]


NEG_INF = float("-inf")
LANES = 128


def _valid(len_ref, x_ref, chunk):
  r, c = pl.program_id(0), pl.program_id(1)
  x = x_ref[...].astype(jnp.float32)  # [chunk / 128, 128]
  shape = x.shape
  idx = (c * chunk + lax.broadcasted_iota(jnp.int32, shape, 0) * LANES
         + lax.broadcasted_iota(jnp.int32, shape, 1))
  ok = (idx < len_ref[r]) & (x == x)
  return jnp.where(ok, x, NEG_INF)


def _group_max_kernel(len_ref, x_ref, o_ref, *, chunk: int):
  o_ref[...] = jnp.max(_valid(len_ref, x_ref, chunk), axis=0, keepdims=True)


def _count_kernel(len_ref, thr_ref, x_ref, o_ref, *, chunk: int):
  x = _valid(len_ref, x_ref, chunk)
  m = (x >= thr_ref[pl.program_id(0)]) & (x > NEG_INF)
  o_ref[...] = jnp.sum(m.astype(jnp.int32), axis=0, keepdims=True)


def _call(kernel, x, scalars, out_dtype, *, chunk: int, interpret: bool, name: str):
  r, n = x.shape
  rows = chunk // LANES
  xv = x.reshape(r, n // LANES, LANES)
  idx = lambda i, c, *_: (i, c, 0)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(scalars),
          grid=(r, n // chunk),
          in_specs=[pl.BlockSpec((None, rows, LANES), idx)],
          out_specs=pl.BlockSpec((None, None, 1, LANES), lambda i, c, *_: (i, c, 0, 0)),
      ),
      out_shape=jax.ShapeDtypeStruct((r, n // chunk, 1, LANES), out_dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=tpu_interpret_params() if interpret else False,
      name=name,
  )(*scalars, xv)
  return out.reshape(r, (n // chunk) * LANES)


def group_max(x, lengths, *, chunk: int, interpret: bool):
  """x [R, N] (N % chunk == 0) -> [R, (N / chunk) * 128] maxima of lane-strided groups."""
  return _call(functools.partial(_group_max_kernel, chunk=chunk), x, [lengths], jnp.float32,
               chunk=chunk, interpret=interpret, name="jaxsparse_topk_group_max_tpu")


def count(x, lengths, thr, *, chunk: int, interpret: bool):
  """-> [R] int32 number of candidates (entries >= thr) per row."""
  per_lane = _call(functools.partial(_count_kernel, chunk=chunk), x, [lengths, thr], jnp.int32,
                   chunk=chunk, interpret=interpret, name="jaxsparse_topk_count_tpu")
  return per_lane.sum(axis=1)

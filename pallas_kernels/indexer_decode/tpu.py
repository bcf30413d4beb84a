"""Paged decode indexer scoring on TPU (Pallas, Mosaic TPU).

One grid step scores one 64-slot page of one request: the block table and lengths are
scalar-prefetched, and the key BlockSpec's index map reads the page id from the table, so the
pipeline DMAs exactly the pages in use. Steps past a request's length clamp to its last page
(an unchanged block index issues no new DMA) and write -inf.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._util import tpu_interpret_params
from pallas_kernels.indexer_decode.config import DecodeConfig

__all__ = [
    "NEG_INF", "decode_scores_tpu"
]


NEG_INF = float("-inf")


def _decode_kernel(table_ref, maxlen_ref, logical_ref, q_ref, w_ref, lens_ref, k_ref, *rest,
                   rows: int, heads: int, page: int, has_scale: bool, max_blocks: int):
  """table_ref: [B * max_blocks] (SMEM); maxlen_ref: [B] (SMEM): pages to score (dense: slots);
  logical_ref: [B * max_blocks] (SMEM) logical block of each table entry; q_ref: [R*H, D];
  w_ref: [R*H, 1]; lens_ref: [R, 1] int32; k_ref: [page, D]; scale_ref: [1, page];
  o_ref: [R, page] float32."""
  if has_scale:
    scale_ref, o_ref = rest
  else:
    (o_ref,) = rest
  b, j = pl.program_id(0), pl.program_id(1)
  first = logical_ref[b * max_blocks + j] * page
  live = (j * page < maxlen_ref[b]) & (first >= 0)

  @pl.when(live)
  def _():
    cd = jnp.bfloat16 if q_ref.dtype == jnp.float8_e4m3fn else q_ref.dtype
    k = k_ref[...].astype(cd)
    s = lax.dot_general(q_ref[...].astype(cd), k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)  # [R*H, page]
    p = jnp.maximum(s, 0.0) * w_ref[...]
    z = jnp.concatenate(
        [jnp.sum(p[r * heads:(r + 1) * heads], axis=0, keepdims=True) for r in range(rows)],
        axis=0)  # [R, page]
    if has_scale:
      z = z * scale_ref[...]
    slot = first + lax.broadcasted_iota(jnp.int32, (rows, page), 1)
    o_ref[...] = jnp.where(slot < lens_ref[...], z, NEG_INF)

  @pl.when(jnp.logical_not(live))
  def _():
    o_ref[...] = jnp.full((rows, page), NEG_INF, jnp.float32)


def decode_scores_tpu(q, k_cache, block_table, lens, w, k_scale, *, config: DecodeConfig,
                      interpret: bool = False, logical=None, counts=None):
  """q [B, R, H, D] (H a multiple of 8), lens [B, R] -> z [B, R, max_blocks * 64]."""
  del config  # one page per grid step; the pipeline double-buffers the page DMAs
  bsz, rows, heads, d = q.shape
  num_blocks, page, _ = k_cache.shape
  max_blocks = block_table.shape[1]
  table = jnp.clip(block_table, 0, num_blocks - 1).reshape(-1)
  if logical is None:  # dense: table entry j is logical block j; score the pages under maxlen
    maxlen = jnp.max(lens, axis=1)  # [B]
    logical = jnp.broadcast_to(jnp.arange(max_blocks, dtype=jnp.int32), (bsz, max_blocks))
  else:  # sparse: the first counts[b] entries are selected pages (x page: the same test)
    maxlen = counts * page
  qf = q.reshape(bsz, rows * heads, d)
  wf = w.reshape(bsz, rows * heads, 1)
  lf = lens.reshape(bsz, rows, 1)
  has_scale = k_scale is not None

  def page_index(b, j, table_ref, maxlen_ref, logical_ref):
    last = jnp.maximum(pl.cdiv(maxlen_ref[b], page) - 1, 0)
    return table_ref[b * max_blocks + jnp.minimum(j, last)]

  in_specs = [
      pl.BlockSpec((None, rows * heads, d), lambda b, j, t, m, lg: (b, 0, 0)),
      pl.BlockSpec((None, rows * heads, 1), lambda b, j, t, m, lg: (b, 0, 0)),
      pl.BlockSpec((None, rows, 1), lambda b, j, t, m, lg: (b, 0, 0)),
      pl.BlockSpec((None, page, d), lambda b, j, t, m, lg: (page_index(b, j, t, m, lg), 0, 0)),
  ]
  args = [qf, wf, lf, k_cache]
  if has_scale:
    in_specs.append(pl.BlockSpec((None, 1, page),
                                 lambda b, j, t, m, lg: (page_index(b, j, t, m, lg), 0, 0)))
    args.append(k_scale.reshape(num_blocks, 1, page))
  kernel = functools.partial(_decode_kernel, rows=rows, heads=heads, page=page,
                             has_scale=has_scale, max_blocks=max_blocks)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(bsz, max_blocks),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((None, None, rows, page), lambda b, j, t, m, lg: (b, j, 0, 0)),
      ),
      out_shape=jax.ShapeDtypeStruct((bsz, max_blocks, rows, page), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=tpu_interpret_params() if interpret else False,
      name="jaxsparse_decode_scores_tpu",
  )(table, maxlen, logical.reshape(-1).astype(jnp.int32), *args)
  return out.transpose(0, 2, 1, 3).reshape(bsz, rows, max_blocks * page)

"""Paged decode indexer scoring on GPU (Pallas, Triton backend).

Why Triton and not Mosaic GPU: the kernel gathers pages through a block table with a vector of
page ids (`k_ref[ids]`), which the Triton backend lowers to one coalesced gather per step and
software-pipelines over the page loop (`num_stages`). Mosaic GPU needs TMA descriptors per page
for that; it is the next step (benchmarks/NOTES.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import masked_relu
from pallas_kernels.indexer_decode.config import DecodeConfig

__all__ = [
    "NEG_INF", "decode_scores_gpu"
]


NEG_INF = float("-inf")


def _decode_kernel(table_ref, len_ref, q_ref, w_ref, k_ref, *rest, rows: int, heads: int,
                   page: int, pages_per_step: int, steps: int, num_blocks: int,
                   has_scale: bool, emit_group_max: int, sparse: bool):
  """One program: request b, a run of `steps * pages_per_step` pages.

  sparse (SPIN's block-sparse scoring): the table holds only the selected pages; two more refs
  follow k/scale: logical_ref [pages_per_program] int32 logical block ids (-1: padding) and
  count_ref [1] int32 selected pages of this request. Output slot j of the run then holds slot
  logical[j // page] * page + j % page.

  table_ref: [pages_per_program] int32; len_ref: [rows] int32 visible slots per row;
  q_ref: [rows * heads, D]; w_ref: [rows * heads]; k_ref: [num_blocks, page, D] (whole cache);
  scale_ref: [num_blocks, page] (fp8 only); o_ref: [rows, pages_per_program * page] float32;
  gmax_ref: [rows, pages_per_program * page / emit_group_max] (when emit_group_max > 0).
  """
  if has_scale:
    scale_ref, *rest = rest
  if sparse:
    logical_ref, count_ref, *rest = rest
  o_ref, *rest = rest
  gmax_ref = rest[0] if emit_group_max else None
  c = pl.program_id(1)
  step_keys = pages_per_step * page
  first_slot = c * steps * step_keys
  lens = len_ref[...]  # [rows]
  if sparse:
    active = jnp.clip(pl.cdiv(count_ref[0] - c * steps * pages_per_step, pages_per_step), 0,
                      steps)
  else:
    active = jnp.clip(pl.cdiv(jnp.max(lens) - first_slot, step_keys), 0, steps)
  q = q_ref[...]  # [rows*heads, D]
  w = w_ref[...].astype(jnp.float32)  # [rows*heads]

  def store(s, z):
    o_ref[:, pl.ds(s * step_keys, step_keys)] = z
    if emit_group_max:
      g = emit_group_max
      gmax_ref[:, pl.ds(s * (step_keys // g), step_keys // g)] = (
          z.reshape(rows, step_keys // g, g).max(axis=-1))

  def body(s, carry):
    ids = table_ref[pl.ds(s * pages_per_step, pages_per_step)]
    ids = jnp.clip(ids, 0, num_blocks - 1)
    k = k_ref[ids].reshape(step_keys, -1)  # [step_keys, D]
    k = k.astype(q.dtype)
    sc = plgpu.dot(q, k, trans_b=True)  # [rows*heads, step_keys] f32
    p = masked_relu(sc, w[:, None]) * w[:, None]
    z = p.reshape(rows, heads, step_keys).sum(axis=1)  # [rows, step_keys]
    if has_scale:
      z = z * scale_ref[ids].reshape(1, step_keys)
    if sparse:
      lb = logical_ref[pl.ds(s * pages_per_step, pages_per_step)]  # [pages_per_step]
      slot = (lb[:, None] * page + lax.broadcasted_iota(jnp.int32, (pages_per_step, page), 1))
      slot = jnp.where(lb[:, None] >= 0, slot, jnp.iinfo(jnp.int32).max)
      slot = jnp.broadcast_to(slot.reshape(1, step_keys), (rows, step_keys))
    else:
      slot = first_slot + s * step_keys + lax.broadcasted_iota(jnp.int32, (rows, step_keys), 1)
    z = jnp.where(slot < lens[:, None], z, NEG_INF)
    store(s, z)
    return carry

  lax.fori_loop(0, active, body, 0)

  def fill(s, carry):
    store(s, jnp.full((rows, step_keys), NEG_INF, jnp.float32))
    return carry

  lax.fori_loop(active, steps, fill, 0)


def decode_scores_gpu(q, k_cache, block_table, lens, w, k_scale, *, config: DecodeConfig,
                      interpret: bool = False, group_max: int = 0, logical=None, counts=None):
  """q [B, R, H, D] (R, H powers of two), lens [B, R] -> z [B, R, S_pad] (+ gmax [B, R, S_pad/g])."""
  bsz, rows, heads, d = q.shape
  num_blocks, page, _ = k_cache.shape
  max_blocks = block_table.shape[1]
  ppp = config.pages_per_step * config.steps_per_program
  programs = pl.cdiv(max_blocks, ppp)
  padded = programs * ppp
  sparse = logical is not None
  if padded != max_blocks:
    block_table = jnp.pad(block_table, ((0, 0), (0, padded - max_blocks)))
    if sparse:
      logical = jnp.pad(logical, ((0, 0), (0, padded - max_blocks)), constant_values=-1)
  slots = padded * page
  qf = q.reshape(bsz, rows * heads, d)
  wf = w.reshape(bsz, rows * heads)
  has_scale = k_scale is not None
  kernel = functools.partial(
      _decode_kernel, rows=rows, heads=heads, page=page, pages_per_step=config.pages_per_step,
      steps=config.steps_per_program, num_blocks=num_blocks, has_scale=has_scale,
      emit_group_max=group_max, sparse=sparse)
  in_specs = [
      pl.BlockSpec((None, ppp), lambda b, c: (b, c)),  # block table run
      pl.BlockSpec((None, rows), lambda b, c: (b, 0)),  # lengths per row
      pl.BlockSpec((None, rows * heads, d), lambda b, c: (b, 0, 0)),  # q resident
      pl.BlockSpec((None, rows * heads), lambda b, c: (b, 0)),
      # whole cache as one block: pages are gathered in the kernel through the block table
      pl.BlockSpec((num_blocks, page, d), lambda b, c: (0, 0, 0)),
  ]
  args = [block_table, lens, qf, wf, k_cache]
  if has_scale:
    in_specs.append(pl.BlockSpec((num_blocks, page), lambda b, c: (0, 0)))
    args.append(k_scale)
  if sparse:
    in_specs += [pl.BlockSpec((None, ppp), lambda b, c: (b, c)),
                 pl.BlockSpec((1,), lambda b, c: (b,))]
    args += [logical, counts]
  out_shape = [jax.ShapeDtypeStruct((bsz, rows, slots), jnp.float32)]
  out_specs = [pl.BlockSpec((None, rows, ppp * page), lambda b, c: (b, 0, c))]
  if group_max:
    out_shape.append(jax.ShapeDtypeStruct((bsz, rows, slots // group_max), jnp.float32))
    out_specs.append(pl.BlockSpec((None, rows, ppp * page // group_max), lambda b, c: (b, 0, c)))
  out = pl.pallas_call(
      kernel,
      grid=(bsz, programs),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.stages_for(k_cache.dtype.itemsize)),
      interpret=interpret,
      name="jaxsparse_decode_scores",
  )(*args)
  return out if group_max else out[0]

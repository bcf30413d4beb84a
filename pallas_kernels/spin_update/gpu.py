"""SPIN EMA update on GPU (Pallas, Triton backend): V and D updated in place.

Per request, only the selected blocks were scored, so only their slots change:
  V[i]       <- a * V[i] + (1 - a) * z[i]         for observed slots i (i < length)
  D[pos - i] <- a * D[pos - i] + (1 - a) * z[i]   (D is indexed by offset from the query)
The kernel reads the block-sparse scoring output as it is laid out (selected blocks in order,
`page` scores each) and touches V and D only where a slot was observed; V and D are aliased
to the outputs, so nothing else is read or written (the XLA version rewrites all N slots of
both arrays and first scatters the scores back onto N slots).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG_INF = float("-inf")


def _ema(old, new, decay):
  """EMA in float32, rounded once to the state's dtype (float32 or bfloat16)."""
  return (decay * old.astype(jnp.float32) + (1 - decay) * new).astype(old.dtype)


def _block_max(sel_ref, len_ref, z_ref, blk_ref, *, page: int, blocks: int):
  """blk_ref[s] = max observed score of selected block s (-inf if none): A2's block states."""
  j = sel_ref[...]
  i = j[:, None] * page + lax.broadcasted_iota(jnp.int32, (blocks, page), 1)
  obs = (j[:, None] >= 0) & (i < len_ref[0])
  blk_ref[...] = jnp.max(jnp.where(obs, z_ref[...].reshape(blocks, page), NEG_INF), axis=1)


def _kernel_tile(sel_ref, pos_ref, len_ref, z_ref, v_in, d_in, v_ref, d_ref, blk_ref, *,
                 page: int, blocks: int, decay: float, cap: int):
  """All `blocks` selected blocks of the program as one [blocks, page] tile: every load is
  issued at once (the per-block loop below waits on each block's loads in turn)."""
  del v_in, d_in
  _block_max(sel_ref, len_ref, z_ref, blk_ref, page=page, blocks=blocks)
  pos = pos_ref[0]
  length = len_ref[0]
  j = sel_ref[...]  # [blocks]
  i = j[:, None] * page + lax.broadcasted_iota(jnp.int32, (blocks, page), 1)
  obs = (j[:, None] >= 0) & (i < length)
  z = jnp.where(obs, z_ref[...].reshape(blocks, page), 0.0)
  # i unclamped (padding rows point before the array, masked): a select would hide the
  # per-block contiguity from Triton and turn the vector loads into scalar ones
  v = plgpu.load(v_ref.at[i], mask=obs, other=0.0)
  plgpu.store(v_ref.at[i], _ema(v, z, decay), mask=obs)
  o = jnp.where(obs, pos - i, 0)
  d = plgpu.load(d_ref.at[o], mask=obs, other=0.0)
  plgpu.store(d_ref.at[o], _ema(d, z, decay), mask=obs)


def _kernel(sel_ref, pos_ref, len_ref, z_ref, v_in, d_in, v_ref, d_ref, blk_ref, *, page: int,
            blocks: int, decay: float, cap: int):
  """One block at a time (used in interpret mode, where a masked scatter is a read-modify-
  write of every lane, so masked lanes must not share a slot with a real one: per block they
  can be given distinct wrapped slots)."""
  del v_in, d_in  # aliased with v_ref / d_ref
  _block_max(sel_ref, len_ref, z_ref, blk_ref, page=page, blocks=blocks)
  pos = pos_ref[0]
  length = len_ref[0]
  lane = lax.broadcasted_iota(jnp.int32, (page,), 0)

  def body(s, carry):
    j = sel_ref[s]

    @pl.when(j >= 0)
    def _():
      i = j * page + lane
      obs = i < length
      z = z_ref[pl.ds(s * page, page)]
      z = jnp.where(obs, z, 0.0)
      v = v_ref[pl.ds(j * page, page)]
      v_ref[pl.ds(j * page, page)] = jnp.where(obs, _ema(v, z, decay), v)
      o = pos - i  # unobserved lanes (past the query) wrap to distinct slots and are masked
      o = jnp.where(o >= 0, o, o + cap)
      d = plgpu.load(d_ref.at[o], mask=obs, other=0.0)
      plgpu.store(d_ref.at[o], _ema(d, z, decay), mask=obs)

    return carry

  lax.fori_loop(0, blocks, body, 0)


def update_vd_gpu(v, d, z, sel, pos, lengths, *, decay: float, page: int,
                  blocks_per_program: int = 8, interpret: bool = False):
  """v, d [B, cap] float32 or bfloat16; z [B, W * page] float32 scores of the selected blocks in order;
  sel [B, W] int32 block ids (-1: padding); pos, lengths [B] int32 -> updated (v, d) and
  blk [B, W] float32, the max observed score of each selected block (-inf: none)."""
  bsz, cap = v.shape
  width = sel.shape[1]
  bpp = blocks_per_program
  padded = -(-width // bpp) * bpp
  if padded != width:
    sel = jnp.pad(sel, ((0, 0), (0, padded - width)), constant_values=-1)
    z = jnp.pad(z, ((0, 0), (0, (padded - width) * page)))
  row = pl.BlockSpec((None, cap), lambda b, c: (b, 0))
  one = pl.BlockSpec((1,), lambda b, c: (b,))
  body = _kernel if interpret else _kernel_tile
  v, d, blk = pl.pallas_call(
      functools.partial(body, page=page, blocks=bpp, decay=float(decay), cap=cap),
      grid=(bsz, padded // bpp),
      in_specs=[pl.BlockSpec((None, bpp), lambda b, c: (b, c)), one, one,
                pl.BlockSpec((None, bpp * page), lambda b, c: (b, c)), row, row],
      out_specs=[row, row, pl.BlockSpec((None, bpp), lambda b, c: (b, c))],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(d.shape, d.dtype),
                 jax.ShapeDtypeStruct((bsz, padded), jnp.float32)],
      input_output_aliases={4: 0, 5: 1},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="jaxsparse_spin_update",
  )(sel.astype(jnp.int32), pos.astype(jnp.int32), lengths.astype(jnp.int32),
    z.astype(jnp.float32), v, d)
  return v, d, blk[:, :width]


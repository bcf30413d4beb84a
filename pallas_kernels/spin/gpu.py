"""SPIN's GPU kernels (Pallas, Triton backend): block selection + compaction, and the EMA
updates in place.

Selection (`select_compact_gpu`, one program per request): forced, exploited and explored
blocks as `jaxsparse.spin.select_blocks` picks them, and their ids compacted in ascending order
for the block-sparse scoring kernel, in one launch (XLA needs two ranking kernels, mask
algebra and a scatter for the same).

Slot-state update (`update_vd_gpu`, reductions A0/A1): V and D updated in place.

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

from pallas_kernels.topk.gpu import _scatter_width, _take_best

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



# --------------------------------------------------------------------- block-state update (A2)


def _block_states_common(sel_ref, len_ref, z_ref, gm_refs, *, page: int, blocks: int,
                         group: int):
  """The program's selected blocks: their max observed score [blocks] (-inf: none) and
  whether each was seen; also writes the top-K group maxima of its scores (when asked)."""
  j = sel_ref[...]
  length = len_ref[0]
  z = z_ref[...]
  if gm_refs:
    zc = jnp.where(z == z, z, NEG_INF)  # NaN is no score (as the top-K's own group-max pass)
    gm_refs[0][...] = zc.reshape(blocks * page // group, group).max(axis=1)
  i = j[:, None] * page + lax.broadcasted_iota(jnp.int32, (blocks, page), 1)
  obs = (j[:, None] >= 0) & (i < length)
  blk = jnp.max(jnp.where(obs, z.reshape(blocks, page), NEG_INF), axis=1)
  return j, blk, (j >= 0) & (j * page < length)


def _block_states_tile(sel_ref, pos_ref, len_ref, step_ref, z_ref, vb_in, db_in, age_in,
                       vb_ref, db_ref, age_ref, *gm_refs, page: int, blocks: int, decay: float,
                       group: int):
  """Compiled GPU: the program's blocks as one vector; masked-off lanes touch no memory."""
  del vb_in, db_in, age_in  # aliased with vb_ref / db_ref / age_ref
  j, blk, seen = _block_states_common(sel_ref, len_ref, z_ref, gm_refs, page=page,
                                      blocks=blocks, group=group)
  vb = plgpu.load(vb_ref.at[j], mask=seen, other=0.0)
  plgpu.store(vb_ref.at[j], _ema(vb, blk, decay), mask=seen)
  o = pos_ref[0] // page - j  # DB is indexed by block offset from the query's block
  db = plgpu.load(db_ref.at[o], mask=seen, other=0.0)
  plgpu.store(db_ref.at[o], _ema(db, blk, decay), mask=seen)
  plgpu.store(age_ref.at[j], jnp.full((blocks,), step_ref[0], jnp.int32), mask=seen)


def _block_states_loop(sel_ref, pos_ref, len_ref, step_ref, z_ref, vb_in, db_in, age_in,
                       vb_ref, db_ref, age_ref, *gm_refs, page: int, blocks: int, decay: float,
                       group: int):
  """Interpret mode (a masked scatter there rewrites every lane's slot): one block at a time."""
  del vb_in, db_in, age_in
  _block_states_common(sel_ref, len_ref, z_ref, gm_refs, page=page, blocks=blocks, group=group)
  length = len_ref[0]
  lane = lax.broadcasted_iota(jnp.int32, (page,), 0)

  def body(s, carry):
    j = sel_ref[s]

    @pl.when((j >= 0) & (j * page < length))
    def _():
      z = z_ref[pl.ds(s * page, page)]
      m = jnp.max(jnp.where(j * page + lane < length, z, NEG_INF)).reshape(1)
      vb_ref[pl.ds(j, 1)] = _ema(vb_ref[pl.ds(j, 1)], m, decay)
      o = pos_ref[0] // page - j
      db_ref[pl.ds(o, 1)] = _ema(db_ref[pl.ds(o, 1)], m, decay)
      age_ref[pl.ds(j, 1)] = step_ref[...]

    return carry

  lax.fori_loop(0, blocks, body, 0)


def update_block_states_gpu(vb, db, age, z, sel, pos, lengths, step, *, decay: float, page: int,
                            group: int = 0, blocks_per_program: int = 8,
                            interpret: bool = False):
  """A2's EMA update in place: vb, db [B, nb] float32 or bfloat16, age [B, nb] int32; z
  [B, W * page] float32 scores of the selected blocks in order; sel [B, W] int32 block ids
  (-1: padding, last); pos, lengths, step [B] int32. For every selected block j seen by its
  request (j * page < length), with m its max observed score:
    VB[j] <- a VB[j] + (1 - a) m,  DB[pos // page - j] <- a DB[...] + (1 - a) m,  age[j] <- step.
  Nothing else is read or written. group > 0 also returns the [B, W * page / group] maxima of
  consecutive groups of z (NaN as -inf): the top-K's first pass, fused into this read of z.
  -> (vb, db, age, group maxima or None)."""
  bsz, nb = vb.shape
  width = sel.shape[1]
  bpp = blocks_per_program
  if group and (page % group or group & (group - 1)):
    raise ValueError(f"group={group} must be a power of two dividing page={page}")
  padded = -(-width // bpp) * bpp
  if padded != width:
    sel = jnp.pad(sel, ((0, 0), (0, padded - width)), constant_values=-1)
    z = jnp.pad(z, ((0, 0), (0, (padded - width) * page)), constant_values=NEG_INF)
  row = pl.BlockSpec((None, nb), lambda b, c: (b, 0))
  one = pl.BlockSpec((1,), lambda b, c: (b,))
  out_specs = [row, row, row]
  out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (vb, db, age)]
  if group:
    out_specs.append(pl.BlockSpec((None, bpp * page // group), lambda b, c: (b, c)))
    out_shape.append(jax.ShapeDtypeStruct((bsz, padded * page // group), jnp.float32))
  body = _block_states_loop if interpret else _block_states_tile
  out = pl.pallas_call(
      functools.partial(body, page=page, blocks=bpp, decay=float(decay), group=group),
      grid=(bsz, padded // bpp),
      in_specs=[pl.BlockSpec((None, bpp), lambda b, c: (b, c)), one, one, one,
                pl.BlockSpec((None, bpp * page), lambda b, c: (b, c)), row, row, row],
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases={5: 0, 6: 1, 7: 2},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="jaxsparse_spin_block_update",
  )(sel.astype(jnp.int32), pos.astype(jnp.int32), lengths.astype(jnp.int32),
    step.astype(jnp.int32), z.astype(jnp.float32), vb, db, age.astype(jnp.int32))
  gm = out[3][:, :width * page // group] if group else None
  return out[0], out[1], out[2], gm


# ------------------------------------------------------------------ selection and compaction


def _select_kernel(s_ref, p_ref, n_ref, m_ref, sel_ref, *, width: int, score_bits: int):
  """One request: n = (n_blocks, n_exploit, n_explore, warm). Forced blocks (first and
  newest), the n_exploit best other blocks by score, the n_explore best of the rest by
  priority (ties to the lower block), or every valid block when cold; then their ids in
  ascending order at the front of the sel row (cumulative-sum positions), -1 after."""
  s = s_ref[...]
  lane = lax.broadcasted_iota(jnp.int32, s.shape, 0)
  n_blocks, n_exploit, n_explore, warm = n_ref[0], n_ref[1], n_ref[2], n_ref[3]
  valid = lane < n_blocks
  forced = valid & ((lane == 0) | (lane == n_blocks - 1))
  exploit = _take_best(s, valid & ~forced, n_exploit, bits=score_bits)
  rest = valid & ~forced & ~exploit
  explore = _take_best(p_ref[...], rest, n_explore)
  mask = jnp.where(warm != 0, forced | exploit | explore, valid)
  m_ref[...] = mask.astype(jnp.int32)
  pos = jnp.cumsum(mask.astype(jnp.int32)) - 1
  keep = mask & (pos < width)
  count = jnp.minimum(jnp.sum(mask.astype(jnp.int32)), width)
  trash = sel_ref.shape[0] - 1 - lane  # masked lanes: distinct slots (see _scatter_width)
  plgpu.store(sel_ref.at[jnp.where(keep, pos, trash)], lane, mask=keep)
  tail = (lane >= count) & (lane < width)  # slots [count, width): disjoint from the above
  plgpu.store(sel_ref.at[jnp.where(tail, lane, trash)], jnp.full(s.shape, -1, jnp.int32),
              mask=tail)


def select_compact_gpu(score, prio, counts, width: int, *, score_bits: int = 32,
                       num_warps: int = 8, interpret: bool = False):
  """score, prio [B, L] float32 (L a power of two >= the number of blocks), counts [B, 4] int32
  (n_blocks, n_exploit, n_explore, warm) -> (mask [B, L] bool, sel [B, width] int32: the
  selected block ids ascending, -1 padded; more than `width` selected are cut). n_exploit and
  n_explore must not exceed the blocks eligible for them (as `select_blocks` computes them).
  score_bits=16 when every score is a bfloat16 value (half the ranking steps)."""
  bsz, length = score.shape
  if length & (length - 1) or width > length:
    raise ValueError(f"score width {length} must be a power of two >= width={width}")
  sw = _scatter_width(length, interpret)
  row = pl.BlockSpec((None, length), lambda i: (i, 0))
  m, sel = pl.pallas_call(
      functools.partial(_select_kernel, width=width, score_bits=score_bits),
      grid=(bsz,),
      in_specs=[row, row, pl.BlockSpec((None, 4), lambda i: (i, 0))],
      out_specs=[row, pl.BlockSpec((None, sw), lambda i: (i, 0))],
      out_shape=[jax.ShapeDtypeStruct((bsz, length), jnp.int32),
                 jax.ShapeDtypeStruct((bsz, sw), jnp.int32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_spin_select",
  )(score.astype(jnp.float32), prio.astype(jnp.float32), counts.astype(jnp.int32))
  return m != 0, sel[:, :width]

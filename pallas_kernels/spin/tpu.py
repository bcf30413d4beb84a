"""SPIN's block selection and compaction on TPU (Pallas, Mosaic TPU): one program per request.

A request's block scores and exploration priorities [nb / 128, 128] float32 stay in VMEM. The
program takes the sink and newest blocks, the n_exploit best other valid blocks by score and the
n_explore best of the rest by priority, ties to the lower block, or every valid block when the
request is cold; then writes the selected ids in ascending order (-1 after) and their count.
"n best" is exact and sort-free: a 32-step bitwise search on order-preserving int32 keys finds
the n-th best key, entries above it are taken, and entries equal to it are taken in block order
by a prefix count (lane rotations, then a prefix over rows). The compaction moves each row's
ids to its front with lane rotations and stores the row at a dynamic offset (no scatter), as
the TPU top-K's compaction does (`pallas_kernels.topk.tpu`).

The block scores and the slot update also run here: D's window maxima (block scores) and the
observed scores (update) are flipped onto offsets by a reversal (log2(n) partner exchanges of
lane and sublane rotations) and a dynamic shift. Block shapes: one request per program; its
state rows ([cap / 128, 128], 256 KB per bfloat16 array at 128K slots) and block vectors sit in
VMEM (16 MB on v5e, 32 MB on v5p and v6e) whole, so no tiling is needed up to ~1M slots per
request on v5p / v6e (2 MB per array); the per-block vectors are columns [nb, 1] in the block
score kernel (the reductions over each block's 64 lanes land there).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._util import tpu_interpret_params
from pallas_kernels.topk.tpu import LANES, lane_prefix, ordered_key, to_front

__all__ = ["select_compact_tpu", "best_mask", "block_scores_max_tpu", "by_offset",
           "update_slots_tpu"]

_INT_MIN = -(1 << 31)
NEG_INF = float("-inf")


def _prefix_2d(ci, lane, row):
  """Inclusive prefix counts of ci [R, 128] int32 in row-major order."""
  incl = lane_prefix(ci, lane)
  tot = jnp.broadcast_to(incl[:, LANES - 1:LANES], ci.shape)  # each row's total
  acc, s = tot, 1
  while s < ci.shape[0]:
    acc = acc + jnp.where(row >= s, pltpu.roll(acc, s, 0), 0)
    s *= 2
  return incl + acc - tot


def best_mask(x, eligible, n, lane, row):
  """Mask of the n best eligible entries of x [R, 128] float32, ties to the lower flat index;
  n a traced int32 (<= 0: none; more than eligible: all eligible). Ranked as
  `jaxsparse.spin.algorithm.rank_key` ranks: NaN as -inf, -0.0 and subnormals as 0, so NaN and
  -inf come after every other value (in index order) and still count towards n."""
  x = jnp.where(x == x, x, NEG_INF)
  s = jnp.where(eligible, ordered_key(x), _INT_MIN)
  int_min = jnp.int32(_INT_MIN)

  def body(i, c):
    cand = c | lax.shift_left(jnp.int32(1), 31 - i)
    cnt = jnp.sum((eligible & (s >= (cand ^ int_min))).astype(jnp.int32))
    return jnp.where(cnt >= n, cand, c)

  key = lax.fori_loop(0, 32, body, jnp.int32(0)) ^ int_min
  above = eligible & (s > key)
  tie = eligible & (s == key)
  room = n - jnp.sum(above.astype(jnp.int32))
  ti = tie.astype(jnp.int32)
  take = above | (tie & (_prefix_2d(ti, lane, row) - ti < room))
  return take & (n > 0)


def _select_kernel(len_ref, warm_ref, nx_ref, ne_ref, s_ref, p_ref, m_ref, sel_ref, t_ref, *,
                   log_block: int, width_rows: int):
  b = pl.program_id(0)
  s, p = s_ref[...], p_ref[...]
  lane = lax.broadcasted_iota(jnp.int32, s.shape, 1)
  row = lax.broadcasted_iota(jnp.int32, s.shape, 0)
  flat = row * LANES + lane
  n_blocks = (len_ref[b] + (1 << log_block) - 1) >> log_block
  valid = flat < n_blocks
  forced = valid & ((flat == 0) | (flat == n_blocks - 1))
  exploit = best_mask(s, valid & ~forced, nx_ref[b], lane, row)
  rest = valid & ~forced & ~exploit
  explore = best_mask(p, rest, ne_ref[b], lane, row)
  mask = jnp.where(warm_ref[b] > 0, forced | exploit | explore, valid)
  m_ref[...] = mask.astype(jnp.int32)
  ids, _ = to_front(mask, flat, flat, lane)
  sel_ref[...] = jnp.full(sel_ref.shape, -1, jnp.int32)
  row_lane = lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
  off = jnp.int32(0)
  for r in range(s.shape[0]):
    n = jnp.sum(mask[r:r + 1].astype(jnp.int32))
    q, sh = off >> 7, off & (LANES - 1)

    @pl.when((n > 0) & (q < width_rows))
    def _(r=r, n=n, q=q, sh=sh):
      rid = pltpu.roll(ids[r:r + 1], sh, 1)
      first = (row_lane >= sh) & (row_lane < sh + n)
      second = row_lane < sh + n - LANES
      sel_ref[pl.ds(q, 1), :] = jnp.where(first, rid, sel_ref[pl.ds(q, 1), :])
      sel_ref[pl.ds(q + 1, 1), :] = jnp.where(second, rid, sel_ref[pl.ds(q + 1, 1), :])

    off = off + n
  t_ref[...] = jnp.full((1, LANES), off, jnp.int32)


def select_compact_tpu(score, prio, lengths, warm, width: int, n_exploit, n_explore, *,
                       block: int, interpret: bool = False):
  """score, prio [B, nb] float32 (block scores, -inf past a request's blocks; exploration
  priorities), lengths [B] int32 slots, warm [B] bool, n_exploit / n_explore [B] int32 (the
  budget of `jaxsparse.spin`) -> (masks [B, nb] bool, sel [B, width] int32 selected ids
  ascending, -1 padded, selected [B] int32 blocks selected). block: slots per block (a power
  of two)."""
  bsz, nb = score.shape
  nbp = -(-nb // LANES) * LANES
  rows = nbp // LANES
  wrows = -(-width // LANES)
  pad = lambda a, v: jnp.pad(a.astype(jnp.float32), ((0, 0), (0, nbp - nb)),
                             constant_values=v).reshape(bsz, rows, LANES)
  per_b = lambda i, *_: (i, 0, 0)
  m, sel, t = pl.pallas_call(
      functools.partial(_select_kernel, log_block=block.bit_length() - 1, width_rows=wrows),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(bsz,),
          in_specs=[pl.BlockSpec((None, rows, LANES), per_b)] * 2,
          out_specs=[pl.BlockSpec((None, rows, LANES), per_b),
                     pl.BlockSpec((None, wrows + 1, LANES), per_b),
                     pl.BlockSpec((None, 1, LANES), per_b)],
      ),
      out_shape=[jax.ShapeDtypeStruct((bsz, rows, LANES), jnp.int32),
                 jax.ShapeDtypeStruct((bsz, wrows + 1, LANES), jnp.int32),
                 jax.ShapeDtypeStruct((bsz, 1, LANES), jnp.int32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=tpu_interpret_params() if interpret else False,
      name="jaxsparse_spin_select_tpu",
  )(lengths.astype(jnp.int32), warm.astype(jnp.int32), n_exploit.astype(jnp.int32),
    n_explore.astype(jnp.int32), pad(score, -jnp.inf), pad(prio, 0.0))
  return (m.reshape(bsz, nbp)[:, :nb] > 0, sel.reshape(bsz, -1)[:, :width], t[:, 0, 0])


# ------------------------------------------------------------------ by_offset in a kernel


def _partners(x, d: int, flat):
  """(x[f + d], x[f - d]) of x [R, W] in row-major order (W = 128 lanes, or 1 for columns)."""
  rows, width = x.shape
  if d < width:
    return pltpu.roll(x, width - d, 1), pltpu.roll(x, d, 1)
  dr = d // width
  return pltpu.roll(x, rows - dr, 0), pltpu.roll(x, dr, 0)


def _reverse(x, flat):
  """y[f] = x[n - 1 - f] over the row-major flattening of x [R, W] (n = R * W a power of two):
  f XOR (n - 1), one partner exchange per bit."""
  n = x.shape[0] * x.shape[1]
  d = 1
  while d < n:
    up, down = _partners(x, d, flat)
    x = jnp.where((flat & d) == 0, up, down)
    d *= 2
  return x


def _shift_left(x, s, flat, fill):
  """y[f] = x[f + s] for f + s < n, else fill, over the row-major flattening of x [R, W];
  s a traced int32 in [0, n]."""
  rows, width = x.shape
  n = rows * width
  if width == 1:
    sr = s & (rows - 1)  # rows is a power of two; s >= 0 (no sign op in Mosaic)
    y = pltpu.roll(x, jnp.where(sr == 0, 0, rows - sr), 0)
    return jnp.where(flat + s < n, y, fill)
  a, b = s >> 7, s & (LANES - 1)
  ar = a & (rows - 1)
  xr = pltpu.roll(x, jnp.where(ar == 0, 0, rows - ar), 0)  # xr[r] = x[r + a]
  xn = pltpu.roll(xr, rows - 1, 0) if rows > 1 else xr  # xn[r] = xr[r + 1]
  lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  y = jnp.where(lane + b < LANES, pltpu.roll(xr, (LANES - b) & (LANES - 1), 1),
                pltpu.roll(xn, (LANES - b) & (LANES - 1), 1))
  return jnp.where(flat + s < n, y, fill)


def by_offset(x, pos, flat, fill):
  """y[f] = x[pos - f] for 0 <= pos - f < n, else fill (`jaxsparse.spin.algorithm.by_offset`
  in a kernel): a reversal, then a shift by n - 1 - pos. x [R, W], n = R * W a power of two."""
  n = x.shape[0] * x.shape[1]
  return _shift_left(_reverse(x, flat), n - 1 - pos, flat, fill)


# -------------------------------------------------------------------- A1 block scores


def _block_score_kernel(len_ref, vm_ref, v_ref, d_ref, o_ref, *, page: int):
  """One request: vm_ref [nb, 1] (V's block maxima), v_ref / d_ref [nb, page] (the V and D
  states by block) -> o_ref [nb, 1]: A1's max-pooled block scores (-inf past the context)."""
  b = pl.program_id(0)
  length = len_ref[b]
  pos = length - 1
  nb = vm_ref.shape[0]
  col = lax.broadcasted_iota(jnp.int32, (nb, 1), 0)
  lp = page.bit_length() - 1  # page is a power of two: shifts, not divisions
  full = length >> lp
  rem = length - full * page
  vrow = v_ref[pl.ds(jnp.minimum(full, nb - 1), 1), :].astype(jnp.float32)  # the newest block
  lanes = lax.broadcasted_iota(jnp.int32, vrow.shape, 1)
  part = jnp.max(jnp.where(lanes < rem, vrow, NEG_INF))
  vmax = jnp.where(col < full, vm_ref[...].astype(jnp.float32),
                   jnp.where((col == full) & (rem > 0), part, NEG_INF))
  d = d_ref[...].astype(jnp.float32)
  lane = lax.broadcasted_iota(jnp.int32, d.shape, 1)
  r = (pos + 1) & (page - 1)
  c = (pos + 1) >> lp
  suffix = jnp.max(jnp.where(lane >= r, d, NEG_INF), axis=1, keepdims=True)  # [nb, 1]
  prefix = jnp.max(jnp.where(lane < r, d, NEG_INF), axis=1, keepdims=True)
  window = jnp.maximum(by_offset(suffix, c - 1, col, NEG_INF), by_offset(prefix, c, col, NEG_INF))
  o_ref[...] = jnp.where(col < ((length + page - 1) >> lp), jnp.maximum(vmax, window), NEG_INF)


def block_scores_max_tpu(vm, v, d, lengths, *, page: int, interpret: bool = False):
  """A1's max-pooled block scores on TPU: vm [B, nb], v, d [B, nb * page] (float32 or
  bfloat16; vm V's block maxima), lengths [B] int32 -> [B, nb] float32, equal to
  `jaxsparse.spin.algorithm._max_pooled_block_scores` per request. The block vectors are
  columns [nb, 1] (the per-block reductions of V and D by block rows land there); D's window
  maxima are flipped onto blocks by a reversal and a shift (`by_offset`)."""
  bsz, nb = vm.shape
  nbp = 1 << max(nb - 1, 0).bit_length()
  padb = lambda a, v: jnp.pad(a, ((0, 0), (0, nbp - nb)) + ((0, 0),) * (a.ndim - 2),
                              constant_values=v)
  vmc = padb(vm, -jnp.inf)[:, :, None]
  vr = padb(v.reshape(bsz, nb, page), 0)
  dr = padb(d.reshape(bsz, nb, page), 0)
  per_b = lambda i, *_: (i, 0, 0)
  out = pl.pallas_call(
      functools.partial(_block_score_kernel, page=page),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(bsz,),
          in_specs=[pl.BlockSpec((None, nbp, 1), per_b),
                    pl.BlockSpec((None, nbp, page), per_b),
                    pl.BlockSpec((None, nbp, page), per_b)],
          out_specs=pl.BlockSpec((None, nbp, 1), per_b)),
      out_shape=jax.ShapeDtypeStruct((bsz, nbp, 1), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=tpu_interpret_params() if interpret else False,
      name="jaxsparse_spin_block_scores_tpu",
  )(lengths.astype(jnp.int32), vmc, vr, dr)
  return out[:, :nb, 0]


# ------------------------------------------------------------------------- EMA update


def _update_kernel(sel_ref, len_ref, z_ref, v_ref, d_ref, vo_ref, do_ref, vm_ref, zs_ref,
                   ob_ref, *, page: int, width: int, decay: float):
  """One request: the selected blocks' scores z_ref [W * page / 128, 128] (block i at flat
  i * page) are placed on their slots in VMEM (zs_ref, ob_ref; one row read-modify-write per
  block), then V[i] and D[pos - i] move to decay * old + (1 - decay) * z[i] for every observed
  slot i < length (float32, stored in the state's dtype), and vm_ref [rows, 128 / page] gets
  each block's maximum of the new V."""
  b = pl.program_id(0)
  length = len_ref[b]
  pos = length - 1
  zs_ref[...] = jnp.zeros(zs_ref.shape, jnp.float32)
  ob_ref[...] = jnp.zeros(ob_ref.shape, jnp.float32)
  lane = lax.broadcasted_iota(jnp.int32, (1, LANES), 1)

  def place(i, carry):
    blk = sel_ref[b * width + i]

    @pl.when(blk >= 0)
    def _():
      src, dst = i * page, blk * page
      row = z_ref[pl.ds(src >> 7, 1), :]
      moved = pltpu.roll(row, (dst - src) & (LANES - 1), 1)
      mine = (lane >= (dst & (LANES - 1))) & (lane < (dst & (LANES - 1)) + page)
      r = dst >> 7
      zs_ref[pl.ds(r, 1), :] = jnp.where(mine, moved, zs_ref[pl.ds(r, 1), :])
      ob_ref[pl.ds(r, 1), :] = jnp.where(mine, 1.0, ob_ref[pl.ds(r, 1), :])

    return carry

  lax.fori_loop(0, width, place, 0)
  shape = v_ref.shape
  flat = (lax.broadcasted_iota(jnp.int32, shape, 0) * LANES
          + lax.broadcasted_iota(jnp.int32, shape, 1))
  obs = (ob_ref[...] > 0) & (flat < length)
  z = jnp.where(obs, zs_ref[...], 0.0)
  ema = lambda old, new: (decay * old.astype(jnp.float32) + (1 - decay) * new).astype(old.dtype)
  v = v_ref[...]
  vn = jnp.where(obs, ema(v, z), v)
  vo_ref[...] = vn
  z_off = by_offset(z, pos, flat, 0.0)
  obs_off = by_offset(obs.astype(jnp.float32), pos, flat, 0.0) > 0
  d = d_ref[...]
  do_ref[...] = jnp.where(obs_off, ema(d, z_off), d)
  lanes = lax.broadcasted_iota(jnp.int32, shape, 1)
  vf = vn.astype(jnp.float32)
  for s in range(LANES // page):
    seg = (lanes >= s * page) & (lanes < (s + 1) * page)
    vm_ref[:, s:s + 1] = jnp.max(jnp.where(seg, vf, NEG_INF), axis=1,
                                 keepdims=True).astype(vm_ref.dtype)


def update_slots_tpu(v, d, z, sel, lengths, *, page: int, decay: float,
                     interpret: bool = False):
  """The slot part of SPIN's EMA update on TPU (reductions A0 / A1): v, d [B, cap] (the V and
  D states, float32 or bfloat16; cap = nb * page, page a power of two <= 128), z [B, W * page]
  float32 the selected blocks' scores, sel [B, W] int32 their block ids (-1: padding), lengths
  [B] -> (V, D, VM [B, nb]) as `jaxsparse.spin.algorithm.update_blocks` leaves them."""
  bsz, cap = v.shape
  width = sel.shape[1]
  if LANES % page:
    raise ValueError(f"page={page} must divide {LANES}")
  nb = cap // page
  rows = 1 << max(-(-cap // LANES) - 1, 0).bit_length()  # a power of two (the reversal)
  capp = rows * LANES
  zrows = -(-width * page // LANES)
  pad2 = lambda a, n: jnp.pad(a, ((0, 0), (0, n - a.shape[1])))
  state = lambda a: pad2(a, capp).reshape(bsz, rows, LANES)
  per_b = lambda i, *_: (i, 0, 0)
  blk = pl.BlockSpec((None, rows, LANES), per_b)
  vo, do, vm = pl.pallas_call(
      functools.partial(_update_kernel, page=page, width=width, decay=decay),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(bsz,),
          in_specs=[pl.BlockSpec((None, zrows, LANES), per_b), blk, blk],
          out_specs=[blk, blk, pl.BlockSpec((None, rows, LANES // page), per_b)],
          scratch_shapes=[pltpu.VMEM((rows, LANES), jnp.float32),
                          pltpu.VMEM((rows, LANES), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((bsz, rows, LANES), v.dtype),
                 jax.ShapeDtypeStruct((bsz, rows, LANES), d.dtype),
                 jax.ShapeDtypeStruct((bsz, rows, LANES // page), v.dtype)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=tpu_interpret_params() if interpret else False,
      name="jaxsparse_spin_update_tpu",
  )(sel.reshape(-1).astype(jnp.int32), lengths.astype(jnp.int32),
    pad2(z.astype(jnp.float32), zrows * LANES).reshape(bsz, zrows, LANES), state(v), state(d))
  return (vo.reshape(bsz, capp)[:, :cap], do.reshape(bsz, capp)[:, :cap],
          vm.reshape(bsz, -1)[:, :nb])

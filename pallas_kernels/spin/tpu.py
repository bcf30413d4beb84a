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

__all__ = ["select_compact_tpu", "best_mask"]

_INT_MIN = -(1 << 31)


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
  """Mask of the n best eligible entries of x [R, 128] float32 (no NaN), ties to the lower
  flat index; n a traced int32 (<= 0: none; more than eligible: all eligible)."""
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

"""Threshold-filter top-K on TPU (Pallas, Mosaic TPU): group maxima, an exact threshold, a
scatter-free compaction and a bitonic finish, each a kernel.

A row is viewed as [N / 128, 128] (lane-dense). A group is one lane of one chunk (`chunk / 128`
entries strided by 128), so a group maximum is a sublane reduction: no cross-lane shuffles.
Mosaic TPU has no vector scatter, so:
  - the threshold (the k-th largest group maximum, exactly) is a 32-step bitwise search on
    order-preserving int32 keys over the row's maxima held in VMEM (`threshold`);
  - the compaction moves each row of 128 lanes' candidates to its front with 7 lane rotations
    (a candidate moves left by its count of non-candidates before it, one bit of that count
    per rotation: shifts of 1, 2, ..., 64 that never collide and keep the order), then rotates
    the row by its running offset and writes it into two rows of the candidate buffer at a
    dynamic sublane offset (`compact`): candidates land in index order, and the buffer stays
    in VMEM for the whole row;
  - the finish sorts the buffer [capacity / 128, 128] by (value descending, index ascending)
    with a bitonic network of lane and sublane rotations (`bitonic_finish`).
Every pass is exact; a row with more candidates than the buffer holds is counted, and the
caller falls back to a full sort for the call (`pallas_kernels.topk`).

Block shapes: the compaction's unit is one float32 vreg (8 x 128, `COMPACT_CHUNK`), so every
rotation is a single-vreg op on every generation (v5e, v5p, v6e); the buffer (2k entries, 32 KB
at k = 2048 per array) and a row's group maxima (N / g <= 16K entries, 64 KB) sit in VMEM
(16 MB on v5e, 32 MB on v5p and v6e) with room to double-buffer the streaming passes' chunks of
g x 128 scores. None of these passes uses the MXU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._util import flush_zero, tpu_interpret_params

__all__ = ["NEG_INF", "LANES", "COMPACT_CHUNK", "group_max", "count", "threshold", "compact",
           "bitonic_finish", "ordered_key", "lane_prefix", "to_front"]

NEG_INF = float("-inf")
LANES = 128
COMPACT_CHUNK = 8 * LANES  # one float32 vreg: the compaction's unit
_INT_MIN = -(1 << 31)


def _interp(interpret: bool):
  return tpu_interpret_params() if interpret else False


def _valid(len_ref, x_ref, chunk):
  r, c = pl.program_id(0), pl.program_id(1)
  x = x_ref[...].astype(jnp.float32)  # [chunk / 128, 128]
  shape = x.shape
  idx = (c * chunk + lax.broadcasted_iota(jnp.int32, shape, 0) * LANES
         + lax.broadcasted_iota(jnp.int32, shape, 1))
  ok = (idx < len_ref[r]) & (x == x)
  return jnp.where(ok, jnp.where(x == 0, 0.0, x), NEG_INF), idx


def _group_max_kernel(len_ref, x_ref, o_ref, *, chunk: int):
  o_ref[...] = jnp.max(_valid(len_ref, x_ref, chunk)[0], axis=0, keepdims=True)


def _count_kernel(len_ref, thr_ref, x_ref, o_ref, *, chunk: int):
  x = _valid(len_ref, x_ref, chunk)[0]
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
      interpret=_interp(interpret),
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


# ----------------------------------------------------------------------------- threshold


def ordered_key(x):
  """float32 -> int32 whose signed order is the float order (x has no NaN; -0.0 as +0.0)."""
  b = lax.bitcast_convert_type(flush_zero(x), jnp.int32)
  return jnp.where(b < 0, b ^ 0x7FFFFFFF, b)


def _fromordered_key(s):
  b = jnp.where(s < 0, s ^ 0x7FFFFFFF, s)
  return lax.bitcast_convert_type(b, jnp.float32)


def _threshold_kernel(m_ref, o_ref, *, k: int):
  """m_ref [G / 128, 128]: one row's group maxima (-inf for empty groups) -> o_ref [1, 128]:
  the k-th largest, broadcast over the lanes, or -inf when fewer than k are finite. Bit b of
  the answer (as an unsigned key, from bit 31 down) is set when at least k keys reach the
  prefix with it set: 32 counts over the maxima, no sort."""
  s = ordered_key(m_ref[...])
  int_min = jnp.int32(_INT_MIN)

  def body(i, c):
    cand = c | lax.shift_left(jnp.int32(1), 31 - i)
    n = jnp.sum((s >= (cand ^ int_min)).astype(jnp.int32))
    return jnp.where(n >= k, cand, c)

  key = lax.fori_loop(0, 32, body, jnp.int32(0)) ^ int_min
  t = _fromordered_key(jnp.full((1, LANES), key, jnp.int32))
  o_ref[...] = jnp.where(key < ordered_key(jnp.float32(NEG_INF)), NEG_INF, t)


def threshold(gmax, k: int, *, interpret: bool):
  """gmax [R, G] (G % 128 == 0) float32 -> [R] float32: the k-th largest group maximum of
  each row (-inf when fewer than k are finite): a valid threshold, since k groups each hold an
  entry at or above it."""
  r, g = gmax.shape
  out = pl.pallas_call(
      functools.partial(_threshold_kernel, k=k),
      grid=(r,),
      in_specs=[pl.BlockSpec((None, g // LANES, LANES), lambda i: (i, 0, 0))],
      out_specs=pl.BlockSpec((None, 1, LANES), lambda i: (i, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((r, 1, LANES), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=_interp(interpret), name="jaxsparse_topk_threshold_tpu",
  )(gmax.reshape(r, g // LANES, LANES))
  return out[:, 0, 0]


# ---------------------------------------------------------------------------- compaction


def lane_prefix(ci, lane):
  """Inclusive prefix sums along the lanes of ci [S, 128] int32 (7 rotations)."""
  s = 1
  while s < LANES:
    ci = ci + jnp.where(lane >= s, pltpu.roll(ci, s, 1), 0)
    s *= 2
  return ci


def to_front(cand, v, ix, lane):
  """Move each row's candidates to its front lanes, in order (see the module docstring)."""
  ci = cand.astype(jnp.int32)
  d = lane - (lane_prefix(ci, lane) - ci)  # non-candidates before each lane
  for b in range(7):
    sh = 1 << b
    left = lambda a: pltpu.roll(a, LANES - sh, 1)  # left(a)[l] = a[l + sh]
    rv, ri, rc, rd = left(v), left(ix), left(cand), left(d)
    incoming = rc & ((rd >> b) & 1 == 1) & (lane < LANES - sh)
    stays = cand & ((d >> b) & 1 == 0)
    v = jnp.where(incoming, rv, v)
    ix = jnp.where(incoming, ri, ix)
    d = jnp.where(incoming, rd, d)
    cand = incoming | stays
  return v, ix


def _compact_kernel(len_ref, thr_ref, x_ref, v_ref, i_ref, t_ref, off_ref, *, chunk: int,
                    rows: int):
  """One (row, chunk of 8 x 128) program; v_ref / i_ref [rows + 1, 128]: the row's buffer,
  resident over the chunks (the extra row takes what spills past the capacity); t_ref
  [1, 128]: the row's candidate count; off_ref: SMEM [1], the running count."""
  r, c = pl.program_id(0), pl.program_id(1)

  @pl.when(c == 0)
  def _():
    v_ref[...] = jnp.full(v_ref.shape, NEG_INF, jnp.float32)
    i_ref[...] = jnp.full(i_ref.shape, -1, jnp.int32)
    off_ref[0] = 0

  x, idx = _valid(len_ref, x_ref, chunk)
  cand = (x >= thr_ref[r]) & (x > NEG_INF)
  lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  v, ix = to_front(cand, x, idx, lane)
  row_lane = lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
  off = off_ref[0]
  for s in range(x.shape[0]):
    n = jnp.sum(cand[s:s + 1].astype(jnp.int32))
    q, sh = off >> 7, off & (LANES - 1)  # off >= 0 (shifts: no sign op in Mosaic)

    @pl.when((n > 0) & (q < rows))
    def _(s=s, n=n, q=q, sh=sh):
      rv = pltpu.roll(v[s:s + 1], sh, 1)
      ri = pltpu.roll(ix[s:s + 1], sh, 1)
      first = (row_lane >= sh) & (row_lane < sh + n)
      second = row_lane < sh + n - LANES
      v_ref[pl.ds(q, 1), :] = jnp.where(first, rv, v_ref[pl.ds(q, 1), :])
      i_ref[pl.ds(q, 1), :] = jnp.where(first, ri, i_ref[pl.ds(q, 1), :])
      v_ref[pl.ds(q + 1, 1), :] = jnp.where(second, rv, v_ref[pl.ds(q + 1, 1), :])
      i_ref[pl.ds(q + 1, 1), :] = jnp.where(second, ri, i_ref[pl.ds(q + 1, 1), :])

    off = off + n
  off_ref[0] = off

  @pl.when(c == pl.num_programs(1) - 1)
  def _():
    t_ref[...] = jnp.full((1, LANES), off_ref[0], jnp.int32)


def compact(x, lengths, thr, *, capacity: int, interpret: bool):
  """x [R, N] (N % 1024 == 0), lengths [R], thr [R] -> (values [R, capacity] float32, indices
  [R, capacity] int32, counts [R] int32): each row's candidates (valid entries >= thr, > -inf)
  in index order, then -inf / -1; a row with count > capacity keeps its first capacity."""
  r, n = x.shape
  if capacity % LANES or n % COMPACT_CHUNK:
    raise ValueError(f"capacity={capacity} must be a multiple of {LANES} and N={n} of "
                     f"{COMPACT_CHUNK}")
  rows = capacity // LANES
  buf = pl.BlockSpec((None, rows + 1, LANES), lambda i, c, *_: (i, 0, 0))
  v, i, t = pl.pallas_call(
      functools.partial(_compact_kernel, chunk=COMPACT_CHUNK, rows=rows),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(r, n // COMPACT_CHUNK),
          in_specs=[pl.BlockSpec((None, COMPACT_CHUNK // LANES, LANES),
                                 lambda i, c, *_: (i, c, 0))],
          out_specs=[buf, buf, pl.BlockSpec((None, 1, LANES), lambda i, c, *_: (i, 0, 0))],
          scratch_shapes=[pltpu.SMEM((1,), jnp.int32)],
      ),
      out_shape=[jax.ShapeDtypeStruct((r, rows + 1, LANES), jnp.float32),
                 jax.ShapeDtypeStruct((r, rows + 1, LANES), jnp.int32),
                 jax.ShapeDtypeStruct((r, 1, LANES), jnp.int32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=_interp(interpret), name="jaxsparse_topk_compact_tpu",
  )(lengths.astype(jnp.int32), thr.astype(jnp.float32), x.reshape(r, n // LANES, LANES))
  return (v[:, :rows].reshape(r, capacity), i[:, :rows].reshape(r, capacity), t[:, 0, 0])


# -------------------------------------------------------------------------------- finish


def _bitonic_kernel(v_ref, i_ref, vo_ref, io_ref):
  """Sort one row's buffer [rows, 128] by (value descending, index ascending)."""
  v, ix = v_ref[...], i_ref[...]
  rows = v.shape[0]
  n = rows * LANES
  flat = (lax.broadcasted_iota(jnp.int32, v.shape, 0) * LANES
          + lax.broadcasted_iota(jnp.int32, v.shape, 1))

  def partner(a, d):  # (a[f + d], a[f - d]) by rotations along lanes or rows
    if d < LANES:
      return pltpu.roll(a, LANES - d, 1), pltpu.roll(a, d, 1)
    dr = d // LANES
    return pltpu.roll(a, rows - dr, 0), pltpu.roll(a, dr, 0)

  size = 2
  while size <= n:
    d = size // 2
    while d >= 1:
      (vu, vd), (iu, idn) = partner(v, d), partner(ix, d)
      lower = (flat & d) == 0
      pv, pi = jnp.where(lower, vu, vd), jnp.where(lower, iu, idn)
      p_first = (pv > v) | ((pv == v) & (pi < ix))
      s_first = (v > pv) | ((v == pv) & (ix < pi))
      best_first = (flat & size) == 0  # this block sorts best-first
      take = jnp.where(lower == best_first, p_first, s_first)
      v, ix = jnp.where(take, pv, v), jnp.where(take, pi, ix)
      d //= 2
    size *= 2
  vo_ref[...] = v
  io_ref[...] = ix


def bitonic_finish(cv, ci, *, interpret: bool):
  """cv [R, C] float32, ci [R, C] int32 (C a power of two >= 128; distinct indices for
  finite values) -> the rows sorted by value descending, ties by index ascending."""
  r, c = cv.shape
  if c % LANES or c & (c - 1):
    raise ValueError(f"the buffer width {c} must be a power of two >= {LANES}")
  rows = c // LANES
  spec = pl.BlockSpec((None, rows, LANES), lambda i: (i, 0, 0))
  v, i = pl.pallas_call(
      _bitonic_kernel,
      grid=(r,),
      in_specs=[spec, spec],
      out_specs=[spec, spec],
      out_shape=[jax.ShapeDtypeStruct((r, rows, LANES), jnp.float32),
                 jax.ShapeDtypeStruct((r, rows, LANES), jnp.int32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=_interp(interpret), name="jaxsparse_topk_bitonic_tpu",
  )(cv.reshape(r, rows, LANES), ci.reshape(r, rows, LANES))
  return v.reshape(r, c), i.reshape(r, c)

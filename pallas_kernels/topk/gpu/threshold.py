"""The GPU top-K's first two passes: group maxima (one streaming pass, one program per (row,
chunk)) and the threshold (one program per row: a search on the value that k group maxima
reach, with no sort; it can also list the groups that reach it, zero the compaction's row
counters and estimate a pivot for two value buckets)."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import next_pow2
from pallas_kernels.topk.gpu._common import (COUNTER_STRIDE, NEG_INF, PER_ROW, lengths_in,
                                             row_chunk_specs, scatter_width, valid)

__all__ = ["group_max", "threshold"]


def _group_max_kernel(x_ref, len_ref, o_ref, *, chunk: int, group: int):
  x, _ = valid(x_ref, len_ref, chunk)
  o_ref[...] = x.reshape(chunk // group, group).max(axis=1)


def _pow2_pieces(g: int) -> list[tuple[int, int]]:
  """(offset, size) of the power-of-two pieces that tile [0, g), largest first."""
  out, off = [], 0
  for b in reversed(range(g.bit_length())):
    if g >> b & 1:
      out.append((off, 1 << b))
      off += 1 << b
  return out


def _search(ms: list, k: int, iters: int, slack: int = 0):
  """Group maxima of one row, held in registers as pieces ms ([size] float32 each, -inf for
  empty groups) -> a valid threshold (float32 scalar): a search on the value that keeps the
  invariant count(m >= lo) >= k, so k groups each hold an entry >= lo. -inf when fewer than k
  groups are non-empty (every valid entry is then a candidate).

  slack 0: bisection, `iters` steps, within (max - min) / 2**iters of the k-th largest
  maximum. slack > 0: regula falsi (Illinois): the first probe is where the k-th largest
  would sit if the maxima were normal (from their mean and deviation); each later one
  interpolates where the count crosses k + slack / 2 between the bracket's counts (the count
  above the maximum is 0), and the end that stays twice has its weight halved; probes keep
  1/64 of the bracket from either end; it stops once at most k + slack maxima reach lo, or
  after `iters` probes. A step is one count over every maximum (most of its time,
  benchmarks/NOTES.md), and on smooth rows interpolation needs a few probes where
  bisection needs 14; on flat or tied rows it makes no more probes than bisection."""
  def total(f):
    return functools.reduce(lambda a, b: a + b, [jnp.sum(f(m).astype(jnp.int32)) for m in ms])

  nfin = total(lambda m: m > NEG_INF)
  hi = functools.reduce(jnp.maximum, [jnp.max(m) for m in ms])
  lo = functools.reduce(jnp.minimum, [jnp.min(jnp.where(m > NEG_INF, m, jnp.inf)) for m in ms])

  if not slack:
    def body(i, c):
      lo, hi = c
      mid = lo + (hi - lo) * 0.5
      ok = total(lambda m: m >= mid) >= k
      return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = lax.fori_loop(0, iters, body, (lo, hi))
    return jnp.where(nfin >= k, lo, NEG_INF)

  target = k + 0.5 * slack
  # first probe: where the k-th largest would sit if the maxima were normal (mean + z std,
  # z the upper (target / nfin) quantile, Abramowitz & Stegun 26.2.23); moments about lo
  d = [jnp.where(m > NEG_INF, m - lo, 0.0) for m in ms]
  nf = jnp.maximum(nfin, 1).astype(jnp.float32)
  mean = functools.reduce(lambda a, b: a + b, [jnp.sum(x) for x in d]) / nf
  var = functools.reduce(lambda a, b: a + b, [jnp.sum(x * x) for x in d]) / nf - mean * mean
  p = jnp.clip(target / nf, 1e-7, 1 - 1e-7)
  q = jnp.minimum(p, 1 - p)
  u = jnp.sqrt(-2 * jnp.log(q))
  z = u - (2.515517 + u * (0.802853 + u * 0.010328)) / (
      1 + u * (1.432788 + u * (0.189269 + u * 0.001308)))
  z = jnp.where(p > 0.5, -z, z)
  first = lo + mean + z * jnp.sqrt(jnp.maximum(var, 0.0))

  def probe(c, t):
    i, lo, hi, n_lo, w_lo, w_hi, side = c
    t = jnp.clip(jnp.where(t == t, t, lo + (hi - lo) * 0.5),
                 lo + (hi - lo) * (1 / 64), lo + (hi - lo) * (63 / 64))
    n = total(lambda m: m >= t)
    ok = n >= k
    f = n.astype(jnp.float32) - target
    # Illinois: the end that stays a second time in a row counts half as much (side: +1, the
    # last probe moved lo; -1, hi; 0, none yet). Arithmetic, not selects of constants or
    # bool-to-float casts, which the Triton lowering gets wrong for scalars.
    w_lo = jnp.where(ok, f, w_lo * (1 + 0.5 * jnp.minimum(side, 0.0)))
    w_hi = jnp.where(ok, w_hi * (1 - 0.5 * jnp.maximum(side, 0.0)), f)
    side = (2 * ok.astype(jnp.int32) - 1).astype(jnp.float32)
    return (i + 1, jnp.where(ok, t, lo), jnp.where(ok, hi, t), jnp.where(ok, n, n_lo),
            w_lo, w_hi, side)

  def cond(c):
    i, lo, hi, n_lo, _, _, _ = c
    return (i < iters) & (n_lo > k + slack) & (lo < hi)

  def body(c):
    _, lo, hi, _, w_lo, w_hi, _ = c
    return probe(c, lo + (hi - lo) * (w_lo / (w_lo - w_hi)))

  c = (jnp.int32(0), lo, hi, nfin, nfin.astype(jnp.float32) - target, jnp.float32(-target),
       jnp.float32(0))
  lo = lax.while_loop(cond, body, probe(c, first))[1]
  return jnp.where(nfin >= k, lo, NEG_INF)


def _pivot(ms: list, thr, k: int):
  """A value splitting a row's candidates (its entries >= thr, about k of them) into two
  buckets of roughly equal size, with no count: above a threshold that keeps k of many scores
  the tail falls off about exponentially, so the count above thr + t (hi - thr) (hi: the
  largest maximum, where one remains) is about k ** (1 - t), half of k at t = ln 2 / ln k.
  That fits exponential-like tails; a normal row's candidates split about 60 / 40, uniform
  or heavy-tailed rows up to 90 / 10. -inf when thr is -inf (every valid entry is then in
  the upper bucket). Only the speed of a finish that compares within buckets depends on the
  split, never its result."""
  hi = functools.reduce(jnp.maximum, [jnp.max(m) for m in ms])
  frac = math.log(2) / math.log(max(k, 2))
  t = thr + (hi - thr) * frac
  return jnp.where(thr > NEG_INF, t, NEG_INF)


def _threshold_kernel(m_ref, o_ref, *refs, k: int, iters: int, list_width: int, slack: int,
                      pivot: bool = False):
  """m_ref: [G] group maxima of one row (-inf for empty groups) -> o_ref: [1] threshold.

  The search on the value (`_search`: bisection, or regula falsi with slack > 0) keeps the
  invariant count(m >= lo) >= k, so `lo` is always a valid threshold (k groups, each
  holding an entry >= lo). The row stays in registers, as
  power-of-two pieces when G is not one (no padded copy of the maxima).
  refs (all optional, in this order): the compaction's zeroed row counters; with list_width
  > 0, the ids of the groups that can hold a candidate (maximum >= lo and > -inf, or NaN),
  in ascending order, into a [>= list_width] row (ids past list_width are dropped), and how
  many there are [1]. Each listed group holds at least one candidate, so a row listing more
  than list_width (the candidate buffer's capacity) overflows the buffer anyway: its counter
  then starts past the capacity, which sends the row to the repair kernel. With pivot, the
  last ref gets [1] a value between the threshold and the largest maximum that splits the
  candidates into two value buckets of roughly equal size (`_pivot`).
  """
  ms = [m_ref[pl.ds(off, size)] for off, size in _pow2_pieces(m_ref.shape[0])]
  thr = _search(ms, k, iters, slack)
  o_ref[...] = thr.reshape(1)
  if pivot:
    *refs, p_ref = refs
    p_ref[...] = _pivot(ms, thr, k).reshape(1)
  c_ref = refs[0] if len(refs) in (1, 3) else None
  ctr0 = 0
  if list_width:
    l_ref, n_ref = refs[-2:]
    listed = 0
    for (off, size), m in zip(_pow2_pieces(m_ref.shape[0]), ms):
      hit = (((m >= thr) & (m > NEG_INF)) | (m != m)).astype(jnp.int32)
      pos = listed + jnp.cumsum(hit) - 1
      keep = (hit > 0) & (pos < list_width)
      ids = off + lax.broadcasted_iota(jnp.int32, (size,), 0)
      # masked lanes aim at one trash slot past the list (see scatter_width)
      plgpu.store(l_ref.at[jnp.where(keep, pos, list_width)], ids, mask=keep)
      listed = listed + jnp.sum(hit)
    n_ref[...] = listed.reshape(1)
    # (integer arithmetic, not selects: the Triton lowering of a select between a scalar and
    # a tensor fails to verify)
    ctr0 = (listed > list_width).astype(jnp.int32) * (list_width + 1)
  if c_ref is not None:  # the compaction's row counters (saves XLA a fill kernel before it)
    lane = lax.broadcasted_iota(jnp.int32, c_ref.shape, 0)
    c_ref[...] = ((lane == 0).astype(jnp.int32) * ctr0).astype(c_ref.dtype)


def group_max(x, lengths, *, chunk: int, group: int, num_warps: int, interpret: bool):
  """x [R, N] (N % chunk == 0), lengths [R] or None (whole rows) -> [R, N / group] float32."""
  r, n = x.shape
  kernel, len_in, len_spec = lengths_in(
      functools.partial(_group_max_kernel, chunk=chunk, group=group), lengths, PER_ROW)
  return pl.pallas_call(
      kernel,
      grid=(r, n // chunk),
      in_specs=row_chunk_specs(chunk) + len_spec,
      out_specs=pl.BlockSpec((None, chunk // group), lambda r, c: (r, c)),
      out_shape=jax.ShapeDtypeStruct((r, n // group), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_group_max",
  )(x, *len_in)


def threshold(gmax, k: int, *, iters: int, num_warps: int, interpret: bool,
              counter=None, list_width: int = 0, slack: int = 0, pivot: bool = False):
  """gmax [R, G] -> [R] float32 valid thresholds (see _threshold_kernel). G need not be a
  power of two; up to 4 power-of-two pieces are kept apart, more are padded to one.
  slack: 0, `iters` steps of bisection; > 0, at most `iters` probes of regula falsi, stopping
  once at most k + slack maxima reach the threshold (`_search`).
  counter=dtype (`counter_dtype(placement)`) -> also [R, COUNTER_STRIDE] zeros of it: the
  row counters `compact_atomic` / `compact_groups` count in, written by this kernel instead
  of a separate XLA fill.
  list_width > 0 (the candidate capacity) -> also the group list [R, >= list_width] int32
  (the ids of the groups that can hold a candidate, ascending; slots past the count are not
  initialised) and the count [R] int32 (may exceed list_width: then the row's counter starts
  at list_width + 1, so the row overflows). pivot=True -> also [R] float32 pivots splitting
  each row's candidates into two buckets (`_pivot`; for `compact_atomic(..., pivot=)`).
  Returns a tuple (thr, [counters,] [list, count,] [pivot]) unless only thr is asked for."""
  r, g = gmax.shape
  if len(_pow2_pieces(g)) > 4:
    gmax = jnp.pad(gmax, ((0, 0), (0, next_pow2(g) - g)), constant_values=NEG_INF)
    g = gmax.shape[1]
  if list_width and counter is None:
    raise ValueError("list_width needs counter= (the list's overflow is flagged in it)")
  if not (isinstance(slack, int) and slack >= 0):
    raise ValueError(f"slack={slack!r} must be an int >= 0")
  one = pl.BlockSpec((1,), lambda i: (i,))
  specs, shapes = [one], [jax.ShapeDtypeStruct((r,), jnp.float32)]
  if counter is not None:
    specs.append(pl.BlockSpec((None, COUNTER_STRIDE), lambda i: (i, 0)))
    shapes.append(jax.ShapeDtypeStruct((r, COUNTER_STRIDE), counter))
  if list_width:
    width = scatter_width(list_width, interpret)
    specs += [pl.BlockSpec((None, width), lambda i: (i, 0)), one]
    shapes += [jax.ShapeDtypeStruct((r, width), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.int32)]
  if pivot:
    specs.append(one)
    shapes.append(jax.ShapeDtypeStruct((r,), jnp.float32))
  out = pl.pallas_call(
      functools.partial(_threshold_kernel, k=k, iters=iters, list_width=list_width,
                        slack=slack, pivot=pivot),
      grid=(r,),
      in_specs=[pl.BlockSpec((None, g), lambda i: (i, 0))],
      out_specs=specs,
      out_shape=shapes,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_threshold",
  )(gmax)
  return tuple(out) if len(out) > 1 else out[0]

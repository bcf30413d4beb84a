"""Exact top-k for rows whose candidates overflow the buffer: the `repair` pass before a finish,
and the sorted repair the repairing finishes (rank, split bitonic, rank merge) run in place of
their own work for such a row. Both keep the call branch-free."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import is_pow2, next_pow2
from pallas_kernels.topk.gpu._common import (COUNTER_STRIDE, NEG_INF, lengths_in, ordered_key,
                                             scatter_width)
from pallas_kernels.topk.gpu.network import bitonic_sort, sort_keys, write_sorted

__all__ = ["repair_sorted", "repair_first", "repair_refs", "repair_in", "repair"]


def _exact_set(x_ref, length, v_ref, i_ref, *, n: int, chunk: int, k: int):
  """One program: the exact top-k set of the row x_ref [n] (entries at or past `length`,
  NaN and -inf never chosen; ties to the lower index) written in index order into the first
  slots of v_ref / i_ref [W] (W a multiple of chunk, >= k), the other slots -inf / -1. The
  k-th largest key is found four bits a sweep (8 counting sweeps, each counting the entries
  at or above the 15 candidates for the next hex digit), then entries above it and the first
  ties up to k are compacted with a running offset."""
  nchunks = n // chunk

  def load(c, size=chunk):
    x = x_ref[pl.ds(c * size, size)].astype(jnp.float32)
    idx = c * size + lax.broadcasted_iota(jnp.int32, (size,), 0)
    ok = (idx < length) & (x == x) & (x > NEG_INF)
    x = jnp.where(x == 0, 0.0, x)
    return x, idx, ok, jnp.where(ok, ordered_key(x), jnp.uint32(0))

  def count_ge(cand):
    def body(c, acc):
      _, _, ok, key = load(c)
      return acc + jnp.sum((ok & (key >= cand)).astype(jnp.int32))
    return lax.fori_loop(0, nchunks, body, jnp.int32(0))

  dchunk = min(chunk, 256)  # the digit sweeps hold [dchunk, 16] compares
  digits = lax.broadcasted_iota(jnp.int32, (16,), 0).astype(jnp.uint32)

  def digit(i, t):
    shift = (28 - 4 * i).astype(jnp.uint32)
    cands = t | (digits << shift)  # [16]; digit 0 is t itself (k or more reach it)

    def body(c, acc):
      _, _, ok, key = load(c, dchunk)
      hit = ok[:, None] & (key[:, None] >= cands[None, :])
      return acc + jnp.sum(hit.astype(jnp.int32), axis=0)

    counts = lax.fori_loop(0, n // dchunk, body, jnp.zeros((16,), jnp.int32))
    # counts fall with the digit: the largest digit that k entries reach is how many do, less 1
    d = jnp.maximum(jnp.sum((counts >= k).astype(jnp.int32)) - 1, 0).astype(jnp.uint32)
    return t | (d << shift)

  t = lax.fori_loop(0, 8, digit, jnp.uint32(0))
  n_gt = count_ge(t + jnp.uint32(1))
  quota = k - n_gt
  width = v_ref.shape[0]

  def clear(c, carry):
    v_ref[pl.ds(c * chunk, chunk)] = jnp.full((chunk,), NEG_INF, jnp.float32)
    i_ref[pl.ds(c * chunk, chunk)] = jnp.full((chunk,), -1, jnp.int32)
    return carry

  lax.fori_loop(0, width // chunk, clear, 0)

  def emit(c, carry):
    off, ties = carry
    x, idx, ok, key = load(c)
    tie = ok & (key == t)
    tie_rank = ties + jnp.cumsum(tie.astype(jnp.int32))
    take = (ok & (key > t)) | (tie & (tie_rank <= quota))
    pos = off + jnp.cumsum(take.astype(jnp.int32)) - 1
    pos = jnp.where(take, pos, width - 1)
    plgpu.store(v_ref.at[pos], x, mask=take)
    plgpu.store(i_ref.at[pos], idx, mask=take)
    return off + jnp.sum(take.astype(jnp.int32)), ties + jnp.sum(tie.astype(jnp.int32))

  lax.fori_loop(0, nchunks, emit, (jnp.int32(0), jnp.int32(0)))


def _repair_kernel(x_ref, len_ref, tot_ref, v_in, i_in, v_ref, i_ref, live_ref, *, n: int,
                   chunk: int, capacity: int, k: int):
  """Rows whose candidates overflowed the buffer (tot > capacity) get their exact top-k set
  written into it instead, in index order (`_exact_set`); every other row returns at once.
  Slow (the row is read 10 times by one program) but only runs for rows the threshold does
  not bound (real rows, whose neighbours rise together, in calls too small for the refined
  threshold; long runs of equal scores), and it keeps the whole call branch-free: no
  device-to-host predicate, which on GPU costs more than all the filter passes together.
  """
  del v_in, i_in
  # live slots of the row for the finish: the count, or k for a repaired row
  tot = tot_ref[0].astype(jnp.int32)
  live_ref[...] = jnp.where(tot > capacity, k, tot).reshape(1)

  @pl.when(tot > capacity)
  def _():
    _exact_set(x_ref, n if len_ref is None else len_ref[0], v_ref, i_ref, n=n, chunk=chunk,
               k=k)


def repair_sorted(x_ref, len_ref, rv_ref, ri_ref, vo_ref, io_ref, *, n: int, chunk: int,
                   k: int, interpret: bool, sel_ref=None, page: int = 0):
  """One program: the row's exact top-k set (`_exact_set`) into the scratch rv / ri, read
  back, sorted by a bitonic network and written to vo / io (values descending, ties to the
  lower index, -inf / -1 tail; sel_ref / page: indices mapped as `write_sorted` does)."""
  kw = next_pow2(k)
  _exact_set(x_ref, n if len_ref is None else len_ref[0], rv_ref, ri_ref, n=n,
             chunk=min(chunk, kw), k=k)
  if not interpret:
    plgpu.debug_barrier()  # the set's scattered stores, read back by other lanes below
  head = pl.ds(0, kw)
  key, idx = bitonic_sort(*sort_keys(rv_ref.at[head], ri_ref.at[head], k))
  write_sorted(key, idx, vo_ref.at[head], io_ref.at[head], sel_ref, page)


def repair_first(cond, x_ref, len_ref, scratch, vo_ref, io_ref, *, k: int, repair,
                  interpret: bool):
  """With repair ((n, chunk, with_lengths)), the program where `cond` holds writes its row's
  exact sorted top-k (`repair_sorted`, scratch: its pair of buffers); nothing without."""
  if not repair:
    return

  @pl.when(cond)
  def _():
    repair_sorted(x_ref, len_ref, *scratch, vo_ref, io_ref, n=repair[0], chunk=repair[1],
                   k=k, interpret=interpret)


def repair_refs(refs, repair):
  """Split a finish kernel's refs into (x_ref, len_ref, the rest) when it repairs."""
  if not repair:
    return None, None, list(refs)
  x_ref, *refs = refs
  len_ref = refs.pop(0) if repair[2] else None
  return x_ref, len_ref, refs


def repair_in(repair, r: int, k: int, interpret: bool):
  """repair=(x [R, N] float32, lengths [R] int32 or None, chunk) for a finish that repairs
  overflowing rows itself (`repair_sorted`), or None -> (extra inputs, their specs, extra
  outputs' shapes, their specs, the kernel's static (n, chunk, with_lengths) or None)."""
  if repair is None:
    return [], [], [], [], None
  x, lengths, chunk = repair
  n = x.shape[1]
  if x.shape[0] != r or not is_pow2(chunk) or n % chunk:
    raise ValueError(f"repair rows {x.shape} must have {r} rows and chunk={chunk} must be a "
                     f"power of two dividing {n}")
  whole = lambda w: pl.BlockSpec((None, w), lambda i, *_: (i, 0))
  ins, specs = [x.astype(jnp.float32)], [whole(n)]
  if lengths is not None:
    ins.append(lengths.astype(jnp.int32))
    specs.append(pl.BlockSpec((1,), lambda i, *_: (i,)))
  rep_w = scatter_width(next_pow2(k), interpret)
  shapes = [jax.ShapeDtypeStruct((r, rep_w), jnp.float32),
            jax.ShapeDtypeStruct((r, rep_w), jnp.int32)]
  return ins, specs, shapes, [whole(rep_w)] * 2, (n, chunk, lengths is not None)


def repair(x, lengths, total, v, i, *, k: int, capacity: int, chunk: int, num_warps: int,
           interpret: bool):
  """Exact candidates for overflowing rows (see _repair_kernel); v, i: compact's buffers;
  total: the candidate counts [R] int32, or `compact_atomic`'s row counters [R,
  COUNTER_STRIDE] (int32 or float32; element 0 read in the kernel, no XLA slice or convert).
  -> (v, i, live [R] int32): the live slots per row, the count, or k for a repaired row (its
  first k slots, -inf padded)."""
  r, n = x.shape
  width = v.shape[1]
  if width % chunk or width < k:
    raise ValueError(f"candidate buffer width {width} must be a multiple of chunk={chunk} "
                     f"and hold k={k}")
  row = pl.BlockSpec((None, width), lambda i: (i, 0))
  one = pl.BlockSpec((1,), lambda i: (i,))
  if total.shape == (r,):
    tot_spec, total = one, total.astype(jnp.int32)
  elif total.shape == (r, COUNTER_STRIDE):
    tot_spec = pl.BlockSpec((None, COUNTER_STRIDE), lambda i: (i, 0))
  else:
    raise ValueError(f"total {total.shape} must be ({r},) or ({r}, {COUNTER_STRIDE})")
  kernel, len_in, len_spec = lengths_in(
      functools.partial(_repair_kernel, n=n, chunk=chunk, capacity=capacity, k=k), lengths, one)
  return pl.pallas_call(
      kernel,
      grid=(r,),
      in_specs=[pl.BlockSpec((None, n), lambda i: (i, 0))] + len_spec + [tot_spec, row, row],
      out_specs=[row, row, one],
      out_shape=[jax.ShapeDtypeStruct(v.shape, jnp.float32),
                 jax.ShapeDtypeStruct(i.shape, jnp.int32),
                 jax.ShapeDtypeStruct((r,), jnp.int32)],
      input_output_aliases={2 + len(len_in): 0, 3 + len(len_in): 1},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_repair",
  )(x, *len_in, total, v, i)

"""Candidate compaction on GPU: the entries at or above each row's threshold into a per-row
buffer of `capacity` slots.

  count + compact: per-chunk counts, then a scatter at offsets from their exclusive scan, in
    index order (what the "set" and "sort" finishes need: ties break by lower index);
  compact_atomic: one pass, a range per chunk ("scan") or a slot per candidate ("lane")
    reserved by atomic adds, in run order (for the order-free finishes);
  compact_groups: compact_atomic reading only the groups the threshold kernel listed.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.topk.gpu._common import (COUNTER_STRIDE, NEG_INF, PER_ROW, check_group_list,
                                             lengths_in, listed_entries, row_chunk_specs,
                                             scatter_width, valid)

__all__ = ["PLACEMENTS", "counter_dtype", "count", "compact", "compact_atomic", "compact_groups"]


PLACEMENTS = ("scan", "lane")


def _count_kernel(x_ref, len_ref, thr_ref, o_ref, *, chunk: int):
  x, _ = valid(x_ref, len_ref, chunk)
  m = (x >= thr_ref[0]) & (x > NEG_INF)
  o_ref[...] = jnp.sum(m.astype(jnp.int32)).reshape(1)


def _compact_kernel(x_ref, len_ref, thr_ref, off_ref, v_ref, i_ref, *, chunk: int,
                    capacity: int):
  x, idx = valid(x_ref, len_ref, chunk)
  m = (x >= thr_ref[0]) & (x > NEG_INF)
  pos = off_ref[0] + jnp.cumsum(m.astype(jnp.int32)) - 1
  keep = m & (pos < capacity)
  # masked lanes aim at a trash slot past the buffer proper: interpret mode implements a masked
  # scatter as read-modify-write, so they must not share a slot with a real candidate
  pos = jnp.where(keep, pos, capacity)
  plgpu.store(v_ref.at[pos], x, mask=keep)
  plgpu.store(i_ref.at[pos], idx, mask=keep)


def _place(x, idx, m, ctr_ref, v_ref, i_ref, *, capacity: int, placement: str, zero=None,
           pivot=None, interpret: bool = False):
  """Append the lanes m [L] of (x, idx) [L] to the row's candidate buffer (v_ref, i_ref) at
  slots reserved on the row's counter ctr_ref (element 0) by atomic adds, as
  `_compact_atomic_kernel` describes for each placement; slots >= capacity are dropped.
  zero: a traced int32 zero made outside any `pl.when` (interpret mode substitutes program
  ids only at the kernel's top level), or None to make it here. pivot ("scan" only): a
  float32 scalar; lanes >= pivot reserve on element 1 and fill the buffer from its front,
  the others on element 2 and fill it from its back (slots < 0 are dropped). interpret: the
  "lane" placement's per-lane atomics as one add in lane order (the same slots as a compiled
  run whose lanes' atomics arrive in lane order)."""
  L = x.shape[0]
  if pivot is not None:  # both buckets in one scan and one two-lane atomic
    zero = pl.program_id(1) * 0 if zero is None else zero
    up = m & (x >= pivot)
    both = up.astype(jnp.int32) + (m & ~up).astype(jnp.int32) * (1 << 16)  # L < 2**16
    run, tot = jnp.cumsum(both), jnp.sum(both)
    two = lax.broadcasted_iota(jnp.int32, (2,), 0)
    old = plgpu.atomic_add(ctr_ref, (zero + 1 + two,),
                           ((tot & 0xFFFF) * (1 - two) + (tot >> 16) * two).astype(ctr_ref.dtype))
    top = jnp.sum(old * (1 - two).astype(old.dtype)).astype(jnp.int32)
    low = jnp.sum(old * two.astype(old.dtype)).astype(jnp.int32)
    pos = jnp.where(up, top + (run & 0xFFFF) - 1, capacity - low - (run >> 16))
    pos = jnp.where(pos < 0, capacity, pos)  # a lower candidate past the front: dropped
  elif placement == "lane":
    if interpret:  # every lane of a vector atomic on one address gets the same old value
      # in the interpreter: the lanes' adds of 1, in lane order, as one add of their sum
      zero = pl.program_id(1) * 0 if zero is None else zero
      mf = m.astype(jnp.float32)
      pos = plgpu.atomic_add(ctr_ref, (zero,), jnp.sum(mf)) + jnp.cumsum(mf) - 1
    else:
      lanes = jnp.zeros((L,), jnp.int32)
      pos = plgpu.atomic_add(ctr_ref, (lanes,), jnp.ones((L,), jnp.float32), mask=m)
    pos = pos.astype(jnp.int32)
  else:
    mi = m.astype(jnp.int32)
    running, total = jnp.cumsum(mi), jnp.sum(mi)
    # a scalar index and value: the Triton lowering picks the integer atomic only for a scalar
    # integer value (a [1] tensor gets a float add, which flushes small integers to zero);
    # a traced index, which interpret mode's discharge rule needs
    zero = pl.program_id(1) * 0 if zero is None else zero
    start = plgpu.atomic_add(ctr_ref, (zero,), total.astype(ctr_ref.dtype))
    pos = start.astype(jnp.int32) + running - 1
  keep = m & (pos < capacity)
  pos = jnp.where(keep, pos, capacity)  # masked lanes: a trash slot (see scatter_width)
  plgpu.store(v_ref.at[pos], x, mask=keep)
  plgpu.store(i_ref.at[pos], idx, mask=keep)


def _compact_atomic_kernel(x_ref, len_ref, thr_ref, *refs, chunk: int, capacity: int,
                           placement: str, buckets: bool = False, interpret: bool = False):
  """One (row, chunk): the chunk's candidates appended to the row's buffer (count and
  compaction in one pass; the slots land in whatever order the programs run, so only an
  order-free finish such as `bitonic_finish` may consume the buffer). refs: [pivot,]
  counter in, counter out ([COUNTER_STRIDE], element 0 is the row's), values, indices.

  placement "scan": the chunk reserves one range with one atomic add of its count on the
  row's int32 counter and places its candidates in index order inside it (a chunk-wide scan).
  "lane": every candidate lane takes its own slot with its
  own atomic add of 1 on the row's float32 counter (exact up to 2**24): no scan and no
  chunk-wide sum. (Pallas Triton lowers an atomic add of an integer tensor as a float add,
  hence the float counter; its interpret mode gives every lane of such an atomic the same
  old value, so there the lanes' adds are made as one, in lane order: `_place`.)
  buckets ("scan" only): refs hold the row's pivot [1] before the counters, and candidates
  at or above it are placed from the buffer's front (counter element 1), the others from its
  back (element 2); element 0 stays 0."""
  *p_ref, _, ctr_ref, v_ref, i_ref = refs
  pivot = p_ref[0][0] if buckets else None
  x, idx = valid(x_ref, len_ref, chunk)
  _place(x, idx, (x >= thr_ref[0]) & (x > NEG_INF), ctr_ref, v_ref, i_ref, capacity=capacity,
         placement=placement, pivot=pivot, interpret=interpret)


def _compact_groups_kernel(x_ref, len_ref, thr_ref, gl_ref, ng_ref, _, ctr_ref, v_ref, i_ref,
                           *, group: int, capacity: int, list_width: int, placement: str,
                           interpret: bool = False):
  """One (row, slice of the row's group list): the listed groups' entries are gathered (each
  group `group` contiguous scores), and those >= the threshold appended to the row's
  candidate buffer as `_place` does. Programs past the listed count return at once."""
  per = gl_ref.shape[0]  # groups per program
  j = pl.program_id(1)
  zero = j * 0  # the atomic's traced index, made here (see _place)
  listed = jnp.minimum(ng_ref[0], list_width)

  @pl.when(j * per < listed)
  def _():
    x, idx = listed_entries(x_ref, len_ref, gl_ref, j, listed, group)
    _place(x, idx, (x >= thr_ref[0]) & (x > NEG_INF), ctr_ref, v_ref, i_ref, capacity=capacity,
           placement=placement, zero=zero, interpret=interpret)


def counter_dtype(placement: str, buckets: bool = False):
  """The row counters' dtype for `compact_atomic(..., placement=placement)` (buckets: with
  pivot=, whose two-lane atomic is a tensor add, which the Triton lowering makes a float
  add)."""
  return jnp.float32 if placement == "lane" or buckets else jnp.int32


def count(x, lengths, thr, *, chunk: int, num_warps: int, interpret: bool):
  """-> [R, N / chunk] int32 number of candidates per chunk."""
  r, n = x.shape
  kernel, len_in, len_spec = lengths_in(functools.partial(_count_kernel, chunk=chunk), lengths,
                                         PER_ROW)
  return pl.pallas_call(
      kernel,
      grid=(r, n // chunk),
      in_specs=row_chunk_specs(chunk) + len_spec + [PER_ROW],
      out_specs=pl.BlockSpec((None, 1), lambda r, c: (r, c)),
      out_shape=jax.ShapeDtypeStruct((r, n // chunk), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_count",
  )(x, *len_in, thr)


def compact(x, lengths, thr, offsets, *, capacity: int, chunk: int, num_warps: int,
            interpret: bool):
  """-> (values, indices) [R, W >= capacity] float32 / int32: row r's first min(count,
  capacity) slots hold its candidates in index order; the rest is NOT initialised (no fill
  pass: consumers mask by the count)."""
  r, n = x.shape
  width = scatter_width(capacity, interpret)
  out_shape = [jax.ShapeDtypeStruct((r, width), jnp.float32),
               jax.ShapeDtypeStruct((r, width), jnp.int32)]
  row = pl.BlockSpec((None, width), lambda r, c: (r, 0))
  kernel, len_in, len_spec = lengths_in(
      functools.partial(_compact_kernel, chunk=chunk, capacity=capacity), lengths, PER_ROW)
  v, i = pl.pallas_call(
      kernel,
      grid=(r, n // chunk),
      in_specs=row_chunk_specs(chunk) + len_spec
      + [PER_ROW, pl.BlockSpec((None, 1), lambda r, c: (r, c))],
      out_specs=[row, row],
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_compact",
  )(x, *len_in, thr, offsets)
  return v, i


def compact_atomic(x, lengths, thr, *, capacity: int, chunk: int, num_warps: int,
                   interpret: bool, counter=None, placement: str = "scan", pivot=None):
  """x [R, N] (N % chunk == 0), lengths [R] (or None: whole rows), thr [R] -> (values,
  indices) [R, W >= capacity] float32 / int32 and the row counters [R, COUNTER_STRIDE]
  (element 0: the row's candidate count; `repair` reads them as they are): row r's first
  min(count, capacity) slots hold its candidates (entries >= thr[r]) in no fixed order; the
  slots past them are NOT initialised. One pass (no count pass). counter: [R, COUNTER_STRIDE]
  zeros of `counter_dtype(placement)` to count in (updated in place; `threshold(...,
  counter=dtype)` makes them), else a fresh zero array.
  placement: see _compact_atomic_kernel ("lane" needs N <= 2**24).
  pivot [R] float32 (placement "scan" only, chunk < 2**16, N <= 2**24; `threshold(...,
  pivot=True)`): two value buckets, the candidates >= pivot in slots [0, counters[:, 1]) and
  the others in [capacity - counters[:, 2], capacity) (counter element 0 stays 0; float32
  counters, `counter_dtype(placement, buckets=True)`: each chunk reserves in both buckets
  with one two-lane atomic); a row whose two counts add up to more than capacity
  overflows."""
  r, n = x.shape
  if placement not in PLACEMENTS:
    raise ValueError(f"placement={placement!r} must be one of {PLACEMENTS}")
  if pivot is not None and placement != "scan":
    raise ValueError(f"pivot= needs placement='scan', got {placement!r}")
  if placement == "lane" and n > 1 << 24:
    raise ValueError(f"placement='lane' counts in float32: rows of {n} > 2**24 entries")
  if pivot is not None and (n > 1 << 24 or chunk >= 1 << 16):
    raise ValueError(f"pivot= counts in float32 and packs a chunk's two counts in 16 bits: "
                     f"rows of {n} (<= 2**24) in chunks of {chunk} (< 2**16)")
  width = scatter_width(capacity, interpret)
  row = pl.BlockSpec((None, width), lambda r, c: (r, 0))
  ctr = pl.BlockSpec((None, COUNTER_STRIDE), lambda r, c: (r, 0))
  dtype = counter_dtype(placement, buckets=pivot is not None)
  if counter is None:
    counter = jnp.zeros((r, COUNTER_STRIDE), dtype)
  if counter.shape != (r, COUNTER_STRIDE) or counter.dtype != dtype:
    raise ValueError(f"counter {counter.shape} {counter.dtype} must be ({r}, {COUNTER_STRIDE}) "
                     f"{jnp.dtype(dtype).name}")
  kernel, len_in, len_spec = lengths_in(functools.partial(
      _compact_atomic_kernel, chunk=chunk, capacity=capacity,
      placement=placement, buckets=pivot is not None, interpret=interpret), lengths, PER_ROW)
  piv = [] if pivot is None else [pivot.astype(jnp.float32)]
  total, v, i = pl.pallas_call(
      kernel,
      grid=(r, n // chunk),
      in_specs=(row_chunk_specs(chunk) + len_spec + [PER_ROW] + [PER_ROW] * len(piv)
                + [ctr]),
      out_specs=[ctr, row, row],
      out_shape=[jax.ShapeDtypeStruct((r, COUNTER_STRIDE), dtype),
                 jax.ShapeDtypeStruct((r, width), jnp.float32),
                 jax.ShapeDtypeStruct((r, width), jnp.int32)],
      input_output_aliases={2 + len(len_in) + len(piv): 0},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_compact_atomic",
  )(x, *len_in, thr, *piv, counter)
  return v, i, total


def compact_groups(x, lengths, thr, glist, nlisted, counter, *, group: int, capacity: int,
                   lanes: int, num_warps: int, interpret: bool, placement: str = "scan"):
  """`compact_atomic` that reads only the groups the threshold kernel listed
  (`threshold(..., list_width=capacity)`): x [R, N] (N % group == 0), lengths [R] or None,
  thr [R], glist [R, >= capacity] int32 group ids (the first min(nlisted, capacity) valid),
  nlisted [R] int32, counter [R, COUNTER_STRIDE] (from the same threshold call: a row that
  listed more than capacity groups starts past capacity) -> (values, indices) [R, W >=
  capacity] and the row counters, as `compact_atomic`. A grid of (R, capacity * group /
  lanes) programs, each gathering lanes / group listed groups; only the first ceil(listed *
  group / lanes) of a row do any work. The candidates all lie in listed groups (a group
  whose maximum is below the threshold holds none), so the result is the same candidate set
  as `compact_atomic`'s, read from about (listed groups * group) entries instead of N."""
  r, n = x.shape
  if placement not in PLACEMENTS:
    raise ValueError(f"placement={placement!r} must be one of {PLACEMENTS}")
  per = check_group_list(n, group, lanes, glist, nlisted, r, capacity, "capacity")
  dtype = counter_dtype(placement)
  if counter.shape != (r, COUNTER_STRIDE) or counter.dtype != dtype:
    raise ValueError(f"counter {counter.shape} {counter.dtype} must be ({r}, {COUNTER_STRIDE}) "
                     f"{jnp.dtype(dtype).name}")
  width = scatter_width(capacity, interpret)
  row = pl.BlockSpec((None, width), lambda r, c: (r, 0))
  ctr = pl.BlockSpec((None, COUNTER_STRIDE), lambda r, c: (r, 0))
  kernel, len_in, len_spec = lengths_in(functools.partial(
      _compact_groups_kernel, group=group, capacity=capacity, list_width=capacity,
      placement=placement, interpret=interpret), lengths, PER_ROW)
  total, v, i = pl.pallas_call(
      kernel,
      grid=(r, capacity // per),
      in_specs=[pl.BlockSpec((None, n), lambda r, c: (r, 0))] + len_spec
      + [PER_ROW, pl.BlockSpec((None, per), lambda r, c: (r, c)), PER_ROW, ctr],
      out_specs=[ctr, row, row],
      out_shape=[jax.ShapeDtypeStruct((r, COUNTER_STRIDE), dtype),
                 jax.ShapeDtypeStruct((r, width), jnp.float32),
                 jax.ShapeDtypeStruct((r, width), jnp.int32)],
      input_output_aliases={4 + len(len_in): 0},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_compact_groups",
  )(x, *len_in, thr, glist, nlisted.astype(jnp.int32), counter)
  return v, i, total

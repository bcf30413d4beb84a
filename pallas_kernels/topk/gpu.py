"""Threshold-filter top-K passes on GPU (Pallas, Triton backend).

Three streaming passes over a [R, N] float32 score matrix, one program per (row, chunk):
  group_max: maxima of `g` consecutive entries (invalid entries count as -inf);
  count:     entries >= the row threshold, per chunk;
  compact:   scatter those entries (value and index) into a per-row candidate buffer at
             offsets from an exclusive scan of the counts, in index order.
Index order is what makes the final `lax.top_k` over candidates break ties by lower index.
The default sorted path instead compacts in one pass (`compact_atomic`: no count; a range per
chunk or a slot per candidate, reserved by atomic adds, in run order) and sorts each row's
candidates by (value, index) (`bitonic_finish`, or `rank_finish`), which needs no order.
`compact_groups` is that one-pass compaction reading only the groups the threshold kernel
listed (`threshold(..., list_width=capacity)`) instead of every chunk of the row.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import flush_zero, is_pow2, next_pow2

__all__ = [
    "NEG_INF", "COUNTER_STRIDE", "PLACEMENTS", "counter_dtype", "compact_atomic",
    "compact_groups", "count_groups", "refine_threshold", "threshold", "group_max", "count",
    "compact", "repair", "take_best_keys", "select_mask", "rank_finish",
    "index_order_finish", "bitonic_finish", "bitonic_finish_split"
]


NEG_INF = float("-inf")


def _valid(x_ref, len_ref, chunk):
  """The chunk's scores as candidates see them: -inf past the length (len_ref None: whole
  rows) and for NaN, -0.0 as +0.0."""
  c = pl.program_id(1)
  x = x_ref[...]
  idx = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  return _as_candidates(x, idx, len_ref), idx


def _as_candidates(x, idx, len_ref):
  """Scores x at row positions idx -> float32, -inf past the length (len_ref None: whole
  rows; the padding past N is -inf already) and for NaN, -0.0 as +0.0."""
  x = x.astype(jnp.float32)
  ok = x == x  # NaN is never chosen
  if len_ref is not None:
    ok &= idx < len_ref[0]
  x = jnp.where(x == 0, 0.0, x)  # -0.0 == +0.0: one value, so ties go by index
  return jnp.where(ok, x, NEG_INF)


def _lengths_in(kernel, lengths, spec):
  """(kernel, [lengths], [spec]), or for lengths None (whole rows) a kernel that gets
  len_ref=None and no lengths input, so XLA makes no broadcast of a constant for it."""
  if lengths is not None:
    return kernel, [lengths], [spec]
  return (lambda x_ref, *refs: kernel(x_ref, None, *refs)), [], []


def _group_max_kernel(x_ref, len_ref, o_ref, *, chunk: int, group: int):
  x, _ = _valid(x_ref, len_ref, chunk)
  o_ref[...] = x.reshape(chunk // group, group).max(axis=1)


def _count_kernel(x_ref, len_ref, thr_ref, o_ref, *, chunk: int):
  x, _ = _valid(x_ref, len_ref, chunk)
  m = (x >= thr_ref[0]) & (x > NEG_INF)
  o_ref[...] = jnp.sum(m.astype(jnp.int32)).reshape(1)


def _scatter_width(width: int, interpret: bool) -> int:
  """Width of a buffer that masked scatters write into. Compiled, masked-off lanes touch no
  memory, so `width` is enough; interpret mode runs a masked scatter as read-modify-write of
  every lane's slot, so masked lanes get their own trash slots past `width` (2 * width)."""
  return 2 * width if interpret else width


def _compact_kernel(x_ref, len_ref, thr_ref, off_ref, v_ref, i_ref, *, chunk: int,
                    capacity: int):
  x, idx = _valid(x_ref, len_ref, chunk)
  m = (x >= thr_ref[0]) & (x > NEG_INF)
  pos = off_ref[0] + jnp.cumsum(m.astype(jnp.int32)) - 1
  keep = m & (pos < capacity)
  # masked lanes aim at a trash slot past the buffer proper: interpret mode implements a masked
  # scatter as read-modify-write, so they must not share a slot with a real candidate
  pos = jnp.where(keep, pos, capacity)
  plgpu.store(v_ref.at[pos], x, mask=keep)
  plgpu.store(i_ref.at[pos], idx, mask=keep)


COUNTER_STRIDE = 32  # a row's counter every 128 bytes: rows' atomics go to different L2 lines


PLACEMENTS = ("scan", "lane")


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
  x, idx = _valid(x_ref, len_ref, chunk)
  _place(x, idx, (x >= thr_ref[0]) & (x > NEG_INF), ctr_ref, v_ref, i_ref, capacity=capacity,
         placement=placement, pivot=pivot, interpret=interpret)


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
  pos = jnp.where(keep, pos, capacity)  # masked lanes: a trash slot (see _scatter_width)
  plgpu.store(v_ref.at[pos], x, mask=keep)
  plgpu.store(i_ref.at[pos], idx, mask=keep)


def counter_dtype(placement: str, buckets: bool = False):
  """The row counters' dtype for `compact_atomic(..., placement=placement)` (buckets: with
  pivot=, whose two-lane atomic is a tensor add, which the Triton lowering makes a float
  add)."""
  return jnp.float32 if placement == "lane" or buckets else jnp.int32


def compact_atomic(x, lengths, thr, *, capacity: int, chunk: int, num_warps: int,
                   interpret: bool, counter=None, placement: str = "scan", pivot=None):
  """x [R, N] (N % chunk == 0), lengths [R] (or None: whole rows), thr [R] -> (values,
  indices) [R, W >= capacity] float32 / int32 and the row counters [R, COUNTER_STRIDE]
  (element 0: the row's candidate count; `repair` reads them as they are): row r's first
  min(count, capacity) slots hold its candidates (entries >= thr[r]) in no fixed order; the
  slots past them are NOT initialised. One pass (no count pass). counter: [R, COUNTER_STRIDE] zeros of `counter_dtype(placement)` to count in
  (updated in place; `threshold(..., counter=dtype)` makes them), else a fresh zero array.
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
  width = _scatter_width(capacity, interpret)
  row = pl.BlockSpec((None, width), lambda r, c: (r, 0))
  ctr = pl.BlockSpec((None, COUNTER_STRIDE), lambda r, c: (r, 0))
  dtype = counter_dtype(placement, buckets=pivot is not None)
  if counter is None:
    counter = jnp.zeros((r, COUNTER_STRIDE), dtype)
  if counter.shape != (r, COUNTER_STRIDE) or counter.dtype != dtype:
    raise ValueError(f"counter {counter.shape} {counter.dtype} must be ({r}, {COUNTER_STRIDE}) "
                     f"{jnp.dtype(dtype).name}")
  kernel, len_in, len_spec = _lengths_in(functools.partial(
      _compact_atomic_kernel, chunk=chunk, capacity=capacity,
      placement=placement, buckets=pivot is not None, interpret=interpret), lengths, _PER_ROW)
  piv = [] if pivot is None else [pivot.astype(jnp.float32)]
  total, v, i = pl.pallas_call(
      kernel,
      grid=(r, n // chunk),
      in_specs=(_row_chunk_specs(chunk) + len_spec + [_PER_ROW] + [_PER_ROW] * len(piv)
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


def _listed_entries(x_ref, len_ref, gl_ref, j, listed, group: int):
  """Program j's slice of the row's group list (gl_ref [per] group ids, the first `listed` of
  the row's list valid): the entries of its groups as candidates see them (-inf for unlisted
  slots) and their row positions, [per * group] each. (j is read outside any `pl.when`.)"""
  per = gl_ref.shape[0]
  live = j * per + lax.broadcasted_iota(jnp.int32, (per,), 0) < listed
  gid = plgpu.load(gl_ref, mask=live, other=0)
  lanes = per * group
  idx = (gid[:, None] * group + lax.broadcasted_iota(jnp.int32, (per, group), 1)).reshape(lanes)
  ok = jnp.broadcast_to(live[:, None], (per, group)).reshape(lanes)
  return _as_candidates(plgpu.load(x_ref.at[idx], mask=ok, other=NEG_INF), idx, len_ref), idx


def _check_group_list(n: int, group: int, lanes: int, glist, nlisted, r: int, width: int,
                      what: str) -> int:
  """Validate a gathering call's shapes; -> groups per program (lanes / group)."""
  if not is_pow2(group) or n % group or not is_pow2(lanes) or lanes < group:
    raise ValueError(f"group={group} and lanes={lanes} must be powers of two, lanes >= group, "
                     f"group dividing the row length {n}")
  per = lanes // group
  if width % per or glist.shape[1] < width or nlisted.shape != (r,):
    raise ValueError(f"group list {glist.shape} / counts {nlisted.shape} do not fit {what} "
                     f"{width} in slices of {per} groups")
  return per


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
    x, idx = _listed_entries(x_ref, len_ref, gl_ref, j, listed, group)
    _place(x, idx, (x >= thr_ref[0]) & (x > NEG_INF), ctr_ref, v_ref, i_ref, capacity=capacity,
           placement=placement, zero=zero, interpret=interpret)


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
  per = _check_group_list(n, group, lanes, glist, nlisted, r, capacity, "capacity")
  dtype = counter_dtype(placement)
  if counter.shape != (r, COUNTER_STRIDE) or counter.dtype != dtype:
    raise ValueError(f"counter {counter.shape} {counter.dtype} must be ({r}, {COUNTER_STRIDE}) "
                     f"{jnp.dtype(dtype).name}")
  width = _scatter_width(capacity, interpret)
  row = pl.BlockSpec((None, width), lambda r, c: (r, 0))
  ctr = pl.BlockSpec((None, COUNTER_STRIDE), lambda r, c: (r, 0))
  kernel, len_in, len_spec = _lengths_in(functools.partial(
      _compact_groups_kernel, group=group, capacity=capacity, list_width=capacity,
      placement=placement, interpret=interpret), lengths, _PER_ROW)
  total, v, i = pl.pallas_call(
      kernel,
      grid=(r, capacity // per),
      in_specs=[pl.BlockSpec((None, n), lambda r, c: (r, 0))] + len_spec
      + [_PER_ROW, pl.BlockSpec((None, per), lambda r, c: (r, c)), _PER_ROW, ctr],
      out_specs=[ctr, row, row],
      out_shape=[jax.ShapeDtypeStruct((r, COUNTER_STRIDE), dtype),
                 jax.ShapeDtypeStruct((r, width), jnp.float32),
                 jax.ShapeDtypeStruct((r, width), jnp.int32)],
      input_output_aliases={4 + len(len_in): 0},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_compact_groups",
  )(x, *len_in, thr, glist, nlisted.astype(jnp.int32), counter)
  return v, i, total


def _count_groups_kernel(x_ref, len_ref, e_ref, gl_ref, ng_ref, o_ref, *, group: int,
                         list_width: int):
  """One (row, slice of the row's group list): how many of the listed groups' entries reach
  each of the row's edges e_ref [E] (o_ref [E]; programs past the listed count write 0)."""
  x, _ = _listed_entries(x_ref, len_ref, gl_ref, pl.program_id(1),
                         jnp.minimum(ng_ref[0], list_width), group)
  e = e_ref[...]
  hit = (x[:, None] >= e[None, :]) & (x[:, None] > NEG_INF)
  o_ref[...] = jnp.sum(hit.astype(jnp.int32), axis=0)


def count_groups(x, lengths, edges, glist, nlisted, *, group: int, list_width: int, lanes: int,
                 num_warps: int, interpret: bool):
  """Per row, how many entries of the listed groups reach each edge: x [R, N], lengths [R] or
  None, edges [R, E] float32 (E a power of two), glist [R, >= list_width] / nlisted [R] (the
  threshold kernel's group list) -> [R, E] int32. Reads what `compact_groups` reads: about
  (listed groups * group) entries a row, in programs of `lanes` entries."""
  r, n = x.shape
  e = edges.shape[1]
  if edges.shape[0] != r or not is_pow2(e):
    raise ValueError(f"edges {edges.shape} must be [{r}, E], E a power of two")
  per = _check_group_list(n, group, lanes, glist, nlisted, r, list_width, "list_width")
  kernel, len_in, len_spec = _lengths_in(functools.partial(
      _count_groups_kernel, group=group, list_width=list_width), lengths, _PER_ROW)
  counts = pl.pallas_call(
      kernel,
      grid=(r, list_width // per),
      in_specs=[pl.BlockSpec((None, n), lambda r, c: (r, 0))] + len_spec
      + [pl.BlockSpec((None, e), lambda r, c: (r, 0)),
         pl.BlockSpec((None, per), lambda r, c: (r, c)), _PER_ROW],
      out_specs=pl.BlockSpec((None, None, e), lambda r, c: (r, c, 0)),
      out_shape=jax.ShapeDtypeStruct((r, list_width // per, e), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_count_groups",
  )(x, *len_in, edges.astype(jnp.float32), glist, nlisted.astype(jnp.int32))
  return counts.sum(axis=1)


def refine_threshold(thr, gmax, counts_fn, k: int, edges: int, rounds: int = 2):
  """A higher threshold that still keeps k entries. thr [R]: k or more entries reach it;
  gmax [R, G] the group maxima (the row maximum bounds the search); counts_fn(edges [R, E])
  -> [R, E] entries reaching each edge. Each round spaces `edges` values evenly from the
  threshold to the bound and keeps the highest one that k entries reach; the next edge up
  (which fewer than k reach) bounds the next round. A threshold from group maxima admits up
  to group * k entries where neighbouring scores rise together (real score rows); refined,
  about k, so the candidate buffer holds them and no row takes the exact repair."""
  top = jnp.max(gmax, axis=1)
  frac = jnp.arange(edges, dtype=jnp.float32) / edges
  lo = thr
  hi = jnp.where(jnp.isfinite(thr) & jnp.isfinite(top), top, thr)
  for _ in range(rounds):
    e = lo[:, None] + (hi - lo)[:, None] * frac[None, :]
    reach = counts_fn(e) >= k
    last = edges - 1 - jnp.argmax(reach[:, ::-1], axis=1)
    ok = reach.any(axis=1)
    new_lo = jnp.take_along_axis(e, last[:, None], 1)[:, 0]
    nxt = jnp.take_along_axis(e, jnp.minimum(last + 1, edges - 1)[:, None], 1)[:, 0]
    hi = jnp.where(ok & (last < edges - 1), nxt, hi)
    lo = jnp.where(ok, new_lo, lo)
  return lo


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
      # masked lanes aim at one trash slot past the list (see _scatter_width)
      plgpu.store(l_ref.at[jnp.where(keep, pos, list_width)], ids, mask=keep)
      listed = listed + jnp.sum(hit)
    n_ref[...] = listed.reshape(1)
    # (integer arithmetic, not selects: the Triton lowering of a select between a scalar and
    # a tensor fails to verify)
    ctr0 = (listed > list_width).astype(jnp.int32) * (list_width + 1)
  if c_ref is not None:  # the compaction's row counters (saves XLA a fill kernel before it)
    lane = lax.broadcasted_iota(jnp.int32, c_ref.shape, 0)
    c_ref[...] = ((lane == 0).astype(jnp.int32) * ctr0).astype(c_ref.dtype)


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
    width = _scatter_width(list_width, interpret)
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


def _row_chunk_specs(chunk):
  return [pl.BlockSpec((None, chunk), lambda r, c: (r, c))]


_PER_ROW = pl.BlockSpec((1,), lambda r, c: (r,))  # one value per row (length, threshold)


def group_max(x, lengths, *, chunk: int, group: int, num_warps: int, interpret: bool):
  """x [R, N] (N % chunk == 0), lengths [R] or None (whole rows) -> [R, N / group] float32."""
  r, n = x.shape
  kernel, len_in, len_spec = _lengths_in(
      functools.partial(_group_max_kernel, chunk=chunk, group=group), lengths, _PER_ROW)
  return pl.pallas_call(
      kernel,
      grid=(r, n // chunk),
      in_specs=_row_chunk_specs(chunk) + len_spec,
      out_specs=pl.BlockSpec((None, chunk // group), lambda r, c: (r, c)),
      out_shape=jax.ShapeDtypeStruct((r, n // group), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_group_max",
  )(x, *len_in)


def count(x, lengths, thr, *, chunk: int, num_warps: int, interpret: bool):
  """-> [R, N / chunk] int32 number of candidates per chunk."""
  r, n = x.shape
  kernel, len_in, len_spec = _lengths_in(functools.partial(_count_kernel, chunk=chunk), lengths,
                                         _PER_ROW)
  return pl.pallas_call(
      kernel,
      grid=(r, n // chunk),
      in_specs=_row_chunk_specs(chunk) + len_spec + [_PER_ROW],
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
  width = _scatter_width(capacity, interpret)
  out_shape = [jax.ShapeDtypeStruct((r, width), jnp.float32),
               jax.ShapeDtypeStruct((r, width), jnp.int32)]
  row = pl.BlockSpec((None, width), lambda r, c: (r, 0))
  kernel, len_in, len_spec = _lengths_in(
      functools.partial(_compact_kernel, chunk=chunk, capacity=capacity), lengths, _PER_ROW)
  v, i = pl.pallas_call(
      kernel,
      grid=(r, n // chunk),
      in_specs=_row_chunk_specs(chunk) + len_spec
      + [_PER_ROW, pl.BlockSpec((None, 1), lambda r, c: (r, c))],
      out_specs=[row, row],
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_compact",
  )(x, *len_in, thr, offsets)
  return v, i


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
    return x, idx, ok, jnp.where(ok, _ordered_key(x), jnp.uint32(0))

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
  kernel, len_in, len_spec = _lengths_in(
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


def _ordered_key(x):
  """float32 -> uint32 whose unsigned order is the float order (-0.0 and +0.0 equal)."""
  b = lax.bitcast_convert_type(flush_zero(x), jnp.uint32)
  neg = (b >> 31) == 1
  return jnp.where(neg, ~b, b | jnp.uint32(0x80000000))


def _take_best(x, elig, n, bits: int = 32):
  """Mask of the n best eligible entries of a float row held in registers, ties to the lower
  position (see `take_best_keys`). bits=16 is exact when every eligible value is a bfloat16
  value (the low half of its float32 key is constant), and halves the steps. (Settling 2 or 4
  bits per step, with a [2**r, L] comparison and one reduction, was slower on the H200.)"""
  key = _ordered_key(x)
  if bits < 32:
    key = key >> jnp.uint32(32 - bits)
  return take_best_keys(key, elig, n, bits)


def take_best_keys(key, elig, n, bits: int):
  """Mask of the n eligible entries with the largest uint32 keys (< 2**bits), ties to the
  lower position: the n-th largest key is found from the top one bit per step (exact, no
  sort: each step counts the eligible keys at or above the candidate prefix). Entries above
  it are all taken, entries equal to it in order up to the quota."""
  key = jnp.where(elig, key, jnp.uint32(0))

  def body(i, t):
    cand = t | (jnp.uint32(1) << (bits - 1 - i).astype(jnp.uint32))
    ok = jnp.sum(((key >= cand) & elig).astype(jnp.int32)) >= n
    return jnp.where(ok, cand, t)

  t = lax.fori_loop(0, bits, body, jnp.uint32(0))
  gt = elig & (key > t)
  tie = elig & (key == t)
  quota = n - jnp.sum(gt.astype(jnp.int32))
  return (gt | (tie & (jnp.cumsum(tie.astype(jnp.int32)) <= quota))) & (n > 0)


def _select_kernel(x_ref, e_ref, n_ref, o_ref):
  """One row: mask of the n_ref[0] best eligible entries, ties to the lower index."""
  o_ref[...] = _take_best(x_ref[...], e_ref[...] != 0, n_ref[0]).astype(jnp.int32)


def select_mask(x, eligible, n, *, num_warps: int = 8, interpret: bool = False):
  """x [R, L] float32 (L a power of two), eligible [R, L] bool, n [R] int32 ->
  [R, L] bool: the n[r] largest eligible entries of row r, ties to the lower index (n[r] must
  not exceed the eligible count)."""
  r, length = x.shape
  row = pl.BlockSpec((None, length), lambda i: (i, 0))
  out = pl.pallas_call(
      _select_kernel,
      grid=(r,),
      in_specs=[row, row, pl.BlockSpec((1,), lambda i: (i,))],
      out_specs=row,
      out_shape=jax.ShapeDtypeStruct((r, length), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_select_mask",
  )(x.astype(jnp.float32), eligible.astype(jnp.int32), n.astype(jnp.int32))
  return out != 0


def _before(vj, ij, vi, ii):
  """[1, J] candidates j against [I, 1] candidates i -> [I, J] int32: 1 where j comes before i
  in the sorted order (a larger value, or the same value and a lower index)."""
  return ((vj > vi) | ((vj == vi) & (ij < ii))).astype(jnp.int32)


def _store_tail(vo_ref, io_ref, slots, live, k: int, trash):
  """Write the -inf / -1 tail into those of `slots` [L] in [live, k) (the slots no live
  candidate reaches); the other lanes aim at `trash` (distinct slots, see _scatter_width)."""
  tail = (slots >= live) & (slots < k)
  dest = jnp.where(tail, slots, trash)
  plgpu.store(vo_ref.at[dest], jnp.full(slots.shape, NEG_INF, jnp.float32), mask=tail)
  plgpu.store(io_ref.at[dest], jnp.full(slots.shape, -1, jnp.int32), mask=tail)


def _put_ranked(vo_ref, io_ref, v, idx, rank, ok, k: int, trash):
  """Write the candidates (v, idx) [I] whose lanes are `ok` (live) and rank below k to their
  rank's slot (index -1 for a -inf value); the other lanes aim at `trash`."""
  keep = ok & (rank < k)
  dest = jnp.where(keep, rank, trash)
  plgpu.store(vo_ref.at[dest], v, mask=keep)
  plgpu.store(io_ref.at[dest], jnp.where(v > NEG_INF, idx, -1), mask=keep)


def _ranked_row(tot_ref, vo_ref, bi: int, cap: int, buckets: bool = False):
  """A rank finish program's view of its row: (over: more candidates than cap, which only a
  compaction's counters can say; live: the live count, at most cap; lane [bi] iota; trash
  [bi]: distinct slots past the output for masked lanes, see _scatter_width). buckets: the
  count is the sum of counter elements 1 and 2 (`compact_atomic(..., pivot=)`)."""
  total = (tot_ref[1] + tot_ref[2] if buckets else tot_ref[0]).astype(jnp.int32)
  lane = lax.broadcasted_iota(jnp.int32, (bi,), 0)
  return total > cap, jnp.minimum(total, cap), lane, vo_ref.shape[0] - 1 - lane


def _repair_first(cond, x_ref, len_ref, scratch, vo_ref, io_ref, *, k: int, repair,
                  interpret: bool):
  """With repair ((n, chunk, with_lengths)), the program where `cond` holds writes its row's
  exact sorted top-k (`_repair_sorted`, scratch: its pair of buffers); nothing without."""
  if not repair:
    return

  @pl.when(cond)
  def _():
    _repair_sorted(x_ref, len_ref, *scratch, vo_ref, io_ref, n=repair[0], chunk=repair[1],
                   k=k, interpret=interpret)


def _rank_rows_kernel(vi_ref, ii_ref, vj_ref, ij_ref, tot_ref, *refs, k: int, cap: int,
                      block_j: int, unrolled: int, interpret: bool, repair=None,
                      buckets: bool = False):
  """One (row, block of block_i candidates) program of `rank_finish`: the
  block's ranks against every live candidate of the row (vj_ref / ij_ref: the row's cap
  slots), the compares accumulated elementwise in a [block_i, block_j] int32 array over the
  row's blocks of block_j and reduced once, then each candidate written to its slot (and the
  block's share of the -inf / -1 tail). The first `unrolled` blocks of block_j are loaded
  before any compare (their latency overlaps); blocks past them, reached only by rows with
  more live candidates, go through a loop bounded by the live count. One kernel, no partial
  counts and no atomics. tot_ref: the row's live count [1], or its compaction counters
  (element 0 the candidate count). repair: None, or (n, chunk, with_lengths): refs then start
  with the row [n] (and its length), and end with a scratch pair; a row with more candidates
  than `cap` is not ranked: program 0 writes its exact sorted top-k alone (`_repair_sorted`).
  buckets: the slots hold two value buckets (`compact_atomic(..., pivot=)`): the upper one
  in [0, tot_ref[1]), the lower in [cap - tot_ref[2], cap). Every upper candidate comes
  before every lower one, so a block compares only with the buckets its candidates are in
  (in loops), and a block of lower candidates adds the upper count."""
  x_ref, len_ref, refs = _repair_refs(refs, repair)
  vo_ref, io_ref, *scratch = refs
  bi = vi_ref.shape[0]
  ia = pl.program_id(1)
  a = ia * bi
  over, live, lane, trash = _ranked_row(tot_ref, vo_ref, bi, cap, buckets=buckets)
  _repair_first(over & (ia == 0), x_ref, len_ref, scratch, vo_ref, io_ref, k=k, repair=repair,
                interpret=interpret)

  @pl.when(~over)
  def _():
    _store_tail(vo_ref, io_ref, a + lane, live, k, trash)

  if buckets:  # (start, end, does this block have candidates there) of each bucket
    n_up = tot_ref[1].astype(jnp.int32)
    low0 = cap - tot_ref[2].astype(jnp.int32)
    ok = (a + lane < n_up) | (a + lane >= low0)
    regions = ((0, n_up, a < n_up), (low0, cap, a + bi > low0))
    busy = regions[0][2] | regions[1][2]
  else:
    ok = a + lane < live
    regions = ((0, live, True),)
    busy = a < live

  @pl.when(busy & ~over)
  def _():
    vi, ii = vi_ref[...], ii_ref[...]
    iota = lax.broadcasted_iota(jnp.int32, (block_j,), 0)

    def block(t, lo, hi):  # block t of the row's slots, dead outside [lo, hi)
      pj = t * block_j + iota
      live_j = (pj >= lo) & (pj < hi)
      vj = plgpu.load(vj_ref.at[pl.ds(t * block_j, block_j)], mask=live_j, other=NEG_INF)
      ij = plgpu.load(ij_ref.at[pl.ds(t * block_j, block_j)], mask=live_j,
                      other=jnp.iinfo(jnp.int32).max)
      return vj[None, :], ij[None, :]

    def before(vj, ij):  # [bi, block_j]: candidate j comes before candidate i
      return _before(vj, ij, vi[:, None], ii[:, None])

    def scan(f, acc):  # acc + f over every block of the regions this block needs
      for lo, hi, use in regions:
        t0 = lo // block_j
        # (arithmetic, not a select: Triton mis-lowers scalar selects with constants)
        t1 = t0 + ((hi + block_j - 1) // block_j - t0) * jnp.asarray(use).astype(jnp.int32)
        acc = lax.fori_loop(t0, t1, lambda t, s, lo=lo, hi=hi: s + f(*block(t, lo, hi)), acc)
      return acc

    zeros = jnp.zeros((bi, block_j), jnp.int32)
    if buckets:
      acc = scan(before, zeros)
    else:
      pre = [block(t, 0, live) for t in range(unrolled)]
      acc = functools.reduce(lambda s, b: s + before(*b), pre[1:], before(*pre[0]))
      rest = (live + block_j - 1) // block_j
      acc = lax.fori_loop(unrolled, jnp.maximum(rest, unrolled),
                          lambda t, s: s + before(*block(t, 0, live)), acc)
    rank = jnp.sum(acc, axis=1)
    if buckets:  # a block without upper candidates skipped them: all come before it
      rank = rank + n_up * (~regions[0][2]).astype(jnp.int32)
    _put_ranked(vo_ref, io_ref, vi, ii, rank, ok, k, trash)


def rank_finish(cv, ci, live, k: int, cap: int, *, block_i: int = 8, block_j: int = 256,
                num_warps: int = 4, interpret: bool = False, repair=None, preload: int = 0,
                buckets: bool = False):
  """cv, ci [R, >= cap] candidates in any order (distinct indices), live [R] (<= cap) of them
  per row (slots past live are ignored; slots before it may be -inf) -> the k best, sorted:
  values [R, k] float32 (-inf tail) and indices [R, k] int32 (-1 tail).

  Sorting by counting, with no dependent chain: a candidate's place is the number of
  candidates before it. One kernel of (R, cap / block_i) programs (`_rank_rows_kernel`):
  each ranks its block of candidates against every live candidate of the row, accumulating
  the compares elementwise over blocks of block_j and reducing once, then writes each to its
  slot. O(live^2) compares: cheap for a few rows, where a sorting network's ~78 dependent
  steps dominate; the bitonic finish wins for many rows (the compares then fill the GPU).
  repair: (x [R, N] the rows, lengths [R] or None, chunk): live may then be the compaction's
  row counters [R, COUNTER_STRIDE] with counts past cap, and such a row gets its exact
  top-k from x (no `repair` kernel before the finish).
  preload: the blocks of block_j each program loads before its first compare (0: enough for
  k * 1.25 candidates; the rest are loaded one by one in a loop bounded by the live count).
  buckets: live is the counters of `compact_atomic(..., pivot=)`, whose two value buckets
  fill the buffer from its front and its back; each block is compared only with its own
  bucket(s)."""
  r = cv.shape[0]
  if buckets and live.shape != (r, COUNTER_STRIDE):
    raise ValueError("rank_finish(buckets=True) needs the compaction's "
                     f"[{r}, {COUNTER_STRIDE}] counters as live")
  _check_cap(cap, k, cv.shape[1])
  block_i, block_j = min(block_i, cap), min(block_j, cap)
  if not (is_pow2(block_i) and is_pow2(block_j)):
    raise ValueError(f"block_i={block_i} and block_j={block_j} must be powers of two")
  cv, ci = cv.astype(jnp.float32), ci.astype(jnp.int32)
  nj = cap // block_j
  width = next_pow2(k) + (block_i if interpret else 0)  # interpret: trash slots past the row
  live, live_spec = _count_in(live, r)
  rep_in, rep_specs, rep_shapes, rep_out, rep = _repair_in(repair, r, k, interpret)
  whole = pl.BlockSpec((None, cap), lambda r, a: (r, 0))
  out = pl.BlockSpec((None, width), lambda r, a: (r, 0))
  blk = pl.BlockSpec((None, block_i), lambda r, a: (r, a))
  # blocks of block_j loaded up front: enough for k plus a quarter (rows rarely hold more)
  unrolled = min(nj, preload or -(-(k + k // 4) // block_j))
  v, i = pl.pallas_call(
      functools.partial(_rank_rows_kernel, k=k, cap=cap, block_j=block_j, unrolled=unrolled,
                        interpret=interpret, repair=rep, buckets=buckets),
      grid=(r, cap // block_i),
      in_specs=[blk, blk, whole, whole, live_spec] + rep_specs,
      out_specs=[out, out] + rep_out,
      out_shape=[jax.ShapeDtypeStruct((r, width), jnp.float32),
                 jax.ShapeDtypeStruct((r, width), jnp.int32)] + rep_shapes,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_rank_rows",
  )(cv, ci, cv, ci, live, *rep_in)[:2]
  return v[:, :k], i[:, :k]


def _repair_sorted(x_ref, len_ref, rv_ref, ri_ref, vo_ref, io_ref, *, n: int, chunk: int,
                   k: int, interpret: bool, sel_ref=None, page: int = 0):
  """One program: the row's exact top-k set (`_exact_set`) into the scratch rv / ri, read
  back, sorted by a bitonic network and written to vo / io (values descending, ties to the
  lower index, -inf / -1 tail; sel_ref / page: indices mapped as `_write_sorted` does)."""
  kw = next_pow2(k)
  _exact_set(x_ref, n if len_ref is None else len_ref[0], rv_ref, ri_ref, n=n,
             chunk=min(chunk, kw), k=k)
  if not interpret:
    plgpu.debug_barrier()  # the set's scattered stores, read back by other lanes below
  head = pl.ds(0, kw)
  key, idx = _bitonic_sort(*_sort_keys(rv_ref.at[head], ri_ref.at[head], k))
  _write_sorted(key, idx, vo_ref.at[head], io_ref.at[head], sel_ref, page)


def _index_order_kernel(v_ref, i_ref, live_ref, vo_ref, io_ref, *, k: int):
  """One row of candidates (index order; slots past live_ref[0] not initialised): the k best,
  kept in index order. The k-th key is found by `_take_best` over the buffer in registers, the
  taken entries are compacted with a running position (no sort), and the -inf / -1 tail is
  written into the slots after them (the output needs no fill pass)."""
  v = v_ref[...]
  lane = lax.broadcasted_iota(jnp.int32, v.shape, 0)
  live = (lane < live_ref[0]) & (v > NEG_INF)
  v = jnp.where(live, v, NEG_INF)
  n = jnp.minimum(jnp.sum(live.astype(jnp.int32)), k)
  take = _take_best(v, live, n)
  trash = vo_ref.shape[0] - 1 - lane  # masked lanes: distinct slots (see _scatter_width)
  pos = jnp.where(take, jnp.cumsum(take.astype(jnp.int32)) - 1, trash)
  plgpu.store(vo_ref.at[pos], v, mask=take)
  plgpu.store(io_ref.at[pos], i_ref[...], mask=take)
  tail = lane < k - n  # slots [n, k): disjoint from the ones written above
  pos = jnp.where(tail, n + lane, trash)
  plgpu.store(vo_ref.at[pos], jnp.full(v.shape, NEG_INF, jnp.float32), mask=tail)
  plgpu.store(io_ref.at[pos], jnp.full(v.shape, -1, jnp.int32), mask=tail)


def index_order_finish(cv, ci, live, k: int, cap: int, *, num_warps: int = 8,
                       interpret: bool = False):
  """cv, ci [R, >= cap] candidates in index order, live [R] (<= cap) of them per row (slots
  past live are ignored; slots before it may be -inf) -> the k best as a set in ascending
  index order: values [R, k] float32 (-inf tail) and indices [R, k] int32 (-1 tail). One
  program per row; the row's cap candidates stay in registers."""
  return _per_row_finish(functools.partial(_index_order_kernel, k=k), cv, ci, live, k, cap,
                         width=_scatter_width(cap, interpret), num_warps=num_warps,
                         interpret=interpret, name="jaxsparse_topk_index_order")


def _count_in(live, r: int):
  """live [R] int32 (<= the capacity), or a compaction's row counters [R, COUNTER_STRIDE]
  (int32 or float32; element 0 the candidate count, which may exceed the capacity) -> (the
  array to pass, its BlockSpec for a grid whose first axis is the row)."""
  if live.shape == (r,):
    return live.astype(jnp.int32), pl.BlockSpec((1,), lambda i, *_: (i,))
  if live.shape == (r, COUNTER_STRIDE):
    return live, pl.BlockSpec((None, COUNTER_STRIDE), lambda i, *_: (i, 0))
  raise ValueError(f"live {live.shape} must be ({r},) or ({r}, {COUNTER_STRIDE}) counters")


def _repair_in(repair, r: int, k: int, interpret: bool):
  """repair=(x [R, N] float32, lengths [R] int32 or None, chunk) for a finish that repairs
  overflowing rows itself (`_repair_sorted`), or None -> (extra inputs, their specs, extra
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
  rep_w = _scatter_width(next_pow2(k), interpret)
  shapes = [jax.ShapeDtypeStruct((r, rep_w), jnp.float32),
            jax.ShapeDtypeStruct((r, rep_w), jnp.int32)]
  return ins, specs, shapes, [whole(rep_w)] * 2, (n, chunk, lengths is not None)


def _repair_refs(refs, repair):
  """Split a finish kernel's refs into (x_ref, len_ref, the rest) when it repairs."""
  if not repair:
    return None, None, list(refs)
  x_ref, *refs = refs
  len_ref = refs.pop(0) if repair[2] else None
  return x_ref, len_ref, refs


def _block_map_in(block_map, r: int):
  """block_map=(sel [R, W] block ids, page) or None -> (extra inputs, their specs for a grid
  whose first axis is the row, page; 0 without a map)."""
  if block_map is None:
    return [], [], 0
  sel, page = block_map
  if sel.shape[0] != r or not page:
    raise ValueError(f"block_map ids {sel.shape} must have {r} rows and page={page} > 0")
  return [sel.astype(jnp.int32)], [pl.BlockSpec((None, sel.shape[1]),
                                                lambda i, *_: (i, 0))], page


def _check_cap(cap: int, k: int, buffer_width: int):
  if not is_pow2(cap) or cap < k or buffer_width < cap:
    raise ValueError(f"cap={cap} must be a power of two, >= k={k} and <= the buffer width "
                     f"{buffer_width}")


def _per_row_finish(kernel, cv, ci, live, k: int, cap: int, *, width: int, num_warps: int,
                    interpret: bool, name: str):
  """Launch a finish kernel with one program per row: it reads the row's first cap candidate
  slots (values, indices) and its live count, and writes [width] values and indices, of
  which the first k are returned."""
  r = cv.shape[0]
  _check_cap(cap, k, cv.shape[1])
  row_in = pl.BlockSpec((None, cap), lambda i: (i, 0))
  row_out = pl.BlockSpec((None, width), lambda i: (i, 0))
  v, i = pl.pallas_call(
      kernel,
      grid=(r,),
      in_specs=[row_in, row_in, pl.BlockSpec((1,), lambda i: (i,))],
      out_specs=[row_out, row_out],
      out_shape=[jax.ShapeDtypeStruct((r, width), jnp.float32),
                 jax.ShapeDtypeStruct((r, width), jnp.int32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name=name,
  )(cv.astype(jnp.float32), ci.astype(jnp.int32), live.astype(jnp.int32))
  return v[:, :k], i[:, :k]


def _bitonic_sort(key, idx, *, first_size: int = 2, offset=0, keep: int = 0):
  """Sort one row held in registers: key [n] uint32 descending, ties by idx [n] int32
  ascending (n a power of two). A bitonic network: for each merge size s = 2, 4, ..., n and
  each stride d = s/2, ..., 1, entries i and i + d of every block of 2d are put in order,
  descending where bit s of i is clear and ascending where it is set (so every merged run is
  bitonic for the next size; at s = n every block is descending). A stride-d step views the
  row as [n / 2d, 2, d] and swaps the two halves elementwise (split / stack, which Triton
  lowers to register splits and joins).

  Parts of one longer row's network (`bitonic_finish` with run > 0): first_size > 2 starts
  at that merge size (runs of first_size / 2 already sorted in alternating directions);
  offset (an int32 scalar, a multiple of n) is the row position of element 0, so a run's
  direction follows its place in the whole row. keep > 0 (a power of two <= n): in the last
  merge, once a step has put the largest half of the (bitonic) row first, drop the other half
  while it is not needed, so the last steps work on keep entries; -> [keep] entries then."""
  def halves(x, d):  # [n] -> [n / 2d, d] x 2: the first and second half of each block
    return jnp.split(x.reshape(x.shape[0] // (2 * d), 2 * d), 2, axis=1)

  def join(a, b):  # [n / 2d, d] x 2 -> [n / 2d, d, 2] -> [n / 2d, 2, d] -> [n]
    return jnp.transpose(jnp.stack([a, b], axis=-1), (0, 2, 1)).reshape(2 * a.size)

  n = key.shape[0]
  size = first_size
  while size <= n:
    d = size // 2
    while d >= 1:
      ka, kb = halves(key, d)
      ia, ib = halves(idx, d)
      start = offset + lax.broadcasted_iota(jnp.int32, (key.shape[0] // (2 * d), 1), 0) * (2 * d)
      desc = (start & size) == 0
      b_first = (kb > ka) | ((kb == ka) & (ib < ia))  # b belongs before a in descending order
      swap = jnp.where(desc, b_first, ~b_first & ((ka != kb) | (ia != ib)))
      key = join(jnp.where(swap, kb, ka), jnp.where(swap, ka, kb))
      idx = join(jnp.where(swap, ib, ia), jnp.where(swap, ia, ib))
      if size == n and keep and keep <= d and key.shape[0] == 2 * d:
        # one block left, and this step put its d largest first (a bitonic run): keep those
        key, idx = (jnp.split(x.reshape(1, -1), 2, axis=1)[0].reshape(-1) for x in (key, idx))
      d //= 2
    size *= 2
  return key, idx


def _from_ordered_key(key):
  """Inverse of `_ordered_key` (uint32 -> float32)."""
  b = jnp.where((key >> 31) == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return lax.bitcast_convert_type(b, jnp.float32)


def _sort_keys(v_ref, i_ref, live, offset=0):
  """Candidate slots -> (key uint32, idx int32) to sort: slots at or past `live` (row
  positions, the block starting at `offset`) and -inf entries get key 0 and the largest index,
  so they sort after every live candidate."""
  v = v_ref[...]
  lane = offset + lax.broadcasted_iota(jnp.int32, v.shape, 0)
  ok = (lane < live) & (v > NEG_INF)
  dead_idx = jnp.iinfo(jnp.int32).max  # sorts after every live index among equal keys
  # live keys are > _ordered_key(-inf) > 0
  return jnp.where(ok, _ordered_key(v), jnp.uint32(0)), jnp.where(ok, i_ref[...], dead_idx)


def _write_sorted(key, idx, vo_ref, io_ref, sel_ref=None, page: int = 0):
  """Sorted keys (at least as many as the output holds) -> the output's values / indices.
  sel_ref (a row of block ids, -1: none) and page: an index p is written as the slot
  sel[p // page] * page + p % page instead (-1 where that block id is -1)."""
  while key.shape[0] > vo_ref.shape[0]:  # keep the first half (the output is a power of two)
    key, idx = (jnp.split(x.reshape(1, -1), 2, axis=1)[0].reshape(-1) for x in (key, idx))
  ok = key != 0
  vo_ref[...] = jnp.where(ok, _from_ordered_key(key), NEG_INF)
  if sel_ref is not None:
    blk = plgpu.load(sel_ref.at[jnp.where(ok, idx // page, 0)], mask=ok, other=-1)
    ok = ok & (blk >= 0)
    idx = blk * page + idx % page
  io_ref[...] = jnp.where(ok, idx, -1)


def _bitonic_kernel(v_ref, i_ref, live_ref, vo_ref, io_ref):
  """One row of candidates (any order; slots past live_ref[0] not initialised) -> the row
  sorted by value descending, ties by lower index, then the -inf / -1 tail."""
  _write_sorted(*_bitonic_sort(*_sort_keys(v_ref, i_ref, live_ref[0])), vo_ref, io_ref)


def _bitonic_runs_kernel(v_ref, i_ref, live_ref, ko_ref, io_ref, *n_ref, cap: int,
                         descending: bool = False):
  """Step 1 of the split bitonic finish, one (row, run) per program: the run's candidates
  sorted as the first merge sizes of the whole row's network (direction by row position;
  descending: every run descending, for `_rank_merge_kernel`, and n_ref [1] gets the run's
  live entry count).
  A run wholly at or past the row's live count holds only dead slots, which are in order in
  either direction: it writes them without sorting (the compaction fills slots from 0, so
  with ~k + 15% candidates in a 2k buffer about 3 runs of 8 are dead)."""
  run = v_ref.shape[0]
  offset = pl.program_id(1) * run
  live = jnp.minimum(live_ref[0].astype(jnp.int32), cap)  # a count may pass cap (repaired)

  @pl.when(offset < live)
  def _():
    key, idx = _sort_keys(v_ref, i_ref, live, offset)
    ko_ref[...], io_ref[...] = _bitonic_sort(key, idx, offset=0 if descending else offset)
    if n_ref:
      n_ref[0][...] = jnp.sum((key > 0).astype(jnp.int32)).reshape(1)

  @pl.when(offset >= live)
  def _():  # the dead key and index of `_sort_keys`
    ko_ref[...] = jnp.zeros((run,), jnp.uint32)
    io_ref[...] = jnp.full((run,), jnp.iinfo(jnp.int32).max, jnp.int32)
    if n_ref:
      n_ref[0][...] = jnp.zeros((1,), jnp.int32)


def _bitonic_mid_kernel(k_ref, i_ref, ko_ref, io_ref, *, run: int):
  """Step 1b of the split bitonic finish (with a middle block m), one (row, block of m
  slots) per program: the network's merge sizes 2 run ... m over runs sorted by step 1
  (direction by row position, as the whole row's network has it)."""
  m = k_ref.shape[0]
  ko_ref[...], io_ref[...] = _bitonic_sort(k_ref[...], i_ref[...], first_size=2 * run,
                                           offset=pl.program_id(1) * m)


def _bitonic_merge_kernel(k_ref, i_ref, *refs, run: int, page: int, cap: int,
                          interpret: bool, repair=None):
  """Step 2, one row per program: the network's remaining merges over runs of `run` sorted by
  the steps before, dropping the lower half of the last merge as soon as the output no
  longer needs it. refs: [the row's count or counters, the row [, its length] (repair: (n,
  chunk, with_lengths)),] [block ids of the row (page > 0: indices are mapped to slots),]
  values, indices [, a scratch pair (repair)]. With repair, a row with more candidates than
  cap gets its exact sorted top-k from the row instead (`_repair_sorted`)."""
  if repair:
    tot_ref, *refs = refs
    x_ref, len_ref, refs = _repair_refs(refs, repair)
    *refs, rv_ref, ri_ref = refs
  *sel_ref, vo_ref, io_ref = refs

  def merge():
    key, idx = _bitonic_sort(k_ref[...], i_ref[...], first_size=2 * run, keep=vo_ref.shape[0])
    _write_sorted(key, idx, vo_ref, io_ref, *sel_ref, page=page)

  if not repair:
    merge()
    return
  over = tot_ref[0].astype(jnp.int32) > cap
  pl.when(~over)(merge)

  @pl.when(over)
  def _():
    # the best next_pow2(k) (the output's width) sorted: their first k are the top-k
    _repair_sorted(x_ref, len_ref, rv_ref, ri_ref, vo_ref, io_ref, n=repair[0],
                   chunk=repair[1], k=vo_ref.shape[0], interpret=interpret,
                   sel_ref=sel_ref[0] if sel_ref else None, page=page)


def _count_before_in_runs(k_ref, i_ref, key, idx, *, runs: int, run: int, n_live):
  """Entries (key, idx) [L] -> [L] int32: for each, how many entries of a row's `runs`
  sorted runs (k_ref / i_ref [runs * run]: each run's keys descending, ties by ascending
  index) come before it. One branchless binary search per run, log2(run) + 1 probes; the
  runs' searches step together as one [runs, L] gather of keys a step, and of indices only
  where the keys tie. n_live [runs] int32: each run's live entries (keys > 0, first in the
  run: dead slots hold key 0 and sort last); a probe at or past its run's live count is not
  loaded but read as a dead key, which comes before no live entry (the compaction fills
  slots from 0, so with ~k + 15% candidates in a 2k buffer ~40% of the probes are dead)."""
  base = lax.broadcasted_iota(jnp.int32, (runs, 1), 0) * run
  kc, ic = key[None, :], idx[None, :]
  end = base + n_live.reshape(runs, 1)

  def before(p):
    tie = p < end  # masked lanes make no memory request
    kp = plgpu.load(k_ref.at[p], mask=tie, other=0)
    tie = tie & (kp == kc)  # only ties read the index
    ip = plgpu.load(i_ref.at[p], mask=tie, other=0)
    return ((kp > kc) | (tie & (ip < ic))).astype(jnp.int32)

  c = jnp.zeros((runs, key.shape[0]), jnp.int32)
  width = run  # the count lies in [c, c + width] (c + width - 1 at most but for the last)
  while width > 1:  # afterwards c = min(count, run - 1) for each run
    width //= 2
    c = c + width * before(base + c + (width - 1))
  return jnp.sum(c + before(base + c), axis=0)


def _rank_merge_kernel(k_ref, i_ref, n_ref, tot_ref, *refs, k: int, cap: int, run: int,
                       block: int, page: int, interpret: bool, repair=None):
  """Step 2 of the split bitonic finish with a rank merge, one (row, block of `block`
  slots) per program, instead of the merges: every run of `run` slots is sorted descending
  (step 1 with descending=True), so an entry's place in the row is the sum over the runs of
  how many entries of each come before it (`_count_before_in_runs`: log2(run) + 1 dependent
  probes, where the merges take ~log2(cap)^2 / 2 network steps), and the block writes its
  live entries ranked below k to their slots. Dead slots (key 0) are not written; the
  block writes the -inf / -1 tail into its share of the slots from the row's live count
  (the sum of n_ref [cap / run], each run's live entries) to k. k_ref / i_ref: the row's
  sorted runs [cap]. tot_ref: the row's count, or the compaction's counters. refs: [the row
  [, its length] (repair: (n, chunk, with_lengths)),] [block ids (page > 0: indices are
  mapped to slots, as `_write_sorted` does),] values, indices [, a scratch pair (repair)];
  with repair a row with more candidates than cap gets its exact sorted top-k from program
  0 (`_repair_sorted`). The searches load no probe past a run's live count (n_ref)."""
  x_ref, len_ref, refs = _repair_refs(refs, repair)
  sel_ref = refs.pop(0) if page else None
  vo_ref, io_ref, *scratch = refs
  a = pl.program_id(1) * block
  over, _, lane, trash = _ranked_row(tot_ref, vo_ref, block, cap)
  runs = cap // run
  if repair:
    @pl.when(over & (pl.program_id(1) == 0))
    def _():
      _repair_sorted(x_ref, len_ref, *scratch, vo_ref, io_ref, n=repair[0], chunk=repair[1],
                     k=k, interpret=interpret, sel_ref=sel_ref, page=page)

  @pl.when(~over)
  def _():
    _store_tail(vo_ref, io_ref, a + lane, jnp.sum(n_ref[...]), k, trash)
    kb, ib = k_ref[pl.ds(a, block)], i_ref[pl.ds(a, block)]

    @pl.when(jnp.max(kb) > 0)  # a block of dead slots writes nothing more
    def _():
      rank = _count_before_in_runs(k_ref, i_ref, kb, ib, runs=runs, run=run, n_live=n_ref[...])
      keep = (kb > 0) & (rank < k)
      dest = jnp.where(keep, rank, trash)
      idx = ib
      if page:
        blk = plgpu.load(sel_ref.at[jnp.where(keep, ib // page, 0)], mask=keep, other=-1)
        idx = jnp.where(blk >= 0, blk * page + ib % page, -1)
      plgpu.store(vo_ref.at[dest], _from_ordered_key(kb), mask=keep)
      plgpu.store(io_ref.at[dest], idx, mask=keep)


def bitonic_finish(cv, ci, live, k: int, cap: int, *, num_warps: int = 16,
                   interpret: bool = False):
  """cv, ci [R, >= cap] candidates in any order, live [R] (<= cap) of them per row (slots
  past live are ignored; slots before it may be -inf) -> the k best, sorted: values [R, k]
  float32 (-inf tail) and indices [R, k] int32 (-1 tail). One program per row sorts its cap
  candidates in registers with a bitonic network: log2(cap) (log2(cap) + 1) / 2 dependent
  steps, so its time is a latency chain (~26 us for cap = 4096 on the H200 at 16 warps,
  whatever the number of rows up to one per SM). The program writes only the first
  next_pow2(k) sorted slots, so for a power-of-two k the output needs no slicing."""
  return _per_row_finish(_bitonic_kernel, cv, ci, live, k, cap, width=next_pow2(k),
                         num_warps=num_warps,
                         interpret=interpret, name="jaxsparse_topk_bitonic")


def bitonic_finish_split(cv, ci, live, k: int, cap: int, *, run: int, num_warps: int = 16,
                         run_warps: int = 4, interpret: bool = False, block_map=None,
                         mid: int = 0, repair=None, rank_merge: int = 0,
                         rank_merge_warps: int = 4):
  """`bitonic_finish` as two kernels (three with `mid`), the same network: (rows, cap / run)
  programs each sort a run of `run` candidate slots (the first log2(run) merge sizes, in
  parallel over the GPU),
  then one program per row does the remaining merges, log2(cap / run) of them, on cap
  entries shrinking to next_pow2(k) in the last. The chain keeps its log2(cap) (log2(cap) +
  1) / 2 dependent steps (cap 4096, run 512: 45 in the run kernel, 33 in the merge kernel),
  so it can only win if a step of a small run program is shorter than one over the whole
  row. Same outputs as `bitonic_finish`.

  block_map=(sel [R, W] int32, page): the candidates' indices are positions in a row of W
  blocks of `page` scores (SPIN's block-sparse scores); the merge kernel then writes each
  one's slot sel[p // page] * page + p % page (-1 for a -1 block) instead of p.

  mid: 0, or m (a power of two, run < m < cap): a middle kernel of (rows, cap / m) programs
  (num_warps each) does the merge sizes up to m, so the per-row program does only the last
  log2(cap / m) of them, over fewer dependent steps on the whole row.
  repair=(x [R, N], lengths [R] or None, chunk): live may be the compaction's row counters
  [R, COUNTER_STRIDE] with counts past cap; the merge program of such a row writes its exact
  top-k from x instead (no `repair` kernel before the finish).
  rank_merge: 0, or b (a power of two <= run): no merges; the runs are sorted descending and
  a kernel of (rows, cap / b) programs (rank_merge_warps each) places every entry by binary
  searches in the runs (`_rank_merge_kernel`); mid is then ignored."""
  r = cv.shape[0]
  width = next_pow2(k)
  _check_cap(cap, k, cv.shape[1])
  if not is_pow2(run) or not 2 <= run < cap:
    raise ValueError(f"run={run} must be a power of two in [2, cap={cap})")
  if mid and not (is_pow2(mid) and run < mid < cap):
    raise ValueError(f"mid={mid} must be 0 or a power of two in ({run}, {cap})")
  if rank_merge and not (is_pow2(rank_merge) and rank_merge <= run):
    raise ValueError(f"rank_merge={rank_merge} must be 0 or a power of two <= run={run}")
  blk = pl.BlockSpec((None, run), lambda i, j: (i, j))
  live, live_spec = _count_in(live, r)
  counts = ([pl.BlockSpec((None, 1), lambda i, j: (i, j))],
            [jax.ShapeDtypeStruct((r, cap // run), jnp.int32)]) if rank_merge else ([], [])
  keys, idx, *n_live = pl.pallas_call(
      functools.partial(_bitonic_runs_kernel, cap=cap, descending=bool(rank_merge)),
      grid=(r, cap // run),
      in_specs=[blk, blk, live_spec],
      out_specs=[blk, blk] + counts[0],
      out_shape=[jax.ShapeDtypeStruct((r, cap), jnp.uint32),
                 jax.ShapeDtypeStruct((r, cap), jnp.int32)] + counts[1],
      compiler_params=plgpu.CompilerParams(num_warps=run_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_bitonic_runs",
  )(cv.astype(jnp.float32), ci.astype(jnp.int32), live)
  if rank_merge:
    return _rank_merge(keys, idx, n_live[0], live, live_spec, k, cap, run=run, block=rank_merge,
                       num_warps=rank_merge_warps, interpret=interpret, block_map=block_map,
                       repair=repair)
  if mid:
    mblk = pl.BlockSpec((None, mid), lambda i, j: (i, j))
    keys, idx = pl.pallas_call(
        functools.partial(_bitonic_mid_kernel, run=run),
        grid=(r, cap // mid),
        in_specs=[mblk, mblk],
        out_specs=[mblk, mblk],
        out_shape=[jax.ShapeDtypeStruct((r, cap), jnp.uint32),
                   jax.ShapeDtypeStruct((r, cap), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="jaxsparse_topk_bitonic_mid",
    )(keys, idx)
    run = mid
  row_in = pl.BlockSpec((None, cap), lambda i: (i, 0))
  row_out = pl.BlockSpec((None, width), lambda i: (i, 0))
  extra, extra_specs, page = _block_map_in(block_map, r)
  rep_in, rep_specs, rep_shapes, rep_out, rep = _repair_in(repair, r, k, interpret)
  if rep:  # the row's count, then the row itself, before the block ids
    extra, extra_specs = [live] + rep_in + extra, [live_spec] + rep_specs + extra_specs
  v, i = pl.pallas_call(
      functools.partial(_bitonic_merge_kernel, run=run, page=page, cap=cap,
                        interpret=interpret, repair=rep),
      grid=(r,),
      in_specs=[row_in, row_in] + extra_specs,
      out_specs=[row_out, row_out] + rep_out,
      out_shape=[jax.ShapeDtypeStruct((r, width), jnp.float32),
                 jax.ShapeDtypeStruct((r, width), jnp.int32)] + rep_shapes,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_bitonic_merge",
  )(keys, idx, *extra)[:2]
  return v[:, :k], i[:, :k]


def _rank_merge(keys, idx, n_live, live, live_spec, k: int, cap: int, *, run: int,
                block: int, num_warps: int, interpret: bool, block_map, repair):
  """`bitonic_finish_split`'s second step with rank_merge=block: `_rank_merge_kernel` over
  runs of `run` sorted descending (keys [R, cap] uint32, idx [R, cap] int32, n_live
  [R, cap / run] int32 each run's live entries; live and its spec from `_count_in`) ->
  values [R, k], indices [R, k]."""
  r = keys.shape[0]
  width = next_pow2(k) + (block if interpret else 0)  # interpret: trash slots past the row
  whole = pl.BlockSpec((None, cap), lambda i, a: (i, 0))
  out = pl.BlockSpec((None, width), lambda i, a: (i, 0))
  rep_in, rep_specs, rep_shapes, rep_out, rep = _repair_in(repair, r, k, interpret)
  sel_in, sel_specs, page = _block_map_in(block_map, r)
  v, i = pl.pallas_call(
      functools.partial(_rank_merge_kernel, k=k, cap=cap, run=run, block=block, page=page,
                        interpret=interpret, repair=rep),
      grid=(r, cap // block),
      in_specs=[whole, whole, pl.BlockSpec((None, cap // run), lambda i, a: (i, 0)),
                live_spec] + rep_specs + sel_specs,
      out_specs=[out, out] + rep_out,
      out_shape=[jax.ShapeDtypeStruct((r, width), jnp.float32),
                 jax.ShapeDtypeStruct((r, width), jnp.int32)] + rep_shapes,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jaxsparse_topk_rank_merge",
  )(keys, idx, n_live, live, *rep_in, *sel_in)[:2]
  return v[:, :k], i[:, :k]

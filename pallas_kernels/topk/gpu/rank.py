"""The rank finish on GPU: sorting by counting (a candidate's place is the number before it),
no dependent chain; for few rows, where a sorting network's chain dominates."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import is_pow2, next_pow2
from pallas_kernels.topk.gpu._common import (COUNTER_STRIDE, NEG_INF, check_cap, count_in,
                                             ranked_row, store_tail)
from pallas_kernels.topk.gpu.repair import repair_first, repair_in, repair_refs

__all__ = ["rank_finish"]


def _before(vj, ij, vi, ii):
  """[1, J] candidates j against [I, 1] candidates i -> [I, J] int32: 1 where j comes before i
  in the sorted order (a larger value, or the same value and a lower index)."""
  return ((vj > vi) | ((vj == vi) & (ij < ii))).astype(jnp.int32)


def _put_ranked(vo_ref, io_ref, v, idx, rank, ok, k: int, trash):
  """Write the candidates (v, idx) [I] whose lanes are `ok` (live) and rank below k to their
  rank's slot (index -1 for a -inf value); the other lanes aim at `trash`."""
  keep = ok & (rank < k)
  dest = jnp.where(keep, rank, trash)
  plgpu.store(vo_ref.at[dest], v, mask=keep)
  plgpu.store(io_ref.at[dest], jnp.where(v > NEG_INF, idx, -1), mask=keep)


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
  than `cap` is not ranked: program 0 writes its exact sorted top-k alone (`repair_sorted`).
  buckets: the slots hold two value buckets (`compact_atomic(..., pivot=)`): the upper one
  in [0, tot_ref[1]), the lower in [cap - tot_ref[2], cap). Every upper candidate comes
  before every lower one, so a block compares only with the buckets its candidates are in
  (in loops), and a block of lower candidates adds the upper count."""
  x_ref, len_ref, refs = repair_refs(refs, repair)
  vo_ref, io_ref, *scratch = refs
  bi = vi_ref.shape[0]
  ia = pl.program_id(1)
  a = ia * bi
  over, live, lane, trash = ranked_row(tot_ref, vo_ref, bi, cap, buckets=buckets)
  repair_first(over & (ia == 0), x_ref, len_ref, scratch, vo_ref, io_ref, k=k, repair=repair,
                interpret=interpret)

  @pl.when(~over)
  def _():
    store_tail(vo_ref, io_ref, a + lane, live, k, trash)

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
  check_cap(cap, k, cv.shape[1])
  block_i, block_j = min(block_i, cap), min(block_j, cap)
  if not (is_pow2(block_i) and is_pow2(block_j)):
    raise ValueError(f"block_i={block_i} and block_j={block_j} must be powers of two")
  cv, ci = cv.astype(jnp.float32), ci.astype(jnp.int32)
  nj = cap // block_j
  width = next_pow2(k) + (block_i if interpret else 0)  # interpret: trash slots past the row
  live, live_spec = count_in(live, r)
  rep_in, rep_specs, rep_shapes, rep_out, rep = repair_in(repair, r, k, interpret)
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

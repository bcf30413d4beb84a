"""Exact top-K by threshold filtering: public wrapper over the GPU and TPU passes.

Algorithm (exact for any partition of a row into groups): the k-th largest group maximum `t`
is a lower bound on the k-th largest entry, because k groups each hold an entry >= t. So every
top-k entry is >= t, and the entries >= t (typically ~k of them) are the only candidates.
  1. group maxima (one streaming pass; fused into decode scoring by `jaxsparse.indexer_topk`),
  2. t = k-th largest group maximum (`lax.top_k` over N / g entries), or on GPU a value found
     by a search that keeps >= k group maxima above it (one program per row, no sort:
     regula falsi, stopping within a slack of maxima above k, or bisection;
     TopkConfig.threshold),
  3. count and compact the candidates in index order into a [R, C] buffer (before an
     order-free finish on GPU, for large calls, TopkConfig.gather: the threshold kernel lists
     the groups whose maximum reaches t, and the compaction gathers only their entries),
  4. on GPU by default (TopkConfig(finish="auto")) the candidates are sorted by (value, index)
     with a bitonic network in registers (programs sort runs, one program per row merges them;
     finish="bitonic"; for 2-8 rows at k >= 1024 the runs are sorted descending and a grid of
     programs places each entry by binary searches in every run instead: the rank merge),
     or for a single row at k >= 512 by counting: a grid of programs counts, for every
     candidate of its block, the candidates before it and puts it in its place
     (finish="rank"). Both are order-free, which lets step 3 be one pass (no count pass:
     chunk ranges, or for many long rows single slots, reserved by atomic adds;
     TopkConfig.compact). Otherwise `lax.top_k` over the C candidates (ties -> lower candidate
     slot -> lower index; finish="sort"). The shapes at which the GPU's choices switch were
     measured: they are the internal table `_tuning.TUNING`. On TPU the threshold (an exact
     bitwise search for the k-th largest group maximum), the compaction (lane rotations, no
     scatter) and a bitonic finish are Mosaic kernels (`tpu.py`).
     When the caller asks for the top-k as a set
     (ordered=False: ascending index order, what sparse attention consumes), step 3 counts
     then compacts in index order, and a GPU kernel finds the exact k-th candidate (four bits a
     sweep) and compacts the k best in index order: no sort at all.
If any row has more than C candidates (adversarial ties or long runs of near-equal scores): on
GPU a repair kernel recomputes that row's exact top-k set into the buffer (one program per
row, a no-op for every other row, so the call has no branch); on TPU the call falls back to
one full `lax.top_k` of the masked rows through a `lax.cond`. Both are slow but exact.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._platform import KernelPlatform
from pallas_kernels._util import flush_zero, next_pow2, pad_axis
from pallas_kernels.topk._tuning import TUNING, Tuning
from pallas_kernels.topk.config import TopkConfig
from pallas_kernels.topk import gpu as _gpu
from pallas_kernels.topk import tpu as _tpu

__all__ = ["TopkConfig", "topk_rows", "group_size", "gpu_chunk", "block_slots", "fused_groups"]

NEG_INF = float("-inf")


def group_size(n: int, k: int, config: TopkConfig, kind: str, *, rows: int,
               tuning: Tuning = TUNING) -> int:
  """Entries per group for a call of `rows` rows (a power of two <= 64, or on GPU for at most
  tuning.max_group_rows rows, <= config.max_group) so that the group maxima, padded to a
  power of two as the GPU threshold kernel takes them, number >= groups_per_k * k (so there
  are more than groups_per_k * k / 2 real groups); 0 means "sort directly". Counting the
  padded size keeps a row that is not a power of two from paying for a padded array twice as
  long (SPIN's 80K-slot compacted width: 5120 groups of 16, padded to 8192, not 10240 groups
  of 8 padded to 16384)."""
  cap = config.max_group if kind == "gpu" and rows <= tuning.max_group_rows else 64
  g = 1
  while g < cap and next_pow2(max(n // (2 * g), 1)) >= tuning.groups_per_k * k:
    g *= 2
  min_g = 8 if kind == "tpu" else 2
  return g if g >= min_g else 0


def gpu_chunk(config: TopkConfig, rows: int, n: int, k: int, g: int, finish: str,
              tuning: Tuning = TUNING):
  """GPU: the filter passes' chunk for rows of n scores, top-k, groups of g, the finish
  `finish` resolved ("set" for the order-free one), and whether the compaction fills two
  value buckets (Tuning.buckets_for; their chunk is Tuning.bucket_chunk). Groups sit
  contiguously inside a chunk, which is at most the row padded to a power of two."""
  def chunk_of(buckets):
    return max(min(tuning.chunk_for(rows, n, buckets=buckets), next_pow2(n)), g)
  capacity = next_pow2(config.capacity_factor * k)
  c = chunk_of(False)
  buckets = tuning.buckets_for(config, finish, rows, -(-n // c) * c, k, capacity)
  return (chunk_of(True) if buckets else c), buckets


def fused_groups(config: TopkConfig, tile: int) -> TopkConfig:
  """`config` for a top-K whose group maxima another kernel emits over tiles of `tile` scores
  (the decode scoring step, SPIN's block): groups capped at 64 (what the emitting kernels are
  built and tested for) and at the largest power of two dividing the tile, so that the
  groups `topk_rows` expects are ones the kernel can emit."""
  return dataclasses.replace(config, max_group=min(config.max_group, 64, tile & -tile))


def masked_rows(x, lengths):
  """x [R, N] -> float32 with entries at/after lengths, NaN and -inf all -inf; -0.0 -> +0.0.

  (`lax.top_k` orders -0.0 below +0.0; they are equal scores, so ties must go by index.)
  """
  x = flush_zero(x.astype(jnp.float32))
  idx = jnp.arange(x.shape[1])[None, :]
  return jnp.where((idx < lengths[:, None]) & ~jnp.isnan(x), x, NEG_INF)


def finish(vals, idx):
  """Tail entries (-inf) get index -1."""
  return vals, jnp.where(vals == NEG_INF, -1, idx)


def full_sort(x, lengths, k):
  v, i = lax.top_k(masked_rows(x, lengths), k)
  return finish(v, i.astype(jnp.int32))


def index_order(v, i):
  """Sorted top-k rows -> the same entries in ascending index order (-1 / -inf tail last)."""
  key = jnp.where(i < 0, jnp.iinfo(jnp.int32).max, i)
  _, v, i = lax.sort((key, v, i), dimension=1, num_keys=1)
  return v, i


def topk_rows(x, lengths, k: int, config: TopkConfig, platform: KernelPlatform, gmax=None, *,
              ordered: bool = True, block_map=None, tuning: Tuning = TUNING):
  """x [R, N] float32/bfloat16, lengths [R] int32 or None (whole rows) -> (values [R, k]
  float32, indices [R, k]).

  ordered: True -> values descending (ties: lower index first); False -> the same k entries
    in ascending index order (valid entries first, then the -inf / -1 tail), which lets the
    GPU path skip the final sort.
  gmax: optional [R, N / g] maxima of consecutive groups of g = group_size(...) entries, as
  emitted by the fused decode scoring kernel (GPU); computed here when None.
  block_map: optional (sel [R, W] int32, page) when x holds the scores of W blocks of `page`
    slots each, block sel[r, j] at positions j * page ... (SPIN's block-sparse scores; -1: a
    padding block): the indices returned are then slots sel[p // page] * page + p % page
    (-1 for the tail). The GPU's split bitonic finish maps them in its merge (or rank
    merge) kernel.
  tuning: the measured per-shape choices (`_tuning.TUNING`); tests pass others to reach
    every kernel path at small sizes.
  """
  sel, page = block_map if block_map is not None else (None, 0)
  return _topk_rows(x, lengths, k, config, platform, ordered, gmax, page, sel, tuning)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 7, 9))
def _topk_rows(x, lengths, k, config, platform, ordered, gmax, page, sel, tuning):
  v, i, in_order, mapped = _topk_rows_sorted_or_set(x, lengths, k, config, tuning, platform,
                                                    ordered, gmax,
                                                    (sel, page) if page else None)
  if page and not mapped:
    i = block_slots(sel, i, page)
  return (v, i) if ordered or in_order else index_order(v, i)


def block_slots(sel, p, page: int):
  """Positions p [R, K] int32 in rows of W blocks of `page` scores, block sel[r, j] at
  positions j * page ... (sel [R, W] int32, -1: a padding block) -> slots sel[p // page] *
  page + p % page, -1 where p < 0 or the block id is -1 (no [R, W * page] slot array)."""
  q = jnp.maximum(p, 0)
  blk = jnp.take_along_axis(sel, q // page, axis=1)
  return jnp.where((p >= 0) & (blk >= 0), blk * page + q % page, -1)


def _topk_rows_sorted_or_set(x, lengths, k, config, tuning, platform, ordered, gmax,
                             block_map=None):
  """-> (values, indices, in_index_order, indices already mapped through block_map)."""
  r, n = x.shape
  g = group_size(n, k, config, platform.kind, rows=r, tuning=tuning)
  if lengths is None and (platform.kind != "gpu" or g == 0 or n <= k):
    lengths = jnp.full((r,), n, jnp.int32)  # the GPU kernels take None: no lengths input
  if g == 0 or n <= k:
    return *full_sort(x, lengths, k), False, False
  if gmax is not None and gmax.shape != (r, -(-n // g)):
    raise ValueError(f"gmax {gmax.shape} must be [{r}, {-(-n // g)}]: the maxima of groups of "
                     f"group_size(...) = {g} scores")
  capacity = next_pow2(config.capacity_factor * k)
  interp = platform.interpret
  if platform.kind == "gpu":
    finish_ = tuning.finish_for(config, r, k) if ordered else "set"
    chunk, buckets = gpu_chunk(config, r, n, k, g, finish_, tuning)
  else:  # TPU: a group is one lane of a [g, 128] chunk
    chunk = g * _tpu.LANES
  n_pad = -(-n // chunk) * chunk
  xp = pad_axis(x.astype(jnp.float32), 1, n_pad, value=NEG_INF)
  if platform.kind == "gpu":
    # the finish repairs overflowing rows itself (no repair kernel): it gets the counters
    repair = None
    if tuning.finish_repairs(finish_, capacity):
      repair = (xp, lengths, min(chunk, next_pow2(k)))
    cv, ci, live = _gpu_candidates(xp, lengths, k, g, chunk, capacity, config, tuning, interp,
                                   gmax, order_free=finish_ in ("bitonic", "rank"),
                                   repair=repair is None, buckets=buckets)
    return _gpu_finish(cv, ci, live, k, capacity, tuning, interp, finish_, block_map, repair,
                       buckets)
  # TPU: threshold, compaction and finish are Mosaic kernels (`tpu.py`: no vector scatter)
  cap = max(capacity, _tpu.LANES)
  gm = _tpu.group_max(xp, lengths, chunk=chunk, interpret=interp)
  thr = _tpu.threshold(gm, k, interpret=interp)
  cv, ci, total = _tpu.compact(xp, lengths, thr, capacity=cap, interpret=interp)

  def filtered():
    v, i = _tpu.bitonic_finish(cv, ci, interpret=interp)
    return finish(v[:, :k], i[:, :k])

  return *lax.cond(jnp.all(total <= cap), filtered,
                   lambda: full_sort(x, lengths, k)), False, False


def _gpu_candidates(xp, lengths, k, g, chunk, capacity, config, tuning, interp, gmax, *,
                    order_free, repair: bool = True, buckets: bool = False):
  """GPU, rows of any length: group maxima (unless given), threshold, compaction and repair
  -> (values, indices) [R, >= capacity] candidates and live [R] slots per row.
  repair=False (an order-free finish that repairs overflowing rows itself): no repair
  kernel, and live is the compaction's row counters [R, COUNTER_STRIDE] instead.
  order_free: the finish accepts candidates in any slot order (one-pass compaction, maybe
  gathering). buckets (`Tuning.buckets_for`): the threshold kernel also writes a pivot
  and the compaction places two value buckets from the buffer's two ends."""
  r, n_pad = xp.shape
  if gmax is None:
    gmax = _gpu.group_max(xp, lengths, chunk=chunk, group=g, num_warps=tuning.num_warps,
                          interpret=interp)
  else:  # emitted for the unpadded row: the padding's groups are -inf
    gmax = pad_axis(gmax, 1, n_pad // g, value=NEG_INF)
  # an order-free finish takes a one-pass compaction; from the group list (gather) when the
  # threshold kernel can write one
  in_kernel = config.threshold in ("bisect", "falsi")  # the threshold kernel, not a sort
  gather = order_free and tuning.gathers(config, r, n_pad) and in_kernel
  place = tuning.placement(config, r, n_pad, k, gather=gather)
  gather_lanes = min(tuning.chunk_for(r, n_pad), capacity * g)  # entries per gathering program
  ctr = pivot = None  # the compaction's row counters, from the threshold kernel
  if in_kernel:
    thr, ctr, *glist = _gpu.threshold(gmax, k, iters=tuning.bisect_iters,
                                      slack=tuning.slack_for(config, g),
                                      num_warps=tuning.threshold_warps,
                                      interpret=interp, counter=_gpu.counter_dtype(place, buckets),
                                      list_width=capacity if gather else 0, pivot=buckets)
    if buckets:
      *glist, pivot = glist
  else:
    thr = lax.top_k(gmax, k)[0][:, k - 1]
  if tuning.refines(r, gather):
    thr = _gpu.refine_threshold(thr, gmax, lambda e: _gpu.count_groups(
        xp, lengths, e, *glist, group=g, list_width=capacity, lanes=min(gather_lanes, 512),
        num_warps=tuning.num_warps, interpret=interp), k, tuning.refine_edges)
  if gather:
    cv, ci, total = _gpu.compact_groups(xp, lengths, thr, *glist, ctr, group=g,
                                        capacity=capacity, lanes=gather_lanes,
                                        num_warps=tuning.num_warps, interpret=interp,
                                        placement=place)
  elif order_free:  # count and compaction in one pass
    cv, ci, total = _gpu.compact_atomic(xp, lengths, thr, capacity=capacity, chunk=chunk,
                                        num_warps=tuning.num_warps, interpret=interp,
                                        counter=ctr, placement=place, pivot=pivot)
  else:
    counts = _gpu.count(xp, lengths, thr, chunk=chunk, num_warps=tuning.num_warps,
                        interpret=interp)
    offsets = jnp.cumsum(counts, axis=1) - counts
    total = counts.sum(axis=1)
    cv, ci = _gpu.compact(xp, lengths, thr, offsets, capacity=capacity, chunk=chunk,
                          num_warps=tuning.num_warps, interpret=interp)
  if not repair:
    return cv, ci, total
  # overflowing rows are redone exactly inside a kernel: no lax.cond (on GPU its predicate
  # is read on the host, ~35 us on the H200, more than the filter passes together)
  # live slots per row: the count, or k for a repaired row (its first k slots, -inf padded)
  return _gpu.repair(xp, lengths, total, cv, ci, k=k, capacity=capacity,
                     chunk=min(chunk, cv.shape[1]), num_warps=tuning.num_warps,
                     interpret=interp)


def _gpu_finish(cv, ci, live, k, capacity, tuning, interp, how, block_map, repair=None,
                buckets: bool = False):
  """Candidates -> (values, indices, in_index_order, mapped through block_map): how is
  "set" (the k best in index order; the candidates must be in index order), "bitonic",
  "rank" or "sort" (`Tuning.finish_for`). repair: (rows, lengths, chunk) when the finish
  repairs overflowing rows (`Tuning.finish_repairs`; live is then the compaction's
  counters). buckets: the candidates are in two value buckets (`Tuning.buckets_for`)."""
  if how == "set":
    return *_gpu.index_order_finish(cv, ci, live, k, capacity, interpret=interp), True, False
  if how == "bitonic" and 0 < tuning.bitonic_run < capacity:
    return *_gpu.bitonic_finish_split(cv, ci, live, k, capacity, run=tuning.bitonic_run,
                                      num_warps=tuning.bitonic_warps,
                                      run_warps=tuning.run_warps_for(cv.shape[0], k),
                                      interpret=interp,
                                      block_map=block_map, repair=repair,
                                      mid=tuning.mid_for(capacity),
                                      rank_merge=tuning.rank_merge_for(cv.shape[0], k),
                                      rank_merge_warps=tuning.rank_merge_warps,
                                      ), False, block_map is not None
  if how == "bitonic":
    return *_gpu.bitonic_finish(cv, ci, live, k, capacity, num_warps=tuning.bitonic_warps,
                                interpret=interp), False, False
  if how == "rank":
    v, i = _gpu.rank_finish(cv, ci, live, k, capacity, block_i=tuning.rank_block_i,
                            block_j=tuning.rank_block_j, num_warps=tuning.rank_warps,
                            interpret=interp, repair=repair, preload=tuning.rank_preload,
                            buckets=buckets)
    return v, i, False, False
  cvm = jnp.where(jnp.arange(capacity) < live[:, None], cv[:, :capacity], NEG_INF)
  v, p = lax.top_k(cvm, k)
  return *finish(v, jnp.take_along_axis(ci[:, :capacity], p, axis=1)), False, False

"""The bitonic finishes on GPU: one program per row sorts its candidates with a network in
registers, or (split) programs sort runs in parallel and later kernels merge them (a middle
merge kernel, then one program per row, or the rank merge)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import is_pow2, next_pow2
from pallas_kernels.topk.gpu._common import block_map_in, check_cap, count_in, per_row_finish
from pallas_kernels.topk.gpu.merge import rank_merge_runs
from pallas_kernels.topk.gpu.network import bitonic_sort, sort_keys, write_sorted
from pallas_kernels.topk.gpu.repair import repair_in, repair_refs, repair_sorted

__all__ = ["bitonic_finish", "bitonic_finish_split"]


def _bitonic_kernel(v_ref, i_ref, live_ref, vo_ref, io_ref):
  """One row of candidates (any order; slots past live_ref[0] not initialised) -> the row
  sorted by value descending, ties by lower index, then the -inf / -1 tail."""
  write_sorted(*bitonic_sort(*sort_keys(v_ref, i_ref, live_ref[0])), vo_ref, io_ref)


def _bitonic_runs_kernel(v_ref, i_ref, live_ref, ko_ref, io_ref, *n_ref, cap: int,
                         descending: bool = False):
  """Step 1 of the split bitonic finish, one (row, run) per program: the run's candidates
  sorted as the first merge sizes of the whole row's network (direction by row position;
  descending: every run descending, for `merge.rank_merge_runs`, and n_ref [1] gets the run's
  live entry count).
  A run wholly at or past the row's live count holds only dead slots, which are in order in
  either direction: it writes them without sorting (the compaction fills slots from 0, so
  with ~k + 15% candidates in a 2k buffer about 3 runs of 8 are dead)."""
  run = v_ref.shape[0]
  offset = pl.program_id(1) * run
  live = jnp.minimum(live_ref[0].astype(jnp.int32), cap)  # a count may pass cap (repaired)

  @pl.when(offset < live)
  def _():
    key, idx = sort_keys(v_ref, i_ref, live, offset)
    ko_ref[...], io_ref[...] = bitonic_sort(key, idx, offset=0 if descending else offset)
    if n_ref:
      n_ref[0][...] = jnp.sum((key > 0).astype(jnp.int32)).reshape(1)

  @pl.when(offset >= live)
  def _():  # the dead key and index of `sort_keys`
    ko_ref[...] = jnp.zeros((run,), jnp.uint32)
    io_ref[...] = jnp.full((run,), jnp.iinfo(jnp.int32).max, jnp.int32)
    if n_ref:
      n_ref[0][...] = jnp.zeros((1,), jnp.int32)


def _bitonic_mid_kernel(k_ref, i_ref, ko_ref, io_ref, *, run: int):
  """Step 1b of the split bitonic finish (with a middle block m), one (row, block of m
  slots) per program: the network's merge sizes 2 run ... m over runs sorted by step 1
  (direction by row position, as the whole row's network has it)."""
  m = k_ref.shape[0]
  ko_ref[...], io_ref[...] = bitonic_sort(k_ref[...], i_ref[...], first_size=2 * run,
                                           offset=pl.program_id(1) * m)


def _bitonic_merge_kernel(k_ref, i_ref, *refs, run: int, page: int, cap: int,
                          interpret: bool, repair=None):
  """Step 2, one row per program: the network's remaining merges over runs of `run` sorted by
  the steps before, dropping the lower half of the last merge as soon as the output no
  longer needs it. refs: [the row's count or counters, the row [, its length] (repair: (n,
  chunk, with_lengths)),] [block ids of the row (page > 0: indices are mapped to slots),]
  values, indices [, a scratch pair (repair)]. With repair, a row with more candidates than
  cap gets its exact sorted top-k from the row instead (`repair_sorted`)."""
  if repair:
    tot_ref, *refs = refs
    x_ref, len_ref, refs = repair_refs(refs, repair)
    *refs, rv_ref, ri_ref = refs
  *sel_ref, vo_ref, io_ref = refs

  def merge():
    key, idx = bitonic_sort(k_ref[...], i_ref[...], first_size=2 * run, keep=vo_ref.shape[0])
    write_sorted(key, idx, vo_ref, io_ref, *sel_ref, page=page)

  if not repair:
    merge()
    return
  over = tot_ref[0].astype(jnp.int32) > cap
  pl.when(~over)(merge)

  @pl.when(over)
  def _():
    # the best next_pow2(k) (the output's width) sorted: their first k are the top-k
    repair_sorted(x_ref, len_ref, rv_ref, ri_ref, vo_ref, io_ref, n=repair[0],
                   chunk=repair[1], k=vo_ref.shape[0], interpret=interpret,
                   sel_ref=sel_ref[0] if sel_ref else None, page=page)


def bitonic_finish(cv, ci, live, k: int, cap: int, *, num_warps: int = 16,
                   interpret: bool = False):
  """cv, ci [R, >= cap] candidates in any order, live [R] (<= cap) of them per row (slots
  past live are ignored; slots before it may be -inf) -> the k best, sorted: values [R, k]
  float32 (-inf tail) and indices [R, k] int32 (-1 tail). One program per row sorts its cap
  candidates in registers with a bitonic network: log2(cap) (log2(cap) + 1) / 2 dependent
  steps, so its time is a latency chain (~26 us for cap = 4096 on the H200 at 16 warps,
  whatever the number of rows up to one per SM). The program writes only the first
  next_pow2(k) sorted slots, so for a power-of-two k the output needs no slicing."""
  return per_row_finish(_bitonic_kernel, cv, ci, live, k, cap, width=next_pow2(k),
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
  searches in the runs (`merge.rank_merge_runs`); mid is then ignored."""
  r = cv.shape[0]
  width = next_pow2(k)
  check_cap(cap, k, cv.shape[1])
  if not is_pow2(run) or not 2 <= run < cap:
    raise ValueError(f"run={run} must be a power of two in [2, cap={cap})")
  if mid and not (is_pow2(mid) and run < mid < cap):
    raise ValueError(f"mid={mid} must be 0 or a power of two in ({run}, {cap})")
  if rank_merge and not (is_pow2(rank_merge) and rank_merge <= run):
    raise ValueError(f"rank_merge={rank_merge} must be 0 or a power of two <= run={run}")
  blk = pl.BlockSpec((None, run), lambda i, j: (i, j))
  live, live_spec = count_in(live, r)
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
    return rank_merge_runs(keys, idx, n_live[0], live, live_spec, k, cap, run=run,
                           block=rank_merge, num_warps=rank_merge_warps, interpret=interpret,
                           block_map=block_map, repair=repair)
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
  extra, extra_specs, page = block_map_in(block_map, r)
  rep_in, rep_specs, rep_shapes, rep_out, rep = repair_in(repair, r, k, interpret)
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

"""The rank merge: the split bitonic finish's merges replaced, for few rows, by binary searches
in runs sorted descending (log2(run) + 1 dependent probes an entry)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import next_pow2
from pallas_kernels.topk.gpu._common import block_map_in, from_ordered_key, ranked_row, store_tail
from pallas_kernels.topk.gpu.repair import repair_in, repair_refs, repair_sorted

__all__ = ["rank_merge_runs"]


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
  mapped to slots, as `write_sorted` does),] values, indices [, a scratch pair (repair)];
  with repair a row with more candidates than cap gets its exact sorted top-k from program
  0 (`repair_sorted`). The searches load no probe past a run's live count (n_ref)."""
  x_ref, len_ref, refs = repair_refs(refs, repair)
  sel_ref = refs.pop(0) if page else None
  vo_ref, io_ref, *scratch = refs
  a = pl.program_id(1) * block
  over, _, lane, trash = ranked_row(tot_ref, vo_ref, block, cap)
  runs = cap // run
  if repair:
    @pl.when(over & (pl.program_id(1) == 0))
    def _():
      repair_sorted(x_ref, len_ref, *scratch, vo_ref, io_ref, n=repair[0], chunk=repair[1],
                     k=k, interpret=interpret, sel_ref=sel_ref, page=page)

  @pl.when(~over)
  def _():
    store_tail(vo_ref, io_ref, a + lane, jnp.sum(n_ref[...]), k, trash)
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
      plgpu.store(vo_ref.at[dest], from_ordered_key(kb), mask=keep)
      plgpu.store(io_ref.at[dest], idx, mask=keep)


def rank_merge_runs(keys, idx, n_live, live, live_spec, k: int, cap: int, *, run: int,
                    block: int, num_warps: int, interpret: bool, block_map, repair):
  """`bitonic_finish_split`'s second step with rank_merge=block: `_rank_merge_kernel` over
  runs of `run` sorted descending (keys [R, cap] uint32, idx [R, cap] int32, n_live
  [R, cap / run] int32 each run's live entries; live and its spec from `count_in`) ->
  values [R, k], indices [R, k]."""
  r = keys.shape[0]
  width = next_pow2(k) + (block if interpret else 0)  # interpret: trash slots past the row
  whole = pl.BlockSpec((None, cap), lambda i, a: (i, 0))
  out = pl.BlockSpec((None, width), lambda i, a: (i, 0))
  rep_in, rep_specs, rep_shapes, rep_out, rep = repair_in(repair, r, k, interpret)
  sel_in, sel_specs, page = block_map_in(block_map, r)
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

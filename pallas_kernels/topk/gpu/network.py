"""The bitonic sorting network over one row held in registers, and the keys it sorts: shared
by the bitonic finishes and the sorted repair of an overflowing row."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.topk.gpu._common import NEG_INF, from_ordered_key, ordered_key

__all__ = ["bitonic_sort", "sort_keys", "write_sorted"]


def bitonic_sort(key, idx, *, first_size: int = 2, offset=0, keep: int = 0):
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


def sort_keys(v_ref, i_ref, live, offset=0):
  """Candidate slots -> (key uint32, idx int32) to sort: slots at or past `live` (row
  positions, the block starting at `offset`) and -inf entries get key 0 and the largest index,
  so they sort after every live candidate."""
  v = v_ref[...]
  lane = offset + lax.broadcasted_iota(jnp.int32, v.shape, 0)
  ok = (lane < live) & (v > NEG_INF)
  dead_idx = jnp.iinfo(jnp.int32).max  # sorts after every live index among equal keys
  # live keys are > ordered_key(-inf) > 0
  return jnp.where(ok, ordered_key(v), jnp.uint32(0)), jnp.where(ok, i_ref[...], dead_idx)


def write_sorted(key, idx, vo_ref, io_ref, sel_ref=None, page: int = 0):
  """Sorted keys (at least as many as the output holds) -> the output's values / indices.
  sel_ref (a row of block ids, -1: none) and page: an index p is written as the slot
  sel[p // page] * page + p % page instead (-1 where that block id is -1)."""
  while key.shape[0] > vo_ref.shape[0]:  # keep the first half (the output is a power of two)
    key, idx = (jnp.split(x.reshape(1, -1), 2, axis=1)[0].reshape(-1) for x in (key, idx))
  ok = key != 0
  vo_ref[...] = jnp.where(ok, from_ordered_key(key), NEG_INF)
  if sel_ref is not None:
    blk = plgpu.load(sel_ref.at[jnp.where(ok, idx // page, 0)], mask=ok, other=-1)
    ok = ok & (blk >= 0)
    idx = blk * page + idx % page
  io_ref[...] = jnp.where(ok, idx, -1)

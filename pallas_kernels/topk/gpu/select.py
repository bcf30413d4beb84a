"""The n best of a row without a sort (the n-th largest key found bit by bit): the finish of
the top-k as a set in index order, and the mask kernel of SPIN's block selection."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.topk.gpu._common import NEG_INF, ordered_key, per_row_finish, scatter_width

__all__ = ["take_best", "take_best_keys", "select_mask", "index_order_finish"]


def take_best(x, elig, n, bits: int = 32):
  """Mask of the n best eligible entries of a float row held in registers, ties to the lower
  position (see `take_best_keys`). bits=16 is exact when every eligible value is a bfloat16
  value (the low half of its float32 key is constant), and halves the steps. (Settling 2 or 4
  bits per step, with a [2**r, L] comparison and one reduction, was slower on the H200.)"""
  key = ordered_key(x)
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
  o_ref[...] = take_best(x_ref[...], e_ref[...] != 0, n_ref[0]).astype(jnp.int32)


def _index_order_kernel(v_ref, i_ref, live_ref, vo_ref, io_ref, *, k: int):
  """One row of candidates (index order; slots past live_ref[0] not initialised): the k best,
  kept in index order. The k-th key is found by `take_best` over the buffer in registers, the
  taken entries are compacted with a running position (no sort), and the -inf / -1 tail is
  written into the slots after them (the output needs no fill pass)."""
  v = v_ref[...]
  lane = lax.broadcasted_iota(jnp.int32, v.shape, 0)
  live = (lane < live_ref[0]) & (v > NEG_INF)
  v = jnp.where(live, v, NEG_INF)
  n = jnp.minimum(jnp.sum(live.astype(jnp.int32)), k)
  take = take_best(v, live, n)
  trash = vo_ref.shape[0] - 1 - lane  # masked lanes: distinct slots (see scatter_width)
  pos = jnp.where(take, jnp.cumsum(take.astype(jnp.int32)) - 1, trash)
  plgpu.store(vo_ref.at[pos], v, mask=take)
  plgpu.store(io_ref.at[pos], i_ref[...], mask=take)
  tail = lane < k - n  # slots [n, k): disjoint from the ones written above
  pos = jnp.where(tail, n + lane, trash)
  plgpu.store(vo_ref.at[pos], jnp.full(v.shape, NEG_INF, jnp.float32), mask=tail)
  plgpu.store(io_ref.at[pos], jnp.full(v.shape, -1, jnp.int32), mask=tail)


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


def index_order_finish(cv, ci, live, k: int, cap: int, *, num_warps: int = 8,
                       interpret: bool = False):
  """cv, ci [R, >= cap] candidates in index order, live [R] (<= cap) of them per row (slots
  past live are ignored; slots before it may be -inf) -> the k best as a set in ascending
  index order: values [R, k] float32 (-inf tail) and indices [R, k] int32 (-1 tail). One
  program per row; the row's cap candidates stay in registers."""
  return per_row_finish(functools.partial(_index_order_kernel, k=k), cv, ci, live, k, cap,
                         width=scatter_width(cap, interpret), num_warps=num_warps,
                         interpret=interpret, name="jaxsparse_topk_index_order")

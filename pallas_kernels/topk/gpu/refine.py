"""A higher threshold before the compaction, for calls that gather listed groups: counting
passes over the listed groups find the highest value that k entries reach, so rows whose
neighbouring scores rise together keep about k candidates instead of up to group * k."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import is_pow2
from pallas_kernels.topk.gpu._common import (NEG_INF, PER_ROW, check_group_list, lengths_in,
                                             listed_entries)

__all__ = ["count_groups", "refine_threshold"]


def _count_groups_kernel(x_ref, len_ref, e_ref, gl_ref, ng_ref, o_ref, *, group: int,
                         list_width: int):
  """One (row, slice of the row's group list): how many of the listed groups' entries reach
  each of the row's edges e_ref [E] (o_ref [E]; programs past the listed count write 0)."""
  x, _ = listed_entries(x_ref, len_ref, gl_ref, pl.program_id(1),
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
  per = check_group_list(n, group, lanes, glist, nlisted, r, list_width, "list_width")
  kernel, len_in, len_spec = lengths_in(functools.partial(
      _count_groups_kernel, group=group, list_width=list_width), lengths, PER_ROW)
  counts = pl.pallas_call(
      kernel,
      grid=(r, list_width // per),
      in_specs=[pl.BlockSpec((None, n), lambda r, c: (r, 0))] + len_spec
      + [pl.BlockSpec((None, e), lambda r, c: (r, 0)),
         pl.BlockSpec((None, per), lambda r, c: (r, c)), PER_ROW],
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

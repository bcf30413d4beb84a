"""What the GPU top-K passes share: the value conventions of a candidate (-inf for past the
length and NaN, -0.0 as +0.0), ordered keys, the row counters' layout, and the BlockSpecs and
checks of per-row inputs (lengths, live counts, block maps) and per-row finish kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import flush_zero, is_pow2

__all__ = [
    "NEG_INF", "COUNTER_STRIDE", "PER_ROW", "row_chunk_specs", "scatter_width", "valid",
    "lengths_in", "listed_entries", "check_group_list", "ordered_key", "from_ordered_key",
    "count_in", "check_cap", "block_map_in", "ranked_row", "store_tail", "per_row_finish"
]


NEG_INF = float("-inf")


COUNTER_STRIDE = 32  # a row's counter every 128 bytes: rows' atomics go to different L2 lines


PER_ROW = pl.BlockSpec((1,), lambda r, c: (r,))  # one value per row (length, threshold)


def row_chunk_specs(chunk):
  return [pl.BlockSpec((None, chunk), lambda r, c: (r, c))]


def scatter_width(width: int, interpret: bool) -> int:
  """Width of a buffer that masked scatters write into. Compiled, masked-off lanes touch no
  memory, so `width` is enough; interpret mode runs a masked scatter as read-modify-write of
  every lane's slot, so masked lanes get their own trash slots past `width` (2 * width)."""
  return 2 * width if interpret else width


def _as_candidates(x, idx, len_ref):
  """Scores x at row positions idx -> float32, -inf past the length (len_ref None: whole
  rows; the padding past N is -inf already) and for NaN, -0.0 as +0.0."""
  x = x.astype(jnp.float32)
  ok = x == x  # NaN is never chosen
  if len_ref is not None:
    ok &= idx < len_ref[0]
  x = jnp.where(x == 0, 0.0, x)  # -0.0 == +0.0: one value, so ties go by index
  return jnp.where(ok, x, NEG_INF)


def valid(x_ref, len_ref, chunk):
  """The chunk's scores as candidates see them: -inf past the length (len_ref None: whole
  rows) and for NaN, -0.0 as +0.0."""
  c = pl.program_id(1)
  x = x_ref[...]
  idx = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  return _as_candidates(x, idx, len_ref), idx


def lengths_in(kernel, lengths, spec):
  """(kernel, [lengths], [spec]), or for lengths None (whole rows) a kernel that gets
  len_ref=None and no lengths input, so XLA makes no broadcast of a constant for it."""
  if lengths is not None:
    return kernel, [lengths], [spec]
  return (lambda x_ref, *refs: kernel(x_ref, None, *refs)), [], []


def listed_entries(x_ref, len_ref, gl_ref, j, listed, group: int):
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


def check_group_list(n: int, group: int, lanes: int, glist, nlisted, r: int, width: int,
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


def ordered_key(x):
  """float32 -> uint32 whose unsigned order is the float order (-0.0 and +0.0 equal)."""
  b = lax.bitcast_convert_type(flush_zero(x), jnp.uint32)
  neg = (b >> 31) == 1
  return jnp.where(neg, ~b, b | jnp.uint32(0x80000000))


def from_ordered_key(key):
  """Inverse of `ordered_key` (uint32 -> float32)."""
  b = jnp.where((key >> 31) == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return lax.bitcast_convert_type(b, jnp.float32)


def count_in(live, r: int):
  """live [R] int32 (<= the capacity), or a compaction's row counters [R, COUNTER_STRIDE]
  (int32 or float32; element 0 the candidate count, which may exceed the capacity) -> (the
  array to pass, its BlockSpec for a grid whose first axis is the row)."""
  if live.shape == (r,):
    return live.astype(jnp.int32), pl.BlockSpec((1,), lambda i, *_: (i,))
  if live.shape == (r, COUNTER_STRIDE):
    return live, pl.BlockSpec((None, COUNTER_STRIDE), lambda i, *_: (i, 0))
  raise ValueError(f"live {live.shape} must be ({r},) or ({r}, {COUNTER_STRIDE}) counters")


def check_cap(cap: int, k: int, buffer_width: int):
  if not is_pow2(cap) or cap < k or buffer_width < cap:
    raise ValueError(f"cap={cap} must be a power of two, >= k={k} and <= the buffer width "
                     f"{buffer_width}")


def block_map_in(block_map, r: int):
  """block_map=(sel [R, W] block ids, page) or None -> (extra inputs, their specs for a grid
  whose first axis is the row, page; 0 without a map)."""
  if block_map is None:
    return [], [], 0
  sel, page = block_map
  if sel.shape[0] != r or not page:
    raise ValueError(f"block_map ids {sel.shape} must have {r} rows and page={page} > 0")
  return [sel.astype(jnp.int32)], [pl.BlockSpec((None, sel.shape[1]),
                                                lambda i, *_: (i, 0))], page


def ranked_row(tot_ref, vo_ref, bi: int, cap: int, buckets: bool = False):
  """A rank finish program's view of its row: (over: more candidates than cap, which only a
  compaction's counters can say; live: the live count, at most cap; lane [bi] iota; trash
  [bi]: distinct slots past the output for masked lanes, see scatter_width). buckets: the
  count is the sum of counter elements 1 and 2 (`compact_atomic(..., pivot=)`)."""
  total = (tot_ref[1] + tot_ref[2] if buckets else tot_ref[0]).astype(jnp.int32)
  lane = lax.broadcasted_iota(jnp.int32, (bi,), 0)
  return total > cap, jnp.minimum(total, cap), lane, vo_ref.shape[0] - 1 - lane


def store_tail(vo_ref, io_ref, slots, live, k: int, trash):
  """Write the -inf / -1 tail into those of `slots` [L] in [live, k) (the slots no live
  candidate reaches); the other lanes aim at `trash` (distinct slots, see scatter_width)."""
  tail = (slots >= live) & (slots < k)
  dest = jnp.where(tail, slots, trash)
  plgpu.store(vo_ref.at[dest], jnp.full(slots.shape, NEG_INF, jnp.float32), mask=tail)
  plgpu.store(io_ref.at[dest], jnp.full(slots.shape, -1, jnp.int32), mask=tail)


def per_row_finish(kernel, cv, ci, live, k: int, cap: int, *, width: int, num_warps: int,
                    interpret: bool, name: str):
  """Launch a finish kernel with one program per row: it reads the row's first cap candidate
  slots (values, indices) and its live count, and writes [width] values and indices, of
  which the first k are returned."""
  r = cv.shape[0]
  check_cap(cap, k, cv.shape[1])
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

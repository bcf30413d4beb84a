"""Sequence-sharded exact top-K for the indexer's prefill with `jax.shard_map`.

Queries stay on their device; the sequence is cut into 2P chunks and device d takes chunks d
and 2P-1-d (zig-zag), so every device holds an early and a late chunk and the causal work is
balanced. Two key exchanges:
  "allgather": all-gather the key shards (as fp8 with a per-token scale, half the bytes of
               bf16, when they come quantised or fp8_keys=True), score the local queries
               against every key, exact top-K;
  "ring":      pass key shards around the ring (ppermute) for P steps; each step scores the
               local queries against the visiting shard and merges its top-K into the running
               one (`jaxsparse.merge_topk`), so no device ever holds more than two key shards.
Both give exactly the single-device top-K (same indices, ties to the lower position). For
several hosts, call `jax.distributed.initialize()` in every process and pass a mesh over all
processes' devices; each process then receives the whole result (tested on one process only).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsparse import _checks
from jaxsparse.prep import quantize_fp8
from jaxsparse.selection import keyed_topk_xla, merge_topk
from pallas_kernels._util import masked_relu

__all__ = ["sharded_prefill_topk", "balanced_order", "quantize_keys_fp8", "STRATEGIES"]

STRATEGIES = ("allgather", "ring")
NEG_INF = float("-inf")


def balanced_order(n_padded: int, shards: int) -> np.ndarray:
  """Positions in device order for zig-zag sharding: device d holds chunks d and 2P-1-d of
  the 2P equal chunks. -> [n_padded] int (a permutation)."""
  c = n_padded // (2 * shards)
  chunks = [np.arange(i * c, (i + 1) * c) for i in range(2 * shards)]
  return np.concatenate([np.concatenate([chunks[d], chunks[2 * shards - 1 - d]])
                         for d in range(shards)])


def quantize_keys_fp8(k):
  """Per-token power-of-two scales and float8_e4m3fn keys: k [N, D] -> (k8 [N, D], scale [N]
  float32), k ~ k8 * scale: `jaxsparse.prep.quantize_fp8` per key."""
  return quantize_fp8(k)


def _scores(q, w, k, qpos, kpos, block, scale=None):
  """q [T, H, D], w [T, H], k [S, D], scale [S] float32 or None -> causal scores [T, S]
  float32 (-inf where hidden): sum_h w relu(q . k) (* scale after the head sum, as
  `jaxsparse.indexer_scores` applies k_scale). float8_e4m3fn q and keys go into the dot as
  bfloat16, as `indexer_scores`' XLA path takes them (exact); other dtypes as float32.

  Computed tile by tile ([T, block] per key block), so a score's arithmetic is the same
  whichever device, shard or gather it comes from: results are bitwise those of one device.
  """
  nb = k.shape[0] // block
  cd = jnp.bfloat16 if q.dtype == jnp.float8_e4m3fn else jnp.float32
  kb = k.astype(cd).reshape(nb, block, k.shape[1])
  sb = None if scale is None else scale.reshape(nb, block)

  def tile(xs):
    kk, ss = xs
    s = jnp.einsum("thd,sd->ths", q.astype(cd), kk, preferred_element_type=jnp.float32)
    wf = w.astype(jnp.float32)
    z = jnp.einsum("ths,th->ts", masked_relu(s, wf[..., None]), wf)
    return z if ss is None else z * ss[None, :]

  z = jnp.moveaxis(lax.map(tile, (kb, sb)), 0, 1).reshape(q.shape[0], nb * block)
  return jnp.where(kpos[None, :] <= qpos[:, None], z, NEG_INF)


def _local_topk(z, kpos, topk):
  """Top-k of scores z [T, S] with keys at positions kpos [S] under the README's input rules:
  ties to the lower position, NaN and -inf never chosen (-inf / -1 tail)."""
  return keyed_topk_xla(z, jnp.broadcast_to(kpos[None, :], z.shape), topk)


def _chunked(fn, q, w, qpos, block):
  """Apply fn(q, w, qpos) -> (v [block, k], i [block, k]) over query blocks (bounded memory;
  T is a multiple of block)."""
  t = q.shape[0]
  nc = t // block
  qq = q.reshape(nc, block, *q.shape[1:])
  ww = w.reshape(nc, block, w.shape[1])
  pp = qpos.reshape(nc, block)
  v, i = lax.map(lambda a: fn(*a), (qq, ww, pp))
  return v.reshape(t, -1), i.reshape(t, -1)


@_checks.array_args("q", "k", "w", optional=("k_scale",))
def sharded_prefill_topk(q, k, w, topk: int, *, mesh: Mesh | None = None, axis: str = "x",
                         strategy: str = "allgather", fp8_keys: bool = False, k_scale=None,
                         block: int = 64, implementation=None):
  """Every query's exact indexer top-K over a causal sequence, sharded over `mesh[axis]`.

  q [N, H, D], k [N, D], w [N, H] (query n sits at position n and sees keys 0..n): bfloat16
  or float32, or DeepSeek-V3.2's fp8 format (`jaxsparse.prep.prepare_indexer_inputs`):
  float8_e4m3fn k with k_scale [N] float32 (one scale a key; required with fp8 keys, allowed
  with others), q float8_e4m3fn (its scale folded into w, float32) or bfloat16 / float32.
  With k_scale a score is `jaxsparse.indexer_scores(q, k, w, k_scale=)`'s: q and k upcast
  exactly (fp8 to bfloat16), float32 sums, times k_scale after the head sum; keys and scales
  travel between devices as given (fp8: one byte an element), and the indices equal the
  single-device `jaxsparse.prefill_topk(q, k, w, topk, k_scale=k_scale,
  query_positions=arange(N))`'s. mesh: a 1-D device mesh (default: every device); strategy:
  "allgather" or "ring". fp8_keys: quantise bfloat16 / float32 keys here (`quantize_keys_fp8`,
  per-token power-of-two scales) and exchange and score them as fp8 with those scales, the way
  DSA serving stacks quantise before the gather (the result then equals the single-device
  top-K of the same fp8 keys); not with keys already quantised or a k_scale. block: queries
  and keys per scoring tile (every device scores the same
  tiles, so the result does not depend on the device count). implementation: None (the
  kernels on GPU/TPU, XLA on a CPU), "xla" (tile-by-tile einsums, float32 sums) or "pallas": each
  device runs `jaxsparse.prefill_topk`'s kernel path (chunked scoring and top-K kernels) on its
  queries: in the all-gather, each of its two chunks against the keys (back in position order)
  up to the chunk's end, in causal segments (`causal_prefill_topk`); in the ring, against each
  contiguous run of the visiting shard's keys, merged. Per-element kernel arithmetic does not
  depend on the tiling, so the result is one device's kernel result. Returns (values
  [N, topk] float32, indices [N, topk] int32, -1 / -inf where fewer keys are visible). N need
  not divide evenly: each of the 2P chunks is padded to a multiple of block and masked. One
  process: jax arrays replicated on the mesh's devices; several processes: numpy arrays in
  every process.
  """
  from jaxsparse import backend
  _checks.check_implementation(implementation)
  kernels = backend.resolve(implementation) == "pallas"
  _checks.check_bool("fp8_keys", fp8_keys)
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
  for _name, _x in (("q", q), ("k", k), ("w", w)):
    _checks.check_real_dtype(_name, _x)
  _checks.check_int("topk", topk, 1)
  topk = int(topk)
  q, k, w = jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)
  _checks.check_kw_order(q, k, w)
  n = k.shape[0]
  if q.ndim != 3 or q.shape[0] != n or w.shape != q.shape[:2] or k.shape != (n, q.shape[2]):
    raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)} must be "
                     f"[N, H, D], [N, D], [N, H]")
  if topk < 1:
    raise ValueError(f"topk={topk} must be positive")
  if fp8_keys and (k_scale is not None or k.dtype == jnp.float8_e4m3fn):
    raise ValueError("fp8_keys=True quantises bfloat16 / float32 keys here; keys already "
                     "quantised (float8_e4m3fn with k_scale) take fp8_keys=False")
  if k_scale is not None:
    _checks.check_dtype("k_scale", k_scale, (jnp.float32,))
    k_scale = jnp.asarray(k_scale)
  _checks.check_key_scale(k, k_scale, (n,))
  _checks.check_fp8_pairing(q, k, "k")
  if n == 0:
    raise ValueError("k is empty: the sequence needs at least one token")
  mesh = jax.make_mesh((len(jax.devices()),), (axis,)) if mesh is None else mesh
  _checks.check_instance("mesh", mesh, Mesh)
  if axis not in mesh.axis_names:
    raise ValueError(f"axis={axis!r} is not an axis of the mesh {mesh.axis_names}")
  _checks.check_int("block", block, 1)
  shards = mesh.shape[axis]
  per = -(-n // (2 * shards * block)) * 2 * block  # tokens per device: two chunks of blocks
  npad = per * shards
  order = balanced_order(npad, shards)
  pos = jnp.asarray(order, jnp.int32)
  valid = pos < n
  qs, ws, ks = (_zigzag(a, npad, shards) for a in (q, w, k))  # zero rows pad the last chunk
  # padded keys sit past every query: never visible; padded queries are dropped below
  kpos = jnp.where(valid, pos, jnp.iinfo(jnp.int32).max)
  scale = None if k_scale is None else _zigzag(k_scale, npad, shards)  # padded keys: 0
  if fp8_keys:
    ks, scale = quantize_keys_fp8(ks)
  spec = P(axis)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
  args = [put(qs), put(ws), put(ks), put(pos), put(kpos)]
  if scale is not None:
    args.append(put(scale))
  v, i = _sharded_fn(mesh, axis, topk, strategy, scale is not None, block, kernels,
                     len(args))(*args)
  if jax.process_count() == 1:  # back to position order on the devices (no host copy)
    return _reassemble(mesh, n, shards)(v, i)
  from jax.experimental import multihost_utils  # every process gets the whole result
  v, i = multihost_utils.process_allgather((v, i), tiled=True)
  v, i = np.asarray(v), np.asarray(i)
  out_v = np.full((n, topk), -np.inf, np.float32)
  out_i = np.full((n, topk), -1, np.int32)
  keep = order < n
  out_v[order[keep]], out_i[order[keep]] = v[keep], i[keep]
  return out_v, out_i


@functools.lru_cache(maxsize=64)
def _sharded_fn(mesh, axis, topk, strategy, scaled, block, kernels, nargs):
  """The jitted shard_map of `_shard_body` for one mesh and setting (built once, so repeated
  calls neither retrace nor recompile; scaled: per-key scales travel with the keys)."""
  spec = P(axis)
  fn = functools.partial(_shard_body, topk=topk, axis=axis, shards=mesh.shape[axis],
                         strategy=strategy, scaled=scaled, block=block, kernels=kernels)
  # pallas_call outputs carry no varying-axis annotation: the kernel path skips that check
  body = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * nargs,
                       out_specs=(spec, spec), **({"check_vma": False} if kernels else {}))
  return jax.jit(body)


def _zigzag(x, npad: int, shards: int):
  """x [n, ...] -> [npad, ...] rows in `balanced_order`, zero rows after the last: static
  slices of the 2P chunks (device d's rows are chunk d then chunk 2P-1-d), no gather, so the
  copy costs one pass over x and one device's order is x itself."""
  if npad > x.shape[0]:
    x = jnp.pad(x, ((0, npad - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
  if shards == 1:
    return x
  c = x.reshape(2 * shards, npad // (2 * shards), *x.shape[1:])
  return jnp.stack([c[:shards], c[shards:][::-1]], axis=1).reshape(x.shape)


def _unzigzag(x, n: int, shards: int):
  """The inverse of `_zigzag`: rows [npad, ...] in device order -> [n, ...] in position
  order."""
  if shards > 1:
    c = x.reshape(shards, 2, x.shape[0] // (2 * shards), *x.shape[1:])
    x = jnp.concatenate([c[:, 0], c[::-1, 1]]).reshape(x.shape)
  return x[:n]


@functools.lru_cache(maxsize=16)
def _reassemble(mesh, n: int, shards: int):
  """(v, i) in device order -> (v, i) [n, K] in position order, replicated on the mesh."""
  rep = NamedSharding(mesh, P())
  def whole(x):  # replicate, then cut the padding: slicing a sharded dim needs N % P == 0
    x = jax.sharding.reshard(_unzigzag(x, x.shape[0], shards), rep)
    return x[:n]

  return jax.jit(lambda v, i: (whole(v), whole(i)), out_shardings=(rep, rep))


def _varying(x, axis):
  """Mark a per-device constant as varying over `axis` (a scan carry must match the body)."""
  if hasattr(lax, "pcast"):
    return lax.pcast(x, (axis,), to="varying")
  if hasattr(lax, "pvary"):
    return lax.pvary(x, (axis,))
  return x


def _kernel_topk(q, w, k, scale, qpos, start, topk):
  """The kernel path's top-K of local queries against keys at positions start, start + 1, ...
  (indices as positions)."""
  from jaxsparse.selection import prefill_topk
  v, i = prefill_topk(q, k, w, topk, k_scale=scale, query_positions=qpos - start,
                      implementation="pallas")
  return v, jnp.where(i >= 0, i + start, -1)


CAUSAL_SEGMENTS = 8  # query segments over the whole sequence in the kernels' all-gather


def _causal_chunks(q, w, kall, sall, *, device, shards, topk):
  """Device `device`'s top-K in the kernels' all-gather: its two chunks of c queries sit at
  positions device * c and (2P - 1 - device) * c (static per device, so `lax.switch` picks the
  branch); each goes through `causal_prefill_topk` against the keys up to its end, in
  CAUSAL_SEGMENTS / 2P segments, so no chunk scores keys after it (key counts rounded up to
  eighths of the sequence: at most 8 shapes to compile whatever P)."""
  from jaxsparse.selection import causal_prefill_topk
  c = q.shape[0] // 2
  segments = max(1, CAUSAL_SEGMENTS // (2 * shards))
  parts = [causal_prefill_topk(q[r * c:(r + 1) * c], kall, w[r * c:(r + 1) * c], topk,
                               start=chunk * c, k_scale=sall, segments=segments,
                               key_align=max(1, kall.shape[0] // 8), implementation="pallas")
           for r, chunk in ((0, device), (1, 2 * shards - 1 - device))]
  return (jnp.concatenate([parts[0][0], parts[1][0]]),
          jnp.concatenate([parts[0][1], parts[1][1]]))


def _ring(k, pos, sc, visit, *, topk, axis, shards, scaled, rows):
  """P ring steps: `visit(keys, positions, scales)` gives the top-K pieces [(v, i), ...] of the
  local queries against the visiting key shard (and its scales when `scaled`); they are
  merged into the running top-K and the shard moves on to the next device."""
  perm = [(d, (d + 1) % shards) for d in range(shards)]

  def step(carry, _):
    v, i, kk, pp, ss = carry
    for nv, ni in visit(kk, pp, ss if scaled else None):
      v, i = _merge_rows(v, i, nv, ni, topk)
    kk, pp = lax.ppermute(kk, axis, perm), lax.ppermute(pp, axis, perm)
    if scaled:
      ss = lax.ppermute(ss, axis, perm)
    return (v, i, kk, pp, ss), None

  init = (_varying(jnp.full((rows, topk), NEG_INF, jnp.float32), axis),
          _varying(jnp.full((rows, topk), -1, jnp.int32), axis), k, pos,
          sc if scaled else jnp.zeros_like(pos, jnp.float32))
  (v, i, *_), _ = lax.scan(step, init, None, length=shards)
  return v, i


MERGE_ROWS = 4096  # rows merged at a time: a merge sorts [rows, 2K] (bounded memory)


def _merge_rows(v, i, nv, ni, topk):
  """`merge_topk` of [R, K] running and new results, MERGE_ROWS rows at a time, so a long
  sequence's merge never sorts all R rows at once (at 512K rows and K 2,048 that sort's
  buffers exceed an 80 GB GPU)."""
  r = v.shape[0]
  if r <= MERGE_ROWS or r % MERGE_ROWS:
    return merge_topk(v, i, nv, ni, topk)
  blk = lambda a: a.reshape(r // MERGE_ROWS, MERGE_ROWS, a.shape[1])  # noqa: E731
  mv, mi = lax.map(lambda a: merge_topk(*a, topk), (blk(v), blk(i), blk(nv), blk(ni)))
  return mv.reshape(r, topk), mi.reshape(r, topk)


def _shard_body(q, w, k, qpos, kpos, *rest, topk, axis, shards, strategy, scaled, block,
                kernels=False):
  sc = rest[0] if scaled else None
  ring = functools.partial(_ring, topk=topk, axis=axis, shards=shards, scaled=scaled,
                           rows=q.shape[0])
  if kernels and strategy == "allgather":
    back = lambda a: _unzigzag(a, a.shape[0], shards)  # noqa: E731  (position order)
    kall = back(lax.all_gather(k, axis, tiled=True))
    sall = back(lax.all_gather(sc, axis, tiled=True)) if scaled else None
    branches = [functools.partial(_causal_chunks, device=d, shards=shards, topk=topk)
                for d in range(shards)]
    if shards == 1:
      return branches[0](q, w, kall, sall)
    return lax.switch(lax.axis_index(axis), branches, q, w, kall, sall)
  if kernels:  # ring: the visiting shard is two contiguous runs of (raw) positions
    c = k.shape[0] // 2
    return ring(k, qpos, sc, lambda kk, pp, ss: [
        _kernel_topk(q, w, kk[r * c:(r + 1) * c], None if ss is None else ss[r * c:(r + 1) * c],
                     qpos, pp[r * c], topk) for r in (0, 1)])
  if strategy == "allgather":
    kall = lax.all_gather(k, axis, tiled=True)
    pall = lax.all_gather(kpos, axis, tiled=True)
    sall = lax.all_gather(sc, axis, tiled=True) if scaled else None
    return _chunked(lambda a, b, c: _local_topk(_scores(a, b, kall, c, pall, block, sall),
                                                pall, topk), q, w, qpos, block)
  return ring(k, kpos, sc, lambda kk, pp, ss: [_chunked(
      lambda a, b, c: _local_topk(_scores(a, b, kk, c, pp, block, ss), pp, topk),
      q, w, qpos, block)])

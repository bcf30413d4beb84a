"""The DSA lightning indexer: plain-JAX reference (the contract) and dispatch to Pallas kernels."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _checks
from jaxsparse import backend
from pallas_kernels import _util as _kutil
from pallas_kernels._util import masked_relu

__all__ = [
    "PAGE_SIZE", "indexer_scores_xla", "paged_indexer_scores_xla", "indexer_scores",
    "sanitize_paged", "paged_indexer_scores", "pack_dense_as_paged", "row_lengths"
]


PAGE_SIZE = 64  # slots per paged-cache block, as in DeepGEMM / vLLM's DSA indexer cache


# --------------------------------------------------------------------------------------
# References (plain jnp). They materialise [T, H, N]; they are the definition, not the fast path.
# --------------------------------------------------------------------------------------


@_checks.array_args("lengths")
def row_lengths(lengths, num_rows: int):
  """Visible slots of each verifier row: row r of R sees `lengths - (R - 1 - r)` slots, at
  least 0. lengths [B] int (any integer dtype; clamped, never wrapped) -> [B, R] int32."""
  _checks.check_int("num_rows", num_rows, 1)
  if not hasattr(lengths, "dtype"):
    lengths = np.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths.dtype={lengths.dtype} must be an integer type")
  _checks.check_ndim("lengths", lengths, (1,), "[B]")
  return _kutil.row_lengths(_checks.clip_lengths(lengths, np.iinfo(np.int32).max), num_rows)


def indexer_scores_xla(q, k, w, k_scale=None, query_positions=None):
  """Plain-jnp DSA indexer; see `indexer_scores` for shapes."""
  cd = _checks.compute_dtype(q.dtype)
  s = jnp.einsum("thd,nd->thn", q.astype(cd), k.astype(cd), preferred_element_type=jnp.float32)
  wf = w.astype(jnp.float32)
  z = jnp.einsum("thn,th->tn", masked_relu(s, wf[:, :, None]), wf)
  if k_scale is not None:
    z = z * k_scale[None, :]
  if query_positions is not None:
    visible = jnp.arange(k.shape[0])[None, :] <= _checks.clip_positions(query_positions,
                                                                         k.shape[0])[:, None]
    z = jnp.where(visible, z, -jnp.inf)
  return z


def paged_indexer_scores_xla(q, k_cache, block_table, lengths, w, k_scale=None):
  """Plain-jnp paged decode scoring; `q [B, R, H, D]`, `w [B, R, H]` -> `[B, R, max_slots]`."""
  num_blocks, page, d = k_cache.shape
  bsz, max_blocks = block_table.shape
  pages = jnp.clip(block_table, 0, num_blocks - 1)
  keys = k_cache[pages].reshape(bsz, max_blocks * page, d)  # [B, S, D]
  cd = _checks.compute_dtype(q.dtype)
  s = jnp.einsum("brhd,bsd->brhs", q.astype(cd), keys.astype(cd),
                 preferred_element_type=jnp.float32)
  wf = w.astype(jnp.float32)
  z = jnp.einsum("brhs,brh->brs", masked_relu(s, wf[..., None]), wf)
  if k_scale is not None:
    z = z * k_scale[pages].reshape(bsz, 1, max_blocks * page)
  lens = row_lengths(lengths, q.shape[1])  # [B, R]
  slot = jnp.arange(max_blocks * page)
  return jnp.where(slot[None, None, :] < lens[:, :, None], z, -jnp.inf)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def _validate_dense(q, k, w, k_scale, query_positions):
  _checks.check_ndim("q", q, (3,), "[T, H, D]")
  _checks.check_ndim("k", k, (2,), "[N, D]")
  _checks.check_ndim("w", w, (2,), "[T, H]")
  _checks.check_dtype("q", q, _checks.QUERY_DTYPES)
  _checks.check_dtype("k", k, _checks.KEY_DTYPES)
  _checks.check_dtype("w", w, (jnp.float32, jnp.bfloat16))
  for name, x in (("q", q), ("k", k), ("w", w)):
    _checks.check_nonempty(name, x)
  t, h, d = q.shape
  if k.shape[1] != d:
    raise ValueError(f"k.shape[1]={k.shape[1]} must equal the head dim q.shape[2]={d}")
  if w.shape != (t, h):
    raise ValueError(f"w.shape={tuple(w.shape)} must be (T, H)=({t}, {h}) to match q")
  _checks.check_key_scale(k, k_scale, (k.shape[0],))
  _checks.check_fp8_pairing(q, k, "k")
  if query_positions is not None:
    if query_positions.shape != (t,):
      raise ValueError(f"query_positions.shape={tuple(query_positions.shape)} must be ({t},)")
    _checks.check_positions("query_positions", query_positions)


@_checks.array_args("q", "k", "w", optional=("k_scale", "query_positions"))
def indexer_scores(q, k, w, *, k_scale=None, query_positions=None, implementation=None,
                   config=None):
  """DSA lightning-indexer scores `z[t, i] = sum_h w[t, h] * relu(q[t, h] . k[i]) (* k_scale[i])`.

  Args:
    q: [T, H, D] bfloat16, float32 or float8_e4m3fn indexer queries. fp8 queries (DeepSeek-V3.2
      quantises them per token and head, folding the scale into w) need fp8 keys and run an
      fp8 x fp8 dot (fp8 tensor cores on GPU; exact bfloat16 upcast on XLA and TPU).
    k: [N, D] bfloat16, float32 or float8_e4m3fn keys (one key per token, shared by all heads).
      Keys are converted to q's dtype and the dot accumulates in float32.
    w: [T, H] float32 head weights.
    k_scale: optional [N] float32 per-key scale (required for float8 keys); applied after the
      head sum, which is exact because it is positive (DeepSeek-V3.2 uses power-of-two scales).
    query_positions: optional [T] int; key i is visible to query t iff i <= query_positions[t].
      Invisible entries are -inf. Tiles fully above the causal diagonal are skipped by kernels.
    implementation: None (best available), "xla" (plain-JAX reference) or "pallas" (GPU/TPU
      kernel; interpret mode on a CPU-only machine).
    config: optional kernel config (`pallas_kernels.indexer_prefill.PrefillConfig`).

  Returns:
    [T, N] float32 scores. NaN / Inf inputs, zero-weight heads and traced positions follow
    README "Input rules".
  """
  _checks.check_implementation(implementation)
  _validate_dense(q, k, w, k_scale, query_positions)
  impl = backend.resolve(implementation)
  if impl == "xla":
    return _indexer_scores_xla_jit(q, k, w, k_scale, query_positions)
  from pallas_kernels import indexer_prefill
  return indexer_prefill.prefill_scores(q, k, w, k_scale=k_scale, query_positions=query_positions,
                                        config=config, platform=backend.kernel_platform())


_indexer_scores_xla_jit = jax.jit(indexer_scores_xla)


def _validate_paged(q, k_cache, block_table, lengths, w, k_scale):
  _checks.check_ndim("q", q, (3, 4), "[B, H, D] or [B, R, H, D]")
  _checks.check_ndim("k_cache", k_cache, (3,), f"[num_blocks, {PAGE_SIZE}, D]")
  _checks.check_ndim("block_table", block_table, (2,), "[B, max_blocks]")
  _checks.check_ndim("lengths", lengths, (1,), "[B]")
  _checks.check_dtype("q", q, _checks.QUERY_DTYPES)
  _checks.check_dtype("k_cache", k_cache, _checks.KEY_DTYPES)
  _checks.check_dtype("w", w, (jnp.float32, jnp.bfloat16))
  for name, x in (("q", q), ("k_cache", k_cache), ("block_table", block_table), ("w", w)):
    _checks.check_nonempty(name, x)
  if not jnp.issubdtype(block_table.dtype, jnp.integer):
    raise ValueError(f"block_table.dtype={block_table.dtype} must be an integer type")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths.dtype={lengths.dtype} must be an integer type")
  num_blocks, page, d = k_cache.shape
  if page != PAGE_SIZE:
    raise ValueError(f"k_cache.shape[1]={page} must be the page size {PAGE_SIZE}")
  bsz = q.shape[0]
  if q.shape[-1] != d:
    raise ValueError(f"q.shape[-1]={q.shape[-1]} must equal k_cache.shape[2]={d}")
  expected_w = q.shape[:-1]
  if tuple(w.shape) != tuple(expected_w):
    raise ValueError(f"w.shape={tuple(w.shape)} must be {tuple(expected_w)} to match q")
  if block_table.shape[0] != bsz:
    raise ValueError(f"block_table.shape[0]={block_table.shape[0]} must equal the batch {bsz}")
  if lengths.shape[0] != bsz:
    raise ValueError(f"lengths.shape={tuple(lengths.shape)} must be ({bsz},)")
  _checks.check_key_scale(k_cache, k_scale, (num_blocks, page))
  _checks.check_fp8_pairing(q, k_cache, "k_cache")
  capacity = block_table.shape[1] * page
  lens = _checks.concrete_values(lengths)
  if lens is not None and lens.dtype.kind in "iu" and lens.dtype != np.uint64:
    lens = lens.astype(np.int64)  # widened: int8 65 + 63 must not wrap in the page count
  if lens is not None:
    if (lens < 0).any() or (lens > capacity).any():
      raise ValueError(f"lengths must lie in [0, {capacity}] (block_table.shape[1] * {page}); "
                       f"got min={lens.min()} max={lens.max()}")
    table = _checks.concrete_values(block_table)
    if table is not None:
      used = (lens[:, None] + page - 1) // page > np.arange(table.shape[1])[None, :]
      bad = used & ((table < 0) | (table >= num_blocks))
      if bad.any():
        b, j = [int(v[0]) for v in bad.nonzero()]
        raise ValueError(f"block_table[{b}, {j}]={int(table[b, j])} points past the cache "
                         f"(num_blocks={num_blocks})")


def sanitize_paged(block_table, lengths, num_blocks: int, page: int = PAGE_SIZE, *,
                   checked: bool = False):
  """The rule for paged inputs whose values cannot be checked (traced under jit or vmap).

  block_table [B, max_blocks] int, lengths [B] int -> lengths [B] int32 to use instead:
  a length is clamped to [0, max_blocks * page]; a request whose block table holds a page id
  outside [0, num_blocks) within its (clamped) length is void: its length becomes 0, so every
  slot scores -inf and its top-K is all -1. (Reading a clipped page instead would return
  plausible but wrong scores.) The cost is one pass over the [B, max_blocks] table.

  checked=True also adds `jax.experimental.checkify` checks that name the argument: run the
  jitted function under `checkify.checkify` and call `err.throw()` to raise them. Concrete
  (not traced) inputs are always checked eagerly and raise ValueError.
  """
  from jax.experimental import checkify
  _checks.check_bool("checked", checked)
  max_blocks = block_table.shape[1]
  cap = max_blocks * page
  lengths = _checks.widen_int(jnp.asarray(lengths))
  # clamped in the lengths' own dtype before the int32 cast: a uint32 / int64 length past 2^31
  # clamps to the capacity instead of wrapping
  if jnp.issubdtype(lengths.dtype, jnp.unsignedinteger):
    in_range = lengths <= cap
    clamped = jnp.minimum(lengths, jnp.asarray(cap, lengths.dtype)).astype(jnp.int32)
  else:
    in_range = (lengths >= 0) & (lengths <= cap)
    clamped = jnp.clip(lengths, 0, cap).astype(jnp.int32)
  lens = lengths.astype(jnp.int32)  # for the check's message only
  used = jnp.arange(max_blocks, dtype=jnp.int32)[None, :] * page < clamped[:, None]
  bad = used & ((block_table < 0) | (block_table >= num_blocks))
  if checked:
    checkify.check(jnp.all(in_range),
                   "lengths must lie in [0, {cap}] (block_table.shape[1] * page); got min="
                   "{lo} max={hi}", cap=jnp.int32(cap), lo=lens.min(), hi=lens.max())
    checkify.check(~jnp.any(bad), "block_table holds a page id outside [0, {n}) within a "
                   "request's length (request {b})", n=jnp.int32(num_blocks),
                   b=jnp.argmax(bad.any(1)).astype(jnp.int32))
  return jnp.where(bad.any(1), 0, clamped)


@_checks.array_args("q", "k_cache", "block_table", "lengths", "w", optional=("k_scale",))
def paged_indexer_scores(q, k_cache, block_table, lengths, w, *, k_scale=None,
                         implementation=None, config=None, checked=False):
  """Decode-time indexer scores over a paged key cache.

  Args:
    q: [B, H, D] or [B, R, H, D] bfloat16/float32 queries; R verifier rows for speculative
      decoding (row r sits at position lengths[b] - R + r and sees the slots before it).
    k_cache: [num_blocks, 64, D] bfloat16, float32 or float8_e4m3fn keys.
    block_table: [B, max_blocks] int32 page ids; entries past a request's length are ignored.
    lengths: [B] int32 visible slots for the last row (at most max_blocks * 64).
    w: [B, H] or [B, R, H] float32 head weights.
    k_scale: [num_blocks, 64] float32 per-slot scales (required for float8 keys).
    implementation: None, "xla" or "pallas" (see `indexer_scores`).
    config: optional `pallas_kernels.indexer_decode.DecodeConfig`.
    checked: add checkify checks of the ranges under jit (`sanitize_paged`).

  Returns:
    [B, max_slots] (or [B, R, max_slots]) float32, -inf past each row's length;
    max_slots = max_blocks * 64.

  Out-of-range values: concrete inputs raise ValueError; traced ones follow `sanitize_paged`
  (lengths clamp to the table's capacity; a request reading a page outside the cache scores
  -inf everywhere).

  A DeepGEMM/vLLM packed fp8 cache `[num_blocks, 64, 1, D + 4]` uint8 (64 x D fp8 values, then 64
  float32 scales) maps onto this with `jaxsparse.prep.unpack_fp8_paged_cache`.
  """
  _checks.check_implementation(implementation)
  _validate_paged(q, k_cache, block_table, lengths, w, k_scale)
  lengths = sanitize_paged(block_table, lengths, k_cache.shape[0], k_cache.shape[1],
                           checked=checked)
  single = q.ndim == 3
  if single:
    q, w = q[:, None], w[:, None]
  impl = backend.resolve(implementation)
  if impl == "xla":
    z = _paged_xla_jit(q, k_cache, block_table.astype(jnp.int32), lengths.astype(jnp.int32), w,
                       k_scale)
  else:
    from pallas_kernels import indexer_decode
    z = indexer_decode.decode_scores(q, k_cache, block_table.astype(jnp.int32),
                                     lengths.astype(jnp.int32), w, k_scale=k_scale, config=config,
                                     platform=backend.kernel_platform())
  return z[:, 0] if single else z


_paged_xla_jit = jax.jit(paged_indexer_scores_xla)


@functools.partial(jax.jit, static_argnames=("page",))
def pack_dense_as_paged(k, *, page: int = PAGE_SIZE):
  """Helper: lay a dense [N, D] key array out as a one-request paged cache and block table."""
  n, d = k.shape
  nb = -(-n // page)
  kp = jnp.pad(k, ((0, nb * page - n), (0, 0))).reshape(nb, page, d)
  return kp, jnp.arange(nb, dtype=jnp.int32)[None, :]

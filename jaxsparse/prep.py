"""Indexer input preparation as DeepSeek-V3.2 does it: RoPE, Hadamard rotation, fp8 keys, weights."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _checks

__all__ = [
    "FP8_MAX", "apply_rope", "hadamard_matrix", "hadamard_rotate", "quantize_fp8",
    "indexer_weights", "prepare_indexer_inputs", "unpack_fp8_paged_cache", "pack_fp8_paged_cache"
]


FP8_MAX = 448.0  # largest finite float8_e4m3fn


@_checks.array_args("x", "positions")
def apply_rope(x, positions, *, rope_dims: int = 64, base: float = 10000.0,
               interleaved: bool = False):
  """Rotary embedding on the first `rope_dims` dims of the last axis (the rest pass through).

  Args:
    x: [T, D] or [T, H, D] array (token axis first); the rotated dims are x[..., :rope_dims].
    positions: [T] int positions.
    rope_dims: even number of leading dims to rotate (DeepSeek-V3.2's indexer: 64 of 128).
    base: RoPE frequency base.
    interleaved: rotate adjacent pairs (x[0::2], x[1::2]) instead of the two halves.
  Returns: array like x.
  """
  _checks.check_real_dtype("x", x)
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(f"positions.dtype={positions.dtype} must be an integer type")
  _checks.check_int("rope_dims", rope_dims)
  _checks.check_real("base", base)
  _checks.check_bool("interleaved", interleaved)
  if base <= 0:
    raise ValueError(f"base={base!r} must be > 0")
  d = x.shape[-1]
  if rope_dims % 2 or not 0 < rope_dims <= d:
    raise ValueError(f"{rope_dims=} must be even and in (0, {d}]")
  positions = jnp.asarray(positions)
  if positions.ndim != 1:
    raise ValueError(f"positions must be [T]; got shape {tuple(positions.shape)}")
  half = rope_dims // 2
  inv = 1.0 / (base ** (np.arange(half, dtype=np.float64) * 2.0 / rope_dims))
  ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv, jnp.float32)[None, :]  # [T, half]
  if x.ndim not in (2, 3) or x.shape[0] != positions.shape[0]:
    raise ValueError(f"x.shape={tuple(x.shape)} must be [T, D] or [T, H, D] with "
                     f"T={positions.shape[0]} matching positions")
  if x.ndim == 3:
    ang = ang[:, None, :]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  xr, rest = x[..., :rope_dims].astype(jnp.float32), x[..., rope_dims:]
  if interleaved:
    a, b = xr[..., 0::2], xr[..., 1::2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    rot = jnp.stack([ra, rb], axis=-1).reshape(xr.shape)
  else:
    a, b = xr[..., :half], xr[..., half:]
    rot = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
  return jnp.concatenate([rot.astype(x.dtype), rest], axis=-1)


def hadamard_matrix(d: int) -> np.ndarray:
  """Sylvester Hadamard matrix [d, d] with entries +-1 (d a power of two)."""
  _checks.check_int("d", d)
  if d < 1 or d & (d - 1):
    raise ValueError(f"{d=} must be a power of two for the Hadamard rotation")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  return h


@_checks.array_args("x")
def hadamard_rotate(x):
  """Orthonormal Hadamard rotation of the last axis, x @ H / sqrt(D); q.k is preserved.

  DeepSeek-V3.2 rotates both indexer q and k before fp8 quantisation, which spreads outliers.
  x: [..., D] with D a power of two. Returns the same shape, in x's dtype when it is a float
  type, else float32 (an integer rotated is not an integer); computed in float32.
  """
  _checks.check_real_dtype("x", x)
  x = jnp.asarray(x)
  d = x.shape[-1]
  h = jnp.asarray(hadamard_matrix(d) / math.sqrt(d))
  out = jnp.float32 if not jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
  return jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST).astype(out)


SCALE_FLOOR = 2.0 ** -126  # quantize_fp8's smallest scale: the smallest normal float32


@_checks.array_args("x")
def quantize_fp8(x):
  """Per-row float8_e4m3fn quantisation with a power-of-two scale (DeepSeek-V3.2 style).

  x: [..., D] float. Returns (x_fp8 [..., D] float8_e4m3fn, scale [...] float32) with
  x ~= x_fp8 * scale and scale = max(2**ceil(log2(amax / 448)), 2**-126), amax the row's
  largest finite magnitude (NaN and +-inf entries become NaN). All-zero rows get scale 1. The floor (the smallest normal float32) keeps a tiny but non-zero row finite: its
  scale never underflows to 0 (README "Input rules": subnormals count as zero).
  """
  _checks.check_real_dtype("x", x)
  x = jnp.asarray(x)
  if x.ndim == 0 or x.shape[-1] == 0:
    raise ValueError(f"x.shape={tuple(x.shape)} needs a non-empty last axis (the row to scale)")
  xf = x.astype(jnp.float32)
  # the row's largest finite magnitude sets the scale; NaN / +-inf entries quantise to NaN
  # (float8_e4m3fn has no inf) and leave the finite ones exact
  amax = jnp.max(jnp.where(jnp.isfinite(xf), jnp.abs(xf), 0.0), axis=-1)
  safe = jnp.where(amax > 0, amax, FP8_MAX)
  scale = pow2_ceil(safe / FP8_MAX)
  q = (xf / scale[..., None]).astype(jnp.float8_e4m3fn)
  return q, scale


def pow2_ceil(y):
  """2**ceil(log2(y)) as an exact float32 power of two, floored at SCALE_FLOOR (2**-126).

  y: float32 array, > 0. Built from the exponent bits (frexp), not exp2 / log2, whose float
  results are off by an ulp for large or small y on some backends. inf and NaN pass through.
  """
  y = jnp.asarray(y, jnp.float32)
  mant, exp = jnp.frexp(y)  # y = mant * 2**exp, mant in [0.5, 1)
  e = jnp.clip(jnp.where(mant == 0.5, exp - 1, exp), -126, 127)
  p = jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)
  # y below the floor (or flushed to 0 by the hardware) takes the floor
  return jnp.where(jnp.isfinite(y), jnp.where(y < SCALE_FLOOR, SCALE_FLOOR, p), y)


@_checks.array_args("proj", optional=("q_scale",))
def indexer_weights(proj, *, head_dim: int, q_scale=None):
  """Head weights as DeepSeek-V3.2 computes them: proj * H^-0.5 * D^-0.5 (* q_scale).

  proj: [T, H] output of the weights projection; q_scale: optional [T, H] fp8 query scale.
  Returns [T, H] float32.
  """
  _checks.check_real_dtype("proj", proj)
  if q_scale is not None:
    _checks.check_real_dtype("q_scale", q_scale)
  _checks.check_int("head_dim", head_dim, 1)
  h = proj.shape[-1]
  w = proj.astype(jnp.float32) * (h ** -0.5) * (head_dim ** -0.5)
  if q_scale is not None:
    w = w * q_scale.astype(jnp.float32)
  return w


@_checks.array_args("q", "k", "proj", "positions_q", "positions_k")
def prepare_indexer_inputs(q, k, proj, positions_q, positions_k, *, rope_dims: int | None = 64,
                           rope_base: float = 10000.0, interleaved: bool = False,
                           hadamard: bool = True, fp8_keys: bool = True,
                           fp8_queries: bool = False):
  """Full V3.2 preparation, each step optional.

  q: [T, H, D]; k: [N, D]; proj: [T, H]; positions_q: [T]; positions_k: [N].
  Returns (q [T, H, D] bfloat16 (float8_e4m3fn if fp8_queries, its per-(token, head) scale
  folded into w), k [N, D] (float8_e4m3fn if fp8_keys else bfloat16), k_scale [N] float32 or
  None, w [T, H] float32).
  """
  for name, flag in (("hadamard", hadamard), ("fp8_keys", fp8_keys), ("fp8_queries", fp8_queries)):
    _checks.check_bool(name, flag)
  if fp8_queries and not fp8_keys:
    raise ValueError("fp8_queries=True needs fp8_keys=True (the dot runs fp8 x fp8)")
  d = q.shape[-1]
  if rope_dims:
    q = apply_rope(q, positions_q, rope_dims=rope_dims, base=rope_base, interleaved=interleaved)
    k = apply_rope(k, positions_k, rope_dims=rope_dims, base=rope_base, interleaved=interleaved)
  if hadamard:
    q, k = hadamard_rotate(q), hadamard_rotate(k)
  q_scale = None
  if fp8_queries:
    q, q_scale = quantize_fp8(q)
  w = indexer_weights(proj, head_dim=d, q_scale=q_scale)
  if fp8_keys:
    kq, ks = quantize_fp8(k)
    return (q if fp8_queries else q.astype(jnp.bfloat16)), kq, ks, w
  return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), None, w


@_checks.array_args("packed")
def unpack_fp8_paged_cache(packed, head_dim: int = 128):
  """Map a DeepGEMM/vLLM packed fp8 indexer cache onto jaxsparse's paged layout.

  packed: [num_blocks, 64, 1, head_dim + 4] uint8, where each block stores 64 x head_dim fp8
  values contiguously and then 64 float32 scales (so the last axis is a view, not per-slot data).
  Returns (k_cache [num_blocks, 64, head_dim] float8_e4m3fn, k_scale [num_blocks, 64] float32).
  """
  _checks.check_int("head_dim", head_dim, 1)
  if packed.dtype != jnp.uint8:
    raise ValueError(f"packed.dtype={packed.dtype} must be uint8")
  if packed.ndim != 4 or packed.shape[1:] != (64, 1, head_dim + 4):
    raise ValueError(f"packed.shape={tuple(packed.shape)} must be [num_blocks, 64, 1, {head_dim + 4}]")
  nb = packed.shape[0]
  flat = packed.reshape(nb, 64 * (head_dim + 4))
  vals = flat[:, : 64 * head_dim].reshape(nb, 64, head_dim)
  scales = flat[:, 64 * head_dim:].reshape(nb, 64, 4)
  k = jax.lax.bitcast_convert_type(vals, jnp.float8_e4m3fn)
  s = jax.lax.bitcast_convert_type(scales, jnp.float32)
  return k, s


@_checks.array_args("k_cache", "k_scale")
def pack_fp8_paged_cache(k_cache, k_scale):
  """Inverse of `unpack_fp8_paged_cache` (for tests and for exporting to DeepGEMM layout).

  k_cache [num_blocks, 64, head_dim] float8_e4m3fn, k_scale [num_blocks, 64] float32.
  Returns packed [num_blocks, 64, 1, head_dim + 4] uint8."""
  if not hasattr(k_cache, "dtype") or k_cache.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"k_cache.dtype={getattr(k_cache, 'dtype', type(k_cache).__name__)} must "
                     "be float8_e4m3fn (quantize with prep.quantize_fp8 first)")
  if k_cache.ndim != 3 or k_cache.shape[1] != 64:
    raise ValueError(f"k_cache.shape={tuple(k_cache.shape)} must be [num_blocks, 64, head_dim]")
  if not hasattr(k_scale, "dtype") or k_scale.dtype != jnp.float32:
    raise ValueError(f"k_scale.dtype={getattr(k_scale, 'dtype', type(k_scale).__name__)} must "
                     "be float32")
  if tuple(k_scale.shape) != tuple(k_cache.shape[:2]):
    raise ValueError(f"k_scale.shape={tuple(k_scale.shape)} must be {tuple(k_cache.shape[:2])}")
  nb, page, d = k_cache.shape
  vals = jax.lax.bitcast_convert_type(k_cache, jnp.uint8).reshape(nb, page * d)
  sc = jax.lax.bitcast_convert_type(k_scale, jnp.uint8).reshape(nb, page * 4)
  return jnp.concatenate([vals, sc], axis=1).reshape(nb, page, 1, d + 4)

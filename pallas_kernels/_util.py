"""Small helpers shared by the kernel wrappers."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
  return n >= 1 and (n & (n - 1)) == 0


def pad_axis(x, axis: int, size: int, value=0):
  """Pad `x` along `axis` up to `size` with `value` (no-op when already that size)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, 2^-126


def flush_zero(x):
  """Subnormal float32 values (and -0.0) -> +0.0; everything else, NaN and +-inf included,
  unchanged. Every top-K ranks its scores through this (README "Input rules"), so a subnormal
  score ties with 0 on every path, whether or not the hardware flushes it."""
  return jnp.where(jnp.abs(x) < TINY, 0.0, x)


def widen_int(x):
  """Integers narrower than 32 bits (int8/16, uint8/16) -> int32, exactly; anything else
  unchanged. Clipping to a bound the dtype cannot hold (a length of 1000 in int8) would wrap
  or overflow, so positions and lengths widen before they clip."""
  if jnp.issubdtype(x.dtype, jnp.integer) and jnp.dtype(x.dtype).itemsize < 4:
    return x.astype(jnp.int32)
  return x


def clip_positions(positions, n: int):
  """Query positions -> int32 in [-1, n - 1], clipped before the cast so that a traced uint32
  or int64 position past 2^31 never wraps to a negative one (it sees every key, as any
  position >= n - 1 does; README "Input rules")."""
  p = widen_int(jnp.asarray(positions))
  if jnp.issubdtype(p.dtype, jnp.unsignedinteger):
    return jnp.minimum(p, jnp.asarray(n - 1, p.dtype)).astype(jnp.int32)
  return jnp.clip(p, -1, n - 1).astype(jnp.int32)


def masked_relu(s, w):
  """relu(s) where the head weight w (broadcast against s) is non-zero, else 0.

  The head sum's rule (README "Input rules"): z = sum_h w_h * relu(q_h . k) in IEEE float32
  (an infinite dot stays infinite, NaN propagates through the ReLU and the sum), except that
  a head whose weight is 0 adds exactly 0, even when q_h . k is +-inf or NaN. Padded heads
  (weight 0) therefore never change a score. Use as `masked_relu(s, w) * w`.
  """
  return jnp.where(w != 0, jnp.maximum(s, 0.0), 0.0)


def tpu_interpret_params():
  """TPU interpret mode (models DMAs and semaphores) for running TPU kernels on the CPU."""
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.InterpretParams()


_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive counters over the word


def mix32(x):
  """A uint32 -> uint32 avalanche hash (two xor-shift-multiply rounds). Only jnp integer ops,
  so XLA and a Triton kernel compute the same bits."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def words_seed(word, n: int):
  """A uint32 seed from n uint32 words (word(i) -> the i-th, e.g. a PRNG key's data), each
  mixed in turn; jnp ops only, so XLA and a Triton kernel compute the same bits."""
  s = jnp.uint32(0x243F6A88)
  for i in range(n):
    s = mix32(s ^ word(i))
  return s


def counter_hash(seed, idx):
  """mix32(seed + idx * golden): uint32 pseudo-random words for counters idx (uint32 arrays,
  broadcast) under a uint32 seed; counter-based, so any entry is computed on its own."""
  return mix32(seed + idx * jnp.uint32(_GOLDEN))


def row_lengths(lengths, num_rows: int):
  """Visible slots per verifier row: row r of R sees `lengths - (R - 1 - r)` slots. -> [B, R] int32."""
  offs = jnp.arange(num_rows, dtype=jnp.int32) - (num_rows - 1)
  lengths = widen_int(jnp.asarray(lengths))
  if jnp.issubdtype(lengths.dtype, jnp.unsignedinteger):  # past 2^31: clamp, never wrap
    lengths = jnp.minimum(lengths, jnp.asarray(np.iinfo(np.int32).max, lengths.dtype))
  elif jnp.dtype(lengths.dtype).itemsize > 4:
    lengths = jnp.clip(lengths, np.iinfo(np.int32).min, np.iinfo(np.int32).max)
  # >= 0 before the (non-positive) offsets: a length near -2^31 must not wrap
  lengths = jnp.maximum(lengths.astype(jnp.int32), 0)
  return jnp.maximum(lengths[:, None] + offs[None, :], 0)

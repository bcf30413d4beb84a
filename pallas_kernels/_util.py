"""Small helpers shared by the kernel wrappers."""
from __future__ import annotations

import jax.numpy as jnp


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


def tpu_interpret_params():
  """TPU interpret mode (models DMAs and semaphores) for running TPU kernels on the CPU."""
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.InterpretParams()

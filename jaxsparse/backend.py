"""Which implementation runs: resolve `implementation=` and pick the kernel platform."""
from __future__ import annotations

import os

import jax

from pallas_kernels._platform import KernelPlatform

__all__ = ["KernelPlatform", "resolve", "kernel_platform", "default_backend"]


def default_backend() -> str:
  return jax.default_backend()


def resolve(implementation):
  """None -> "pallas" on GPU/TPU, "xla" on CPU (interpret mode is for testing, not speed)."""
  if implementation is not None:
    return implementation
  return "pallas" if default_backend() in ("gpu", "cuda", "rocm", "tpu") else "xla"


def kernel_platform() -> KernelPlatform:
  """The kernel family for this machine. On CPU, `JAXSPARSE_INTERPRET` picks gpu (default) or tpu."""
  b = default_backend()
  if b == "tpu":
    return KernelPlatform("tpu", False)
  if b in ("gpu", "cuda"):
    return KernelPlatform("gpu", False)
  kind = os.environ.get("JAXSPARSE_INTERPRET", "gpu")
  if kind not in ("gpu", "tpu"):
    raise ValueError(f"JAXSPARSE_INTERPRET={kind!r} must be 'gpu' or 'tpu'")
  return KernelPlatform(kind, True)

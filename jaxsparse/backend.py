"""Which implementation runs: resolve `implementation=` and pick the kernel platform."""
from __future__ import annotations

import dataclasses
import os

import jax


@dataclasses.dataclass(frozen=True)
class KernelPlatform:
  """Where a Pallas kernel runs: `kind` is "gpu" or "tpu"; `interpret` runs it on the CPU."""
  kind: str
  interpret: bool

  def __post_init__(self):
    if self.kind not in ("gpu", "tpu"):
      raise ValueError(f"kind={self.kind!r} must be 'gpu' or 'tpu'")


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

"""Which kernel family runs where (no jaxsparse imports: kernels sit below the library)."""
from __future__ import annotations

import dataclasses

__all__ = ["KernelPlatform"]


@dataclasses.dataclass(frozen=True)
class KernelPlatform:
  """Where a Pallas kernel runs: `kind` is "gpu" or "tpu"; `interpret` runs it on the CPU."""
  kind: str
  interpret: bool

  def __post_init__(self):
    if self.kind not in ("gpu", "tpu"):
      raise ValueError(f"kind={self.kind!r} must be 'gpu' or 'tpu'")

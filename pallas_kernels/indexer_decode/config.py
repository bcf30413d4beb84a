"""Static configuration of the paged decode scoring kernels."""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiling of the paged decode kernel.

  pages_per_step: 64-slot pages gathered per inner step (GPU: keys per dot = 64 * this).
  steps_per_program: inner steps per program (GPU grid: one program per request and run).
  num_warps, num_stages: Triton launch options (GPU only).
  """
  # default: the fastest bf16 tiling of the sweeps in benchmarks/results/decode_sweep_*.json
  # (2 pages x 8 steps, 4 warps; 6 stages beat 4 by 7-18% at B x N = 1M-2M slots)
  pages_per_step: int = 2
  steps_per_program: int = 8
  num_warps: int = 4
  num_stages: int = 6

  def __post_init__(self):
    for name in ("pages_per_step", "steps_per_program", "num_warps"):
      v = getattr(self, name)
      if not isinstance(v, int) or not is_pow2(v):
        raise ValueError(f"{name}={v!r} must be a positive power of two")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages!r} must be a positive int")

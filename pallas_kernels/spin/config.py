"""Launch shapes of SPIN's GPU kernels (`pallas_kernels.spin.gpu`).

The kernels are bound by memory latency per program, not by bandwidth (B=64 x 128K reads
~17 MB), so small programs, many resident per SM, win. The defaults were the fastest in kernel
time at B=64 x 128K slots, 40% sparsity, on the H200 (benchmarks/NOTES.md, SPIN kernels).
"""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2

__all__ = ["SpinKernelConfig"]


@dataclasses.dataclass(frozen=True)
class SpinKernelConfig:
  """update_blocks, update_warps: blocks per program and warps of the EMA update kernel when it
    updates slot states V, D and block states (reductions A0 / A1): 8 blocks at 1 warp.
  block_update_blocks, block_update_warps: the same for block states only (A2): 16 at 2 warps.
  score_blocks, score_warps: A1's max-pooled block-score kernel: 64 blocks at 4 warps.
  select_warps: warps of the selection + compaction program (one per request).
  """
  update_blocks: int = 8
  update_warps: int = 1
  block_update_blocks: int = 16
  block_update_warps: int = 2
  score_blocks: int = 64
  score_warps: int = 4
  select_warps: int = 8

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if not isinstance(v, int) or not is_pow2(v):
        raise ValueError(f"{f.name}={v!r} must be a power of two")

  def update_tile(self, slots: bool) -> tuple[int, int]:
    """(blocks per program, warps) of the update kernel; slots: V and D are updated too."""
    if slots:
      return self.update_blocks, self.update_warps
    return self.block_update_blocks, self.block_update_warps

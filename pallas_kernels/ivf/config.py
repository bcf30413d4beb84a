"""Tiles of AttentionIndex's kernels (`pallas_kernels.ivf`)."""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2

__all__ = ["IVFKernelConfig"]


@dataclasses.dataclass(frozen=True)
class IVFKernelConfig:
  """assign_rows, assign_centers: keys per program and centers per inner step of the k-means
    assignment (the [keys, centers] distance tile is one dot; on TPU 128 x 128 fills the v5e
    MXU, 256 x 256 the v6e one).
  gather_block: gathered candidate keys per program of the candidate scoring (GPU: one
    pointer gather of block x D; TPU: that many row DMAs in flight, block x D in VMEM).
  group_block: members per step when a GPU program walks a query's ranked groups (groups are
    ragged: a smaller step wastes fewer masked lanes at each group's end).
  gather_min_programs: on a GPU each query's candidates are split into runs (one program
    each) until there are at least this many programs (a few per SM).
  num_warps: Triton launch option (GPU only).
  """
  assign_rows: int = 128
  assign_centers: int = 128
  gather_block: int = 128
  group_block: int = 64
  gather_min_programs: int = 512
  num_warps: int = 4

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if not isinstance(v, int) or not is_pow2(v) or v < (1 if f.name == "num_warps" else 16):
        raise ValueError(f"{f.name}={v!r} must be a power of two (>= 16 for tiles)")

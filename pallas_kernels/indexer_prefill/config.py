"""Static configuration of the causal prefill scoring kernels."""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2


__all__ = [
    "MOSAIC_AUTO", "MOSAIC_MIN_CTAS", "PrefillConfig", "TPU_DEFAULT"
]


# Under kernel="auto", the q dtypes (q and k alike) that run the Mosaic GPU kernel on Hopper:
# on the H200 bf16 measured 2.07x the Triton kernel, fp8 q+k 836-884 TFLOP/s with fp8 wgmma
# (Triton fp8 q+k: 224-225).
MOSAIC_AUTO = ("bfloat16", "float8_e4m3fn")

# Under mosaic_key_splits=0, the fewest CTAs a Mosaic call should get: two per SM of the H200's
# 132 (a CTA's ~100 KB of shared memory lets two share an SM), rounded to a power of two.
MOSAIC_MIN_CTAS = 256


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
  """Tiling of the prefill kernel.

  block_t: queries per tile (the dot has M = block_t * H rows).
  block_n: keys per tile.
  tiles_per_program: key tiles looped over inside one GPU program (q stays resident; Triton).
  num_warps, num_stages: Triton launch options (GPU only).
  kernel: which GPU kernel: "auto" (default) runs the Mosaic GPU kernel (TMA + wgmma,
    `mgpu.py`) on Hopper for the q dtypes in `MOSAIC_AUTO` when it can (q and k of one dtype,
    128-byte key rows, H <= 256, the tiling fits shared memory), else the Triton kernel;
    "triton" forces the Triton kernel; "mosaic" requires the Mosaic kernel.
  mosaic_steps: key tiles in flight in the Mosaic kernel's TMA pipeline.
  mosaic_key_splits: CTAs per query group in the Mosaic kernel, each streaming a range of the
    keys; 0 (default) picks the fewest (a power of two) that give the call MOSAIC_MIN_CTAS CTAs,
    so 1 whenever T / block_t >= 256, and more for the short query chunks of `prefill_topk`.
  """
  # Triton defaults: the fastest bf16 tiling of the bench_indexer.py sweep, H200 (246-252 TFLOP/s)
  block_t: int = 4
  block_n: int = 64
  tiles_per_program: int = 8
  num_warps: int = 4
  num_stages: int = 3
  kernel: str = "auto"
  # 4 x 64 tiles, 2 steps in flight: the fastest Mosaic tiling on the H200 (509-518 TFLOP/s
  # at 64K and 256K keys)
  mosaic_steps: int = 2
  mosaic_key_splits: int = 0

  def key_splits_for(self, query_groups: int, key_tiles: int) -> int:
    """The Mosaic kernel's key splits for `query_groups` CTAs' worth of queries and `key_tiles`
    tiles of block_n keys (each split keeps >= 4 tiles)."""
    if self.mosaic_key_splits:
      return self.mosaic_key_splits
    s = 1
    while query_groups * s < MOSAIC_MIN_CTAS and key_tiles // (2 * s) >= 4:
      s *= 2
    return s

  def __post_init__(self):
    if self.kernel not in ("auto", "triton", "mosaic"):
      raise ValueError(f"kernel={self.kernel!r} must be 'auto', 'triton' or 'mosaic'")
    if not isinstance(self.mosaic_key_splits, int) or self.mosaic_key_splits < 0:
      raise ValueError(f"mosaic_key_splits={self.mosaic_key_splits!r} must be an int >= 0")
    if not isinstance(self.mosaic_steps, int) or self.mosaic_steps < 1:
      raise ValueError(f"mosaic_steps={self.mosaic_steps!r} must be a positive int")
    for name in ("block_t", "block_n", "tiles_per_program", "num_warps"):
      v = getattr(self, name)
      if not isinstance(v, int) or not is_pow2(v):
        raise ValueError(f"{name}={v!r} must be a positive power of two")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages!r} must be a positive int")


# The TPU kernel needs block_t a multiple of 8 and block_n a multiple of 128.
TPU_DEFAULT = PrefillConfig(block_t=8, block_n=256, tiles_per_program=1)

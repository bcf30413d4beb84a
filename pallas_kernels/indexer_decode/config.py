"""Static configuration of the paged decode scoring kernels."""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2


__all__ = [
    "MOSAIC_AUTO", "MOSAIC_MIN_CTAS", "run_length_ok", "DecodeConfig"
]


# Under kernel="auto", the (q dtype, cache dtype) pairs that run the Mosaic GPU kernel on Hopper:
# all three measured faster than the Triton kernel on the H200 at B=64 x 128K, 8 x 1M and
# 1 x 1M (bf16 4.18-4.27 TB/s at B x N >= 1M; benchmarks/NOTES.md).
MOSAIC_AUTO = (("bfloat16", "bfloat16"), ("float8_e4m3fn", "float8_e4m3fn"),
               ("bfloat16", "float8_e4m3fn"))

# mosaic_pages=None: runs shrink from 32 pages until a call has at least this many CTAs, about
# one per SM (on the H200, B=1 x 128K took 18.7 us with 32 pages = 64 CTAs, 10.3 with 16 =
# 128 CTAs, 13.5 with 8; at >= 512 CTAs the length mattered little)
MOSAIC_MIN_CTAS = 128


def run_length_ok(pages) -> bool:
  """Pages per CTA the Mosaic kernel takes: 8, 16 (CTAs share a 32-entry table row) or a
  positive multiple of 32 (a block-table row copy must be a multiple of 128 bytes)."""
  return isinstance(pages, int) and pages > 0 and (pages in (8, 16) or pages % 32 == 0)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiling of the paged decode kernel.

  pages_per_step: 64-slot pages gathered per inner step (GPU: keys per dot = 64 * this).
  steps_per_program: inner steps per program (GPU grid: one program per request and run).
  num_warps, num_stages: Triton launch options (GPU only). num_stages=None picks by key dtype:
    6 for bfloat16 keys, 4 for fp8 keys (the H200 sweeps: 6 stages are 7-18% faster for bf16
    and 7% slower for fp8).
  kernel: which GPU kernel scores dense single-row decode: "auto" (default: see
    `MOSAIC_AUTO`), "triton", or "mosaic" (the Mosaic GPU kernel, `mgpu.py`: q and the cache
    both bfloat16, both float8_e4m3fn, or a bfloat16 q with an fp8 cache (the MMA then runs in
    float16), one row per request, a compiled Hopper GPU; dense or SPIN's block-sparse
    scoring). Verifier rows (R > 1) and group maxima always run the Triton kernel.
  mosaic_pages, mosaic_steps: the Mosaic kernel's pages per CTA (8, 16 or a multiple of 32;
    None: `mosaic_pages_for`, by the number of CTAs the call gets) and page gathers in flight.
  """
  # default: the fastest bf16 tiling of the H200 sweeps (`bash benchmarks/run_h200.sh indexer`)
  pages_per_step: int = 2
  steps_per_program: int = 8
  num_warps: int = 4
  num_stages: int | None = None
  kernel: str = "auto"
  mosaic_pages: int | None = None
  mosaic_steps: int = 4

  def mosaic_pages_for(self, batch: int, max_blocks: int) -> int:
    """Pages per CTA: the configured value, else the largest of 32, 16, 8 that still gives
    the call at least MOSAIC_MIN_CTAS CTAs (small batches need short runs to fill 132 SMs)."""
    if self.mosaic_pages is not None:
      return self.mosaic_pages
    for pages in (32, 16):
      if batch * -(-max_blocks // pages) >= MOSAIC_MIN_CTAS:
        return pages
    return 8

  def stages_for(self, key_itemsize: int) -> int:
    if self.num_stages is not None:
      return self.num_stages
    return 6 if key_itemsize >= 2 else 4

  def __post_init__(self):
    if self.kernel not in ("auto", "triton", "mosaic"):
      raise ValueError(f"kernel={self.kernel!r} must be 'auto', 'triton' or 'mosaic'")
    mp = self.mosaic_pages
    if mp is not None and not run_length_ok(mp):
      raise ValueError(f"mosaic_pages={mp!r} must be None, 8, 16 or a positive multiple of 32")
    if not isinstance(self.mosaic_steps, int) or self.mosaic_steps < 1:
      raise ValueError(f"mosaic_steps={self.mosaic_steps!r} must be a positive int")
    for name in ("pages_per_step", "steps_per_program", "num_warps"):
      v = getattr(self, name)
      if not isinstance(v, int) or not is_pow2(v):
        raise ValueError(f"{name}={v!r} must be a positive power of two")
    if self.num_stages is not None and (not isinstance(self.num_stages, int)
                                        or self.num_stages < 1):
      raise ValueError(f"num_stages={self.num_stages!r} must be a positive int")

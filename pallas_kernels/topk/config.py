"""Static configuration of the threshold-filter top-K kernels."""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2


@dataclasses.dataclass(frozen=True)
class TopkConfig:
  """chunk: scores per program in the filter passes (power of two, >= 128).
  capacity_factor: candidate buffer = capacity_factor * k (rounded up to a power of two);
    a row with more candidates than that makes the call fall back to a full sort (still exact).
  groups_per_k: aim for at least this many groups per selected entry (sets the group size).
  num_warps: Triton launch option (GPU only).
  threshold: "bisect" (GPU kernel, no sort) or "sort" (`lax.top_k` over the group maxima).
  bisect_iters: bisection steps for the threshold (more: fewer surplus candidates).
  finish: how the candidates become the sorted top-k (GPU): "sort" (`lax.top_k` over the
    candidate buffer, ~35 us on the H200 whatever the batch), "rank" (one Pallas kernel that
    counts each candidate's rank, O(candidates^2) compares), "bitonic" (one Pallas program per
    row sorts its candidates by (value, index) with a bitonic network in registers; with it
    the candidates are compacted in one pass, chunk ranges reserved by an atomic add), or
    "auto" (the default: rank for
    at most `rank_max_rows` rows when k >= `rank_min_k`, else sort; from the H200 timings in
    benchmarks/results/session3/topk_finish_partial.json, where rank won every single-row
    K=2048 shape and sort most K=512 ones).
  bitonic_warps: warps of the bitonic finish's program (GPU; 16: 25.8-27.7 us at 4K
    candidates on the H200, 8: 28.3, 4: 60.6, benchmarks/results/session7/).
  """
  chunk: int = 4096
  capacity_factor: int = 2
  groups_per_k: int = 4
  num_warps: int = 4
  threshold: str = "bisect"
  bisect_iters: int = 20
  finish: str = "auto"
  rank_max_rows: int = 16
  rank_min_k: int = 1024
  bitonic_warps: int = 16

  def __post_init__(self):
    if not isinstance(self.chunk, int) or not is_pow2(self.chunk) or self.chunk < 128:
      raise ValueError(f"chunk={self.chunk!r} must be a power of two >= 128")
    if self.finish not in ("sort", "rank", "bitonic", "auto"):
      raise ValueError(f"finish={self.finish!r} must be 'sort', 'rank', 'bitonic' or 'auto'")
    if self.threshold not in ("bisect", "sort"):
      raise ValueError(f"threshold={self.threshold!r} must be 'bisect' or 'sort'")
    for name in ("capacity_factor", "groups_per_k", "num_warps", "bisect_iters", "rank_max_rows",
                 "rank_min_k", "bitonic_warps"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")

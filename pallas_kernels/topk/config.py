"""What a user chooses for the threshold-filter top-K (`pallas_kernels.topk`).

The per-shape choices made under these (chunks, warps, tiles and the crossovers between
them) were measured, not chosen: they live in the internal table `_tuning.TUNING`.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2

__all__ = ["TopkConfig"]


@dataclasses.dataclass(frozen=True)
class TopkConfig:
  """How the top-K runs: group maxima -> threshold -> candidate compaction -> finish.

  threshold: how the GPU finds a value that k group maxima reach: "falsi" (regula falsi in
    one program per row, no sort; stops once few maxima above k reach it), "bisect"
    (bisection in the same kernel) or "sort" (`lax.top_k` over the maxima; no kernel).
  compact: how an order-free finish's one-pass compaction places candidates (GPU): "scan" (a
    chunk reserves a range with one atomic add; a chunk-wide scan orders its candidates in
    it), "lane" (each candidate takes its slot with its own atomic add: wins where a chunk
    holds few candidates, loses where every atomic waits for many) or "auto" (by shape).
  gather: True, the threshold kernel also lists the groups whose maximum reaches the
    threshold and the compaction reads only those (about k * group entries a row instead of
    N; GPU); False, it reads every chunk; "auto", by the call's size.
  finish: how the candidates become the sorted top-k (GPU): "bitonic" (a sorting network:
    programs sort runs, then merges), "rank" (each candidate's place is the number of
    candidates before it: O(candidates^2) compares but no dependent chain, for few rows),
    "sort" (`lax.top_k` over the buffer) or "auto" (by rows and k). The order-free ones let
    the compaction be one pass. Top-k as a set (ordered=False) takes none of them.
  capacity_factor: the candidate buffer holds capacity_factor * k (rounded up to a power of
    two); a row with more candidates is repaired exactly (a slow path, never wrong).
  max_group: the largest group of scores one maximum covers (a power of two; GPU, calls of
    few rows; others stop at 64). Larger groups mean fewer maxima to search but more
    entries admitted per group reaching the threshold; kernels that emit the maxima cap it
    (`fused_groups`).
  """
  threshold: str = "falsi"
  compact: str = "auto"
  gather: bool | str = "auto"
  finish: str = "auto"
  capacity_factor: int = 2
  max_group: int = 256

  def __post_init__(self):
    if self.threshold not in ("bisect", "falsi", "sort"):
      raise ValueError(f"threshold={self.threshold!r} must be 'bisect', 'falsi' or 'sort'")
    if self.compact not in ("auto", "scan", "lane"):
      raise ValueError(f"compact={self.compact!r} must be 'auto', 'scan' or 'lane'")
    if not (isinstance(self.gather, bool) or self.gather == "auto"):
      raise ValueError(f"gather={self.gather!r} must be True, False or 'auto'")
    if self.finish not in ("sort", "rank", "bitonic", "auto"):
      raise ValueError(f"finish={self.finish!r} must be 'sort', 'rank', 'bitonic' or 'auto'")
    if not isinstance(self.capacity_factor, int) or self.capacity_factor < 1:
      raise ValueError(f"capacity_factor={self.capacity_factor!r} must be a positive int")
    if not isinstance(self.max_group, int) or not is_pow2(self.max_group) or self.max_group < 2:
      raise ValueError(f"max_group={self.max_group!r} must be a power of two >= 2")

"""Static configuration of the threshold-filter top-K kernels (`pallas_kernels.topk`).

Every default was the fastest measured on the H200 for the shapes it serves (benchmarks/NOTES.md
has the figures, kernel time of whole calls, and what lost); the rules that switch between two
choices by shape (`finish_for`, `chunk_for`, `placement`, `gathers`, `rank_merge_for`) sit at
the measured crossovers.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2

__all__ = ["TopkConfig"]


@dataclasses.dataclass(frozen=True)
class TopkConfig:
  """How the top-K runs: group maxima -> threshold -> candidate compaction -> finish.

  Filter passes (GPU)
    chunk: scores per program in the group-maxima and compaction passes (power of two >= 128).
    small_chunk, small_chunk_entries: calls of at most small_chunk_entries scores (rows x N)
      use chunks of small_chunk: there the passes are one short wave, and shorter programs
      finish sooner.
    bucket_chunk, bucket_chunk_min_entries: the small-call chunk when the compaction fills two
      value buckets (`buckets_for`), for calls of at least bucket_chunk_min_entries scores.
    num_warps: warps of the filter passes.
  Groups and threshold
    groups_per_k: the group maxima, padded to a power of two, number at least groups_per_k * k
      (this sets the group size, `pallas_kernels.topk.group_size`).
    max_group, max_group_rows: the largest group for calls of at most max_group_rows rows on
      GPU; other calls (and TPU) stop at 64.
    threshold: "falsi" (regula falsi on the value over the group maxima, in one GPU program per
      row, no sort; stops once at most `slack_for(group)` maxima above k reach it), "bisect"
      (`bisect_iters` steps of bisection in the same kernel) or "sort" (`lax.top_k` over the
      maxima; no kernel).
    bisect_iters: bisection steps, and the most probes of "falsi".
    falsi_slack, falsi_slack_entries: the stopping slack of "falsi", in maxima: the larger of
      falsi_slack and falsi_slack_entries / group size (about as many extra entries whatever
      the group size).
    threshold_warps: warps of the threshold kernel.
  Compaction
    capacity_factor: the candidate buffer holds capacity_factor * k (rounded up to a power of
      two); a row with more candidates is repaired exactly (a slow path, never wrong).
    compact: how an order-free finish's one-pass compaction places candidates: "scan" (a chunk
      reserves a range with one atomic add and a chunk-wide scan orders its candidates in it),
      "lane" (each candidate takes its slot with its own atomic add: no scan; wins where a
      chunk holds few candidates, loses where every atomic waits for many), or "auto": "lane"
      for at least lane_min_rows rows of at least lane_min_ratio * k scores, else "scan".
    gather, gather_min_entries: True, the threshold kernel also lists the groups whose maximum
      reaches the threshold and the compaction reads only those (about k * group entries a
      row instead of N); "auto": for calls of at least gather_min_entries scores.
    refine_edges, refine_min_rows: with gather, calls of at least refine_min_rows rows raise
      each row's threshold before the compaction (`gpu.refine_threshold`): two passes over
      the listed groups count the entries reaching refine_edges values between the threshold
      and the row maximum, and the highest value that k entries reach becomes the threshold.
      Group maxima admit up to group * k entries where neighbouring scores rise together, as
      in real score rows (keys near each other in the sequence or in one cluster): the
      buffer overflows and the row takes the exact repair (one program reading the row 10
      times). Refined, such rows keep about k. 0 edges: off.
  Finish (candidates -> sorted top-k; the order-free ones let the compaction be one pass)
    finish: "bitonic" (a sorting network: programs sort runs, then merges), "rank" (sorting by
      counting: each candidate's place is the number before it; O(candidates^2) compares but
      no dependent chain, for few rows), "sort" (`lax.top_k` over the buffer) or "auto": rank
      for at most rank_max_rows rows when k >= rank_min_k, else bitonic.
    rank_block_i, rank_block_j, rank_warps: the rank finish's tile (each program ranks
      rank_block_i candidates against the row in blocks of rank_block_j) and its warps.
    rank_preload: blocks of rank_block_j each rank program loads before its first compare
      (0: enough for k * 1.25 candidates).
    rank_buckets, rank_buckets_min_k: for k >= rank_buckets_min_k, the threshold kernel also
      estimates a pivot that halves the candidates and the compaction fills the buffer from
      both ends, so each rank block compares only within its bucket (about half the compares).
    bitonic_run, bitonic_run_warps: 0, one program per row sorts the buffer; r (a power of
      two), programs first sort runs of r candidates in parallel, then merge.
    bitonic_mid: m (run < m < capacity), a middle kernel merges the runs into blocks of m so
      the per-row program does only the last merges (0: none).
    bitonic_warps: warps of the per-row and middle programs.
    bitonic_rank_merge, rank_merge_warps, rank_merge_max_rows, rank_merge_min_k,
      rank_merge_run_warps: for at most rank_merge_max_rows rows and k >= rank_merge_min_k,
      the runs are sorted descending and a grid of programs places every entry by binary
      searches in the runs (log2(run) + 1 dependent probes instead of the merges); blocks of
      bitonic_rank_merge entries per program (0: never), rank_merge_warps each, and
      rank_merge_run_warps for the run sorts.
  """
  chunk: int = 2048
  small_chunk: int = 512
  small_chunk_entries: int = 1 << 18
  bucket_chunk: int = 1024
  bucket_chunk_min_entries: int = 1 << 16
  num_warps: int = 4
  groups_per_k: int = 4
  max_group: int = 256
  max_group_rows: int = 8
  threshold: str = "falsi"
  bisect_iters: int = 14
  falsi_slack: int = 64
  falsi_slack_entries: int = 1024
  threshold_warps: int = 8
  capacity_factor: int = 2
  compact: str = "auto"
  lane_min_rows: int = 8
  lane_min_ratio: int = 256
  gather: bool | str = "auto"
  gather_min_entries: int = 1 << 23
  refine_edges: int = 16
  refine_min_rows: int = 256
  finish: str = "auto"
  rank_max_rows: int = 1
  rank_min_k: int = 512
  rank_block_i: int = 8
  rank_block_j: int = 256
  rank_warps: int = 4
  rank_preload: int = 0
  rank_buckets: bool = True
  rank_buckets_min_k: int = 1024
  bitonic_run: int = 512
  bitonic_run_warps: int = 4
  bitonic_mid: int = 2048
  bitonic_warps: int = 16
  bitonic_rank_merge: int = 32
  rank_merge_warps: int = 4
  rank_merge_max_rows: int = 8
  rank_merge_min_k: int = 1024
  rank_merge_run_warps: int = 8

  def finish_for(self, rows: int, k: int) -> str:
    """The sorted finish for rows of top-k ("auto" resolved): "bitonic", "rank" or "sort"."""
    if self.finish == "auto":
      return "rank" if rows <= self.rank_max_rows and k >= self.rank_min_k else "bitonic"
    return self.finish

  def finish_repairs(self, how: str, capacity: int) -> bool:
    """Whether the finish `how` (GPU) repairs overflowing rows itself for a buffer of
    `capacity` (the rank finish and the split bitonic finish do; the others get the repair
    kernel before them)."""
    return how == "rank" or (how == "bitonic" and 0 < self.bitonic_run < capacity)

  def buckets_for(self, how: str, rows: int, n: int, k: int, capacity: int) -> bool:
    """Whether the rank finish `how` of rows x n scores (GPU) gets its candidates in two value
    buckets (rank_buckets resolved: it needs the threshold kernel and the compaction reading
    every chunk with "scan", in chunks below 2**16 of rows up to 2**24:
    `gpu.compact_atomic(..., pivot=)`)."""
    return (self.rank_buckets and k >= self.rank_buckets_min_k and how == "rank"
            and n <= 1 << 24 and self.chunk_for(rows, n, buckets=True) < 1 << 16
            and self.threshold in ("bisect", "falsi")
            and not self.gathers(rows, n) and self.placement(rows, n, k) == "scan")

  def slack_for(self, group: int) -> int:
    """The threshold kernel's stopping slack, in maxima, for groups of `group` scores (0:
    none, bisection)."""
    if self.threshold != "falsi":
      return 0
    return max(self.falsi_slack, self.falsi_slack_entries // group)

  def rank_merge_for(self, rows: int, k: int) -> int:
    """The split bitonic finish's rank merge block for `rows` rows of top-k (0: the merges;
    at most bitonic_run where it applies)."""
    if rows > self.rank_merge_max_rows or k < self.rank_merge_min_k:
      return 0
    return min(self.bitonic_rank_merge, self.bitonic_run)

  def run_warps_for(self, rows: int, k: int) -> int:
    """Warps of the split bitonic finish's run-sorting programs for `rows` rows of top-k:
    rank_merge_run_warps where the rank merge applies, else bitonic_run_warps."""
    return self.rank_merge_run_warps if self.rank_merge_for(rows, k) else self.bitonic_run_warps

  def mid_for(self, capacity: int) -> int:
    """The split bitonic finish's middle block for a buffer of `capacity` (0: none)."""
    return self.bitonic_mid if self.bitonic_run < self.bitonic_mid < capacity else 0

  def chunk_for(self, rows: int, n: int, buckets: bool = False) -> int:
    """The filter passes' chunk for rows x n scores (GPU; the small-call rule resolved);
    buckets: the compaction fills two value buckets (`buckets_for`; bucket_chunk applies)."""
    if rows * n > self.small_chunk_entries:
      return self.chunk
    if buckets and rows * n >= self.bucket_chunk_min_entries:
      return max(self.small_chunk, self.bucket_chunk)
    return self.small_chunk

  def refines(self, rows: int, gather: bool) -> bool:
    """Whether a call of `rows` rows raises its thresholds by counting (`refine_edges`)."""
    return gather and self.refine_edges > 0 and rows >= self.refine_min_rows

  def gathers(self, rows: int, n: int) -> bool:
    """Whether the compaction of rows x n scores gathers listed groups ("auto" resolved)."""
    if self.gather == "auto":
      return rows * n >= self.gather_min_entries
    return self.gather

  def placement(self, rows: int, n: int, k: int, gather: bool = False) -> str:
    """The compaction's placement for rows x n entries, k kept, reading every chunk or
    (gather) only the listed groups ("auto" resolved; "lane" only for rows of at most 2**24
    entries)."""
    p = self.compact
    if p == "auto":
      p = "lane" if (not gather and rows >= self.lane_min_rows
                     and n >= self.lane_min_ratio * k) else "scan"
    return "scan" if p == "lane" and n > 1 << 24 else p

  def __post_init__(self):
    if not isinstance(self.max_group, int) or not is_pow2(self.max_group) or self.max_group < 2:
      raise ValueError(f"max_group={self.max_group!r} must be a power of two >= 2")
    for name in ("chunk", "small_chunk"):
      v = getattr(self, name)
      if not isinstance(v, int) or not is_pow2(v) or v < 128:
        raise ValueError(f"{name}={v!r} must be a power of two >= 128")
    if not isinstance(self.bucket_chunk, int) or not (
        self.bucket_chunk == 0 or (is_pow2(self.bucket_chunk) and self.bucket_chunk >= 128)):
      raise ValueError(f"bucket_chunk={self.bucket_chunk!r} must be 0 or a power of two >= 128")
    for name in ("small_chunk_entries", "bucket_chunk_min_entries", "rank_preload",
                 "falsi_slack_entries", "rank_merge_max_rows"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}={v!r} must be an int >= 0")
    if self.finish not in ("sort", "rank", "bitonic", "auto"):
      raise ValueError(f"finish={self.finish!r} must be 'sort', 'rank', 'bitonic' or 'auto'")
    if self.threshold not in ("bisect", "falsi", "sort"):
      raise ValueError(f"threshold={self.threshold!r} must be 'bisect', 'falsi' or 'sort'")
    if self.compact not in ("auto", "scan", "lane"):
      raise ValueError(f"compact={self.compact!r} must be 'auto', 'scan' or 'lane'")
    if not isinstance(self.rank_buckets, bool):
      raise ValueError(f"rank_buckets={self.rank_buckets!r} must be a bool")
    if not (isinstance(self.gather, bool) or self.gather == "auto"):
      raise ValueError(f"gather={self.gather!r} must be True, False or 'auto'")
    for name, low in (("rank_block_i", 8), ("rank_block_j", 16)):
      v = getattr(self, name)
      if not isinstance(v, int) or not is_pow2(v) or v < low:
        raise ValueError(f"{name}={v!r} must be a power of two >= {low}")
    for name in ("bitonic_run", "bitonic_mid", "refine_edges"):
      v = getattr(self, name)
      if not isinstance(v, int) or (v and (not is_pow2(v) or v < 2)):
        raise ValueError(f"{name}={v!r} must be 0 or a power of two >= 2")
    if not isinstance(self.bitonic_rank_merge, int) or (self.bitonic_rank_merge and (
        not is_pow2(self.bitonic_rank_merge) or self.bitonic_rank_merge < 16)):
      raise ValueError(f"bitonic_rank_merge={self.bitonic_rank_merge!r} must be 0 or a power "
                       "of two >= 16")
    for name in ("capacity_factor", "groups_per_k", "num_warps", "bisect_iters", "rank_max_rows",
                 "rank_min_k", "rank_buckets_min_k", "bitonic_warps", "bitonic_run_warps",
                 "lane_min_rows", "lane_min_ratio", "gather_min_entries", "rank_warps",
                 "threshold_warps", "falsi_slack", "max_group_rows", "rank_merge_warps",
                 "rank_merge_min_k", "rank_merge_run_warps", "refine_min_rows"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")

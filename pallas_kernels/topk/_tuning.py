"""The top-K's measured per-shape choices (internal; `TopkConfig` holds what a user chooses).

One entry per choice, each with why it has its value: the H200 measurement it won (kernel time
of whole calls; benchmarks/NOTES.md, "Exact top-K", has the figures and what lost) or the
reason it is what it is. The rules below the entries switch between two choices by shape at
the measured crossovers. `TUNING` is the table every call uses; tests pass a
`dataclasses.replace(TUNING, ...)` to `topk_rows(..., tuning=)` to reach each kernel path at
small sizes.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels._util import is_pow2

__all__ = ["Tuning", "TUNING"]


@dataclasses.dataclass(frozen=True)
class Tuning:
  """How the passes of `TopkConfig`'s choices run, by shape (GPU unless said)."""
  # Groups (GPU and TPU)
  # maxima >= 4 k (padded): over 2 k real groups, so the threshold admits few extra entries
  groups_per_k: int = 4
  # groups up to TopkConfig.max_group for <= 8 rows, 64 for more (NOTES: 256 for <= 8 rows)
  max_group_rows: int = 8
  # Filter passes (group maxima, compaction)
  # scores a program for calls above small_chunk_entries; SPIN aligns blocks to it (32 x 64)
  chunk: int = 2048
  # small calls are one short wave: shorter programs finish sooner (NOTES: chunks of 512)
  small_chunk: int = 512
  # the crossover of chunk and small_chunk (NOTES: chunks of 512 for calls <= 2**18 scores)
  small_chunk_entries: int = 1 << 18
  # the bucketed compaction's small-call chunk: its scan carries two counts (efc9e82)
  bucket_chunk: int = 1024
  # bucketed calls below it keep small_chunk (efc9e82)
  bucket_chunk_min_entries: int = 1 << 16
  # warps of the streaming passes, unchanged since the first version (ab60496)
  num_warps: int = 4
  # Threshold (one program per row)
  # bisection steps (2**-14 of the maxima's range), and the most probes of regula falsi
  bisect_iters: int = 14
  # regula falsi stops within k + slack maxima (NOTES: one row 5.0-7.3 -> 3.0-3.2 us)
  falsi_slack: int = 64
  # slack >= this / group: about as many extra entries whatever the group (NOTES: ~1024)
  falsi_slack_entries: int = 1024
  # the threshold program's warps, set with the one-row rank finish (ccffc4f)
  threshold_warps: int = 8
  # Compaction
  # compact="auto" takes one atomic per candidate ("lane") only for calls of >= 8 rows ...
  lane_min_rows: int = 8
  # ... of >= 256 k scores, where chunks hold few candidates (NOTES: 64 x 1M 284 -> 234 us)
  lane_min_ratio: int = 256
  # gather="auto" from 2**23 scores a call (NOTES: 64 x 128K 52.5 -> 42.5 us, 64 x 1M 225 -> 133)
  gather_min_entries: int = 1 << 23
  # values counted per refining round; real rows 6-9.5K -> 2.1-3.2K entries (NOTES); 0: off
  refine_edges: int = 16
  # refine only calls of >= 256 rows, where real rows overflowed into the repair (591a86f)
  refine_min_rows: int = 256
  # Rank finish (sorting by counting, few rows)
  # finish="auto" ranks one row ... (NOTES: one row of 32K 21.8 -> 9.2 us)
  rank_max_rows: int = 1
  # ... at k >= 512 (52ac5e8); for more rows the network wins: its compares fill the GPU
  rank_min_k: int = 512
  # candidates a rank program places (NOTES: blocks of 8)
  rank_block_i: int = 8
  # candidates compared per step of a rank program (NOTES: loop blocks of 256)
  rank_block_j: int = 256
  # warps of a rank program ([8, 256] compares a step)
  rank_warps: int = 4
  # blocks loaded before the first compare; 0: enough for 1.25 k (rows rarely hold more)
  rank_preload: int = 0
  # two value buckets around a tail-model pivot: about half the compares (NOTES)
  rank_buckets: bool = True
  # the buckets from k >= 1024 (NOTES)
  rank_buckets_min_k: int = 1024
  # Bitonic finish (sorting network; split into runs for buffers above bitonic_run)
  # runs of 512 sorted in parallel, then merged (NOTES: 64 x 128K 25.6 -> 17.4 us); 0: none
  bitonic_run: int = 512
  # warps of the run-sorting programs (ddb72ed)
  bitonic_run_warps: int = 4
  # a middle kernel merges up to 2048, leaving the per-row program the last merges (NOTES)
  bitonic_mid: int = 2048
  # the per-row and middle programs' warps: the network's chain (~26 us for 4096 at 16 warps)
  bitonic_warps: int = 16
  # Rank merge (binary searches instead of the split bitonic finish's merges, few rows)
  # entries a rank-merge program places (NOTES: 8 x 32K 17.6 -> 14.5 us); 0: never
  bitonic_rank_merge: int = 32
  # warps of a rank-merge program (346e079)
  rank_merge_warps: int = 4
  # the rank merge for 2-8 rows ...
  rank_merge_max_rows: int = 8
  # ... at k >= 1024 (NOTES: rank merge for 2-8 rows at k >= 1024)
  rank_merge_min_k: int = 1024
  # warps of the runs kernel before a rank merge (175fb41, untimed)
  rank_merge_run_warps: int = 8

  def __post_init__(self):
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
    if not isinstance(self.rank_buckets, bool):
      raise ValueError(f"rank_buckets={self.rank_buckets!r} must be a bool")
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
    for name in ("groups_per_k", "num_warps", "bisect_iters", "rank_max_rows", "rank_min_k",
                 "rank_buckets_min_k", "bitonic_warps", "bitonic_run_warps", "lane_min_rows",
                 "lane_min_ratio", "gather_min_entries", "rank_warps", "threshold_warps",
                 "falsi_slack", "max_group_rows", "rank_merge_warps", "rank_merge_min_k",
                 "rank_merge_run_warps", "refine_min_rows"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")

  def finish_for(self, config, rows: int, k: int) -> str:
    """The sorted finish for rows of top-k (`config.finish` "auto" resolved): "bitonic",
    "rank" or "sort"."""
    if config.finish == "auto":
      return "rank" if rows <= self.rank_max_rows and k >= self.rank_min_k else "bitonic"
    return config.finish

  def finish_repairs(self, how: str, capacity: int) -> bool:
    """Whether the finish `how` repairs overflowing rows itself for a buffer of `capacity`
    (the rank finish and the split bitonic finish do; the others get the repair kernel
    before them)."""
    return how == "rank" or (how == "bitonic" and 0 < self.bitonic_run < capacity)

  def buckets_for(self, config, how: str, rows: int, n: int, k: int, capacity: int) -> bool:
    """Whether the rank finish `how` of rows x n scores gets its candidates in two value
    buckets (rank_buckets resolved: it needs the threshold kernel and the compaction reading
    every chunk with "scan", in chunks below 2**16 of rows up to 2**24:
    `gpu.compact_atomic(..., pivot=)`)."""
    return (self.rank_buckets and k >= self.rank_buckets_min_k and how == "rank"
            and n <= 1 << 24 and self.chunk_for(rows, n, buckets=True) < 1 << 16
            and config.threshold in ("bisect", "falsi")
            and not self.gathers(config, rows, n)
            and self.placement(config, rows, n, k) == "scan")

  def slack_for(self, config, group: int) -> int:
    """The threshold kernel's stopping slack, in maxima, for groups of `group` scores (0:
    none, bisection)."""
    if config.threshold != "falsi":
      return 0
    return max(self.falsi_slack, self.falsi_slack_entries // group)

  def rank_merge_for(self, rows: int, k: int) -> int:
    """The split bitonic finish's rank merge block for `rows` rows of top-k (0: the merges;
    at most bitonic_run where it applies)."""
    if rows > self.rank_merge_max_rows or k < self.rank_merge_min_k:
      return 0
    return min(self.bitonic_rank_merge, self.bitonic_run)

  def run_warps_for(self, rows: int, k: int) -> int:
    """Warps of the split bitonic finish's run-sorting programs for `rows` rows of top-k."""
    return self.rank_merge_run_warps if self.rank_merge_for(rows, k) else self.bitonic_run_warps

  def mid_for(self, capacity: int) -> int:
    """The split bitonic finish's middle block for a buffer of `capacity` (0: none)."""
    return self.bitonic_mid if self.bitonic_run < self.bitonic_mid < capacity else 0

  def chunk_for(self, rows: int, n: int, buckets: bool = False) -> int:
    """The filter passes' chunk for rows x n scores (the small-call rule resolved); buckets:
    the compaction fills two value buckets (`buckets_for`; bucket_chunk applies)."""
    if rows * n > self.small_chunk_entries:
      return self.chunk
    if buckets and rows * n >= self.bucket_chunk_min_entries:
      return max(self.small_chunk, self.bucket_chunk)
    return self.small_chunk

  def refines(self, rows: int, gather: bool) -> bool:
    """Whether a call of `rows` rows raises its thresholds by counting (`refine_edges`)."""
    return gather and self.refine_edges > 0 and rows >= self.refine_min_rows

  def gathers(self, config, rows: int, n: int) -> bool:
    """Whether the compaction of rows x n scores gathers listed groups (`config.gather`
    "auto" resolved)."""
    if config.gather == "auto":
      return rows * n >= self.gather_min_entries
    return config.gather

  def placement(self, config, rows: int, n: int, k: int, gather: bool = False) -> str:
    """The compaction's placement for rows x n entries, k kept, reading every chunk or
    (gather) only the listed groups (`config.compact` "auto" resolved; "lane" only for rows
    of at most 2**24 entries)."""
    p = config.compact
    if p == "auto":
      p = "lane" if (not gather and rows >= self.lane_min_rows
                     and n >= self.lane_min_ratio * k) else "scan"
    return "scan" if p == "lane" and n > 1 << 24 else p


TUNING = Tuning()

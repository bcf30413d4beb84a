"""SPIN's configuration: the paper's knobs and their allowed values."""
from __future__ import annotations

import dataclasses

__all__ = [
    "SpinConfig", "POOLINGS", "REDUCTIONS", "EXPLORES", "MASK_POLICIES", "UPDATE_POLICIES",
    "STATE_DTYPES"
]


NEG_INF = float("-inf")


POOLINGS = ("max", "top4", "mean")


REDUCTIONS = ("A0", "A1", "A2")


EXPLORES = ("random", "staleness", "block-age", "query", "none")


MASK_POLICIES = ("union", "row0")


UPDATE_POLICIES = ("prefix", "row0")


STATE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class SpinConfig:
  """SPIN's knobs (paper defaults: b=64, max pooling, alpha=0.5, A1, random 5% exploration).

  block_size: slots per KV block (must match the paged cache's page size).
  topk: K of the post-indexer top-K.
  sparsity: target block sparsity rho in [0, 1).
  ema_decay: alpha in [0, 1).
  explore_fraction: gamma, the part of the block budget m_t reserved for exploration.
  explore: "random" | "staleness" | "block-age" | "none" | "query". "query" (beyond the
    paper, whose limits section names sudden attention shifts): the explored blocks are the
    ones whose mean indexer key the current query scores highest (`query_priorities`), a
    current-query signal at 1/block_size of the scoring cost; the reference algorithm takes
    them as `select_rows(..., priorities=)` (the model loop, `jaxsparse.inloop`); the serving
    steps keep each block's mean key in the state (`init_state(..., head_dim=D)`), recomputing
    the newest blocks' each step from the cache (every block's on a first step after a reset).
  pooling: "max" | "top4" | "mean" (how predicted slot scores become a block score).
  reduction: "A0" (slot top-K, then expand to blocks) | "A1" (pool predicted slot scores) |
    "A2" (block-level EMA states; `decode_step` then updates only those, not V and D).
  mask_policy, update_policy: speculative decoding (R > 1 verifier rows).
  state_dtype: "bfloat16" (default) or "float32" for the V, D, VB, DB EMAs (updates are
    computed in float32 and rounded once). bfloat16 halves the state bytes read and written
    per step, with the same misses on the shipped trace as float32
    (benchmarks/results/spin_state_dtype.json).
  """
  block_size: int = 64
  topk: int = 2048
  sparsity: float = 0.4
  ema_decay: float = 0.5
  explore_fraction: float = 0.05
  explore: str = "random"
  pooling: str = "max"
  reduction: str = "A1"
  mask_policy: str = "union"
  update_policy: str = "prefix"
  state_dtype: str = "bfloat16"

  def __post_init__(self):
    b = self.block_size
    if not isinstance(b, int) or b < 1 or b & (b - 1):
      raise ValueError(f"block_size={b!r} must be a power of two")
    from jaxsparse._checks import check_int, check_real
    check_int("block_size", b, 1)
    check_int("topk", self.topk, 1)
    for name in ("sparsity", "ema_decay", "explore_fraction"):
      check_real(name, getattr(self, name))
    if not 0.0 <= self.sparsity < 1.0:
      raise ValueError(f"sparsity={self.sparsity!r} must lie in [0, 1)")
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"ema_decay={self.ema_decay!r} must lie in [0, 1)")
    if not 0.0 <= self.explore_fraction <= 0.5:
      raise ValueError(f"explore_fraction={self.explore_fraction!r} must lie in [0, 0.5]: "
                       "exploration may take at most half of the block budget")
    for name, allowed in (("explore", EXPLORES), ("pooling", POOLINGS),
                          ("reduction", REDUCTIONS), ("mask_policy", MASK_POLICIES),
                          ("update_policy", UPDATE_POLICIES),
                          ("state_dtype", STATE_DTYPES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")

  @property
  def min_blocks(self) -> int:
    return -(-self.topk // self.block_size)

"""AttentionIndex: a causal, versioned inverted-file index over indexer keys for prefill
(shared/papers/attentionindex-causal-ivf.txt), with the HiSA block baseline and full DSA."""
from __future__ import annotations

import dataclasses

from jaxsparse.ivf.candidates import (candidate_indices, candidate_mask, inverted_lists,
                                      lists_by_rank, representative_scores)
from jaxsparse.ivf.evaluation import METHODS, evaluate
from jaxsparse.ivf.prefill import prefill_topk
from jaxsparse.ivf.index import (group_capacity, index_bytes, init_state, member_means,
                                 refit, representatives, seal)
from jaxsparse.ivf import plan  # per-layer partitions: content groups or position blocks
from jaxsparse.ivf import metric  # the query-aware grouping metric

__all__ = ["IVFConfig", "evaluate", "prefill_topk", "METHODS", "init_state", "seal", "refit",
           "representatives", "member_means", "candidate_mask", "candidate_indices",
           "inverted_lists", "lists_by_rank", "representative_scores", "group_capacity",
           "index_bytes", "plan", "metric"]


@dataclasses.dataclass(frozen=True)
class IVFConfig:
  """AttentionIndex settings (defaults: the paper's GLM-5.3 values).

  topk: keys each query finally keeps. budget: candidate slots per query (sinks, ungrouped
  keys and group members together). seal_window: keys per seal (W). cluster_size: average
  keys per group (W / cluster_size groups per seal, prefix / cluster_size per refit).
  refit_interval: tokens between refits (R, a multiple of W; 0 = seal only). sink: leading
  keys every query always scores. seal_iters: Lloyd steps when sealing a window.
  refit_batch: keys compared with every center at a time during a refit.
  compact: store the index in 16 bits (int16 ids and ranks, bfloat16 bounds, centers and
    representatives: ~12 bytes a key with the representatives at the default cluster_size,
    under 10% of an fp8 indexer key cache's 132); False keeps int32 / float32 (~24 bytes).
  query_block: consecutive queries (positions b * query_block - 1 ...) that share one
    candidate set (method "ivf"): the block ranks the groups by the maximum of its queries'
    representative scores, takes `budget` slots for its last query (sinks, ungrouped keys,
    whole groups) and every query scores them all, keys after it masked. On a GPU/TPU that is
    one dense [query_block x H, D] x [D, budget] product per block instead of a gather per
    query, so a larger budget costs less. 1 (default): every query ranks its own groups.
  """
  topk: int = 2048
  budget: int = 24576
  seal_window: int = 1024
  cluster_size: int = 128
  refit_interval: int = 16384
  sink: int = 16
  seal_iters: int = 8
  refit_batch: int = 16384
  compact: bool = True
  query_block: int = 1

  def __post_init__(self):
    if not isinstance(self.compact, bool):
      raise ValueError(f"compact={self.compact!r} must be a bool")
    from jaxsparse._checks import check_int
    for name in ("topk", "budget", "seal_window", "cluster_size", "seal_iters", "refit_batch",
                 "query_block"):
      check_int(name, getattr(self, name), 1)
    for name in ("refit_interval", "sink"):
      check_int(name, getattr(self, name), 0)
    if self.sink < 0:
      raise ValueError(f"sink={self.sink} must be >= 0")
    if self.cluster_size > self.seal_window:
      raise ValueError(f"cluster_size={self.cluster_size} must not exceed "
                       f"seal_window={self.seal_window}")
    if self.seal_window % self.cluster_size:
      raise ValueError(f"cluster_size={self.cluster_size} must divide "
                       f"seal_window={self.seal_window}")
    if self.seal_window % self.query_block:
      raise ValueError(f"query_block={self.query_block} must divide "
                       f"seal_window={self.seal_window}")
    if self.sink >= self.seal_window:
      raise ValueError(f"sink={self.sink} must be below seal_window={self.seal_window}")
    if self.refit_interval < 0 or self.refit_interval % self.seal_window:
      raise ValueError(f"refit_interval={self.refit_interval} must be a multiple of "
                       f"seal_window={self.seal_window} (0: seal only)")
    fixed = self.sink + self.seal_window
    if self.budget <= fixed:
      raise ValueError(f"budget={self.budget} must exceed the fixed slots: sink + seal_window "
                       f"= {fixed}")
    if self.topk > self.budget:
      raise ValueError(f"topk={self.topk} must not exceed budget={self.budget}")

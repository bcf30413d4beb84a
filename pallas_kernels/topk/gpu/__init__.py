"""Threshold-filter top-K passes on GPU (Pallas, Triton backend), a module per pass:

  threshold: group maxima of `g` consecutive entries (one streaming pass, invalid entries
             -inf), then one program per row finds a value that k maxima reach (no sort);
  refine:    for large gathering calls, counting passes over the listed groups raise it;
  compact:   the entries at or above it into a per-row candidate buffer, in index order
             (count, then compact at offsets from a scan of the counts) or in one pass with
             atomic reservations (`compact_atomic`, `compact_groups`: only listed groups);
  repair:    exact top-k for rows that overflow the buffer (before a finish, or inside it);
  finishes:  the candidates as the k best: `select` (a set in index order, no sort), `rank`
             (sorting by counting), `bitonic` (a sorting network in registers, `network`,
             whole or split into runs and merges; `merge`: the rank merge of runs).
Index order is what makes `lax.top_k` over candidates break ties by lower index; the
order-free finishes sort by (value, index) and need no order. `pallas_kernels.topk.topk_rows`
chains the passes.
"""
from __future__ import annotations

from pallas_kernels.topk.gpu._common import COUNTER_STRIDE, NEG_INF
from pallas_kernels.topk.gpu.bitonic import bitonic_finish, bitonic_finish_split
from pallas_kernels.topk.gpu.compact import (PLACEMENTS, compact, compact_atomic, compact_groups,
                                             count, counter_dtype)
from pallas_kernels.topk.gpu.rank import rank_finish
from pallas_kernels.topk.gpu.refine import count_groups, refine_threshold
from pallas_kernels.topk.gpu.repair import repair
from pallas_kernels.topk.gpu.select import (index_order_finish, select_mask, take_best,
                                            take_best_keys)
from pallas_kernels.topk.gpu.threshold import group_max, threshold

__all__ = [
    "NEG_INF", "COUNTER_STRIDE", "PLACEMENTS", "counter_dtype", "compact_atomic",
    "compact_groups", "count_groups", "refine_threshold", "threshold", "group_max", "count",
    "compact", "repair", "take_best", "take_best_keys", "select_mask", "rank_finish",
    "index_order_finish", "bitonic_finish", "bitonic_finish_split"
]

"""jaxsparse: the DeepSeek Sparse Attention indexer made cheap at long context, in JAX/Pallas."""
from jaxsparse.indexer import indexer_scores, paged_indexer_scores, row_lengths
from jaxsparse import prep

__all__ = ["indexer_scores", "paged_indexer_scores", "row_lengths", "prep"]
__version__ = "0.1.0"
from jaxsparse.selection import (causal_prefill_topk, indexer_topk, merge_topk,  # noqa: E402
                                 prefill_topk, topk)

__all__ += ["topk", "indexer_topk", "merge_topk", "prefill_topk", "causal_prefill_topk"]

"""Context-parallel (sequence-sharded) prefill of the DSA indexer over a device mesh: full DSA
(`sharded_prefill_topk`) and AttentionIndex with one index per shard
(`sharded_ivf_prefill_topk`)."""
from jaxsparse.distributed.ivf import sharded_ivf_prefill_topk
from jaxsparse.distributed.prefill import (STRATEGIES, balanced_order, sharded_prefill_topk,
                                           quantize_keys_fp8)

__all__ = ["sharded_prefill_topk", "sharded_ivf_prefill_topk", "balanced_order",
           "quantize_keys_fp8", "STRATEGIES"]

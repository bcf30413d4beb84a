"""Training entry points for jaxsparse's small networks.

`train.indexer`: the lightning indexers of the real model (DeepSeek-V3.2 dense warm-up).
"""

"""Training entry points for jaxsparse's small networks (lightning indexer, corrector).

Nothing trains yet: the lightning-indexer warm-up lands with the real-model capability (issue 3).
"""

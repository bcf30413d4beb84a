"""A real DSA model for evaluation: SmolLM2-135M (GGUF, offline) plus trained lightning indexers."""

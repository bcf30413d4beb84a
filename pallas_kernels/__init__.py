"""Pallas kernels behind jaxsparse: one folder per op, one file per backend (gpu.py, tpu.py)."""
# Importing jax.experimental.pallas.tpu registers a config option that is part of jax's trace
# context (jax 0.11). Imported lazily, part-way through the first compiled call, it changes
# every jit cache key afterwards, so the next call recompiles every program once (most of the
# wall time of a 1M-token AttentionIndex prefill). Imported here, before anything compiles, it
# cannot.
import jax.experimental.pallas.tpu  # noqa: F401

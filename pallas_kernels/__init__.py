"""Pallas kernels behind jaxsparse: one folder per op, one file per backend (gpu.py, tpu.py)."""

"""Shared fixtures: GPU marker handling and tolerance helpers."""
from __future__ import annotations

import jax
import numpy as np
import pytest


def has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if item.get_closest_marker("gpu") is not None:
      item.add_marker(skip)


def assert_scores_close(out, ref, *, dtype_tol=2e-2, reduction=1):
  """-inf pattern must match exactly; finite values within a dtype-keyed relative tolerance."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert not np.isnan(out).any(), "NaN in output"
  fin = np.isfinite(ref)
  np.testing.assert_array_equal(np.isfinite(out), fin)
  np.testing.assert_array_equal(out[~fin], ref[~fin])
  if fin.any():
    err = np.linalg.norm(out[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), 1e-30)
    assert err < dtype_tol * max(1.0, np.sqrt(reduction) / 16), f"relative error {err}"

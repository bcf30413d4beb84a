"""Atomic file writes: a crash never leaves a half-written file under the final name."""
from __future__ import annotations

import os

import numpy as np

__all__ = ["save_npz_atomic"]


def save_npz_atomic(path: str, arrays: dict, *, compressed: bool = False) -> None:
  """Write `arrays` as an npz next to `path`, then rename it into place."""
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  tmp = os.path.join(d, f".{os.path.basename(path)}.tmp")
  with open(tmp, "wb") as f:
    (np.savez_compressed if compressed else np.savez)(f, **arrays)
  os.replace(tmp, path)

"""Atomic file writes: a crash never leaves a half-written file under the final name."""
from __future__ import annotations

import contextlib
import os

import numpy as np

__all__ = ["save_npz_atomic", "open_npz"]


def _read_errors():
  import zipfile
  import zlib
  return (ValueError, OSError, EOFError, KeyError, TypeError, zlib.error, zipfile.BadZipFile)


def _why(e) -> str:
  """A short reason for a failed read, never numpy's advice to allow pickles."""
  msg = str(e)
  if "Object arrays" in msg:  # a member saved with allow_pickle
    return "it holds pickled Python objects, which are never loaded"
  if "pickle" in msg:  # numpy's word for a file that is neither .npy nor .npz
    return "not an npz archive"
  return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


@contextlib.contextmanager
def open_npz(path: str, error: type, what: str):
  """`np.load(path, allow_pickle=False)` as a context manager whose every read failure (not an
  archive, a damaged member, a field of the wrong type) raises `error` naming the file and
  `what` it should be. Errors of type `error` raised inside pass through unchanged."""
  errors = _read_errors()
  try:
    z = np.load(path, allow_pickle=False)
  except errors as e:
    raise error(f"{path!r} is not a readable {what}: {_why(e)}") from None
  if not isinstance(z, np.lib.npyio.NpzFile):
    raise error(f"{path!r} is not a readable {what}: a single .npy array, not an npz archive")
  try:
    with z:
      yield z
  except error:
    raise
  except errors as e:
    raise error(f"{path!r} is a damaged {what}: {_why(e)}") from None


def save_npz_atomic(path: str, arrays: dict, *, compressed: bool = False) -> None:
  """Write `arrays` as an npz next to `path`, then rename it into place."""
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  tmp = os.path.join(d, f".{os.path.basename(path)}.tmp")
  with open(tmp, "wb") as f:
    (np.savez_compressed if compressed else np.savez)(f, **arrays)
  os.replace(tmp, path)

"""Real text that ships with Python: the reference docs (prose) and standard-library code."""
from __future__ import annotations

import os
import sysconfig


def python_docs() -> str:
  """CPython's reference documentation topics (English prose), concatenated in key order."""
  from pydoc_data.topics import topics
  return "\n\n".join(topics[k] for k in sorted(topics))


def stdlib_source(name: str = "_pydecimal.py") -> str:
  """Source code of one standard-library module file."""
  path = os.path.join(sysconfig.get_paths()["stdlib"], name)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{name!r} is not a file of the standard library at {path}")
  with open(path, encoding="utf-8") as f:
    return f.read()


def corpus(kind: str) -> str:
  if kind == "docs":
    return python_docs()
  if kind == "code":
    return stdlib_source()
  raise ValueError(f"kind={kind!r} must be 'docs' or 'code'")

"""Real text: CPython's docs and standard library (always present) and the Linux documentation.

Training and evaluation never share a source: the lightning indexers train on long documents
(`training_documents`: standard-library modules and, where installed, the Linux kernel's
Documentation/*.rst), and quality is measured on `held_out_text` (the Python reference docs).
"""
from __future__ import annotations

import glob
import os
import sysconfig
import tarfile

__all__ = ["python_docs", "stdlib_source", "stdlib_modules", "linux_documentation",
           "training_documents", "held_out_text", "corpus"]

LINUX_TARBALL = "/usr/src/linux-source-6.1.tar.xz"


def python_docs() -> str:
  """CPython's reference documentation topics (English prose), concatenated in key order."""
  from pydoc_data.topics import topics
  return "\n\n".join(topics[k] for k in sorted(topics))


def held_out_text() -> str:
  """The evaluation text: English prose that indexer training never reads."""
  return python_docs()


def stdlib_source(name: str = "_pydecimal.py") -> str:
  """Source code of one standard-library module file."""
  path = os.path.join(sysconfig.get_paths()["stdlib"], name)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{name!r} is not a file of the standard library at {path}")
  with open(path, encoding="utf-8") as f:
    return f.read()


def stdlib_modules(min_chars: int = 20000) -> list[str]:
  """Every standard-library module of at least `min_chars` characters (tests excluded), sorted
  by path: long documents of code, comments and docstrings."""
  root = sysconfig.get_paths()["stdlib"]
  docs = []
  for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
    rel = os.path.relpath(path, root)
    if rel.startswith(("test", "site-packages", "idlelib/idle_test")) or "/test" in rel:
      continue
    try:
      with open(path, encoding="utf-8") as f:
        s = f.read()
    except (UnicodeDecodeError, OSError):
      continue
    if len(s) >= min_chars:
      docs.append(s)
  return docs


def linux_documentation(source: str | None = None, min_chars: int = 8000) -> list[str]:
  """The Linux kernel's Documentation/*.rst files (English prose) of at least `min_chars`.

  source: an extracted tree holding a `Documentation` folder, or the Debian `linux-source-6.1`
  tarball (default `/usr/src/linux-source-6.1.tar.xz`; `apt-get install linux-source-6.1`).
  Returns [] when neither exists.
  """
  source = source or LINUX_TARBALL
  docs = []
  if os.path.isdir(source):
    for path in sorted(glob.glob(os.path.join(source, "**", "Documentation", "**", "*.rst"),
                                 recursive=True)):
      with open(path, encoding="utf-8", errors="replace") as f:
        docs.append(f.read())
  elif os.path.isfile(source):
    with tarfile.open(source, "r:xz") as tf:
      for m in tf:
        if m.isfile() and "/Documentation/" in m.name and m.name.endswith(".rst"):
          docs.append(tf.extractfile(m).read().decode("utf-8", errors="replace"))
  return [d for d in docs if len(d) >= min_chars]


def training_documents(linux_source: str | None = None) -> list[str]:
  """Long documents for indexer training: standard-library modules, then Linux docs."""
  return stdlib_modules() + linux_documentation(linux_source)


def corpus(kind: str) -> str:
  if kind == "docs":
    return python_docs()
  if kind == "code":
    return stdlib_source()
  raise ValueError(f"kind={kind!r} must be 'docs' or 'code'")

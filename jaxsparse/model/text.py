"""Real text: CPython's docs and standard library (always present) and the Linux documentation.

Training and evaluation never share a source: the lightning indexers train on long documents
(`training_documents`: standard-library modules and, where installed, the Linux kernel's
Documentation/*.rst), and quality is measured on `held_out_text` (the Python reference docs)
or, as a second held-out text, `numpy_docs` (NumPy's API docstrings).

`python -m jaxsparse.model.text --name pydoc|numpy --out FILE` writes a held-out text to a file
(for `jaxsparse quality --text FILE`).
"""
from __future__ import annotations

import glob
import os
import sysconfig
import tarfile

__all__ = ["python_docs", "numpy_docs", "stdlib_source", "stdlib_modules",
           "linux_documentation", "training_documents", "held_out_text", "HELD_OUT", "corpus"]

LINUX_TARBALL = "/usr/src/linux-source-6.1.tar.xz"


def python_docs() -> str:
  """CPython's reference documentation topics (English prose), concatenated in key order."""
  from pydoc_data.topics import topics
  return "\n\n".join(topics[k] for k in sorted(topics))


def held_out_text() -> str:
  """The evaluation text: English prose that indexer training never reads."""
  return python_docs()


def numpy_docs(min_chars: int = 200) -> str:
  """NumPy's API docstrings (English prose, parameters and examples; numpy's own objects
  only), each public object of numpy and its linalg, fft, random, ma and polynomial modules
  once, in name order: a second held-out text (training reads none of it)."""
  import inspect

  import numpy as np
  seen, docs = set(), []
  for mod in (np, np.linalg, np.fft, np.random, np.ma, np.polynomial):
    for name in sorted(dir(mod)):
      obj = getattr(mod, name, None)
      if name.startswith("_") or id(obj) in seen or isinstance(obj, (int, float, str)):
        continue
      seen.add(id(obj))
      if not str(getattr(obj, "__module__", "") or "").startswith("numpy"):
        continue
      d = inspect.getdoc(obj)
      if d and len(d) >= min_chars:
        docs.append(d)
  return "\n\n".join(docs)


HELD_OUT = {"pydoc": python_docs, "numpy": numpy_docs}


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


def main(argv=None) -> int:
  import argparse
  p = argparse.ArgumentParser(prog="python -m jaxsparse.model.text",
                              description="Write a held-out text to a file.")
  p.add_argument("--name", choices=sorted(HELD_OUT), required=True,
                 help="pydoc: Python's reference docs; numpy: NumPy's docstrings")
  p.add_argument("--out", required=True, help="UTF-8 text file to write")
  args = p.parse_args(argv)
  s = HELD_OUT[args.name]()
  tmp = args.out + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(s)
  os.replace(tmp, args.out)
  print(f"wrote {args.out}: {len(s):,} characters")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

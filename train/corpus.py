"""Write the indexer training corpus as token ids (.npy, uint16): long documents, no eval text.

  python -m train.corpus --out train_tokens.npy --tokens 4200000

Standard-library modules first, then the Linux Documentation/*.rst files (needs
`apt-get install linux-source-6.1`, or --linux pointing at an extracted tree or the .tar.xz),
each followed by <|endoftext|>, cut to --tokens. --out must end in .npy and is written exactly
there. `python -m train.indexer --corpus` reads the file; pre-tokenising lets a machine without
the Linux sources (a GPU box) train on the same ids.
"""
from __future__ import annotations

import glob
import os
import sys

import numpy as np

__all__ = ["build", "check_linux", "main"]

XZ_MAGIC = b"\xfd7zXZ\x00"
CHARS_PER_TOKEN = 3  # the standard library's modules tokenise at more (3.65 on average)


def check_without_linux(tokens: int) -> None:
  """Without the Linux sources only the standard-library modules are read: ValueError naming
  --tokens when they cannot hold `tokens` ids (fewer than one a CHARS_PER_TOKEN characters),
  found before anything is tokenised."""
  from jaxsparse.model import text
  chars = sum(len(d) for d in text.stdlib_modules())
  if tokens > chars // CHARS_PER_TOKEN:
    raise ValueError(f"--tokens={tokens} needs the Linux documentation: the standard-library "
                     f"modules alone ({chars:,} characters) hold fewer than "
                     f"{chars // CHARS_PER_TOKEN:,} tokens, and {text.LINUX_TARBALL} does not "
                     f"exist (install linux-source-6.1, pass --linux, or lower --tokens)")


def build(tokens: int, linux: str | None = None) -> np.ndarray:
  from jaxsparse.model import gguf_weights, text
  tok = gguf_weights.tokenizer()
  docs = text.stdlib_modules() + text.linux_documentation(linux)
  ids = []
  for lo in range(0, len(docs), 16):  # batches of documents: stop once there are enough
    for e in tok.encode_batch(docs[lo:lo + 16]):
      ids.extend(e.ids)
      ids.append(0)  # <|endoftext|>
    if len(ids) >= tokens:
      break
  return np.asarray(ids[:tokens], np.uint16)


def check_linux(path: str) -> None:
  """--linux: an extracted Linux tree (a folder holding Documentation/, at its top or one
  level down) or an xz-compressed tarball; ValueError naming the option for anything else."""
  if os.path.isdir(path):
    if not any(os.path.isdir(d) for d in
               glob.glob(os.path.join(glob.escape(path), "Documentation")) +
               glob.glob(os.path.join(glob.escape(path), "*", "Documentation"))):
      raise ValueError(f"--linux={path!r} is a folder without Documentation/: not an "
                       f"extracted Linux tree (give its top folder, or the .tar.xz of "
                       f"linux-source-6.1)")
    return
  if not os.path.isfile(path):
    raise ValueError(f"--linux={path!r} does not exist (an extracted Linux tree or the "
                     f".tar.xz of linux-source-6.1)")
  try:
    with open(path, "rb") as f:
      magic = f.read(len(XZ_MAGIC))
  except OSError as e:
    raise ValueError(f"--linux={path!r} cannot be read: {e.strerror}") from None
  if magic != XZ_MAGIC:
    raise ValueError(f"--linux={path!r} is not an xz-compressed tarball (the .tar.xz of "
                     f"linux-source-6.1) nor a folder")


def main(argv=None) -> int:
  from jaxsparse.cli._common import CliError, Parser, check_out, integer
  p = Parser(prog="python -m train.corpus", description=__doc__)
  p.add_argument("--out", required=True, help=".npy of uint16 token ids to write (the name "
                 "must end in .npy)")
  p.add_argument("--tokens", type=integer("--tokens"), default=4_200_000,
                 help="token ids to write (default 4200000: needs the Linux documentation)")
  p.add_argument("--linux", default=None, help="extracted Linux tree or .tar.xz tarball "
                 "(default /usr/src/linux-source-6.1.tar.xz, from `apt-get install "
                 "linux-source-6.1`)")
  a = p.parse_args(argv)
  try:
    check_out("--out", a.out, (".npy",))
    if a.linux is not None:
      check_linux(a.linux)
    else:
      from jaxsparse.model import text
      if not os.path.exists(text.LINUX_TARBALL):
        check_without_linux(a.tokens)
  except (CliError, ValueError) as e:
    p.error(str(e))
  from jaxsparse.model.fetch import FetchError
  try:
    ids = build(a.tokens, a.linux)
  except FetchError as e:
    p.error(str(e))
  if len(ids) < a.tokens:
    p.error(f"the documents hold only {len(ids):,} tokens (< --tokens={a.tokens}): install "
            f"linux-source-6.1, pass --linux, or lower --tokens")
  np.save(a.out, ids)
  print(f"wrote {len(ids)} token ids to {a.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

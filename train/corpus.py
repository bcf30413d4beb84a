"""Write the indexer training corpus as token ids (.npy, uint16): long documents, no eval text.

  python -m train.corpus --out train_tokens.npy --tokens 4200000

Standard-library modules first, then the Linux Documentation/*.rst files (needs
`apt-get install linux-source-6.1`, or --linux pointing at an extracted tree), each followed by
<|endoftext|>, cut to --tokens. `python -m train.indexer --corpus` reads the file; pre-tokenising
lets a machine without the Linux sources (a GPU box) train on the same ids.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

__all__ = ["build", "main"]


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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.corpus", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help=".npy of uint16 token ids to write")
  p.add_argument("--tokens", type=int, default=4_200_000,
                 help="token ids to write (default 4200000: needs the Linux documentation)")
  p.add_argument("--linux", default=None, help="extracted Linux tree or tarball (default "
                 "/usr/src/linux-source-6.1.tar.xz, from `apt-get install linux-source-6.1`)")
  a = p.parse_args(argv)
  if a.tokens < 1:
    p.error(f"--tokens={a.tokens} must be positive")
  ids = build(a.tokens, a.linux)
  if len(ids) < a.tokens:
    p.exit(2, f"{p.prog}: error: the documents hold only {len(ids):,} tokens (< --tokens="
              f"{a.tokens}): install linux-source-6.1, pass --linux, or lower --tokens\n")
  np.save(a.out, ids)
  print(f"wrote {len(ids)} token ids to {a.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""`jaxsparse train indexer|corrector`: the training entry points of `train/`, which own their
options (`train/indexer.py` and `train/corrector.py` parse them, --help included)."""
from __future__ import annotations

import argparse

from ._common import FORMATTER

__all__ = ["HELP", "add_parser", "dispatch"]

HELP = """\
Train the lightning indexers of every layer (DeepSeek-V3.2's dense warm-up: KL to the
head-summed attention, base model frozen), with a length curriculum up to 8,192 tokens.
The shipped indexers took 1,800 steps (about 9 minutes on one H200); a CPU run is for small
--schedule values only.

examples:
  jaxsparse train indexer --out runs/idx --schedule 2048:300,4096:200,8192:1300
  jaxsparse train indexer --out runs/tiny --window 128 --steps 10 --layers 2 --eval-tokens 256
  jaxsparse train corrector --train-trace train.npz --eval-trace heldout.npz --out runs/corr
"""


def add_parser(sub) -> None:
  """Register `train` (and its old spelling `train-indexer`) for the top-level help."""
  for name in ("train", "train-indexer"):
    r = sub.add_parser(name, help="train the lightning indexers" if name == "train" else
                       argparse.SUPPRESS, description=HELP, formatter_class=FORMATTER,
                       add_help=name == "train")
    if name == "train":
      what = r.add_subparsers(dest="what", required=True, metavar="WHAT")
      what.add_parser("indexer", help="lightning indexers (options: "
                      "`jaxsparse train indexer --help`)")
      what.add_parser("corrector", help="AttentionIndex representative corrections (options: "
                      "`jaxsparse train corrector --help`)")


def dispatch(argv: list) -> int | None:
  """Run `train indexer` / `train corrector` argv with their own parsers; None for others."""
  if argv[:2] == ["train", "indexer"] or argv[:1] == ["train-indexer"]:
    from train import indexer
    rest = argv[2:] if argv[0] == "train" else argv[1:]
    return indexer.main(rest, prog="jaxsparse train indexer")
  if argv[:2] == ["train", "corrector"]:
    from train import corrector
    return corrector.main(argv[2:], prog="jaxsparse train corrector")
  return None

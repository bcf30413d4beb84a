"""`jaxsparse train indexer|corrector`: the training entry points of `train/`, which own their
options (`train/indexer.py` and `train/corrector.py` parse them, --help included)."""
from __future__ import annotations

import os
import textwrap

from ._common import FORMATTER

__all__ = ["HELP", "shipped_provenance", "add_parser", "dispatch"]

HELP = """\
Train the lightning indexers of every layer (DeepSeek-V3.2's dense warm-up: KL to the
head-summed attention, base model frozen), with a length curriculum up to 8,192 tokens.
{provenance}
A CPU run is for small --schedule or --window values only.

examples:
  jaxsparse train indexer --out runs/idx --schedule 2048:300,4096:200,8192:700 \\
      --max-seconds 420                   (the run of the shipped indexers, on one GPU)
  jaxsparse train indexer --out runs/tiny --window 128 --steps 10 --num-layers 2 \\
      --eval-windows 1 --eval-tokens 256 --recall-k 64          (a CPU-sized run)
  jaxsparse train corrector --train-trace train.npz --eval-trace heldout.npz --out runs/corr
"""


def shipped_provenance() -> str:
  """How the shipped indexers were trained, read from their file's own metadata."""
  import json

  import numpy as np
  from jaxsparse.model import lightning
  path = lightning.default_indexers_path()
  with np.load(path, allow_pickle=False) as z:
    m = json.loads(str(z["meta"]))
  total = sum(int(stage.split(":")[1]) for stage in m["schedule"].split(","))
  stop = " (stopped there by --max-seconds)" if m.get("stopped_early") else ""
  return textwrap.fill(
      f"The shipped indexers ({os.path.basename(path)}) ran {m['steps_done']:,} of the "
      f"{total:,} steps of --schedule {m['schedule']} in {m['train_seconds'] / 60:.0f} minutes "
      f"on one {m['trained_on']}{stop}.", width=95, break_on_hyphens=False)


def add_parser(sub) -> None:
  """Register `train` for the top-level help (`dispatch` runs it, and the old spelling
  `train-indexer`, before the top-level parser sees them)."""
  r = sub.add_parser("train", help="train the lightning indexers or AttentionIndex's "
                     "corrections", description=HELP.format(provenance=shipped_provenance()),
                     formatter_class=FORMATTER)
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

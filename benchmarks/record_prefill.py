"""Record a prefill trace of the held-out text with the shipped indexers (chunked forward).

  python benchmarks/record_prefill.py --tokens 8192 --out prefill_8k.npz [--layers 3,15,27]
  python benchmarks/record_prefill.py --tokens 4096 --ids train_tokens.npy --offset 500000 \
      --out train_4k.npz          (training text: token ids from `python -m train.corpus`)

Past 8,192 tokens the trace is labelled extrapolated (the model's trained context).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxsparse import traces  # noqa: E402
from jaxsparse.model import lightning, llama, make_assets, record  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--layers", default="")
  p.add_argument("--ids", default="", help="token ids (.npy) instead of the held-out text")
  p.add_argument("--offset", type=int, default=0, help="first token taken from --ids")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  if a.ids:
    import numpy as np
    ids = np.load(a.ids, allow_pickle=False)[a.offset: a.offset + a.tokens].astype(np.int32)
    source = f"token ids {a.offset:,}..{a.offset + len(ids):,} of {os.path.basename(a.ids)}"
  else:
    ids = make_assets.held_out_ids()[: a.tokens]
    source = make_assets.SOURCE
  layers = [int(v) for v in a.layers.split(",")] if a.layers else None
  tr = record.record_prefill(llama.load_model(), lightning.load_indexers(), ids, layers=layers,
                             source=source)
  traces.save(a.out, tr, half=True)
  print(f"wrote {a.out}: layers {tr.layers.tolist()}, {len(ids)} tokens, "
        f"extrapolated={tr.meta['extrapolated']}")


if __name__ == "__main__":
  main()

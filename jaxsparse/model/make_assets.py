"""Build the shipped traces and the real-model quality report from trained indexers.

  python -m jaxsparse.model.make_assets --indexers runs/indexer/indexers.npz

Writes into --data-dir: smollm2_indexers.npz (--indexers in the current file format),
smollm2_decode.npz (R = 1, 4,096 slots) and smollm2_mtp.npz (R = 4), recorded on the end of the
held-out text (float16 on disk); and
--report (benchmarks/results/dsa_quality.json): dense vs DSA perplexity and per-layer recall at
4,096 and 8,192 tokens on held-out windows.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from jaxsparse import quality, traces
from jaxsparse._bench.timing import environment, write_json
from jaxsparse.model import gguf_weights, lightning, llama, record, text

__all__ = [
    "TRACE_LAYERS", "MTP_LAYERS", "SOURCE", "held_out_ids", "main"
]


TRACE_LAYERS = (0, 5, 10, 15, 20, 25, 29)
MTP_LAYERS = (5, 15, 25)
PROMPT, STEPS, MTP_STEPS = 3584, 512, 256
SOURCE = "python docs (pydoc_data.topics): held out from indexer training"


def held_out_ids():
  return np.asarray(gguf_weights.tokenizer().encode(text.held_out_text()).ids, np.int32)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--indexers", required=True, help="indexers.npz from train.indexer")
  p.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "data"))
  p.add_argument("--report", default="benchmarks/results/dsa_quality.json")
  p.add_argument("--windows", type=int, default=4, help="held-out windows per length")
  p.add_argument("--lengths", default="4096,8192")
  only = p.add_mutually_exclusive_group()
  only.add_argument("--quality-only", action="store_true", help="write the report, not the traces")
  only.add_argument("--traces-only", action="store_true",
                    help="write the traces and the indexer copy, not the report")
  a = p.parse_args(argv)
  base = llama.load_model()
  idx = lightning.load_indexers(a.indexers, layers=base.cfg.layers, width=base.cfg.width)
  ids = held_out_ids()
  rep = {"environment": environment(), "indexers": os.path.basename(a.indexers),
         "held_out": SOURCE, "quality": {}}
  for t in ([] if a.traces_only else (int(v) for v in a.lengths.split(","))):
    wins = [ids[i * t:(i + 1) * t] for i in range(min(a.windows, len(ids) // t))]
    rep["quality"][str(t)] = quality.measure(base, idx, wins, ks=(64, 256), progress=print,
                                                oracle=True)
    q = rep["quality"][str(t)]
    print(t, q["perplexity"], "min recall256", min(q["recall_top256"]))
  if not a.traces_only:
    write_json(a.report, rep)
  if a.quality_only:
    return
  tail = ids[-(PROMPT + STEPS + 3):]
  dec = record.record_decode(base, idx, tail, prompt_len=PROMPT, steps=STEPS, rows=1,
                             layers=TRACE_LAYERS, source=SOURCE)
  traces.save(os.path.join(a.data_dir, "smollm2_decode.npz"), dec, half=True)
  mtp = record.record_decode(base, idx, tail, prompt_len=PROMPT, steps=MTP_STEPS, rows=4,
                             layers=MTP_LAYERS, source=SOURCE)
  traces.save(os.path.join(a.data_dir, "smollm2_mtp.npz"), mtp, half=True)
  dest = os.path.join(a.data_dir, "smollm2_indexers.npz")
  if os.path.abspath(a.indexers) != os.path.abspath(dest):  # rewritten in the current format
    raw = np.load(a.indexers, allow_pickle=False)
    lightning.save_indexers(dest, idx.cfg, idx.params_tree(), json.loads(str(raw["meta"])))


if __name__ == "__main__":
  main()

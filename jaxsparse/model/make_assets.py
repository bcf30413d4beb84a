"""Build the shipped decode traces and the real-model quality report from trained indexers.

  python -m jaxsparse.model.make_assets --indexers runs/indexer_w512

Writes jaxsparse/data/smollm2_decode.npz (R = 1) and jaxsparse/data/smollm2_mtp.npz (R = 4),
recorded on held-out text (the end of the Python docs, which training never saw), and
benchmarks/results/dsa_quality.json (perplexity: dense vs DSA top-K, per-layer recall).
"""
from __future__ import annotations

import argparse
import json
import os

import jax.numpy as jnp
import numpy as np

from jaxsparse import spin, traces
from jaxsparse.benchtools import environment, write_json
from jaxsparse.model import gguf_weights, lightning, llama, record, text

TRACE_LAYERS = (0, 5, 10, 15, 20, 25, 29)
MTP_LAYERS = (5, 15, 25)


def held_out_tokens(n: int):
  """The last n tokens of the Python docs: inside the held-out windows of train/indexer.py."""
  ids = gguf_weights.tokenizer().encode(text.python_docs()).ids
  return ids[-n:]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--indexers", required=True)
  p.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "data"))
  p.add_argument("--report", default="benchmarks/results/dsa_quality.json")
  p.add_argument("--ppl-tokens", type=int, default=1024)
  a = p.parse_args(argv)
  from train.indexer import load_indexers
  base = llama.load_model()
  idx = load_indexers(a.indexers)
  src = "python docs (pydoc_data.topics), last tokens (held out from indexer training)"
  toks = held_out_tokens(1100)
  dec = record.record_decode(base, idx, toks, prompt_len=768, steps=256, rows=1,
                             layers=TRACE_LAYERS, source=src)
  traces.save(os.path.join(a.data_dir, "smollm2_decode.npz"), dec)
  mtp = record.record_decode(base, idx, toks, prompt_len=768, steps=128, rows=4,
                             layers=MTP_LAYERS, source=src)
  traces.save(os.path.join(a.data_dir, "smollm2_mtp.npz"), mtp)
  # quality: perplexity of dense vs DSA top-K on held-out prose and code
  rep = {"environment": environment(), "indexers": a.indexers, "tokens": a.ppl_tokens,
         "perplexity": {}, "recall": {}}
  code = gguf_weights.tokenizer().encode(text.stdlib_source()).ids[-a.ppl_tokens:]
  for name, ids in (("docs", toks[-a.ppl_tokens:]), ("code", code)):
    ids = jnp.asarray(ids, jnp.int32)
    row = {"dense": llama.perplexity(base(ids), ids)}
    for k in (32, 64, 128, 256):
      row[f"dsa_top{k}"] = llama.perplexity(base(ids, dsa=(idx.cfg, idx.params_tree(), k)), ids)
    # decode half only: dense, DSA top-64, and DSA top-64 with SPIN block selection
    half = a.ppl_tokens // 2
    dsa64 = (idx.cfg, idx.params_tree(), 64)
    row["decode_half"] = {"from_position": half,
                          "dense": llama.perplexity(base(ids), ids, half),
                          "dsa_top64": llama.perplexity(base(ids, dsa=dsa64), ids, half)}
    for rho in (0.2, 0.4, 0.5):
      cfg = spin.SpinConfig(block_size=16, topk=64, sparsity=rho)
      row["decode_half"][f"dsa_top64_spin{int(rho * 100)}"] = llama.perplexity(
          base(ids, dsa=dsa64, spin=(cfg, half)), ids, half)
    _, coll = base(ids, collect=True)
    sc = idx(coll["hidden"])
    rep["recall"][name] = {f"top{k}": np.asarray(lightning.topk_recall(sc, coll["attn"], k)).tolist()
                           for k in (64, 256)}
    rep["recall"][name]["recent64"] = np.asarray(lightning.recent_recall(coll["attn"], 64)).tolist()
    rep["perplexity"][name] = row
  write_json(a.report, rep)
  print(json.dumps(rep["perplexity"], indent=1))


if __name__ == "__main__":
  main()

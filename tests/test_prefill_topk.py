"""jaxsparse.prefill_topk: causal scoring fused with exact top-K (keys streamed in blocks, no
[T, N] buffer) against float64 numpy, and its bad input."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxsparse
from tests.reference import index_ordered, np_indexer, np_topk, prefill_case


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,block,k", [(700, 128, 64), (700, 1024, 64), (300, 64, 300),
                                       (257, 32, 5)])
def test_prefill_topk_matches_float64_reference(fp8, n, block, k):
  rng = np.random.default_rng(n + block + k)
  q, kk, w, pos, ks = prefill_case(rng, 24, 4, 32, n, fp8=fp8)
  z = np_indexer.dense(q, kk, w, ks, pos)  # [T, N] float64, -inf where hidden
  rv, ri = np_topk(z.astype(np.float32), k)
  v, i = jaxsparse.prefill_topk(q, kk, w, k, k_scale=ks, query_positions=pos, block=block)
  np.testing.assert_array_equal(np.asarray(i), ri)
  fin = np.isfinite(rv)
  np.testing.assert_allclose(np.asarray(v)[fin], rv[fin], rtol=1e-5, atol=1e-5)
  assert (np.asarray(v)[~fin] == -np.inf).all()
  vu, iu = jaxsparse.prefill_topk(q, kk, w, k, k_scale=ks, query_positions=pos, block=block,
                                  sorted=False)
  ev, ei = index_ordered(v, i)
  np.testing.assert_array_equal(np.asarray(iu), ei)
  np.testing.assert_array_equal(np.asarray(vu), ev)


def test_prefill_topk_equals_scores_then_topk_under_jit():
  rng = np.random.default_rng(3)
  q, kk, w, pos, _ = prefill_case(rng, 16, 2, 64, 900)
  f = jax.jit(lambda q, k, w, p: jaxsparse.prefill_topk(q, k, w, 48, query_positions=p,
                                                        block=256))
  v, i = f(q, kk, w, pos)
  z = jaxsparse.indexer_scores(q, kk, w, query_positions=pos, implementation="xla")
  rv, ri = jaxsparse.topk(z, 48, implementation="xla")
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))


def test_prefill_topk_bad_input():
  rng = np.random.default_rng(0)
  q, kk, w, pos, _ = prefill_case(rng, 4, 2, 16, 50)
  with pytest.raises(ValueError, match="query_positions"):
    jaxsparse.prefill_topk(q, kk, w, 8, query_positions=None)
  with pytest.raises(ValueError, match="topk=0"):
    jaxsparse.prefill_topk(q, kk, w, 0, query_positions=pos)
  with pytest.raises(NotImplementedError, match="Pallas"):
    jaxsparse.prefill_topk(q, kk, w, 8, query_positions=pos, implementation="pallas")
  with pytest.raises(ValueError):
    jaxsparse.prefill_topk(q, kk[:, :8], w, 8, query_positions=pos)

"""jaxsparse.prefill_topk: causal scoring fused with exact top-K without a [T, N] buffer, on
the plain-JAX path (keys streamed in blocks) and the kernel path (query chunks through the
scoring and top-K kernels: GPU Triton, Mosaic GPU and TPU, interpreted), against float64 numpy;
it lowers for TPU and CUDA; its bad input."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse import selection
from pallas_kernels._platform import KernelPlatform
from tests.conftest import export_for
from tests.reference import index_ordered, np_indexer, np_topk, prefill_case


def _check(v, i, rv, ri):
  np.testing.assert_array_equal(np.asarray(i), ri)
  fin = np.isfinite(rv)
  np.testing.assert_allclose(np.asarray(v)[fin], rv[fin], rtol=1e-5, atol=1e-5)
  assert (np.asarray(v)[~fin] == -np.inf).all()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,block,k", [(700, 128, 64), (700, 1024, 64), (300, 64, 300),
                                       (257, 32, 5)])
def test_prefill_topk_matches_float64_reference(fp8, n, block, k):
  rng = np.random.default_rng(n + block + k)
  q, kk, w, pos, ks = prefill_case(rng, 24, 4, 32, n, fp8=fp8)
  z = np_indexer.dense(q, kk, w, ks, pos)  # [T, N] float64, -inf where hidden
  rv, ri = np_topk(z.astype(np.float32), k)
  v, i = jaxsparse.prefill_topk(q, kk, w, k, k_scale=ks, query_positions=pos, block=block)
  _check(v, i, rv, ri)
  vu, iu = jaxsparse.prefill_topk(q, kk, w, k, k_scale=ks, query_positions=pos, block=block,
                                  sorted=False)
  ev, ei = index_ordered(v, i)
  np.testing.assert_array_equal(np.asarray(iu), ei)
  np.testing.assert_array_equal(np.asarray(vu), ev)


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
@pytest.mark.parametrize("fp8,t,n,k,chunk", [(False, 40, 700, 64, 16), (True, 24, 300, 300, None),
                                             (False, 9, 257, 5, 8)])
def test_prefill_topk_kernels_match_float64_reference(monkeypatch, kind, fp8, t, n, k, chunk):
  """The kernel path, chunks that do not divide T, k >= the visible keys (-inf / -1 tails),
  queries that see nothing: the float64 reference's entries; and exactly the kernel scores
  followed by the kernel top-K, sorted and in index order."""
  monkeypatch.setenv("JAXSPARSE_INTERPRET", kind)
  rng = np.random.default_rng(t + n + k)
  q, kk, w, pos, ks = prefill_case(rng, t, 4, 32, n, fp8=fp8)
  rv, ri = np_topk(np_indexer.dense(q, kk, w, ks, pos).astype(np.float32), k)
  v, i = jaxsparse.prefill_topk(q, kk, w, k, k_scale=ks, query_positions=pos,
                                implementation="pallas", query_chunk=chunk)
  _check(v, i, rv, ri)
  z = jaxsparse.indexer_scores(q, kk, w, k_scale=ks, query_positions=pos, implementation="pallas")
  zv, zi = jaxsparse.topk(z, k, implementation="pallas")
  np.testing.assert_array_equal(np.asarray(i), np.asarray(zi))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(zv))
  vu, iu = jaxsparse.prefill_topk(q, kk, w, k, k_scale=ks, query_positions=pos,
                                  implementation="pallas", query_chunk=chunk, sorted=False)
  ev, ei = index_ordered(v, i)
  np.testing.assert_array_equal(np.asarray(iu), ei)
  np.testing.assert_array_equal(np.asarray(vu), ev)


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_topk_mosaic_chunks_with_key_splits(fp8):
  """Hopper's path in the Mosaic GPU interpreter: chunks of 4 queries are one query group, so
  the scoring kernel splits the keys over two CTAs; the float64 reference's entries."""
  from pallas_kernels.indexer_prefill import PrefillConfig
  cfg = PrefillConfig(kernel="mosaic")
  assert cfg.key_splits_for(1, 8) == 2 and cfg.key_splits_for(256, 8) == 1
  rng = np.random.default_rng(5 + fp8)
  q, kk, w, pos, ks = prefill_case(rng, 10, 16, 128, 512, fp8=fp8)
  rv, ri = np_topk(np_indexer.dense(q, kk, w, ks, pos).astype(np.float32), 32)
  v, i = jaxsparse.prefill_topk(q, kk, w, 32, k_scale=ks, query_positions=pos,
                                implementation="pallas", query_chunk=4, prefill_config=cfg)
  _check(v, i, rv, ri)


def test_prefill_topk_kernels_lower_for_tpu_and_cuda():
  """The kernel path at T=2,048, N=64K lowers for TPU and for CUDA (Triton) with the scoring
  and top-K kernels, holding scores only as [128, N] chunks (the default chunk), never [T, N];
  the Mosaic GPU scoring kernel with split keys lowers for CUDA. (Its compiled memory is
  measured on the H200: benchmarks/bench_prefill_topk.py.)"""
  from pallas_kernels import indexer_prefill, topk as ktopk
  from pallas_kernels.indexer_prefill.mgpu import prefill_scores_mgpu
  S = jax.ShapeDtypeStruct
  t, h, d, n = 2048, 64, 128, 65536
  shapes = (S((t, h, d), jnp.bfloat16), S((n, d), jnp.bfloat16), S((t, h), jnp.float32),
            S((t,), jnp.int32))
  for kind, plat in (("tpu", "tpu"), ("gpu", "cuda")):
    cfg = indexer_prefill.TPU_DEFAULT if kind == "tpu" else indexer_prefill.PrefillConfig()
    f = lambda q, k, w, p: selection._prefill_topk_kernels(  # noqa: E731
        q, k, w, None, p, 2048, True, 128, cfg, ktopk.TopkConfig(), KernelPlatform(kind, False))
    mod = export_for(f, plat, *shapes).mlir_module()
    assert "jaxsparse_prefill" in mod and "jaxsparse_topk" in mod
    assert f"tensor<128x{n}xf32>" in mod and f"tensor<{t}x{n}xf32>" not in mod
  assert selection.default_query_chunk(t) == 128
  exp = export_for(lambda q, k, w, p: prefill_scores_mgpu(q, k, w, p, key_splits=8), "cuda",
                   S((128, h, d), jnp.bfloat16), S((n, d), jnp.bfloat16), S((128, h), jnp.float32),
                   S((128,), jnp.int32))
  assert "mosaic_gpu" in exp.mlir_module()


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
  with pytest.raises(ValueError, match="query_chunk=0"):
    jaxsparse.prefill_topk(q, kk, w, 8, query_positions=pos, implementation="pallas",
                           query_chunk=0)
  with pytest.raises(ValueError, match="prefill_config"):
    jaxsparse.prefill_topk(q, kk, w, 8, query_positions=pos, implementation="pallas",
                           prefill_config="fast")
  with pytest.raises(ValueError, match="sorted"):
    jaxsparse.prefill_topk(q, kk, w, 8, query_positions=pos, sorted="yes")
  with pytest.raises(ValueError):
    jaxsparse.prefill_topk(q, kk[:, :8], w, 8, query_positions=pos)


def test_causal_segments_cover_the_sequence_once():
  for n, s in ((1000, 8), (257, 3), (100, 8), (4096, 1), (70000, 16)):
    seg = selection.causal_segments(n, s)
    assert seg[0][0] == 0 and seg[-1][1] == n and len(seg) <= s
    assert all(a[1] == b[0] for a, b in zip(seg, seg[1:])) and all(lo < hi for lo, hi in seg)
    assert all(hi % 256 == 0 for _, hi in seg[:-1])
  # the work counted in (query, key) pairs: about (S + 1) / 2S of the square
  seg = selection.causal_segments(1 << 16, 8)
  work = sum((hi - lo) * hi for lo, hi in seg) / (1 << 32)
  assert abs(work - 9 / 16) < 1e-3
  with pytest.raises(ValueError, match="segments=0"):
    selection.causal_segments(10, 0)


@pytest.mark.parametrize("impl,fp8,n,k,segments,start,t", [("xla", False, 700, 64, 4, 0, 700),
                                                           ("xla", True, 513, 300, 8, 0, 513),
                                                           ("xla", False, 640, 40, 3, 200, 300),
                                                           ("tpu", False, 300, 32, 3, 0, 300),
                                                           ("gpu", True, 300, 48, 2, 100, 150)])
def test_causal_prefill_topk_matches_float64_reference(monkeypatch, impl, fp8, n, k, segments,
                                                       start, t):
  """A whole sequence (start 0, T = N) or a chunk of one (queries at start.. with later keys
  present but hidden), segments that split it unevenly, K above the early queries' visible
  keys: the float64 reference's entries, and exactly prefill_topk's over all keys."""
  if impl != "xla":
    monkeypatch.setenv("JAXSPARSE_INTERPRET", impl)
  implementation = "xla" if impl == "xla" else "pallas"
  rng = np.random.default_rng(n + k)
  q, kk, w, _, ks = prefill_case(rng, t, 2, 32, n, fp8=fp8)
  pos = np.arange(start, start + t)
  rv, ri = np_topk(np_indexer.dense(q, kk, w, ks, pos).astype(np.float32), k)
  v, i = jaxsparse.causal_prefill_topk(q, kk, w, k, start=start, k_scale=ks, segments=segments,
                                       key_align=100 if start else 1,
                                       implementation=implementation)
  assert v.shape == (t, k) and i.shape == (t, k) and i.dtype == jnp.int32
  _check(v, i, rv, ri)
  fv, fi = jaxsparse.prefill_topk(q, kk, w, k, k_scale=ks, query_positions=jnp.asarray(pos),
                                  implementation=implementation)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(fi))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(fv))


def test_causal_prefill_topk_bad_input():
  rng = np.random.default_rng(1)
  q, kk, w, _, _ = prefill_case(rng, 50, 2, 16, 50)
  with pytest.raises(ValueError, match=r"start \+ T = 60"):
    jaxsparse.causal_prefill_topk(q[:40], kk, w[:40], 8, start=20)
  with pytest.raises(ValueError, match="key_align=0"):
    jaxsparse.causal_prefill_topk(q, kk, w, 8, key_align=0)
  with pytest.raises(ValueError, match="start=-1"):
    jaxsparse.causal_prefill_topk(q[:40], kk, w[:40], 8, start=-1)
  with pytest.raises(ValueError, match="segments=0"):
    jaxsparse.causal_prefill_topk(q, kk, w, 8, segments=0)
  with pytest.raises(ValueError, match="topk=0"):
    jaxsparse.causal_prefill_topk(q, kk, w, 0)

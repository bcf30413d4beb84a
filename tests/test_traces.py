"""Trace format (save/load/validation), recording with the real model, and eval replay."""
from __future__ import annotations


import numpy as np
import pytest
from flax import nnx

from jaxsparse import evaluate, traces
from jaxsparse.model import gguf_weights, lightning, llama, record, text


def _tiny_decode(s=6, r=2, n=40, layers=2, h=2, d=8, seed=0):
  rng = np.random.default_rng(seed)
  return traces.DecodeTrace(
      q=rng.standard_normal((layers, s, r, h, d)).astype(np.float32),
      w=rng.standard_normal((layers, s, r, h)).astype(np.float32),
      k=rng.standard_normal((layers, n, d)).astype(np.float32),
      lengths=np.arange(n - s + 1, n + 1, dtype=np.int32),
      accepted=np.zeros(s, np.int32), layers=np.arange(layers, dtype=np.int32),
      meta={"source": "random"})


def test_roundtrip(tmp_path):
  tr = _tiny_decode()
  p = str(tmp_path / "t.npz")
  traces.save(p, tr)
  back = traces.load(p)
  assert back.kind == "decode" and back.meta == {"source": "random"}
  for f in ("q", "w", "k", "lengths", "accepted", "layers"):
    np.testing.assert_array_equal(getattr(back, f), getattr(tr, f))
  pre = traces.PrefillTrace(q=tr.q[:, :, 0], w=tr.w[:, :, 0], k=tr.k[:, :6], layers=tr.layers,
                            meta={})
  traces.save(p, pre)
  assert traces.load(p).kind == "prefill"


def test_half_traces_store_float16_and_load_float32(tmp_path):
  tr = _tiny_decode()
  p = str(tmp_path / "h.npz")
  traces.save(p, tr, half=True)
  with np.load(p) as z:
    assert z["q"].dtype == z["w"].dtype == z["k"].dtype == np.float16
  back = traces.load(p)
  for f in ("q", "w", "k"):
    got, want = getattr(back, f), getattr(tr, f).astype(np.float64)
    assert got.dtype == np.float32
    # float16 keeps 11 significant bits: relative error <= 2^-11 (normal range)
    assert (np.abs(got - want) <= np.abs(want) * 2.0 ** -11 + 2.0 ** -24).all()
    assert not np.array_equal(got, getattr(tr, f))  # really rounded
  tr.k[0, 0, 0] = 1e5
  with pytest.raises(traces.TraceError, match="k exceeds float16's range"):
    traces.save(p, tr, half=True)


@pytest.mark.parametrize("mutate,match", [
    (lambda t: setattr(t, "lengths", t.lengths[::-1].copy()), "non-decreasing"),
    (lambda t: setattr(t, "lengths", t.lengths + 100), "exceeds"),
    (lambda t: setattr(t, "accepted", t.accepted + 5), "accepted must lie"),
    (lambda t: setattr(t, "q", t.q.astype(np.float64)), "q.dtype"),
    (lambda t: setattr(t, "w", t.w[:, :, :, :1]), "w.shape"),
    (lambda t: t.k.__setitem__((0, 0, 0), np.nan), "non-finite"),
    (lambda t: setattr(t, "layers", t.layers[:1]), "len\\(layers\\)"),
])
def test_validation_names_the_field(mutate, match, tmp_path):
  tr = _tiny_decode()
  mutate(tr)
  with pytest.raises(traces.TraceError, match=match):
    traces.save(str(tmp_path / "bad.npz"), tr)


def test_load_rejects_bad_files(tmp_path):
  p = tmp_path / "x.npz"
  np.savez(p, q=np.zeros(3, object))  # an object array would need pickle
  with pytest.raises(traces.TraceError, match="schema_version"):
    traces.load(str(p))
  good = _tiny_decode()
  traces.save(str(p), good)
  z = dict(np.load(p))
  z["schema_version"] = np.int64(99)
  np.savez(p, **z)
  with pytest.raises(traces.TraceError, match="schema_version=99"):
    traces.load(str(p))
  z["schema_version"] = np.int64(1)
  del z["lengths"]
  np.savez(p, **z)
  with pytest.raises(traces.TraceError, match="missing field"):
    traces.load(str(p))
  (tmp_path / "junk.npz").write_bytes(b"not a zip")
  with pytest.raises(traces.TraceError, match="not a readable"):
    traces.load(str(tmp_path / "junk.npz"))
  with pytest.raises(FileNotFoundError):
    traces.load(str(tmp_path / "none.npz"))


def test_record_decode_with_real_model(tmp_path):
  base = llama.load_model(2)
  icfg = lightning.IndexerConfig(layers=2, width=576, heads=2, head_dim=16, rope_dims=8)
  idx = lightning.LightningIndexers(icfg, rngs=nnx.Rngs(0))
  ids = gguf_weights.tokenizer().encode(text.python_docs()[:4000]).ids
  tr = record.record_decode(base, idx, ids, prompt_len=40, steps=10, rows=3, source="docs")
  assert tr.q.shape == (2, 10, 3, 2, 16) and tr.k.shape == (2, 52, 16)
  np.testing.assert_array_equal(tr.lengths, 40 + np.arange(10) + 3)
  assert not tr.meta["extrapolated"] and tr.meta["rows"] == 3
  p = str(tmp_path / "d.npz")
  traces.save(p, tr)
  tr2 = traces.load(p)
  res = evaluate.decode_baselines(tr2, 8, implementation="xla")
  by = {r["method"]: r for r in res["rows"]}
  assert by["full DSA"]["recall"] == 1.0 and by["full DSA"]["skipped"] == 0.0
  # the recent window scores 8 of 41..52 visible slots
  want = np.mean(1 - 8 / (40 + np.arange(1, 10) + 1))
  np.testing.assert_allclose(by["recent window"]["skipped"], want, rtol=1e-12)
  assert 0 <= by["recent window"]["recall"] <= 1
  with pytest.raises(ValueError, match="tokens has"):
    record.record_decode(base, idx, ids[:20], prompt_len=40, steps=10)


def test_full_topk_kernel_matches_reference():
  tr = _tiny_decode(s=5, r=1, n=300, h=4, d=32)
  q, k, w = tr.layer(0)
  a, _, _ = evaluate.full_topk(q[:, 0], k, w[:, 0], tr.lengths, 16, implementation="xla")
  b, _, _ = evaluate.full_topk(q[:, 0], k, w[:, 0], tr.lengths, 16, implementation="pallas")
  np.testing.assert_array_equal(a, b)


def test_shipped_trace_is_valid():
  tr = traces.load(traces.default_trace_path())
  assert tr.kind == "decode" and tr.meta["model"].startswith("SmolLM2")
  assert not tr.meta["extrapolated"]
  assert tr.lengths[0] >= 3585 and tr.lengths[-1] == 4096  # long context: 4K slots
  assert tr.q.shape[-2:] == (16, 64)  # recorded with the shipped 16-head indexers


def test_traces_past_the_trained_context_are_labelled_extrapolated():
  import types
  base = types.SimpleNamespace(cfg=types.SimpleNamespace(context=8192))
  assert record._meta(base, "x", np.zeros(9000), {})["extrapolated"]
  assert not record._meta(base, "x", np.zeros(8192), {})["extrapolated"]


def _np_scores(q, w, k):
  """float64 indexer scores of every query against every key (no mask): [T, S]."""
  q, w, k = (np.asarray(a, np.float64) for a in (q, w, k))
  return np.einsum("th,tsh->ts", w, np.maximum(np.einsum("thd,sd->tsh", q, k), 0.0))


def test_tile_prefill_keeps_scores_inside_each_copy_and_the_mean_key():
  """Widened to 6 heads x 20 dims and tiled to 130 tokens (a ragged last copy): inside every
  copy the scores are the trace's (float32 storage: ~1e-6 relative), the mean key direction is
  kept, and the copies are rotated apart (their keys differ)."""
  rng = np.random.default_rng(0)
  t, h, d = 50, 2, 8
  q, k, w = rng.standard_normal((t, h, d)), rng.standard_normal((t, d)) + 2, rng.uniform(0, 1, (t, h))
  Q, K, W = (np.asarray(a) for a in traces.tile_prefill(q, k, w, 130, heads=6, dim=20, seed=1))
  assert Q.shape == (130, 6, 20) and W.shape == (130, 6) and K.shape == (130, 20)
  assert Q.dtype == K.dtype == W.dtype == np.float32
  ref = _np_scores(q, w, k)
  for lo in (0, 50, 100):
    hi = min(lo + t, 130)
    got = _np_scores(Q[lo:hi], W[lo:hi], K[lo:hi])
    np.testing.assert_allclose(got, ref[:hi - lo, :hi - lo], rtol=2e-5,
                               atol=2e-5 * np.abs(ref).max())
  np.testing.assert_allclose(K[:50].mean(0), K[50:100].mean(0), atol=1e-5)
  assert np.abs(K[:50] - K[50:100]).max() > 0.5
  # the same seed gives the same tiling
  np.testing.assert_array_equal(K, np.asarray(traces.tile_prefill(q, k, w, 130, heads=6,
                                                                  dim=20, seed=1)[1]))


def test_tile_prefill_bad_input():
  rng = np.random.default_rng(1)
  q, k, w = rng.standard_normal((10, 2, 4)), rng.standard_normal((10, 4)), np.ones((10, 2))
  with pytest.raises(ValueError, match="heads=3"):
    traces.tile_prefill(q, k, w, 20, heads=3)
  with pytest.raises(ValueError, match="dim=2"):
    traces.tile_prefill(q, k, w, 20, dim=2)
  with pytest.raises(ValueError, match="n=0"):
    traces.tile_prefill(q, k, w, 0)
  with pytest.raises(ValueError, match=r"\[T, h, d\]"):
    traces.tile_prefill(q, k, w[:5], 20)

"""The sparse indexer stage: cached attention normalisers reproduce the model's attention, the
loss matches a float64 numpy reference, a tiny run raises the mass its selection holds, resumes
exactly and refuses data that does not fit."""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsparse.model import lightning, llama
from train import sparse

LAYERS, T = 2, 96


@pytest.fixture(scope="module")
def base():
  return llama.load_model(LAYERS)


@pytest.fixture(scope="module")
def windows():
  from jaxsparse.model import gguf_weights, text
  ids = np.asarray(gguf_weights.tokenizer().encode(text.stdlib_source()[:30000]).ids, np.int32)
  return [ids[i * T:(i + 1) * T] for i in range(3)]


@pytest.fixture(scope="module")
def data(tmp_path_factory, base, windows):
  out = str(tmp_path_factory.mktemp("sparse_data"))
  sparse.collect(base, windows, out, chunk=32, progress=lambda s: None)
  return out


@pytest.fixture(scope="module")
def init(tmp_path_factory):
  icfg = lightning.IndexerConfig(layers=LAYERS, width=576, heads=2, head_dim=16, rope_dims=8)
  path = str(tmp_path_factory.mktemp("init") / "idx.npz")
  lightning.save_indexers(path, icfg, lightning.LightningIndexers(
      icfg, rngs=nnx.Rngs(3)).params_tree())
  return path


def _cached(data, i=0):
  with np.load(os.path.join(data, f"window_{i:03d}.npz"), allow_pickle=False) as z:
    return z["hidden"], z["lse"], z["tokens"]


def _np_attention(base, h, layer):
  """float64 numpy: head-averaged causal attention [T, T] of one layer from its input h."""
  lw = {k: np.asarray(v[layer], np.float64) for k, v in llama.var_value(base.layers).items()}
  c = base.cfg
  t = h.shape[0]

  def rope(x):
    inv = 1.0 / (c.rope_base ** (np.arange(0, c.head_dim, 2) / c.head_dim))
    ang = np.arange(t)[:, None, None] * inv
    a, b = x[..., 0::2], x[..., 1::2]
    return np.stack([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)],
                    -1).reshape(x.shape)
  q = rope((h @ lw["q"].T).reshape(t, c.heads, c.head_dim))
  k = rope((h @ lw["k"].T).reshape(t, c.kv_heads, c.head_dim))
  k = np.repeat(k, c.heads // c.kv_heads, axis=1)
  s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(c.head_dim)
  s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return (p / p.sum(-1, keepdims=True)).mean(0)


def test_cached_lse_gives_the_models_attention(base, data):
  h, lse, _ = _cached(data)
  lw = llama.var_value(base.layers)
  rows = jnp.asarray([0, 1, 40, T - 1])
  keys = jnp.broadcast_to(jnp.arange(T)[None], (4, T))
  for layer in range(LAYERS):
    ref = _np_attention(base, np.asarray(h[layer], np.float64), layer)[np.asarray(rows)]
    got = np.asarray(sparse._attention_weights(
        base.cfg, {"q": lw["q"][layer], "k": lw["k"][layer]}, jnp.asarray(h[layer]),
        jnp.asarray(lse[layer]), rows, keys), np.float64)
    got = np.where(ref > 0, got, 0.0)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)


def test_layer_loss_matches_float64_numpy(base, data, init):
  h, lse, _ = _cached(data)
  idx = lightning.load_indexers(init)
  lw = llama.var_value(base.layers)
  k, layer = 12, 1
  rows = np.asarray([5, 20, 50, 95])
  ip = {n: v[layer] for n, v in idx.params_tree().items()}
  loss, held = sparse.layer_loss(base.cfg, idx.cfg, 0.1, k, ip,
                                 {"q": lw["q"][layer], "k": lw["k"][layer]},
                                 jnp.asarray(h[layer]), jnp.asarray(lse[layer]),
                                 jnp.asarray(rows))
  q, kk, w = (np.asarray(a, np.float64) for a in lightning.project(idx.cfg, ip,
                                                                    jnp.asarray(h[layer])))
  z = np.einsum("th,thn->tn", w, np.maximum(np.einsum("thd,nd->thn", q, kk), 0))
  a = _np_attention(base, np.asarray(h[layer], np.float64), layer)
  kls, helds = [], []
  for t in rows:
    vis = np.arange(t + 1)
    sel = vis[np.argsort(-z[t, vis], kind="stable")][:k]
    p = a[t, sel]
    helds.append(p.sum())
    tgt = p / p.sum()
    lq = z[t, sel] - z[t, sel].max()
    lq = lq - np.log(np.exp(lq).sum())
    kls.append(np.sum(np.where(tgt > 0, tgt * (np.log(np.where(tgt > 0, tgt, 1)) - lq), 0)))
  np.testing.assert_allclose(float(held), np.mean(helds), rtol=1e-4)
  np.testing.assert_allclose(float(loss), np.mean(kls), rtol=1e-3, atol=1e-6)


def _cfg(data, init, out, **kw):
  return sparse.SparseConfig(**{"data": data, "out": out, "init": init, "steps": 8, "topk": 8,
                                "queries": 24, "lr": 3e-2, "val_windows": 1, "val_queries": 32,
                                "save_every": 2, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory, data, init):
  out = str(tmp_path_factory.mktemp("sparse_run"))
  return out, sparse.train(_cfg(data, init, out), progress=False)


def test_tiny_run_learns_and_exports(run):
  out, rep = run
  assert rep["steps_run"] == 8 and not rep["stopped_early"]
  assert rep["last_loss"] < rep["first_loss"]
  assert rep["val_after"]["top64"]["mean_indexer"] > rep["val_before"]["top64"]["mean_indexer"]
  for key in ("val_before", "val_after"):
    for r in rep[key].values():
      assert all(0 <= a <= b + 1e-6 <= 1 + 1e-6 for a, b in zip(r["indexer"], r["true"]))
  m = lightning.load_indexers(os.path.join(out, "indexers.npz"))
  assert m.cfg.layers == LAYERS and m.cfg.heads == 2


def test_interrupted_run_resumes_to_identical_parameters(tmp_path, data, init, run):
  ref_out, _ = run
  out = str(tmp_path / "r")
  first = sparse.train(_cfg(data, init, out, save_every=1, max_seconds=1e-9), progress=False)
  assert first["stopped_early"] and first["steps_run"] == 1
  sparse.train(_cfg(data, init, out, save_every=1), progress=False)
  a = lightning.load_indexers(os.path.join(out, "indexers.npz")).params_tree()
  b = lightning.load_indexers(os.path.join(ref_out, "indexers.npz")).params_tree()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])


def test_bad_data_is_refused(tmp_path, data, init):
  with pytest.raises(sparse.ConfigError, match="--data"):
    sparse.SparseConfig(data=str(tmp_path / "none"), out=str(tmp_path / "o"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(sparse.ConfigError, match="no window_"):
    sparse.train(_cfg(str(empty), init, str(tmp_path / "o1")), progress=False)
  with pytest.raises(sparse.ConfigError, match="--val-windows"):
    sparse.train(_cfg(data, init, str(tmp_path / "o2"), val_windows=3), progress=False)
  with pytest.raises(sparse.ConfigError, match="--topk"):
    sparse.train(_cfg(data, init, str(tmp_path / "o3"), topk=90), progress=False)
  bad = tmp_path / "bad"
  bad.mkdir()
  np.savez(bad / "window_000.npz", format=np.int64(1), hidden=np.zeros((LAYERS, 8, 100)),
           lse=np.zeros((LAYERS, 8, 9)))
  with pytest.raises(sparse.ConfigError, match="do not fit"):
    sparse.train(_cfg(str(bad), init, str(tmp_path / "o4")), progress=False)
  from jaxsparse import cli
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "indexer-sparse", "train", "--data", data, "--out", str(tmp_path / "o5"),
              "--steps", "0"])
  assert e.value.code == 2

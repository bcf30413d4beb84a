"""The real model: GGUF loading, tokenizer, NNX forward vs an independent numpy forward, quality."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsparse.model import gguf_weights, lightning, llama, text


@pytest.fixture(scope="module")
def model():
  return llama.load_model()


@pytest.fixture(scope="module")
def tok():
  return gguf_weights.tokenizer()


def _np_forward(cfg, w, tokens):
  """Independent float64 numpy Llama: explicit loops over heads, adjacent-pair RoPE."""
  x = w["embed"][tokens].astype(np.float64)
  t, hd = len(tokens), cfg.head_dim
  rms = lambda v, g: v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.norm_eps) * g
  inv = cfg.rope_base ** (-np.arange(0, hd, 2) / hd)

  def rope(v):  # v [T, hd]
    out = v.copy()
    for p in range(t):
      c, s = np.cos(p * inv), np.sin(p * inv)
      a, b = v[p, 0::2], v[p, 1::2]
      out[p, 0::2], out[p, 1::2] = a * c - b * s, a * s + b * c
    return out

  for i in range(cfg.layers):
    h = rms(x, w[f"{i}.attn_norm"])
    q, k, v = h @ w[f"{i}.q"].T, h @ w[f"{i}.k"].T, h @ w[f"{i}.v"].T
    out = np.zeros((t, cfg.width))
    for head in range(cfg.heads):
      kvh = head // (cfg.heads // cfg.kv_heads)
      qh = rope(q[:, head * hd:(head + 1) * hd])
      kh = rope(k[:, kvh * hd:(kvh + 1) * hd])
      s = qh @ kh.T / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf), 1)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      out[:, head * hd:(head + 1) * hd] = p @ v[:, kvh * hd:(kvh + 1) * hd]
    x = x + out @ w[f"{i}.o"].T
    h2 = rms(x, w[f"{i}.ffn_norm"])
    g = h2 @ w[f"{i}.gate"].T
    x = x + ((g / (1 + np.exp(-g))) * (h2 @ w[f"{i}.up"].T)) @ w[f"{i}.down"].T
  return rms(x, w["final_norm"]) @ w["embed"].T


def test_config_from_gguf_metadata(model):
  c = model.cfg
  assert (c.layers, c.width, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab) == (
      30, 576, 9, 3, 64, 1536, 49152)
  assert c.rope_base == 100000.0 and c.context == 8192


def test_forward_matches_independent_numpy(model, tok):
  ids = tok.encode("Hello, world. The quick brown fox").ids
  cfg, w = gguf_weights.load()
  ref = _np_forward(cfg, w, np.asarray(ids))
  out = np.asarray(model(jnp.asarray(ids, jnp.int32)))
  rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert rel < 1e-3, rel
  assert (out.argmax(-1) == ref.argmax(-1)).all()


def test_perplexity_on_real_prose_and_code(model, tok, xla_optimized):
  prose = jnp.asarray(tok.encode(text.python_docs()[20000:60000]).ids[:1024], jnp.int32)
  code = jnp.asarray(tok.encode(text.stdlib_source()[5000:40000]).ids[:1024], jnp.int32)
  ppl_prose = llama.perplexity(model(prose), prose)
  ppl_code = llama.perplexity(model(code), code)
  assert 5 < ppl_prose < 25, ppl_prose
  assert 4 < ppl_code < 30, ppl_code


def test_completes_a_well_known_sentence(model, tok):
  ids = tok.encode("The capital of France is").ids
  nxt = int(np.asarray(model(jnp.asarray(ids, jnp.int32)))[-1].argmax())
  assert tok.decode([nxt]).strip() == "Paris"


def test_tokenizer_roundtrip(tok):
  s = "def f(x):\n    return x ** 2  # ünïcode"
  assert tok.decode(tok.encode(s).ids) == s


def test_collect_targets_are_distributions(model, tok):
  ids = jnp.asarray(tok.encode(text.python_docs()[:3000]).ids[:64], jnp.int32)
  _, coll = model(ids, collect=True)
  a = np.asarray(coll["attn"])
  assert coll["hidden"].shape == (30, 64, 576) and a.shape == (30, 64, 64)
  np.testing.assert_allclose(a.sum(-1), 1.0, rtol=1e-5)
  assert (np.triu(a, 1) == 0).all()


def test_dsa_with_k_at_least_t_is_dense(model, tok):
  ids = jnp.asarray(tok.encode(text.python_docs()[:3000]).ids[:48], jnp.int32)
  icfg = lightning.IndexerConfig(layers=30, width=576, heads=2, head_dim=16, rope_dims=8)
  idx = lightning.LightningIndexers(icfg, rngs=nnx.Rngs(0))
  dense = np.asarray(model(ids))
  full = np.asarray(model(ids, dsa=(icfg, idx.params_tree(), 48)))
  np.testing.assert_allclose(full, dense, rtol=1e-5, atol=1e-4)
  sparse = np.asarray(model(ids, dsa=(icfg, idx.params_tree(), 8)))
  assert not np.allclose(sparse[-1], dense[-1])  # later queries really lose keys


def test_topk_mask():
  sc = jnp.asarray([[0.0, -np.inf, -np.inf], [1.0, 3.0, -np.inf], [5.0, 1.0, 2.0]])
  m = np.asarray(llama.topk_mask(sc, 2))
  np.testing.assert_array_equal(m, [[1, 0, 0], [1, 1, 0], [1, 0, 1]])


def test_chunked_forward_matches_the_full_matrix_forward(model, tok):
  """run_chunked (query chunks, never [T, T]) against the full-matrix forward: NLL, hidden
  states, DSA top-k attention, and each recall figure recomputed from the full attention."""
  ids = np.asarray(tok.encode(text.python_docs()[:4000]).ids[:200], np.int32)
  idx = lightning.load_indexers()
  logits, coll = model(jnp.asarray(ids), collect=True)
  lp = np.asarray(jax.nn.log_softmax(logits[:-1], -1), np.float64)
  ref_nll = -lp[np.arange(199), ids[1:]]
  nll, pred, hid, st = llama.run_chunked(model, ids, indexers=idx, stat_ks=(16, 64), chunk=64,
                                         hidden=True)
  np.testing.assert_allclose(np.asarray(nll), ref_nll, rtol=2e-4, atol=2e-4)
  np.testing.assert_array_equal(np.asarray(pred), np.asarray(logits).argmax(-1))
  np.testing.assert_allclose(np.asarray(hid), np.asarray(coll["hidden"]), atol=1e-4)
  a = np.asarray(coll["attn"], np.float64)  # [L, T, T]
  z = np.asarray(idx(coll["hidden"]), np.float64)
  for k in (16, 64):
    rows = np.arange(200) + 1 > k
    got = np.zeros(30)
    best = np.zeros(30)
    for l in range(30):
      for t in np.nonzero(rows)[0]:
        order = np.lexsort((np.arange(t + 1), -z[l, t, :t + 1]))[:k]  # ties: lower index
        got[l] += a[l, t, order].sum()
        best[l] += np.sort(a[l, t, :t + 1])[::-1][:k].sum()
    np.testing.assert_allclose(np.asarray(st[f"idx{k}"]), got, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(st[f"true{k}"]), best, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(st[f"rows{k}"]), rows.sum())
  np.testing.assert_array_equal(np.asarray(st["zero"]), (np.tril(z == 0)).sum((1, 2)))
  dsa = model(jnp.asarray(ids), dsa=(idx.cfg, idx.params_tree(), 16))
  lp2 = np.asarray(jax.nn.log_softmax(dsa[:-1], -1), np.float64)
  nll2, _, _, _ = llama.run_chunked(model, ids, indexers=idx, k_sel=16, chunk=64)
  np.testing.assert_allclose(np.asarray(nll2), -lp2[np.arange(199), ids[1:]], rtol=2e-4,
                             atol=2e-4)


def test_chunked_forward_depth_runs_the_first_layers_only(model, tok):
  """depth=d gives the first d layers' hidden states of the whole forward, bit for bit."""
  ids = np.asarray(tok.encode(text.python_docs()[:2000]).ids[:96], np.int32)
  _, _, hid, _ = llama.run_chunked(model, ids, chunk=32, hidden=True)
  _, _, hid3, _ = llama.run_chunked(model, ids, chunk=32, hidden=True, depth=3)
  assert hid3.shape == (3,) + hid.shape[1:]
  np.testing.assert_array_equal(np.asarray(hid3), np.asarray(hid)[:3])
  for bad in (0, 31):
    with pytest.raises(ValueError, match="depth"):
      llama.run_chunked(model, ids, depth=bad)


def test_shipped_indexers_are_a_working_dsa_model(model, tok, xla_optimized):
  """The shipped long-context indexers: no dead layer, and DSA top-64 over 512 held-out tokens
  stays within 10% of dense perplexity."""
  from jaxsparse import quality
  ids = tok.encode(text.held_out_text()[:6000]).ids[:512]
  q = quality.measure(model, lightning.load_indexers(), [ids], ks=(64,), chunk=256)
  assert max(q["zero_share"]) < 0.01
  assert q["perplexity"]["dsa_top64"] < 1.10 * q["perplexity"]["dense"]
  assert min(q["recall_top64"]) > 0.3

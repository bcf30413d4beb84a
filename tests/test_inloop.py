"""Methods in the model's loop (`jaxsparse.inloop`) and the retrieval tasks (`jaxsparse.tasks`):
each selection against a float64 numpy step-by-step reference, the whole forward against a
prefix-by-prefix run (causality), DSA against the model's own DSA path, and bad input."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsparse import inloop, tasks
from jaxsparse.model import lightning, llama
from jaxsparse.model.gguf_weights import LlamaConfig
from jaxsparse.spin import SpinConfig, algorithm
from tests.reference import np_request_seed, np_spin_select, np_spin_state, np_spin_update, np_topk


def _tiny_model(seed=0, layers=2, width=32, heads=4, kv=2, ffn=48, vocab=61):
  cfg = LlamaConfig(layers=layers, width=width, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab,
                    rope_base=10000.0, norm_eps=1e-5, context=4096)
  rng = np.random.default_rng(seed)
  hd = width // heads
  g = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
  w = {"embed": g(vocab, width) * 4, "final_norm": np.ones(width, np.float32)}
  for i in range(layers):
    w.update({f"{i}.attn_norm": np.ones(width, np.float32), f"{i}.q": g(width, width) * 3,
              f"{i}.k": g(kv * hd, width) * 3, f"{i}.v": g(kv * hd, width),
              f"{i}.o": g(width, width), f"{i}.ffn_norm": np.ones(width, np.float32),
              f"{i}.gate": g(ffn, width), f"{i}.up": g(ffn, width), f"{i}.down": g(width, ffn)})
  model = llama.Llama(cfg, w)
  icfg = lightning.IndexerConfig(layers=layers, width=width, heads=4, head_dim=8, rope_dims=4)
  return model, lightning.LightningIndexers(icfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def tiny():
  return _tiny_model()


SETTINGS = inloop.LoopSettings(k=8, decode_from=40, budget=40, seal_window=16, cluster_size=4,
                               refit_interval=32, block_size=8, seed=3, chunk=32)
T = 88


def _dyadic(rng, t, h=2, d=8):
  """Indexer inputs whose scores are exact in float32 and float64 (multiples of 2^-10), with
  enough distinct values that ties are rare but present."""
  q = rng.integers(-8, 9, (t, h, d)) / 8
  k = rng.integers(-8, 9, (t, d)) / 8
  w = rng.integers(1, 17, (t, h)) / 16
  return [np.asarray(a, np.float32) for a in (q, w, k)]


def _np_scores(q, w, k):
  z = np.einsum("th,thn->tn", w.astype(np.float64),
                np.maximum(np.einsum("thd,nd->thn", q.astype(np.float64), k.astype(np.float64)),
                           0.0))
  t = np.arange(len(k))
  return np.where(t[None, :] <= t[:, None], z, -np.inf)


def _rows_equal(got, want):
  got = np.asarray(got)
  assert got.shape == want.shape
  for r in range(len(want)):
    assert set(got[r][got[r] >= 0]) == set(want[r][want[r] >= 0]), f"row {r}"


def test_dsa_selection_is_the_exact_topk():
  q, w, k = _dyadic(np.random.default_rng(0), T)
  idx, scored = inloop._select(q, w, k, jnp.uint32(0), kind="dsa", kk=8, start=1, config=None,
                               chunk=32)
  _, want = np_topk(_np_scores(q, w, k), 8)
  np.testing.assert_array_equal(np.asarray(idx), want)  # ties to the lower index
  np.testing.assert_array_equal(np.asarray(scored), np.arange(1, T + 1))


def test_recent_selection():
  idx, scored = inloop._select(*_dyadic(np.random.default_rng(0), 20), jnp.uint32(0),
                               kind="recent", kk=4, start=1, config=None, chunk=8)
  idx = np.asarray(idx)
  assert idx[0].tolist() == [0, -1, -1, -1] and idx[19].tolist() == [19, 18, 17, 16]
  assert not np.asarray(scored).any()


@pytest.mark.parametrize("sparsity,reduction,explore", [(0.4, "A1", "random"), (0.6, "A0", "random"),
                                                       (0.5, "A1", "query")])
def test_spin_selection_against_a_step_by_step_reference(sparsity, reduction, explore):
  """Prefill rows: exact top-K. Decode rows, one step at a time in float64: the reference
  SPIN state selects blocks, the top-K comes from their visible slots, the state updates
  from the scored slots only."""
  rng = np.random.default_rng(1)
  q, w, k = _dyadic(rng, T)
  cfg = SpinConfig(block_size=8, topk=8, sparsity=sparsity, reduction=reduction,
                   explore=explore, explore_fraction=0.25)
  start = 40
  idx, scored = inloop._select(q, w, k, jnp.uint32(5), kind="spin", kk=8, start=start,
                               config=cfg, chunk=32)
  idx, scored = np.asarray(idx), np.asarray(scored)
  z = _np_scores(q, w, k)
  _, head = np_topk(z[:start, :start], 8)
  np.testing.assert_array_equal(idx[:start], head)
  cap = -(-T // 8) * 8
  st = np_spin_state(algorithm.init_state(cap, cfg))
  key = jax.random.PRNGKey(5)
  skipped = 0
  kd = np.pad(k.astype(np.float64), ((0, cap - T), (0, 0)))
  means = kd.reshape(cap // 8, 8, -1).mean(1)  # only complete blocks' priorities are used
  for t in range(start, T):
    key, sub = jax.random.split(key)
    prio = np.einsum("h,hj->j", w[t].astype(np.float64),
                     np.maximum(q[t].astype(np.float64) @ means.T, 0.0))
    blocks = np_spin_select(st, t, t + 1, cfg, np_request_seed(sub, 0), prio)
    slots = np.repeat(blocks, 8)[:T] & (np.arange(T) <= t)
    zs = np.where(slots, z[t], -np.inf)
    _, want = np_topk(zs[None], 8)
    np.testing.assert_array_equal(idx[t], want[0], err_msg=f"decode step {t}")
    assert scored[t] == slots.sum()
    skipped += t + 1 - slots.sum()
    st = np_spin_update(st, np.pad(zs, (0, cap - T), constant_values=-np.inf),
                        np.pad(slots, (0, cap - T)), t, t + 1, cfg)
  assert skipped > 0  # the blocks it skipped are real


@pytest.mark.parametrize("name", ["dense", "dsa", "spin:0.4", "spin:0.4:query:0.2", "ivf", "hisa",
                                  "recent"])
def test_the_loop_is_causal_prefix_by_prefix(tiny, name):
  """Every position's output equals the output of a run that stops there: the layer-at-a-time
  forward is what a token-by-token decode with the method would produce."""
  model, idx = tiny
  m = inloop.parse_methods(name)[0]
  toks = np.random.default_rng(2).integers(0, model.cfg.vocab, T)
  full = inloop.run(model, idx, toks, m, SETTINGS)
  for stop in (SETTINGS.decode_from + 9, T - 13):
    part = inloop.run(model, idx, toks[:stop], m, SETTINGS)
    np.testing.assert_allclose(part["nll"][0], full["nll"][0, :stop - 1], rtol=2e-4, atol=2e-4,
                               err_msg=f"{name}, prefix {stop}")
    np.testing.assert_array_equal(part["pred"][0], full["pred"][0, :stop])
  if m.kind == "dense":
    assert np.isnan(full["recall"]).all()
  else:
    assert full["recall"].shape == (model.cfg.layers,)
    assert (0 <= full["recall"]).all() and (full["recall"] <= 1).all()
  if m.kind == "dsa":
    np.testing.assert_array_equal(full["recall"], 1.0)
    np.testing.assert_array_equal(full["unscored"], 0.0)
  if m.kind in ("spin", "ivf", "hisa"):
    assert (full["unscored"] > 0).all()  # each skips keys on every layer


def test_ivf_metric_runs_the_shipped_metric_of_each_layer():
  from jaxsparse import ivf
  rng = np.random.default_rng(6)
  q, k = rng.standard_normal((2, 300, 16, 64)), rng.standard_normal((2, 300, 64))
  w = rng.uniform(0, 1, (2, 300, 16))
  s = dataclasses.replace(SETTINGS, k=16, budget=96, seal_window=32, cluster_size=8,
                          refit_interval=64)
  got, num = inloop._select_batch(inloop.Method("ivf-metric"), q, k, w, s, 7)
  plain = inloop._select_batch(inloop.Method("ivf"), q, k, w, s, 7)[0]
  for b in range(2):
    want = ivf.prefill_topk(q=q[b], k=k[b], w=w[b], config=inloop.ivf_config(s),
                            metric=ivf.metric.SHIPPED, layer=7)
    np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(num[b]), np.asarray(want[1]))
  assert not np.array_equal(np.asarray(got), np.asarray(plain))  # the metric changes groups


def test_dsa_in_the_loop_matches_the_models_dsa_path(tiny):
  model, idx = tiny
  toks = np.random.default_rng(4).integers(0, model.cfg.vocab, (2, T))
  got = inloop.run(model, idx, toks, inloop.Method("dsa"), SETTINGS)
  dense = inloop.run(model, idx, toks, inloop.Method("dense"), SETTINGS)
  for b in range(2):
    want = llama.run_chunked(model, toks[b], indexers=idx, k_sel=8, chunk=32)[0]
    np.testing.assert_allclose(got["nll"][b], np.asarray(want), rtol=1e-4, atol=1e-4)
    want = llama.run_chunked(model, toks[b], chunk=32)[0]
    np.testing.assert_allclose(dense["nll"][b], np.asarray(want), rtol=1e-4, atol=1e-4)
  assert np.abs(got["nll"] - dense["nll"]).max() > 1e-3  # the selection changes the output


def test_measure_and_compare_report_every_method(tiny):
  model, idx = tiny
  rng = np.random.default_rng(5)
  wins = rng.integers(0, model.cfg.vocab, (3, T))
  ms = inloop.parse_methods("dense,dsa,recent")
  res = inloop.measure(model, idx, wins, ms, SETTINGS)
  s = inloop.compare(res)
  assert list(s) == ["dense", "dsa", "recent"]
  assert s["dsa"]["perplexity_vs_dsa"] == 0 and s["dsa"]["recall_mean"] == 1
  nll = np.asarray(res["recent"]["window_nll"])
  assert np.isclose(res["recent"]["perplexity"], np.exp(nll.mean()))
  d = nll - np.asarray(res["dsa"]["window_nll"])
  assert np.isclose(s["recent"]["perplexity_vs_dsa_se"], d.std(ddof=1) / np.sqrt(3))
  assert "recall_mean" not in s["dense"]
  rows = np.zeros((3, T), bool)
  rows[:, -5:] = True
  src = np.zeros((3, T), bool)
  src[:, 10:20] = True
  for name in ("dense", "dsa", "recent"):
    r = inloop.run(model, idx, wins, inloop.Method(name), SETTINGS, focus=(rows, src))
    assert r["source_mass"].shape == (model.cfg.layers, 3)
    if name != "recent":
      assert ((0 < r["source_mass"]) & (r["source_mass"] < 1)).all()
    if name == "dense":
      np.testing.assert_array_equal(r["source_kept"], 1.0)
    if name == "recent":  # K = 8 newest keys never reach positions 10..19 from the end
      np.testing.assert_array_equal(r["source_kept"], 0.0)
      np.testing.assert_array_equal(r["source_mass"], 0.0)


# ------------------------------------------------------------------------------------ tasks

class _DigitTokenizer:
  """Characters as tokens: every digit is one token, as in SmolLM2's tokenizer."""

  def encode(self, s):
    return type("E", (), {"ids": [ord(c) for c in s]})()

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


def test_copy_task_repeats_an_early_span_and_scores_it():
  ids = np.arange(10_000) % 997
  tk = tasks.copy_task(ids, windows=3, tokens=512, span=64, seed=1)
  assert tk.tokens.shape == (3, 512) and tk.scored.sum(1).tolist() == [63] * 3
  for row, src in zip(tk.tokens, tk.source):
    assert np.array_equal(row[src], row[-64:])  # the source marks the copied span
    tail = row[-64:]
    starts = [a for a in range(0, 128 - 64 + 1) if np.array_equal(row[a:a + 64], tail)]
    assert starts  # the copied span comes from the first quarter
  perfect = np.concatenate([tk.tokens[:, 1:], tk.tokens[:, :1]], 1)
  s = tasks.score(tk, np.zeros((3, 511)), perfect)
  assert s["accuracy"] == 1.0 and s["logprob"] == 0.0 and s["accuracy_se"] == 0.0
  wrong = perfect.copy()
  wrong[0, -10:] += 1  # the last 9 scored predictions of window 0 are wrong
  s = tasks.score(tk, np.ones((3, 511)), wrong)
  np.testing.assert_allclose(s["window_accuracy"], [54 / 63, 1, 1])
  assert s["logprob"] == -1.0


def test_passkey_task_states_the_key_once_and_asks_at_the_end():
  ids = np.arange(20_000) % 90 + 200
  tk = tasks.passkey_task(ids, _DigitTokenizer(), windows=2, tokens=600, digits=5, seed=0)
  for row, sc in zip(tk.tokens, tk.scored):
    s = "".join(chr(c) if c < 200 else "_" for c in row)
    key = s[-5:]
    assert key.isdigit() and s.count(f"The pass key is {key}.") == 1
    at = s.index("The pass key is")
    assert 600 // 8 <= at <= 600 // 4 + 2
    assert s.endswith(f"What is the pass key? The pass key is {key}")
    assert np.nonzero(sc)[0].tolist() == list(range(600 - 6, 599))
    src = np.nonzero(tk.source[tk.tokens.tolist().index(row.tolist())])[0]
    assert len(src) == 10 and src.min() >= at and "".join(chr(row[i]) for i in src) == key * 2


def test_task_and_method_errors():
  with pytest.raises(ValueError, match="span"):
    tasks.copy_task(np.arange(5000), windows=1, tokens=200)
  with pytest.raises(ValueError, match="tokens"):
    tasks.copy_task(np.arange(500), windows=2, tokens=512)
  with pytest.raises(ValueError, match="task"):
    tasks.build("retrieve", np.arange(5000), None, windows=1, tokens=512)
  for spec, msg in (("dense,foo", "unknown method"), ("spin:1", r"\(0, 1\)"),
                    ("spin:0", r"\(0, 1\)"), ("spin:nan", r"\(0, 1\)"), ("spin", "sparsity"),
                    ("ivf:2", "only spin"), ("dsa,,ivf", "empty"), ("dsa,dsa", "twice"),
                    ("spin:0.4:sideways", "explore"), ("spin:0.4:query:0.9", "explore_fraction"),
                    ("spin:0.4:query:x", "spin:S")):
    with pytest.raises(ValueError, match=msg):
      inloop.parse_methods(spec)
  with pytest.raises(ValueError, match="decode_from"):
    dataclasses.replace(SETTINGS, decode_from=T).check(T)
  with pytest.raises(ValueError, match="budget"):
    inloop.ivf_config(dataclasses.replace(SETTINGS, budget=20))


@pytest.mark.parametrize("args,msg", [
    (["--methods", "dense,foo"], "--methods: unknown method 'foo'"),
    (["--methods", "spin:1.5"], "--methods: 'spin:1.5'"),
    (["--methods", "spin:0.4", "--decode-from", "4096"], "--decode-from=4096 must lie inside"),
    (["--methods", "ivf", "--budget", "100"], "--k=64: --budget=100 must exceed"),
    (["--task", "copy", "--tokens", "200"], "--task copy needs --tokens"),
    (["--task", "ppl,recall"], "--task='ppl,recall'"),
    (["--methods", "dsa", "--plot", "q.gif"], "--plot='q.gif': the file name must end in one "
     "of .png, .pdf, .svg"),
    (["--budget", "512"], "--budget applies with --methods"),
])
def test_cli_inloop_errors_name_the_option_before_loading(args, msg, capsys, tmp_path,
                                                          monkeypatch):
  from jaxsparse import cli
  monkeypatch.setenv("JAXSPARSE_GGUF", str(tmp_path / "absent.gguf"))  # nothing may load
  text = tmp_path / "t.txt"
  text.write_text("words " * 100)
  base = ["--tokens", "4096"] if "--tokens" not in args else []  # each option given once
  argv = ["quality", "--text", str(text), "--k", "64"] + base + args
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  lines = err.strip().splitlines()  # the command's usage, then one error line
  assert "Traceback" not in err and lines[0].startswith("usage: jaxsparse quality")
  assert [ln for ln in lines if "error:" in ln] == [lines[-1]] and msg in lines[-1]


def test_replay_with_query_exploration_against_the_reference():
  """`spin.replay` under explore="query": each step's block mask equals the float64 reference
  stepping with the row's query scores of the block mean keys as exploration priorities."""
  from jaxsparse import spin
  rng = np.random.default_rng(7)
  n, s = 72, 24
  q, w, k = _dyadic(rng, s, h=2, d=8)
  kfull = np.asarray(rng.integers(-8, 9, (n, 8)) / 8, np.float32)
  lengths = np.arange(n - s + 1, n + 1)
  cfg = SpinConfig(block_size=8, topk=8, sparsity=0.5, explore="query", explore_fraction=0.25)
  res = spin.replay(q, kfull, w, lengths, cfg, seed=3)
  cap = -(-n // 8) * 8
  means = np.pad(kfull.astype(np.float64), ((0, cap - n), (0, 0))).reshape(cap // 8, 8, -1).mean(1)
  st = np_spin_state(algorithm.init_state(cap, cfg))
  key = jax.random.PRNGKey(3)
  for i, length in enumerate(lengths):
    key, sub = jax.random.split(key)
    prio = np.einsum("h,hj->j", w[i].astype(np.float64),
                     np.maximum(q[i].astype(np.float64) @ means.T, 0.0))
    blocks = np_spin_select(st, length - 1, length, cfg, np_request_seed(sub, 0), prio)
    np.testing.assert_array_equal(res["block_masks"][i], blocks, err_msg=f"step {i}")
    z = _np_scores(np.concatenate([np.zeros((length - 1, 2, 8), np.float32), q[i:i + 1]]),
                   np.concatenate([np.zeros((length - 1, 2), np.float32), w[i:i + 1]]),
                   kfull[:length])[-1]
    slots = np.repeat(blocks, 8)[:length]
    st = np_spin_update(st, np.pad(np.where(slots, z, -np.inf), (0, cap - length),
                                   constant_values=-np.inf),
                        np.pad(slots, (0, cap - length)), length - 1, length, cfg)
  assert not res["block_masks"][1:].all()  # blocks were skipped

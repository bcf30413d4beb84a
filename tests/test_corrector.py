"""The representative-correction network and its training pipeline: zero init is plain IVF,
the listwise loss falls, checkpoints round-trip, an interrupted or killed run resumes to the
same parameters, damaged checkpoints and bad options give clear errors."""
from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsparse import ivf, traces
from jaxsparse.ivf import corrector as C
from tests.killrun import kill_then_resume
from train import checkpoints
from train import corrector as tc

SMALL = dict(topk=16, budget=96, seal_window=64, cluster_size=16, refit_interval=128,
             queries=32, eval_queries=32, eval_every=10, save_every=5, member_features=16,
             hidden=32)


def _trace(path, seed, n=512, h=2, d=16):
  rng = np.random.default_rng(seed)
  centers = rng.standard_normal((10, d))
  k = centers[rng.integers(0, 10, n)] + 0.5 * rng.standard_normal((n, d))
  q = rng.standard_normal((n, h, d)) + 0.5
  w = rng.uniform(0.2, 1.0, (n, h))
  tr = traces.PrefillTrace(q=q[None].astype(np.float32), w=w[None].astype(np.float32),
                           k=k[None].astype(np.float32), layers=np.asarray([4], np.int32),
                           meta={})
  traces.save(str(path), tr)
  return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("corr")
  return _trace(d / "train.npz", 0), _trace(d / "eval.npz", 1), _trace(d / "val.npz", 2)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("run"))
  cfg = tc.CorrectorTrainConfig(out=out, train_trace=data[0], eval_trace=data[1], steps=40,
                                lr=5e-3, **SMALL)
  return out, cfg, tc.train(cfg, progress=lambda s: None)


def _params(out):
  m = C.load(os.path.join(out, "correctors.npz"))[4]
  return [np.asarray(v) for v in __import__("jax").tree.leaves(nnx.state(m, nnx.Param))]


def test_zero_initialised_network_is_plain_ivf(data):
  tr = traces.load(data[1])
  q, w, k = tr.q[0], tr.w[0], tr.k[0]
  cfg = ivf.IVFConfig(topk=16, budget=96, seal_window=64, cluster_size=16, refit_interval=128)
  m = C.Corrector(C.CorrectorConfig(dim=16), rngs=nnx.Rngs(3))
  pos = np.arange(70, 512, 9)
  a = ivf.evaluate(q, k, w, cfg, query_positions=pos)
  b = ivf.evaluate(q, k, w, cfg, query_positions=pos, corrector=m)
  np.testing.assert_array_equal(a["topk_indices"], b["topk_indices"])
  _, corr = m(jnp.asarray(k), jnp.asarray(np.arange(512) % 7, jnp.int32), 7)
  assert float(jnp.abs(corr).max()) == 0.0


def test_features_pool_members_exactly():
  rng = np.random.default_rng(2)
  keys = rng.standard_normal((30, 4)).astype(np.float32)
  assign = rng.integers(-1, 5, 30).astype(np.int32)
  mean, logsize, fmean, fmax = C.group_features(jnp.asarray(keys), jnp.asarray(assign), 6,
                                                lambda x: x * 2.0)
  for g in range(6):
    m = assign == g
    if m.any():
      np.testing.assert_allclose(mean[g], keys[m].mean(0), rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(fmean[g], 2 * keys[m].mean(0), rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(fmax[g], 2 * keys[m].max(0), rtol=1e-6)
      np.testing.assert_allclose(logsize[g], np.log(m.sum()), rtol=1e-6)
    else:
      assert float(jnp.abs(fmax[g]).max()) == 0 and float(logsize[g]) == 0


def test_training_lowers_the_listwise_loss_and_exports(trained, data):
  out, cfg, rep = trained
  r = rep["layers"][0]
  assert r["layer"] == 4 and r["steps_run"] == 40
  tr = traces.load(data[0])
  q, w, k = (np.asarray(a) for a in (tr.q[0], tr.w[0], tr.k[0]))
  snaps = tc.build_snapshots(q, k, w, cfg.ivf_config())
  trained_m = C.load(os.path.join(out, "correctors.npz"))[4]
  fresh = C.Corrector(trained_m.cfg, rngs=nnx.Rngs(0))

  def loss(m):
    tot = 0.0
    for sn in snaps:
      mean, corr = m(jnp.asarray(k), jnp.asarray(sn["assign"]), len(sn["sizes"]))
      s = tc._scores(jnp.asarray(q[sn["queries"]]), jnp.asarray(w[sn["queries"]]), mean + corr)
      tot += float(tc.listnet_loss(s, jnp.asarray(sn["target"]), jnp.asarray(sn["usable"]),
                                   r["tau"]))
    return tot / len(snaps)

  assert loss(trained_m) < loss(fresh) - 0.01
  assert {"recall_plain", "recall_corrected", "recall_oracle"} <= set(r)
  assert open(os.path.join(out, "report.png"), "rb").read(4) == b"\x89PNG"
  # the export loads by path in ivf.evaluate
  ev = traces.load(data[1])
  res = ivf.evaluate(ev.q[0], ev.k[0], ev.w[0], cfg.ivf_config(), query_positions=[300, 400],
                     corrector=os.path.join(out, "correctors.npz"), layer=4)
  assert res["recall"].shape == (2,)
  with pytest.raises(ValueError, match="layer=5"):
    ivf.evaluate(ev.q[0], ev.k[0], ev.w[0], cfg.ivf_config(), query_positions=[300],
                 corrector=os.path.join(out, "correctors.npz"), layer=5)


def test_snapshots_in_query_chunks_equal_one_chunk(trained, data, monkeypatch):
  """Long traces take the exact reference top-K in query chunks: same snapshots as one chunk."""
  _, cfg, _ = trained
  tr = traces.load(data[0])
  q, w, k = (np.asarray(a) for a in (tr.q[0], tr.w[0], tr.k[0]))
  whole = tc.build_snapshots(q, k, w, cfg.ivf_config())
  monkeypatch.setattr(tc, "_REF_SCORES", 7 * q.shape[1] * k.shape[0])  # 7 queries a chunk
  chunked = tc.build_snapshots(q, k, w, cfg.ivf_config())
  assert len(chunked) == len(whole)
  for a, b in zip(whole, chunked):
    for name in a:
      np.testing.assert_array_equal(a[name], b[name])


def test_interrupted_run_resumes_to_identical_parameters(trained, data, tmp_path):
  ref_out, cfg, _ = trained
  import dataclasses
  out = str(tmp_path / "r")
  first = tc.train(dataclasses.replace(cfg, out=out, max_seconds=1e-9, save_every=1),
                   progress=lambda s: None)
  assert first["stopped_early"] and not os.path.exists(os.path.join(out, "correctors.npz"))
  tc.train(dataclasses.replace(cfg, out=out, save_every=1), progress=lambda s: None)
  for a, b in zip(_params(out), _params(ref_out)):
    np.testing.assert_array_equal(a, b)


def test_killed_run_resumes_to_identical_parameters(trained, data, tmp_path):
  ref_out, cfg, _ = trained
  out = str(tmp_path / "k")
  args = [sys.executable, "-m", "train.corrector", "--out", out, "--train-trace", data[0],
          "--eval-trace", data[1], "--steps", "40", "--lr", "0.005"]
  for key, v in SMALL.items():
    args += ["--" + key.replace("_", "-"), str(1 if key == "save_every" else v)]
  kill_then_resume(args, os.path.join(out, "layer4"), 3)
  for a, b in zip(_params(out), _params(ref_out)):
    np.testing.assert_array_equal(a, b)


def test_corrector_files_reread_when_rewritten_and_nan_parameters_refused(tmp_path):
  path = str(tmp_path / "c.npz")
  m = C.Corrector(C.CorrectorConfig(dim=16), rngs=nnx.Rngs(3))
  C.save(path, {4: m})
  assert sorted(C.load(path)) == [4]
  C.save(path, {4: m, 7: m})  # rewritten in place: read again, never a stale copy
  assert sorted(C.load(path)) == [4, 7]
  with np.load(path, allow_pickle=False) as z:
    arrays = dict(z)
  name = next(k for k in arrays if k.startswith("7/"))
  arrays[name] = np.full_like(arrays[name], np.nan)
  np.savez(path, **arrays)
  with pytest.raises(C.CorrectorFileError, match="finite real floats"):
    C.load(path)


def test_damaged_checkpoints_are_an_error_not_a_restart(trained, tmp_path):
  import shutil
  ref_out, cfg, _ = trained
  out = str(tmp_path / "d")
  shutil.copytree(ref_out, out)
  for step in os.listdir(os.path.join(out, "layer4")):
    for root, _, files in os.walk(os.path.join(out, "layer4", step)):
      for f in files:
        with open(os.path.join(root, f), "wb") as fh:
          fh.write(b"junk")
  import dataclasses
  with pytest.raises(checkpoints.CheckpointError, match="no checkpoint"):
    tc.train(dataclasses.replace(cfg, out=out), progress=lambda s: None)


@pytest.mark.parametrize("extra,msg", [
    (["--steps", "1"], "--steps=1"),
    (["--lr", "0"], "--lr=0.0"),
    (["--layers", "3"], "--layers [3]"),
    (["--budget", "10"], "budget=10"),
    (["--target-power", "0"], "--target-power=0.0"),
    (["--train-trace", "/nonexistent.npz"], "--train-trace"),
    (["--eval-trace", "{train}"], "--eval-trace='{train}' is also a --train-trace"),
    (["--val-trace", "{train}"], "--val-trace='{train}' is also a --train-trace"),
    (["--steps", "5", "--steps", "6"], "argument --steps: given more than once"),
])
def test_bad_options_are_one_line_errors(extra, msg, data, tmp_path, capsys):
  """The usage, then one error line naming the option, exit status 2."""
  given = {"--out": str(tmp_path / "o"), "--train-trace": data[0], "--eval-trace": data[1],
           "--seal-window": "64", "--cluster-size": "16", "--refit-interval": "128"}
  if extra[0] in given and extra.count(extra[0]) == 1:
    given[extra[0]] = extra[1].format(train=data[0])
    extra = []
  argv = [a for kv in given.items() for a in kv] + [a.format(train=data[0]) for a in extra]
  with pytest.raises(SystemExit) as e:
    tc.main(argv)
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines[0].startswith("usage: python -m train.corrector"), lines
  assert [ln for ln in lines if "error:" in ln] == [lines[-1]], lines
  assert msg.format(train=data[0]) in lines[-1] and "Traceback" not in "\n".join(lines)


def test_a_correction_that_does_not_pay_on_validation_exports_as_plain_means(data, tmp_path):
  """With --val-trace a layer is kept only if its correction raises recall on that (unseen
  training) text; an untrained correction (a learning rate of 1e-9 leaves it ~0) does not, so
  the file marks the layer plain and `ivf.evaluate` uses the member means for it."""
  out = str(tmp_path / "gate")
  cfg = tc.CorrectorTrainConfig(out=out, train_trace=data[0], eval_trace=data[1],
                                val_trace=data[2], steps=2, lr=1e-9, **SMALL)
  r = tc.train(cfg, progress=lambda s: None)["layers"][0]
  assert r["kept"] is False and r["val_recall_corrected"] <= r["val_recall_plain"]
  assert r["recall_shipped"] == r["recall_plain"]
  path = os.path.join(out, "correctors.npz")
  assert C.file_meta(path)["plain_layers"] == [4] and 4 not in C.load(path)
  ev = traces.load(data[1])
  pos = np.arange(100, 500, 37)
  got = ivf.evaluate(ev.q[0], ev.k[0], ev.w[0], cfg.ivf_config(), query_positions=pos,
                     corrector=path, layer=4)
  want = ivf.evaluate(ev.q[0], ev.k[0], ev.w[0], cfg.ivf_config(), query_positions=pos)
  np.testing.assert_array_equal(got["topk_indices"], want["topk_indices"])


def test_the_shipped_correctors_load_and_cover_every_layer():
  """SmolLM2's shipped file: every model layer is either a network or marked plain, with the
  IVF settings it was trained for."""
  models = C.load(C.SHIPPED)
  meta = C.file_meta(C.SHIPPED)
  assert sorted(set(models) | set(meta["plain_layers"])) == list(range(30))
  assert not set(models) & set(meta["plain_layers"]) and models
  assert meta["ivf"]["budget"] == 512 and meta["ivf"]["cluster_size"] == 32

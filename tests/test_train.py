"""Lightning-indexer training: a tiny config learns, checkpoints atomically, resumes exactly
(after a real kill too), refuses configurations that would lose work, and exports a file the
trace and quality commands load."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

from jaxsparse import cli
from jaxsparse.model import lightning
from tests.killrun import kill_then_resume
from train import checkpoints
from train import indexer as tr

TINY = dict(schedule="48:3,64:3", num_layers=2, heads=2, head_dim=16, rope_dims=8, lr=1e-2,
            eval_windows=1, eval_tokens=128, recall_k=16, save_every=2)
TINY_ARGS = ["--schedule", "48:3,64:3", "--num-layers", "2", "--heads", "2", "--head-dim", "16",
             "--rope-dims", "8", "--lr", "0.01", "--eval-windows", "1", "--eval-tokens", "128",
             "--recall-k", "16", "--save-every", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  from jaxsparse.model import gguf_weights, text
  ids = gguf_weights.tokenizer().encode(text.stdlib_source()[:20000]).ids
  path = str(tmp_path_factory.mktemp("corpus") / "ids.npy")
  np.save(path, np.asarray(ids, np.uint16))
  return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
  out = str(tmp_path_factory.mktemp("idx"))
  cfg = tr.TrainConfig(out=out, corpus=corpus, **TINY)
  rep = tr.train(cfg, progress=False)
  return out, cfg, rep


def _params(out):
  return lightning.load_indexers(os.path.join(out, "indexers.npz")).params_tree()


def test_tiny_training_learns_reports_and_exports(trained):
  out, cfg, rep = trained
  assert rep["steps_run"] == 6 and len(rep["recall_per_layer"]) == 2
  from flax import nnx
  from jaxsparse.model import llama
  untrained = lightning.LightningIndexers(lightning.load_indexers(
      os.path.join(out, "indexers.npz")).cfg, rngs=nnx.Rngs(cfg.seed))
  before = tr.evaluate(llama.load_model(2), untrained,
                       tr.held_out_windows(cfg.eval_windows, cfg.eval_tokens), cfg.recall_k)
  assert rep["mean_recall"] > before["mean_recall"] + 0.02  # six steps already help
  assert all(0 <= r <= t + 1e-6 <= 1 + 1e-6 for r, t in zip(rep["recall_per_layer"],
                                                            rep["true_topk_per_layer"]))
  with open(os.path.join(out, "report.json")) as f:
    assert json.load(f)["indexer"]["heads"] == 2
  steps = sorted(int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit())
  assert steps == [4, 6]  # the latest two kept
  m = lightning.load_indexers(os.path.join(out, "indexers.npz"))
  assert m.cfg.heads == 2 and m.params_tree()["wq"].shape == (2, 576, 32)


def test_curriculum_windows(trained):
  _, cfg, _ = trained
  assert [cfg.window_at(s) for s in range(7)] == [48, 48, 48, 64, 64, 64, 64]


def test_interrupted_run_resumes_to_identical_parameters(tmp_path, corpus, trained):
  """Stop after 3 of 6 steps (max_seconds), resume: the same parameters as one straight run."""
  ref_out, _, _ = trained
  out = str(tmp_path / "r")
  cfg = tr.TrainConfig(out=out, corpus=corpus, **{**TINY, "save_every": 1})
  first = tr.train(tr.TrainConfig(out=out, corpus=corpus, **{**TINY, "save_every": 1,
                                                              "max_seconds": 1e-9}),
                   progress=False)
  assert first["stopped_early"] and first["steps_done"] == 1
  tr.train(cfg, progress=False)
  a, b = _params(out), _params(ref_out)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])


def test_killed_run_resumes_to_identical_parameters(tmp_path, corpus, trained):
  """SIGKILL a real training process mid-run, then resume: bit-identical parameters."""
  ref_out, _, _ = trained
  out = str(tmp_path / "k")
  args = [sys.executable, "-m", "train.indexer", "--out", out, "--corpus", corpus,
          *TINY_ARGS[:-2], "--save-every", "1"]
  after_kill = kill_then_resume(args, os.path.join(out, "checkpoints"), 2, poll=0.05)
  assert "indexers.npz" not in after_kill
  a, b = _params(out), _params(ref_out)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])


def test_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path, trained, corpus):
  ref_out, _, _ = trained
  out = str(tmp_path / "d")
  shutil.copytree(ref_out, out)
  latest = os.path.join(out, "checkpoints", "6")
  for root, _, files in os.walk(latest):  # damage every file of the newest step
    for f in files:
      with open(os.path.join(root, f), "wb") as fh:
        fh.write(b"\0garbage")
  cfg = tr.TrainConfig(out=out, corpus=corpus, **TINY)
  with pytest.warns(UserWarning, match="step 6"):
    rep = tr.train(cfg, progress=False)
  assert rep["steps_run"] == 2  # resumed from step 4
  assert os.path.isdir(os.path.join(out, "checkpoints.bad", "6"))


def test_flipped_bits_in_the_newest_step_fall_back_to_the_intact_one(tmp_path, trained, corpus):
  """A few flipped bytes (size unchanged) fail the step's checksum: the run resumes from step 4
  to the same parameters, and only the damaged step is moved aside."""
  ref_out, _, _ = trained
  out = str(tmp_path / "f")
  shutil.copytree(ref_out, out)
  latest = os.path.join(out, "checkpoints", "6")
  files = sorted(os.path.join(r, f) for r, _, fs in os.walk(latest) for f in fs)
  big = max(files, key=os.path.getsize)
  with open(big, "r+b") as fh:
    fh.seek(os.path.getsize(big) // 2)
    b = fh.read(1)
    fh.seek(-1, 1)
    fh.write(bytes([b[0] ^ 0x10]))
  with pytest.warns(UserWarning, match="step 6.*checksum"):
    rep = tr.train(tr.TrainConfig(out=out, corpus=corpus, **TINY), progress=False)
  assert rep["steps_run"] == 2
  assert os.path.isdir(os.path.join(out, "checkpoints.bad", "6"))
  assert not os.path.exists(os.path.join(out, "checkpoints.bad", "4"))
  ref, got = _params(ref_out), _params(out)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("stray", ["empty_dir", "file", "nonempty_dir", "padded_name"])
def test_stray_step_names_never_discard_intact_steps(tmp_path, trained, corpus, stray):
  """A stray entry named like a newer step (an empty folder, a file, a folder of other files,
  no Orbax checkpoint) is moved aside with a warning: the run resumes from step 6."""
  ref_out, _, _ = trained
  out = str(tmp_path / stray)
  shutil.copytree(ref_out, out)
  path = os.path.join(out, "checkpoints", "0009" if stray == "padded_name" else "9")
  if stray == "padded_name":  # a copy of a real step under a name Orbax never writes
    shutil.copytree(os.path.join(out, "checkpoints", "6"), path)
  elif stray == "file":
    with open(path, "w") as fh:
      fh.write("x")
  else:
    os.makedirs(path)
  if stray == "nonempty_dir":
    os.makedirs(os.path.join(path, "notes"))
    with open(os.path.join(path, "notes", "readme.txt"), "w") as fh:
      fh.write("not a checkpoint")
  with pytest.warns(UserWarning, match="named like a step"):
    rep = tr.train(tr.TrainConfig(out=out, corpus=corpus, **TINY), progress=False)
  assert rep["steps_run"] == 0  # step 6 restored: nothing left to run
  assert sorted(d for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit()) == \
      ["4", "6"]
  assert os.listdir(os.path.join(out, "checkpoints.bad")) == [os.path.basename(path)]


def test_restore_into_other_shapes_is_an_error(tmp_path):
  """An intact step saved by a run of other shapes or dtypes never restores silently."""
  d = str(tmp_path / "c")
  m = checkpoints.Manager(d, save_every=1)
  m.save(1, {"a": np.zeros(3, np.float32), "b": np.int32(2)})
  m.close()
  for target, what in (({"a": np.zeros(4, np.float32), "b": np.int32(0)}, r"float32\[3\]"),
                       ({"a": np.zeros(3, np.int32), "b": np.int32(0)}, r"float32\[3\]"),
                       ({"a": np.zeros(3, np.float32)}, "")):
    m = checkpoints.Manager(d, save_every=1)
    with pytest.raises(checkpoints.CheckpointError, match="(does not fit|does not restore into) this run.*" + what):
      m.restore_latest(target)
    m.close()
  assert os.listdir(d) == ["1"]  # intact: never moved aside
  m = checkpoints.Manager(d, save_every=1)
  step, tree = m.restore_latest({"a": np.ones(3, np.float32), "b": np.int32(0)})
  assert step == 1 and (np.asarray(tree["a"]) == 0).all()


@pytest.mark.parametrize("kw, match", [
    (dict(save_every=0), "save_every=0"), (dict(save_every=1.5), "save_every=1.5"),
    (dict(save_every=True), "save_every=True"), (dict(save_every=2, keep=0), "keep=0"),
    (dict(save_every=2, keep=2.0), "keep=2.0")])
def test_manager_refuses_bad_sizes_with_their_name(tmp_path, kw, match):
  with pytest.raises(ValueError, match=match):
    checkpoints.Manager(str(tmp_path / "c"), **kw)
  assert not os.path.exists(tmp_path / "c")  # refused before anything is created


def test_no_good_checkpoint_is_an_error_not_a_restart(tmp_path, trained, corpus):
  ref_out, _, _ = trained
  out = str(tmp_path / "e")
  shutil.copytree(ref_out, out)
  for step in ("4", "6"):
    d = os.path.join(out, "checkpoints", step)
    shutil.rmtree(d)
    os.makedirs(d)  # a half-deleted step: the folder without its files
  with pytest.raises(checkpoints.CheckpointError, match="no checkpoint"):
    tr.train(tr.TrainConfig(out=out, corpus=corpus, **TINY), progress=False)


def test_refuses_configurations_that_lose_work(tmp_path, trained, corpus):
  """A rerun into a folder holding checkpoints resumes only with the run's options: fewer or
  more steps (the learning-rate schedule spans the total) and other shapes are refused."""
  out, _, _ = trained
  for schedule in ("48:2", "48:3,64:5"):
    with pytest.raises(checkpoints.CheckpointError, match="--schedule .*differs.*new --out"):
      tr.train(tr.TrainConfig(out=out, corpus=corpus, **{**TINY, "schedule": schedule}),
               progress=False)
  with pytest.raises(checkpoints.CheckpointError, match="--heads=4"):
    tr.train(tr.TrainConfig(out=out, corpus=corpus, **{**TINY, "heads": 4}), progress=False)


def test_a_run_stopped_before_its_first_checkpoint_leaves_its_folder_free(tmp_path, corpus):
  """run.json without a checkpoint beside it: a run of other options takes the folder."""
  out = str(tmp_path / "s")
  other = tr.TrainConfig(out=out, corpus=corpus, **{**TINY, "heads": 4})
  checkpoints.prepare_out(out)
  checkpoints.write_identity(out, other.identity(), other.steps)
  os.makedirs(os.path.join(out, "checkpoints"))
  cfg = tr.TrainConfig(out=out, corpus=corpus, **TINY)
  checkpoints.check_identity(out, cfg.identity(), cfg.steps)  # no error


@pytest.mark.parametrize("argv,msg", [
    (["--schedule", "64:1"], "at least 2"),
    (["--window", "64", "--steps", "1"], "at least 2"),
    (["--lr", "-1"], "--lr=-1.0"),
    (["--schedule", "64"], "WINDOW:STEPS"),
    (["--schedule", "16384:10"], "8,192"),
    (["--window", "64"], "--window and --steps"),
    (["--heads", "0"], "--heads=0"),
    (["--corpus", "/nonexistent.npy", "--window", "64", "--steps", "2"], "--corpus"),
    (["--out", "/proc/forbidden", "--window", "64", "--steps", "2"], "not a writable"),
])
def test_config_errors_before_the_model_loads(argv, msg, capsys, tmp_path):
  """The usage, then one error line, exit status 2."""
  base = [] if "--out" in argv else ["--out", str(tmp_path / "o")]
  with pytest.raises(SystemExit) as e:
    tr.main(base + argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert lines[0].startswith("usage: python -m train.indexer"), err
  assert [ln for ln in lines if "error:" in ln] == [lines[-1]], err
  assert msg in lines[-1] and "Traceback" not in err


def test_trace_cli_records_from_the_exported_file_and_eval_replays(trained, tmp_path, capsys):
  out, _, _ = trained
  text = tmp_path / "t.txt"
  text.write_text("The indexer scores every cached key for every query. " * 30)
  trace = str(tmp_path / "d.npz")
  # a 2-layer indexer file is refused for the 30-layer model, naming the option
  assert cli.main(["trace", "decode", "--text", str(text), "--indexers", out, "--out", trace,
                   "--prompt-len", "40", "--steps", "6"]) == 2
  assert "--indexers" in capsys.readouterr().err


def test_shipped_indexers_load_and_are_long_context():
  m = lightning.load_indexers(layers=30, width=576)
  with np.load(lightning.default_indexers_path()) as z:
    meta = json.loads(str(z["meta"]))
    assert int(z["format"]) == 2 and z["wq"].dtype == np.int8
  assert meta["schedule"].endswith("8192:700") and meta["steps_done"] == 1049
  assert m.cfg.heads == 16 and m.cfg.head_dim == 64
  with pytest.raises(lightning.IndexerFileError, match="holds 30 layers"):
    lightning.load_indexers(layers=12)


def _tiny_file_arrays(rng, fmt):
  cfg = lightning.IndexerConfig(layers=2, width=576, heads=2, head_dim=16, rope_dims=8)
  params = {n: rng.standard_normal(s).astype(np.float32) * 0.05
            for n, s in lightning.param_shapes(cfg).items()}
  params["wq"][1, :, 3] = 0.0  # an all-zero column keeps a usable scale
  arrays = {"format": np.int64(fmt), "config": np.str_(json.dumps(dataclasses.asdict(cfg))),
            "meta": np.str_("{}")}
  return cfg, params, arrays


def test_int8_file_format_round_trip_within_half_a_step(tmp_path):
  """Format 2 keeps each weight within half a quantisation step (per layer and column) plus
  float16 rounding, checked in float64; format-1 float16 files still load."""
  rng = np.random.default_rng(0)
  cfg, params, arrays = _tiny_file_arrays(rng, 1)
  path = str(tmp_path / "i2.npz")
  lightning.save_indexers(path, cfg, params)
  got = lightning.load_indexers(path).params_tree()
  for name, a in params.items():
    a64 = a.astype(np.float64)
    step = np.abs(a64).max(axis=1, keepdims=True) / 127
    bound = step / 2 + np.abs(a64) * 2.0 ** -11 + 1e-12
    err = np.abs(np.asarray(got[name], np.float64) - a64)
    assert (err <= bound).all(), name
    assert err.max() > 0.2 * step.max()  # 8-bit steps, not float16 rounding
  assert not np.asarray(got["wq"])[1, :, 3].any()
  old = str(tmp_path / "i1.npz")
  np.savez(old, **arrays, **{n: a.astype(np.float16) for n, a in params.items()})
  got1 = lightning.load_indexers(old).params_tree()
  np.testing.assert_array_equal(np.asarray(got1["wk"]), params["wk"].astype(np.float16))


@pytest.mark.parametrize("breakage,msg", [
    ("scale_dtype", "wk_int8_scale must be float32"),
    ("scale_shape", "wk_int8_scale must be float32"),
    ("no_scale", "needs int8 wk and wk_int8_scale"),
    ("float_codes", "needs int8 wk and wk_int8_scale"),
    ("format", "not an indexer file of format 1 or 2"),
])
def test_int8_file_format_refuses_broken_files(tmp_path, breakage, msg):
  rng = np.random.default_rng(1)
  cfg, params, _ = _tiny_file_arrays(rng, 2)
  path = str(tmp_path / "i.npz")
  lightning.save_indexers(path, cfg, params)
  z = dict(np.load(path, allow_pickle=False))
  if breakage == "scale_dtype":
    z["wk_int8_scale"] = z["wk_int8_scale"].astype(np.float16)
  elif breakage == "scale_shape":
    z["wk_int8_scale"] = z["wk_int8_scale"][:, :, :8]
  elif breakage == "no_scale":
    del z["wk_int8_scale"]
  elif breakage == "float_codes":
    z["wk"] = z["wk"].astype(np.float32)
  else:
    z["format"] = np.int64(3)
  np.savez(path, **z)
  with pytest.raises(lightning.IndexerFileError, match=msg):
    lightning.load_indexers(path)

"""Lightning-indexer training: a tiny config learns, checkpoints atomically, resumes; the trace
CLI records from the trained indexers."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxsparse import cli, traces
from jaxsparse.model import lightning
from train import indexer as tr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("idx"))
  cfg = tr.TrainConfig(out=out, steps=4, window=64, heads=2, head_dim=16, rope_dims=8, lr=1e-2,
                       eval_windows=1, recall_k=16, save_every=2)
  rep = tr.train(cfg, progress=False)
  return out, cfg, rep


def test_tiny_training_learns_and_reports(trained):
  out, _, rep = trained
  assert rep["steps_run"] == 4 and len(rep["recall_per_layer"]) == 30
  assert rep["last_loss"] < rep["first_loss"]
  assert all(0 <= r <= 1 for r in rep["recall_per_layer"])
  with open(os.path.join(out, "report.json")) as f:
    assert json.load(f)["indexer"]["heads"] == 2
  steps = sorted(int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit())
  assert steps[-1] == 4


def test_resume_continues_from_the_checkpoint(trained):
  out, cfg, _ = trained
  import dataclasses
  rep = tr.train(dataclasses.replace(cfg, steps=6), progress=False)
  assert rep["steps_run"] == 2  # steps 5 and 6 only
  model = tr.load_indexers(out)
  assert isinstance(model, lightning.LightningIndexers)


def test_bad_config():
  with pytest.raises(ValueError, match="window"):
    tr.TrainConfig(out="x", window=16, recall_k=16)
  with pytest.raises(ValueError, match="steps"):
    tr.TrainConfig(out="x", steps=0)
  with pytest.raises(ValueError, match="rope_dims"):
    lightning.IndexerConfig(layers=1, width=8, head_dim=8, rope_dims=9)
  with pytest.raises(FileNotFoundError):
    tr.load_indexers("/nonexistent/run")


def test_trace_cli_records_and_eval_replays(trained, tmp_path, capsys):
  out, _, _ = trained
  text = tmp_path / "t.txt"
  text.write_text("The indexer scores every cached key for every query. " * 20)
  trace = str(tmp_path / "d.npz")
  assert cli.main(["trace", "decode", "--text", str(text), "--indexers", out, "--out", trace,
                   "--prompt-len", "40", "--steps", "6", "--rows", "2", "--layers", "0,29"]) == 0
  t = traces.load(trace)
  assert t.q.shape[:3] == (2, 6, 2) and t.layers.tolist() == [0, 29]
  assert cli.main(["eval", "--trace", trace, "--k", "8", "--implementation", "xla"]) == 0
  assert "SPIN 40%" in capsys.readouterr().out
  pre = str(tmp_path / "p.npz")
  assert cli.main(["trace", "prefill", "--text", str(text), "--indexers", out, "--out", pre,
                   "--tokens", "50", "--layers", "3"]) == 0
  assert traces.load(pre).q.shape[:2] == (1, 50)
  np.testing.assert_array_equal(traces.load(pre).layers, [3])

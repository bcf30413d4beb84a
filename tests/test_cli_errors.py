"""Wrong invocations of every command line (`jaxsparse ...`, `python -m train.*`): the command's
usage, then one `PROG: error: ...` line naming the option, exit status 2, and no work done
(the model, its tokenizer, a corpus or a metric fit are never reached). In-process, no model."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from jaxsparse import cli, traces


class _Work(Exception):
  """Raised where a command would start slow work: every check should come before it."""


@pytest.fixture
def no_work(monkeypatch):
  from jaxsparse import inloop, quality
  from jaxsparse.ivf import metric
  from jaxsparse.model import gguf_weights, llama
  from train import corpus

  def work(*args, **kwargs):
    raise _Work

  for owner, name in ((llama, "load_model"), (gguf_weights, "tokenizer"), (inloop, "study"),
                      (quality, "measure"), (metric, "fit_traces"), (corpus, "build")):
    monkeypatch.setattr(owner, name, work)


@pytest.fixture(scope="module")
def d(tmp_path_factory):
  d = tmp_path_factory.mktemp("inputs")
  (d / "book.txt").write_text("Some words to score. " * 400)
  pre = traces.PrefillTrace(q=np.ones((1, 8, 2, 4), np.float32),
                            w=np.ones((1, 8, 2), np.float32), k=np.ones((1, 8, 4), np.float32),
                            layers=np.asarray([0], np.int32), meta={})
  traces.save(str(d / "p.npz"), pre)
  traces.save(str(d / "p2.npz"), pre)  # another file: a held-out trace beside p.npz
  n = 512
  traces.save(str(d / "p512.npz"), traces.PrefillTrace(
      q=np.ones((1, n, 2, 4), np.float32), w=np.ones((1, n, 2), np.float32),
      k=np.ones((1, n, 4), np.float32), layers=np.asarray([0], np.int32), meta={}))
  np.save(d / "big_ids.npy", np.arange(49100, 49300, dtype=np.int32))
  np.save(d / "ids2d.npy", np.arange(200, dtype=np.int32).reshape(2, 100))
  return d


Q = ["quality", "--text", "{d}/book.txt", "--k", "64"]
TI = ["train", "indexer", "--out", "{d}/run", "--window", "64", "--steps", "2"]
TC = ["train", "corrector", "--out", "{d}/corr", "--train-trace", "{d}/p.npz", "--eval-trace",
      "{d}/p2.npz"]
FM = ["fit-metric", "--trace", "{d}/p.npz", "--out", "{d}/m.npz"]
PL = ["plan", "--trace", "{d}/p.npz", "--out", "{d}/plan.json"]
TR = ["trace", "prefill", "--text", "{d}/book.txt", "--out", "{d}/t.npz"]

CASES = [
    # non-finite or out-of-range numbers
    (FM + ["--eps", "inf"], "--eps=inf must be a finite number"),
    (FM + ["--eps", "nan"], "--eps=nan must be a finite number"),
    (FM + ["--eps", "-1"], "--eps=-1 must be positive"),
    (PL + ["--z", "nan"], "--z=nan must be a finite number"),
    (PL + ["--refit-interval", "-1"], "--refit-interval=-1 must be >= 0"),
    (Q + ["--tokens", "1024", "--seed", "-1", "--methods", "dense"], "--seed=-1 must be >= 0"),
    (TI + ["--seed", "-1"], "--seed=-1 must be >= 0"),
    (TI + ["--max-seconds", "-1"], "--max-seconds=-1.0 must be a finite number >= 0"),
    (TI + ["--max-seconds", "nan"], "--max-seconds=nan"),
    (TI + ["--lr", "inf"], "--lr=inf must be a positive finite number"),
    (TI + ["--eval-tokens", "9000"], "--eval-tokens=9000 exceeds the model's 8,192-token"),
    (TC + ["--seed", "-1"], "--seed=-1 must be >= 0"),
    (TC + ["--scale", "0"], "--scale=0.0 must be a positive finite number"),
    (TC + ["--scale", "nan"], "--scale=nan must be a positive finite number"),
    (TC + ["--lr", "inf"], "--lr=inf must be a positive finite number"),
    (TC + ["--lr", "0"], "--lr=0.0 must be a positive finite number"),
    (TC + ["--target-power", "inf"], "--target-power=inf"),
    (TC + ["--max-seconds", "-5"], "--max-seconds=-5.0 must be a finite number >= 0"),
    # settings that only the measurement checked, after the model loaded
    (Q[:3] + ["--k", "256", "--tokens", "1024", "--methods", "dense,hisa"],
     "at --tokens=1024, --k=256: --k=256 must not exceed --budget=128"),
    (Q + ["--tokens", "128", "--methods", "ivf"], "--budget=16 must exceed"),
    (Q + ["--tokens", "1024", "--methods", "hisa", "--budget", "20"], "--budget=20 must exceed"),
    # options that do not apply
    (Q + ["--tokens", "1024", "--methods", "dense,dsa", "--budget", "300"],
     "--budget applies to the ivf, ivf-metric, hisa methods, and --methods lists none"),
    (Q + ["--tokens", "1024", "--task", "ppl", "--budget", "300"], "--budget applies"),
    (Q + ["--tokens", "1024", "--methods", "dense,ivf", "--decode-from", "300"],
     "--decode-from applies to spin methods, and --methods lists none"),
    (["bench", "--plot", "{d}/b.png"], "--plot does not apply to `bench kernels`"),
    # option names spelled out in full
    (FM + ["--k", "5"], "unrecognized arguments: --k"),
    (["eval", "--expl", "none"], "unrecognized arguments: --expl"),
    (["bench", "--sl=1024"], "unrecognized arguments: --sl=1024"),
    (TI + ["--num-lay", "2"], "unrecognized arguments: --num-lay"),
    (TC + ["--targ", "2"], "unrecognized arguments: --targ"),
    # lists
    (TC[:5] + ["{d}/p.npz,{d}/p.npz"] + TC[6:], "--train-trace='{d}/p.npz,{d}/p.npz' repeats"),
    (TC[:7] + ["{d}/p2.npz,{d}/p2.npz"], "--eval-trace='{d}/p2.npz,{d}/p2.npz' repeats"),
    (TC + ["--layers", "0,0"], "--layers='0,0' repeats 0"),
    (TI[:4] + ["--corpus", "{d}/big_ids.npy", "--window", "64", "--steps", "2"],
     "holds token id 49299, past the model's vocabulary of 49,152"),
    # settings classes' field names written as options
    (["eval", "--block-size", "48"], "--block-size=48 must be a power of two"),
    (TC + ["--budget", "10"], "--budget=10 must exceed the fixed slots: sink + --seal-window"),
    (TC + ["--seal-window", "100"], "--cluster-size=32 must divide --seal-window=100"),
    # output files: the format the command writes
    (["bench", "prefill", "--out", "{d}/x.png"], "--out='{d}/x.png': the file name must end in "
     ".json"),
    (["bench", "--out", "{d}/x.txt"], "--out='{d}/x.txt': the file name must end in .json"),
    (["bench", "prefill", "--plot", "{d}/x.gif"], "--plot='{d}/x.gif': the file name must end "
     "in one of .png, .pdf, .svg"),
    (["eval", "--out", "{d}/e.txt"], "--out='{d}/e.txt'"),
    (["eval", "--plot", "{d}/e.gif"], "--plot='{d}/e.gif'"),
    (Q + ["--tokens", "1024", "--methods", "dense", "--plot", "{d}/q.gif"], "--plot='{d}/q.gif'"),
    (Q + ["--tokens", "1024", "--methods", "dense", "--plot", "/nonexistent/q.svg"],
     "--plot='/nonexistent/q.svg': folder"),
    (Q + ["--tokens", "1024", "--methods", "dense", "--out", "{d}/q.png"], "--out='{d}/q.png'"),
    (Q + ["--tokens", "1024", "--out", "{d}/q.png"], "--out='{d}/q.png'"),
    (TR + ["--tokens", "9000"], "--tokens=9000 exceeds the model's 8,192-token context"),
    (TR[:5] + ["{d}/t.txt"], "--out='{d}/t.txt': the file name must end in .npz"),
    (PL[:4] + ["{d}/plan.txt"], "--out='{d}/plan.txt': the file name must end in .json"),
    (FM[:4] + ["{d}/m.json"], "--out='{d}/m.json': the file name must end in .npz"),
    # the training commands' own checks: the usage too, as every command's
    (TI[:4] + ["--window", "128"], "--window and --steps go together"),
    (TI + ["--lr", "0"], "--lr=0.0 must be a positive finite number"),
    (TI + ["--num-layers", "31"], "--num-layers=31 must lie in [0, 30]"),
    (TC + ["--layers", "3"], "--layers [3] are not in the traces"),
    # an option given twice is an error naming it, never the last value silently
    (["eval", "--k", "256", "--k", "128"], "argument --k: given more than once"),
    (["eval", "--k=256", "--k", "128"], "argument --k: given more than once"),
    (["eval", "--sparsities", "0.4", "--sparsities", "0.2"], "argument --sparsities: given"),
    (TR + ["--text", "{d}/book.txt"], "argument --text: given more than once"),
    (Q + ["--tokens", "1024", "--task", "ppl", "--task", "copy"], "argument --task: given"),
    (Q + ["--tokens", "256", "--tokens", "512"], "argument --tokens: given more than once"),
    (["bench", "--implementation", "auto", "--implementation", "xla"],
     "argument --implementation: given more than once"),
    (Q + ["--tokens", "1024", "--oracle", "--oracle"], "argument --oracle: given more than once"),
    (TI + ["--steps", "3"], "argument --steps: given more than once"),
    (TC + ["--seed", "1", "--seed=2"], "argument --seed: given more than once"),
    # an empty path is not the default
    (["eval", "--trace", ""], "--trace='' is empty"),
    # counts above what the input holds, never capped
    (["eval", "--trace", "{d}/p512.npz", "--k", "16", "--budget", "128", "--seal-window", "64",
      "--queries", "10000"], "--queries=10000 exceeds the 448 query positions of the trace"),
    (FM[:2] + ["{d}/p512.npz"] + FM[3:] + ["--keys", "10000"],
     "--keys=10000 exceeds the 512 keys of --trace="),
    (FM[:2] + ["{d}/p512.npz"] + FM[3:] + ["--queries", "100000"],
     "--queries=100000 exceeds the 480 query positions of --trace="),
    (PL[:2] + ["{d}/p512.npz"] + PL[3:] + ["--budget", "300", "--queries", "1000"],
     "--queries=1000 exceeds the 384 query positions of --trace="),
    # a budget that holds the whole context
    (Q[:3] + ["--tokens", "256", "--k", "16", "--methods", "ivf", "--budget", "10000"],
     "--budget=10000 must be below --tokens=256"),
    (PL[:2] + ["{d}/p512.npz"] + PL[3:], "--budget=1024 (the default) must be below the 512 "
     "tokens of --trace="),
    (["eval", "--trace", "{d}/p512.npz", "--k", "128", "--budget", "1024"],
     "--budget=1024 must be below the trace's 512 tokens"),
    (["eval", "--trace", "{d}/p512.npz", "--k", "128"],
     "--budget=1024 (the default) must be below the trace's 512 tokens"),
    # a top-K that keeps the whole context, in bench as everywhere
    (["bench", "--k", "8192", "--slots", "8192"], "--k=8192 must be below --slots=8192: a top-K "
     "that keeps everything selects nothing"),
    (["bench", "prefill", "--tokens", "4096", "--k", "4096"], "--k=4096 must be below the "
     "smallest --tokens (4096)"),
    # training options the kernels or the schedule cannot take
    (TI + ["--head-dim", "48"], "--head-dim=48 is not supported: the kernels take powers of two"),
    (TI[:4] + ["--schedule", "128:10,128:10"], "window 128 follows window 128"),
    (TI[:4] + ["--schedule", "256:10,128:10"], "window 128 follows window 256"),
    # held-out recall on the training data
    (TC[:7] + ["{d}/p.npz"], "--eval-trace='{d}/p.npz' is also a --train-trace"),
    (TC + ["--val-trace", "{d}/./p.npz"], "--val-trace='{d}/./p.npz' is also a --train-trace"),
    # corpora of another shape
    (TI[:4] + ["--corpus", "{d}/ids2d.npy", "--window", "64", "--steps", "2"],
     "--corpus='{d}/ids2d.npy' holds an array of shape (2, 100)"),
]


def _ids(cases):
  return [" ".join(a[:2]) + "|" + m[:40] for a, m in cases]


def _one_error_line(capsys, prog: str, msg: str) -> str:
  """The error line last; before it only the command's usage. Returns the error output."""
  err = capsys.readouterr().err
  assert "Traceback" not in err
  lines = err.strip().splitlines()
  assert lines[0].startswith(f"usage: {prog}"), err
  assert [ln for ln in lines if "error:" in ln] == [lines[-1]], err
  assert lines[-1].startswith(f"{prog}: error: ") and msg in lines[-1], err
  return err


@pytest.mark.parametrize("argv,msg", CASES, ids=_ids(CASES))
def test_wrong_invocation_is_one_error_line_before_any_work(argv, msg, d, no_work, capsys):
  argv, msg = [a.format(d=d) for a in argv], msg.format(d=d)
  try:
    rc = cli.main(argv)
  except SystemExit as e:  # argparse's own errors
    rc = e.code
  assert rc == 2
  _one_error_line(capsys, "jaxsparse " + " ".join(argv[:2] if argv[0] == "train" else argv[:1]),
                  msg)


CORPUS = [
    (["--out", "/nonexistent/c.npy"], "--out='/nonexistent/c.npy': folder '/nonexistent' does "
     "not exist"),
    (["--out", "{d}/c.txt"], "--out='{d}/c.txt': the file name must end in .npy"),
    (["--out", "{d}/c.npy", "--linux", "/nonexistent"], "--linux='/nonexistent' does not exist"),
    (["--out", "{d}/c.npy", "--linux", "{d}/book.txt"], "--linux='{d}/book.txt' is not an "
     "xz-compressed tarball"),
    (["--out", "{d}/c.npy", "--tokens", "0"], "--tokens=0 must be positive"),
    (["--out", "{d}/c.npy", "--tok", "5"], "unrecognized arguments: --tok"),
    (["--out", "{d}/c.npy", "--tokens", "5", "--tokens", "6"], "argument --tokens: given more "
     "than once"),
    (["--out", "{d}/c.npy", "--tokens", "1000", "--linux", "{d}"], "--linux='{d}' is a folder "
     "without Documentation/"),
    (["--out", "{d}/c.npy"], "--tokens=4200000 needs the Linux documentation"),
]


@pytest.mark.parametrize("argv,msg", CORPUS, ids=_ids(CORPUS))
def test_corpus_wrong_invocation_is_one_error_line_before_the_build(argv, msg, d, no_work,
                                                                    capsys, monkeypatch):
  from jaxsparse.model import text
  from train import corpus
  monkeypatch.setattr(text, "LINUX_TARBALL", str(d / "no-linux-source.tar.xz"))
  try:
    rc = corpus.main([a.format(d=d) for a in argv])
  except SystemExit as e:
    rc = e.code
  assert rc == 2
  _one_error_line(capsys, "python -m train.corpus", msg.format(d=d))


def test_corpus_writes_exactly_the_out_path(tmp_path, monkeypatch, capsys):
  from train import corpus
  monkeypatch.setattr(corpus, "build", lambda tokens, linux=None: np.arange(tokens,
                                                                           dtype=np.uint16))
  out = tmp_path / "ids.npy"
  assert corpus.main(["--out", str(out), "--tokens", "5"]) == 0
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.npy"]
  assert np.load(out).tolist() == [0, 1, 2, 3, 4]


def _parsers(p):
  yield p
  for action in p._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sp in action.choices.values():
        yield from _parsers(sp)


def test_no_parser_takes_abbreviations():
  from train import corrector, indexer
  ps = list(_parsers(cli.build_parser())) + [indexer.build_parser(), corrector.build_parser()]
  assert len(ps) > 10 and all(not p.allow_abbrev for p in ps)


def test_quality_help_lists_every_method(capsys):
  from jaxsparse.inloop import METHOD_KINDS
  with pytest.raises(SystemExit):
    cli.main(["quality", "--help"])
  out = " ".join(capsys.readouterr().out.split())
  listed = out.rsplit("--methods METHODS", 1)[1].split("--task", 1)[0]
  for kind in METHOD_KINDS:
    assert f" {kind}," in listed or f" {kind}:" in listed or f" {kind} " in listed, kind


@pytest.mark.parametrize("windows", [1, 3])
def test_quality_prints_standard_errors_only_over_several_windows(windows, capsys):
  from jaxsparse.cli.quality import _print_inloop
  summary = {"perplexity": 10.0, "second_half": 9.0, "perplexity_vs_dsa": 0.01,
             "perplexity_vs_dsa_se": 0.0 if windows == 1 else 0.002, "second_half_vs_dsa": 0.02,
             "second_half_vs_dsa_se": 0.0 if windows == 1 else 0.003,
             "copy_accuracy": 0.5, "copy_accuracy_se": 0.0 if windows == 1 else 0.1}
  res = {"cells": {"256/8": {"tokens": 256, "k": 8,
                             "methods": {"spin:0.4": {"window_nll": [1.0] * windows}},
                             "summary": {"spin:0.4": summary}}}}
  _print_inloop(res, ["copy"])
  out = capsys.readouterr().out
  row = next(ln for ln in out.splitlines() if "spin:0.4" in ln)
  assert ("±" in row) == (windows > 1), row
  assert "±0.000" not in row


def test_a_k_above_the_default_budget_runs_without_index_methods(d, no_work):
  """The index's budget is checked only when an index method runs: dense and exact DSA at K
  256 on 1,024-token windows (default budget 128) reach the measurement."""
  with pytest.raises(_Work):
    cli.main(["quality", "--text", f"{d}/book.txt", "--k", "256", "--tokens", "1024",
              "--methods", "dense,dsa"])


def _run_folder(out, schedule: str, steps_saved: int, identity_schedule: bool = True):
  """A training folder as a run of `schedule` leaves it: run.json, and a step of checkpoints/
  (Orbax's marker file alone: the identity check comes before any restore)."""
  from train import checkpoints, indexer
  cfg = indexer.TrainConfig(out=str(out), schedule=schedule)
  ident = cfg.identity()
  if not identity_schedule:  # a run.json written before the schedule was recorded
    del ident["schedule"]
  checkpoints.prepare_out(str(out))
  checkpoints.write_identity(str(out), ident, cfg.steps)
  if steps_saved:
    step = out / "checkpoints" / str(steps_saved)
    step.mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")


@pytest.mark.parametrize("recorded", [True, False], ids=["schedule", "steps"])
def test_a_resume_that_changes_the_schedule_is_refused(d, tmp_path, no_work, capsys, recorded):
  """The learning-rate schedule spans the total steps: a rerun of other --window/--steps would
  not end with an uninterrupted run's parameters. The message says how to start a new run."""
  out = tmp_path / "run"
  _run_folder(out, "64:10", 5, identity_schedule=recorded)
  assert cli.main(["train", "indexer", "--out", str(out), "--window", "64", "--steps",
                   "20"]) == 2
  want = ("--schedule (or --window:--steps)='64:20' differs" if recorded
          else "20 total steps differ")
  err = _one_error_line(capsys, "jaxsparse train indexer", want)
  assert "give a new --out to start a new run" in err


def test_a_run_stopped_before_its_first_checkpoint_does_not_hold_its_folder(d, tmp_path,
                                                                            no_work):
  """run.json without a checkpoint: a run of other settings starts there (and reaches the
  tokeniser, the first slow work)."""
  out = tmp_path / "run"
  _run_folder(out, "64:10", 0)
  (out / "checkpoints").mkdir()
  with pytest.raises(_Work):
    cli.main(["train", "indexer", "--out", str(out), "--window", "128", "--steps", "3"])


def test_the_corpus_is_checked_before_the_run_folder(d, tmp_path, no_work, capsys):
  """A bad --corpus is named even where the folder's run would refuse the other options."""
  out = tmp_path / "run"
  _run_folder(out, "64:10", 5)
  assert cli.main(["train", "indexer", "--out", str(out), "--window", "64", "--steps", "20",
                   "--corpus", str(d / "ids2d.npy")]) == 2
  _one_error_line(capsys, "jaxsparse train indexer", "--corpus=")

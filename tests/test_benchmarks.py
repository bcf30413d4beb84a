"""Every benchmark script the README names runs in its --quick mode on the CPU (none rots)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.reference import clustered_prefill_trace

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _run(script, *args):
  env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT)}
  res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                       env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  return res.stdout


def _main(script, *args):
  """A script's `main(argv)` in this process, for its further runs once a test has started it
  as a command (`_run`): the same code without another interpreter and jax import."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(f"_benchmark_{script[:-3]}",
                                                os.path.join(ROOT, "benchmarks", script))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.main(list(args))


@pytest.mark.parametrize("script", ["bench_indexer.py", "bench_topk.py", "bench_spin.py",
                                    "bench_prefill_topk.py"])
def test_kernel_benchmarks_quick(script, tmp_path):
  out = tmp_path / "r.json"
  _run(script, "--quick", "--out", str(out))
  data = json.loads(out.read_text())
  assert data["rows"] and {"device", "jax", "command"} <= set(data["environment"])
  assert all(not r.get("error") for r in data["rows"])


def test_ivf_recall_benchmark_quick(tmp_path):
  from jaxsparse import traces
  # d and layers fit the shipped corrector (layer 4 corrected, 15 plain)
  tr = clustered_prefill_trace(np.random.default_rng(0), 1024, 2, 64, [4, 15])
  path = str(tmp_path / "p.npz")
  traces.save(path, tr)
  _run("bench_ivf_recall.py", "--trace", path, "--quick", "--topk", "32", "--budgets", "256",
       "--seal-window", "128", "--cluster-size", "16", "--refit-interval", "512", "--out",
       str(tmp_path / "ivf"), "--calibration-trace", path, "--query-block", "16")
  data = json.loads((tmp_path / "ivf.json").read_text())
  methods = {r["method"] for r in data["rows"]}
  assert methods == {"IVF", "IVF seal only", "IVF corrected", "IVF metric", "IVF oracle",
                     "HiSA", "HiSA oracle", "IVF planned", "IVF metric planned",
                     "IVF shared 16, 2x budget"}
  assert data["metric"] == "smollm2_metric.npz"
  assert all(r["candidates"] <= 512 for r in data["rows"])  # shared: 2 x 256 per block
  rec = {(r["layer"], r["method"]): r["recall"] for r in data["rows"]}
  assert data["plans"]["256"]["prefer"] == "hisa" and data["plans"]["256"]["z"] == 2.0
  for layer, chosen in data["plans"]["256"]["methods"].items():  # the chosen method's recall
    assert rec[(int(layer), "IVF planned")] == rec[(int(layer), {"ivf": "IVF",
                                                                  "hisa": "HiSA"}[chosen])]
  for layer, chosen in data["metric_plans"]["256"]["methods"].items():
    assert rec[(int(layer), "IVF metric planned")] == rec[
        (int(layer), {"ivf": "IVF metric", "hisa": "HiSA"}[chosen])]
  assert rec[(15, "IVF corrected")] == rec[(15, "IVF")]  # a plain layer of the shipped file
  for r in data["rows"]:  # the paired difference to HiSA is the difference of the means
    hisa = rec[(r["layer"], "HiSA")]
    assert abs(r["minus_hisa"] - (r["recall"] - hisa)) < 1e-9 and r["minus_hisa_se"] >= 0
  assert (tmp_path / "ivf.png").read_bytes()[:4] == b"\x89PNG"


def test_ivf_block_union_quick(tmp_path):
  from jaxsparse import traces
  tr = clustered_prefill_trace(np.random.default_rng(1), 1024, 2, 16, [4])
  path = str(tmp_path / "p.npz")
  traces.save(path, tr)
  _run("ivf_block_union.py", "--trace", path, "--quick", "--topk", "32", "--budgets", "256",
       "--seal-window", "128", "--cluster-size", "16", "--refit-interval", "512", "--out",
       str(tmp_path / "u.json"))
  rows = json.loads((tmp_path / "u.json").read_text())["rows"]
  assert [r["block"] for r in rows] == [8, 16]
  # a union holds at least one query's take and at most the block's
  assert all(1 <= r["mean"] <= r["block"] and r["blocks_measured"] > 0 for r in rows)
  assert rows[0]["mean"] <= rows[1]["mean"]  # the larger block shares less


def test_spin_studies_quick(tmp_path):
  _run("spin_studies.py", "--quick", "--out", str(tmp_path / "s"))
  data = json.loads((tmp_path / "s.json").read_text())
  assert data["sweep"] and "per_layer" in data["sweep"][0] and data["table1"]["average"]


def test_ivf_prefill_benchmark_quick(tmp_path):
  _run("bench_ivf_prefill.py", "--quick", "--metric-timing", "--out", str(tmp_path / "p.json"))
  data = json.loads((tmp_path / "p.json").read_text())
  assert [r["tokens"] for r in data["rows"]] == [512, 1024]
  assert all(0.5 < r["recall"] <= 1 and r["ivf_s"] > 0 for r in data["rows"])
  assert all(0.5 < r["metric_recall"] <= 1 and r["ivf_metric_s"] > 0 for r in data["rows"])
  assert all(0 < r["hisa_recall"] <= 1 and r["hisa_s"] > 0 for r in data["rows"])


def test_ivf_prefill_benchmark_on_a_tiled_trace(tmp_path, capsys):
  """--trace: two layers of a clustered trace tiled past its length and widened, shared query
  blocks; the first layer is timed, both get a recall."""
  from jaxsparse import traces
  tr = clustered_prefill_trace(np.random.default_rng(1), 384, 2, 8, [4, 15])
  path = str(tmp_path / "p.npz")
  traces.save(path, tr)
  _run("bench_ivf_prefill.py", "--quick", "--trace", path, "--layers", "1,0", "--query-block",
       "16", "--out", str(tmp_path / "p.json"))
  rows = json.loads((tmp_path / "p.json").read_text())["rows"]
  assert [r["tokens"] for r in rows] == [512, 1024] and all(r["layer"] == 15 for r in rows)
  for r in rows:
    assert [b["layer"] for b in r["recall_by_layer"]] == [15, 4]
    assert r["recall_by_layer"][0]["recall"] == r["recall"]
    assert all(0 < b["recall"] <= 1 and 0 < b["hisa_recall"] <= 1 for b in r["recall_by_layer"])
  # the script's further runs in this process (it was started as a command above)
  with pytest.raises(SystemExit) as e:
    _main("bench_ivf_prefill.py", "--quick", "--trace", path, "--layers", "2", "--out",
          str(tmp_path / "q.json"))
  assert e.value.code == 2 and "--layers" in capsys.readouterr().err
  _main("bench_ivf_prefill.py", "--quick", "--trace", path, "--layers", "1,0", "--query-block",
        "16", "--recall-only", "--out", str(tmp_path / "r.json"))
  rec = json.loads((tmp_path / "r.json").read_text())["rows"]
  assert [(r["tokens"], r["layer"]) for r in rec] == [(512, 15), (512, 4), (1024, 15), (1024, 4)]
  assert all(0 < r[c] <= 1 for r in rec for c in ("recall", "hisa_recall", "per_query_recall"))


def test_spin_state_dtype_quick(tmp_path):
  _run("spin_state_dtype.py", "--quick", "--out", str(tmp_path / "d.json"))
  rows = json.loads((tmp_path / "d.json").read_text())["rows"]
  assert {r["state_dtype"] for r in rows} == {"float32", "bfloat16"}
  assert all(len(r["per_layer_mean_miss"]) == 2 and 0 <= r["mean_miss"] < 1 for r in rows)


def test_record_prefill_script(tmp_path):
  from jaxsparse import traces
  out = str(tmp_path / "p.npz")
  _run("record_prefill.py", "--tokens", "200", "--layers", "3,15", "--out", out)
  tr = traces.load(out)
  assert tr.kind == "prefill" and tr.layers.tolist() == [3, 15] and tr.k.shape[1] == 200


@pytest.mark.parametrize("what", ["decode-bf16", "decode-fp8qk", "topk-set", "spin"])
def test_profile_one_runs(what, capsys):
  """The ncu helper at small shapes (on a CPU its XLA paths): it must not rot either. Started
  as a command for the first case, its main() in this process for the others."""
  args = (what, "--batch", "2", "--slots", "4096", "--calls", "1")
  if what == "decode-bf16":
    out = _run("profile_one.py", *args)
  else:
    _main("profile_one.py", *args)
    out = capsys.readouterr().out
  assert f"done {what}" in out


def test_tpu_estimates_script(tmp_path):
  """The README's TPU estimate table regenerates: decode HBM-bound, prefill MXU-bound."""
  _run("tpu_estimates.py", "--out", str(tmp_path / "t.json"))
  rows = json.loads((tmp_path / "t.json").read_text())["rows"]
  assert [r["bound_v5e"] for r in rows[:2]] == ["HBM", "MXU"]
  assert all(r["floor_v5e_us"] > r["floor_v6e_us"] > 0 for r in rows)


PARTS = r'''
import contextlib, io, json, os, sys
import pytest
out = {}
for part in sys.argv[2:]:  # one interpreter: jax and the test module are imported once
  os.environ["JAXSPARSE_TEST_PART"] = part
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
    rc = pytest.main(["-q", "--co", "-p", "no:cacheprovider", sys.argv[1]])
  out[part] = {"rc": int(rc), "text": buf.getvalue()}
print(json.dumps(out))
'''


def test_test_parts_cover_the_suite_once():
  """JAXSPARSE_TEST_PART=i/n (the device driver splits the GPU tests over calls with it): the
  n parts together select every test exactly once; a malformed value is refused. Each is a
  collection by pytest itself (`pytest.main`, the conftest's hook), all in one subprocess."""
  env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT)}
  res = subprocess.run([sys.executable, "-c", PARTS, os.path.join(ROOT, "tests", "test_gpu.py"),
                        "", "1/3", "2/3", "3/3", "4/3"], env=env, capture_output=True,
                       text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  runs = json.loads(res.stdout.strip().splitlines()[-1])
  ids = {part: [ln for ln in r["text"].splitlines() if "::" in ln] for part, r in runs.items()}
  every, parts = ids[""], [ids[f"{i}/3"] for i in (1, 2, 3)]
  assert runs[""]["rc"] == 0 and len(every) > 3
  assert sorted(sum(parts, [])) == sorted(every) and all(parts)
  assert runs["4/3"]["rc"] != 0 and "JAXSPARSE_TEST_PART" in runs["4/3"]["text"]


def test_reference_runs_quick(tmp_path):
  from jaxsparse import traces
  tr = clustered_prefill_trace(np.random.default_rng(0), 512, 2, 16, [4, 15])
  path = str(tmp_path / "p.npz")
  traces.save(path, tr)
  _run("ivf_reference_runs.py", "--trace", path, "--quick", "--topk", "32", "--out",
       str(tmp_path / "r.json"))
  rows = json.loads((tmp_path / "r.json").read_text())["rows"]
  assert [r["layer"] for r in rows] == [4, 15]
  pos = np.linspace(512 // 4, 511, 8).astype(np.int64)
  for i, r in enumerate(rows):  # a float64 loop: top-32 keys, share with a neighbour within 4
    q, w, k = (np.asarray(a[i], np.float64) for a in (tr.q, tr.w, tr.k))
    near = total = 0
    for p in pos:
      z = np.maximum(k[:p + 1] @ q[p].T, 0) @ w[p]  # [p + 1] exact causal scores
      ref = np.sort(np.argsort(-z, kind="stable")[:32])
      gaps = np.diff(ref)
      close = np.zeros(len(ref), bool)
      close[1:] |= gaps <= 4
      close[:-1] |= gaps <= 4
      near, total = near + close.sum(), total + len(ref)
    assert r["in_runs"] == pytest.approx(near / total, abs=1e-12)
    assert r["within_1024"] == r["within_8192"] == 1.0  # a 512-token trace

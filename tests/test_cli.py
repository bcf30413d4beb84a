"""The `jaxsparse` command line: help, argument errors, and the main job at tiny shapes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxsparse import cli


def test_help_lists_bench(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  assert "bench" in capsys.readouterr().out


@pytest.mark.parametrize("argv,msg", [(["bench", "--slots", "100"], "--slots=100"),
                                      (["bench", "--k", "0"], "--k=0")])
def test_bad_arguments_name_the_flag(argv, msg, capsys):
  assert cli.main(argv) == 2
  assert msg in capsys.readouterr().err


def test_bench_runs_and_writes_json(tmp_path, capsys):
  out = tmp_path / "r.json"
  assert cli.main(["bench", "--slots", "1024", "--chunk", "16", "--heads", "8", "--head-dim",
                   "32", "--k", "16", "--out", str(out)]) == 0
  data = json.loads(out.read_text())
  assert {"device", "jax", "date", "command"} <= set(data["environment"])
  ops = {r["op"] for r in data["rows"]}
  assert ops == {"decode", "prefill", "topk"}
  assert all(r["error"] == "" for r in data["rows"] if "error" in r)
  assert "jnp einsum" in capsys.readouterr().out


def test_eval_shipped_trace_with_spin_options(capsys):
  assert cli.main(["eval", "--k", "32", "--sparsities", "0.3", "--explore", "none",
                   "--implementation", "xla"]) == 0
  out = capsys.readouterr().out
  assert "SPIN 30%" in out and "full DSA" in out


def test_eval_rejects_bad_spin_options(capsys):
  assert cli.main(["eval", "--sparsities", "1.5"]) == 2
  assert "sparsity" in capsys.readouterr().err
  assert cli.main(["eval", "--explore", "greedy"]) == 2


def test_time_in_graph_modes(monkeypatch):
  """The device timer: loop and unrolled modes with threaded state, and the env switch."""
  import jax
  import jax.numpy as jnp
  from jaxsparse import benchtools
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


def test_kernel_time_needs_gpu_kernels():
  """On a machine without a GPU the device-trace timer says so instead of returning 0."""
  import jax
  import jax.numpy as jnp
  from jaxsparse.benchtools import kernel_time
  if jax.default_backend() == "gpu":
    pytest.skip("covered by tests/test_gpu.py::test_kernel_time_gpu")
  with pytest.raises(RuntimeError, match="no GPU kernel events"):
    kernel_time(jax.jit(lambda x: x + 1), (jnp.ones(8),), calls=2)
  # carry threads a donated state from call to call (each call would otherwise read the
  # buffer the previous one consumed), so the run gets as far as the trace
  step = jax.jit(lambda s, x: (s + x, x.sum()), donate_argnums=0)
  with pytest.raises(RuntimeError, match="no GPU kernel events"):
    kernel_time(step, (jnp.zeros(8), jnp.ones(8)), calls=3, carry=(0, 0))

"""Per-layer partition plans: calibration picks blocks on a layer of positional runs and
content groups on a clustered layer; plan files round-trip and bad ones are named."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxsparse import ivf, traces
from jaxsparse.ivf import plan

CFG = ivf.IVFConfig(topk=32, budget=160, seal_window=128, cluster_size=16, refit_interval=512,
                    sink=4)
N, H, D = 1024, 2, 16


def _runs_layer(rng):
  """Keys = a slowly turning positional direction + content noise; each query aims at the
  positional direction of one earlier position, so its reference keys are a contiguous run
  that block means see through the noise and content clusters split."""
  t = np.arange(N)[:, None] / 24.0
  f = np.arange(1, D // 2 + 1)[None, :] / (D / 2)
  pos = np.concatenate([np.sin(t * f), np.cos(t * f)], 1)
  k = pos + 0.8 * rng.standard_normal((N, D))
  target = (rng.uniform(0, 1, N) * np.arange(N)).astype(int)
  return np.repeat(pos[target][:, None, :], H, 1), k


def _content_layer(rng):
  """Clustered keys at random positions; each query aims at one cluster center."""
  c = 2.0 * rng.standard_normal((16, D))
  k = c[rng.integers(0, 16, N)] + 0.3 * rng.standard_normal((N, D))
  q = np.repeat(c[rng.integers(0, 16, N)][:, None, :], H, 1) + 0.3 * rng.standard_normal(
      (N, H, D))
  return q, k


def _trace(seed=0):
  rng = np.random.default_rng(seed)
  (q0, k0), (q1, k1) = _runs_layer(rng), _content_layer(rng)
  return traces.PrefillTrace(q=np.stack([q0, q1]).astype(np.float32),
                             w=np.ones((2, N, H), np.float32),
                             k=np.stack([k0, k1]).astype(np.float32),
                             layers=np.array([3, 7]), meta={"source": "synthetic"})


@pytest.fixture(scope="module")
def calibrated():
  return _trace(), plan.calibrate(_trace(), CFG, queries=64)


def test_calibration_gives_blocks_to_runs_and_groups_to_content(calibrated):
  tr, p = calibrated
  assert p["methods"] == {3: "hisa", 7: "ivf"}
  pos = plan.calibration_positions(N, CFG.seal_window, 64)
  for i, layer in enumerate([3, 7]):  # the recorded recalls are evaluate's, per method
    for m in ("ivf", "hisa"):
      r = ivf.evaluate(tr.q[i], tr.k[i], tr.w[i], CFG, method=m, query_positions=pos)
      assert p["recall"][layer][m] == pytest.approx(float(r["recall"].mean()), abs=1e-12)
    rec = p["recall"][layer]
    assert rec["difference"] == pytest.approx(rec["hisa"] - rec["ivf"], abs=1e-12)
  assert p["recall"][3]["difference"] > 2 * p["recall"][3]["std_error"] > 0
  assert plan.method(p, 3) == "hisa" and plan.method(p, 7) == "ivf"


def test_calibration_pools_the_texts_that_hold_each_layer(calibrated):
  """A second, shorter text holding only layer 7: layer 7's figures are the mean over both
  texts' queries; layer 3's stay the first text's alone."""
  tr, p1 = calibrated
  t2 = _trace(seed=1)
  n2 = 768
  t2 = traces.PrefillTrace(q=t2.q[1:, :n2], w=t2.w[1:, :n2], k=t2.k[1:, :n2],
                           layers=np.array([7]), meta={"source": "second"})
  p = plan.calibrate([tr, t2], CFG, queries=64)
  assert p["recall"][3] == {**p1["recall"][3]} and p["recall"][3]["texts"] == 1
  pos = plan.calibration_positions(n2, CFG.seal_window, 64)
  r2 = {m: ivf.evaluate(t2.q[0], t2.k[0], t2.w[0], CFG, method=m, query_positions=pos)["recall"]
        for m in ("ivf", "hisa")}
  n1 = len(plan.calibration_positions(N, CFG.seal_window, 64))
  for m in ("ivf", "hisa"):
    want = (p1["recall"][7][m] * n1 + float(np.sum(r2[m]))) / (n1 + len(pos))
    assert p["recall"][7][m] == pytest.approx(want, abs=1e-12)
  assert p["recall"][7]["texts"] == 2 and p["methods"] == {3: "hisa", 7: "ivf"}
  first, second = p["recall"][7]["per_text"]
  assert first == {k: p1["recall"][7][k] for k in first}
  assert second["ivf"] == pytest.approx(float(np.mean(r2["ivf"])), abs=1e-12)
  assert "per_text" not in p["recall"][3]
  assert [m["source"] for m in p["traces"]] == ["synthetic", "second"]
  with pytest.raises(ValueError, match="trace"):
    plan.calibrate([], CFG)


@pytest.mark.parametrize("prefer", ["ivf", "hisa"])
def test_a_strict_rule_keeps_the_preferred_partition_everywhere(prefer):
  p = plan.calibrate(_trace(), CFG, queries=64, z=1e6, prefer=prefer)
  assert set(p["methods"].values()) == {prefer} and p["prefer"] == prefer


def test_choose_keeps_the_preferred_partition_unless_the_other_wins_clearly():
  """Paired differences HiSA minus IVF: mean 0.01, standard error 0.0058 (a 1.7 s.e. lead)."""
  tie = np.array([0.0, 0.02, 0.0, 0.02])
  for prefer in ("ivf", "hisa"):
    assert plan.choose(tie, z=2.0, prefer=prefer) == prefer
  assert plan.choose(tie, z=1.0, prefer="ivf") == "hisa"  # over 1 standard error: blocks win
  assert plan.choose(-tie, z=1.0, prefer="hisa") == "ivf"
  assert plan.choose(tie, z=1.0, prefer="hisa") == "hisa"
  assert plan.choose(np.zeros(5), z=0.0, prefer="ivf") == "ivf"  # no lead at all
  with pytest.raises(ValueError, match="prefer='groups'"):
    plan.choose(tie, prefer="groups")
  with pytest.raises(ValueError, match="difference"):
    plan.choose(tie[:1])


def test_plan_files_round_trip_and_bad_ones_are_named(calibrated, tmp_path):
  _, p = calibrated
  path = str(tmp_path / "plan.json")
  plan.save(path, p)
  back = plan.load(path)
  assert back["methods"] == p["methods"] and back["recall"] == p["recall"]
  with pytest.raises(ValueError, match="layer=5"):
    plan.method(back, 5)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    plan.load(str(tmp_path / "none.json"))
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(plan.PlanFileError, match="not a JSON plan"):
    plan.load(str(bad))
  raw = json.loads((tmp_path / "plan.json").read_text())
  for change, msg in [({"format": 99}, "format=99"), ({"methods": {"3": "blocks"}}, "must each be"),
                      ({"methods": {}}, "no layers"), ({"methods": {"x": "ivf"}}, "integers"),
                      ({"prefer": "groups"}, "prefer='groups'")]:
    bad.write_text(json.dumps({**raw, **change}))
    with pytest.raises(plan.PlanFileError, match=msg):
      plan.load(str(bad))


@pytest.mark.parametrize("kw,msg", [({"queries": 1}, "queries=1"), ({"z": -1.0}, "z=-1"),
                                    ({"prefer": "blocks"}, "prefer='blocks'")])
def test_bad_calibration_options_name_the_argument(kw, msg):
  with pytest.raises(ValueError, match=msg):
    plan.calibrate(_trace(), CFG, **kw)


def test_shared_cache_measures_hisa_once_and_changes_no_plan(calibrated, monkeypatch):
  """Two calibrations sharing a cache (plain, then under a metric) give the plans that separate
  calls give, and evaluate HiSA once per (trace, layer): the second call scores only IVF."""
  from jaxsparse.ivf import evaluation
  tr, want = calibrated
  met = {3: 2.0 * np.eye(D), 7: np.diag(np.linspace(0.5, 2.0, D))}
  want_metric = plan.calibrate(tr, CFG, queries=64, metric=met)
  calls = []
  real = evaluation.evaluate

  def counted(*args, **kw):
    calls.append(kw["method"])
    return real(*args, **kw)

  monkeypatch.setattr(evaluation, "evaluate", counted)
  cache = {}
  got = plan.calibrate(tr, CFG, queries=64, cache=cache)
  assert calls == ["ivf", "hisa"] * 2 and len(cache) == 2
  calls.clear()
  got_metric = plan.calibrate(tr, CFG, queries=64, metric=met, cache=cache)
  assert calls == ["ivf", "ivf"]
  assert got == want and got_metric == want_metric
  calls.clear()  # another budget is another configuration: HiSA is measured again
  plan.calibrate(tr, dataclasses.replace(CFG, budget=192), queries=64, cache=cache)
  assert calls == ["ivf", "hisa"] * 2 and len(cache) == 4


def test_prefill_runs_each_layer_under_its_plan(calibrated, tmp_path):
  """prefill_topk(plan=, layer=) runs the planned partition: layer 3 (planned blocks) equals
  HiSA's prefill even with a metric given (it shapes content groups only), layer 7 equals the
  content groups'; a plan file works as the dict does."""
  tr, p = calibrated
  path = str(tmp_path / "plan.json")
  plan.save(path, p)
  eye = np.eye(D, dtype=np.float32)
  for i, layer in enumerate([3, 7]):
    want = ivf.prefill_topk(tr.q[i], tr.k[i], tr.w[i], CFG, method=p["methods"][layer])
    other = ivf.prefill_topk(tr.q[i], tr.k[i], tr.w[i], CFG,
                             method={"ivf": "hisa", "hisa": "ivf"}[p["methods"][layer]])
    assert not np.array_equal(np.asarray(want[0]), np.asarray(other[0]))  # the choice matters
    for given in (p, path):
      got = ivf.prefill_topk(tr.q[i], tr.k[i], tr.w[i], CFG, plan=given, layer=layer)
      np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  got = ivf.prefill_topk(tr.q[0], tr.k[0], tr.w[0], CFG, plan=p, layer=3, metric=2 * eye)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(
      ivf.prefill_topk(tr.q[0], tr.k[0], tr.w[0], CFG, method="hisa")[0]))


@pytest.mark.parametrize("kw, msg", [
    (dict(method="ivf", layer=3), "method or plan"),
    (dict(), "needs layer"),
    (dict(layer=5), "layer=5 is not in the plan"),
    (dict(layer=3, config=dataclasses.replace(CFG, budget=192)), "budget=160, not config.budget=192"),
])
def test_prefill_plan_misuse_is_named(calibrated, kw, msg):
  tr, p = calibrated
  cfg = kw.pop("config", CFG)
  with pytest.raises(ValueError, match=msg):
    ivf.prefill_topk(tr.q[0], tr.k[0], tr.w[0], cfg, plan=p, **kw)


def test_shipped_plans_are_the_recall_runs_choices(tmp_path):
  """The shipped file is what benchmarks/ship_plans.py makes of the committed recall results,
  and plan.shipped finds a plan by context and budget (blocks on 32K's run layers)."""
  import importlib.util
  import os
  here = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "ship_plans.py")
  spec = importlib.util.spec_from_file_location("ship_plans", here)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  made = [pl for name in mod.SOURCES
          for pl in mod.plans_from(os.path.join(os.path.dirname(here), "results", name))]
  with open(plan.SHIPPED) as f:
    assert json.load(f)["plans"] == made
  out = str(tmp_path / "plans.json")  # the script's own command writes the same file
  assert mod.main(["--out", out]) == 0
  with open(out) as f, open(plan.SHIPPED) as g:
    assert json.load(f) == json.load(g)
  p = plan.shipped(32768, 4096, metric=True)
  assert [m for m in range(30) if p["methods"][m] == "hisa"] == [0, 1, 11, 29]
  assert p["metric"] == "smollm2_metric.npz" and p["config"]["cluster_size"] == 128
  assert plan.shipped(8192, 384, metric=False)["methods"][27] == "hisa"
  with pytest.raises(ValueError, match=r"\(32768, 2048\)"):
    plan.shipped(65536, 4096)

"""AttentionIndex's query-aware grouping metric (jaxsparse.ivf.metric)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxsparse import cli, ivf, traces
from jaxsparse.ivf import metric
from tests.reference import clustered_prefill_trace, saved_prefill_traces
from tests.test_ivf import CFG, _shift_corrector, _trace


def _reference_metric(q, w, k, eps, queries=256, keys=256, seed=0):
  """float64 loops over the sampled pairs: S = sum g g^T with g = sum_h w_h [q_h . k > 0] q_h
  (the score's gradient in the key); A with A A = D S / tr S + eps I."""
  q, w, k = (np.asarray(a, np.float64) for a in (q, w, k))
  n, h, d = q.shape
  s = np.zeros((d, d))
  pos, ids = metric.sample_pairs(n, queries, keys, seed)
  for p, row in zip(pos, ids):
    for i in row:
      g = np.zeros(d)
      for j in range(h):
        if q[p, j] @ k[i] > 0:
          g += w[p, j] * q[p, j]
      s += np.outer(g, g)
  s = d * s / np.trace(s) + eps * np.eye(d)
  e, v = np.linalg.eigh(s)
  return v @ np.diag(np.sqrt(e)) @ v.T


def test_pairs_are_causal_and_spread():
  pos, ids = metric.sample_pairs(1000, 50, 40, seed=1)
  assert pos[0] == 1000 // 16 and pos[-1] == 999 and len(pos) == 50
  assert (ids >= 0).all() and (ids <= pos[:, None]).all()
  assert ids[-1].max() > 600  # not only the oldest keys
  again = metric.sample_pairs(1000, 50, 40, seed=1)[1]
  np.testing.assert_array_equal(ids, again)


@pytest.mark.parametrize("eps", [0.01, 0.5])
def test_fit_matches_a_float64_reference(eps):
  rng = np.random.default_rng(3)
  q = (rng.standard_normal((300, 3, 8)) * np.linspace(0.2, 3.0, 8)).astype(np.float32)
  w = rng.uniform(-0.5, 1.0, (300, 3)).astype(np.float32)
  k = rng.standard_normal((300, 8)).astype(np.float32)
  a = metric.fit(q, k, w, eps=eps, queries=40, keys=30)
  ref = _reference_metric(q, w, k, eps, queries=40, keys=30)
  assert a.dtype == np.float32 and a.shape == (8, 8)
  # float32 rounding of a matrix of entries ~1: relative 1e-6, far below a 1% error
  np.testing.assert_allclose(a, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
  # the gate matters: the ungated moment of sum_h w_h q_h gives another matrix
  u = np.einsum("nh,nhd->nd", w.astype(np.float64), q.astype(np.float64))
  s = 8 * (u.T @ u) / np.trace(u.T @ u) + eps * np.eye(8)
  assert np.abs(a.astype(np.float64) @ a - s).max() > 0.05


def test_fit_traces_pools_every_trace_of_a_layer():
  rng = np.random.default_rng(5)
  t1 = clustered_prefill_trace(rng, 200, 2, 8, [3, 7])
  t2 = clustered_prefill_trace(rng, 300, 2, 8, [3, 7])
  got = metric.fit_traces([t1, t2], eps=0.05, queries=20, keys=10)
  assert sorted(got) == [3, 7]
  for i, layer in enumerate([3, 7]):
    s = sum(_raw_moment(t.q[i], t.w[i], t.k[i], 20, 10) for t in (t1, t2))
    s = 8 * s / np.trace(s) + 0.05 * np.eye(8)
    e, v = np.linalg.eigh(s)
    want = v @ np.diag(np.sqrt(e)) @ v.T
    np.testing.assert_allclose(got[layer], want, rtol=0, atol=2e-6 * np.abs(want).max())
  t3 = clustered_prefill_trace(rng, 200, 2, 8, [3])
  with pytest.raises(ValueError, match="same layers"):
    metric.fit_traces([t1, t3])


def _raw_moment(q, w, k, queries, keys):
  q, w, k = (np.asarray(a, np.float64) for a in (q, w, k))
  pos, ids = metric.sample_pairs(len(k), queries, keys, 0)
  s = np.zeros((q.shape[2],) * 2)
  for p, row in zip(pos, ids):
    for i in row:
      g = sum(w[p, j] * q[p, j] for j in range(q.shape[1]) if q[p, j] @ k[i] > 0)
      s += np.outer(g, g)
  return s


def test_a_power_of_two_metric_changes_nothing():
  """2 I scales every distance by 4 and every key exactly: the same partition, the same
  ranking (q / 2 . 2 c), so the same selection bit for bit; the identity too."""
  q, k, w = _trace()
  pos = np.arange(60, 400, 7)
  base = ivf.evaluate(q, k, w, CFG, query_positions=pos)
  for a in (np.eye(16, dtype=np.float32), 2 * np.eye(16, dtype=np.float32)):
    r = ivf.evaluate(q, k, w, CFG, query_positions=pos, metric=a)
    np.testing.assert_array_equal(r["topk_indices"], base["topk_indices"])
    np.testing.assert_array_equal(r["num_candidates"], base["num_candidates"])


def _nuisance_trace(n=1024, h=2, seed=0):
  """Keys whose large-variance coordinates (0-7) no query reads, and whose small-variance
  coordinates (8-15) hold what the queries score: Euclidean k-means groups by the former."""
  rng = np.random.default_rng(seed)
  k = np.concatenate([4.0 * rng.standard_normal((n, 8)),
                      rng.standard_normal((8, 8))[rng.integers(0, 8, n)]
                      + 0.1 * rng.standard_normal((n, 8))], 1)
  q = np.concatenate([np.zeros((n, h, 8)), rng.standard_normal((n, h, 8))], 2)
  w = rng.uniform(0.5, 1.0, (n, h))
  return q.astype(np.float32), k.astype(np.float32), w.astype(np.float32)


def test_the_metric_groups_keys_by_what_queries_read():
  """On keys whose spread lies where no query looks, plain groups mix what queries tell apart;
  the metric fitted on other queries of the same kind groups them by score and finds far more
  of the top-K at the same budget."""
  q, k, w = _nuisance_trace()
  a = metric.fit(*_nuisance_trace(seed=1))
  cfg = ivf.IVFConfig(topk=32, budget=200, seal_window=128, cluster_size=16,
                      refit_interval=256, sink=4)
  pos = np.arange(256, 1024, 16)
  plain = ivf.evaluate(q, k, w, cfg, query_positions=pos)["recall"].mean()
  fitted = ivf.evaluate(q, k, w, cfg, query_positions=pos, metric=a)["recall"].mean()
  assert fitted > plain + 0.15, (plain, fitted)


def test_no_query_sees_a_key_after_its_position_under_a_metric():
  q, k, w = _trace()
  a = metric.fit(*_trace(seed=2))
  pos = np.asarray([63, 64, 127, 128, 129, 255, 256, 399])
  base = ivf.evaluate(q, k, w, CFG, query_positions=pos, metric=a)
  assert (base["topk_indices"] <= pos[:, None]).all()
  rng = np.random.default_rng(9)
  for j, n in enumerate(pos):
    q2, w2, k2 = q.copy(), w.copy(), k.copy()
    k2[n + 1:] = 5 * rng.standard_normal(k2[n + 1:].shape)
    q2[n + 1:] = rng.standard_normal(q2[n + 1:].shape)
    r = ivf.evaluate(q2, k2, w2, CFG, query_positions=pos[j:j + 1], metric=a)
    np.testing.assert_array_equal(r["topk_indices"][0], base["topk_indices"][j])


@pytest.mark.parametrize("corr", [None, _shift_corrector], ids=["plain", "corrected"])
def test_prefill_topk_equals_the_evaluation_path_under_a_metric(corr):
  q, k, w = _trace()
  a = metric.fit(*_trace(seed=2))
  idx, num = map(np.asarray, ivf.prefill_topk(q, k, w, CFG, metric=a, corrector=corr))
  ref = ivf.evaluate(q, k, w, CFG, query_positions=np.arange(400), metric=a, corrector=corr)
  plain = ivf.evaluate(q, k, w, CFG, query_positions=np.arange(400), corrector=corr)
  assert (plain["topk_indices"] != ref["topk_indices"]).any()  # the metric changed the groups
  np.testing.assert_array_equal(num, ref["num_candidates"])
  for i in range(400):
    assert set(idx[i][idx[i] >= 0]) == set(ref["topk_indices"][i][ref["topk_indices"][i] >= 0])


def test_bad_metrics_name_the_argument(tmp_path):
  q, k, w = _trace()
  pos = np.arange(100, 110)
  for bad, msg in [(np.eye(8), r"metric must be a \[16, 16\]"),
                   (np.diag(np.r_[1.0, -np.ones(15)]), "positive definite"),
                   (np.triu(np.ones((16, 16))), "symmetric"),
                   (np.full((16, 16), np.nan), "finite")]:
    with pytest.raises(ValueError, match=msg):
      ivf.evaluate(q, k, w, CFG, query_positions=pos, metric=bad)
  with pytest.raises(ValueError, match="metric applies to method='ivf'"):
    ivf.evaluate(q, k, w, CFG, method="hisa", query_positions=pos, metric=np.eye(16))
  with pytest.raises(ValueError, match="metric applies to method='ivf'"):
    ivf.prefill_topk(q, k, w, CFG, method="hisa", metric=np.eye(16))
  with pytest.raises(ValueError, match="eps=0"):
    metric.fit(q, k, w, eps=0)
  with pytest.raises(ValueError, match="keys=0"):
    metric.fit(q, k, w, keys=0)
  from jaxsparse.ivf import plan as ivf_plan
  tr = clustered_prefill_trace(np.random.default_rng(0), 300, 4, 16, [3, 7])
  with pytest.raises(ValueError, match=r"metric holds no matrix for layers \[7\]"):
    ivf_plan.calibrate(tr, CFG, queries=8, metric={3: np.eye(16)})
  path = str(tmp_path / "m.npz")
  metric.save(path, {5: metric.fit(q, k, w)})
  with pytest.raises(ValueError, match=r"layer=4 must name a layer the metric file holds: \[5\]"):
    ivf.evaluate(q, k, w, CFG, query_positions=pos, metric=path, layer=4)


def test_metric_files_round_trip_and_bad_files_are_named(tmp_path):
  a = metric.fit(*_trace())
  path = str(tmp_path / "m.npz")
  metric.save(path, {2: a, 9: 2 * a}, meta={"eps": 0.01})
  got = metric.load(path)
  assert sorted(got) == [2, 9]
  np.testing.assert_array_equal(got[9], 2 * a)
  assert metric.file_meta(path) == {"eps": 0.01}
  with pytest.raises(FileNotFoundError, match="does not exist"):
    metric.load(str(tmp_path / "none.npz"))
  junk = tmp_path / "junk.npz"
  junk.write_bytes(b"not a zip")
  with pytest.raises(metric.MetricFileError, match="not a readable metric file"):
    metric.load(str(junk))
  other = str(tmp_path / "other.npz")
  np.savez(other, format=np.int64(7))
  with pytest.raises(metric.MetricFileError, match="format 1"):
    metric.load(other)
  skew = str(tmp_path / "skew.npz")
  np.savez(skew, format=np.int64(1), config=np.str_(json.dumps({"layers": [0]})),
           layer_0=np.triu(np.ones((4, 4), np.float32)))
  with pytest.raises(metric.MetricFileError, match="symmetric"):
    metric.load(skew)
  with pytest.raises(ValueError, match="symmetric"):
    metric.save(str(tmp_path / "x.npz"), {0: np.triu(np.ones((4, 4)))})
  assert not (tmp_path / "x.npz").exists()
  metric.save(path, {2: 3 * a})  # rewritten in place: read again, never a stale copy
  np.testing.assert_array_equal(metric.load(path)[2], 3 * a)
  assert sorted(metric.load(path)) == [2] and metric.file_meta(path) == {}
  cplx = str(tmp_path / "complex.npz")
  np.savez(cplx, format=np.int64(1), config=np.str_(json.dumps({"layers": [0]})),
           layer_0=np.eye(4, dtype=np.complex64))
  with pytest.raises(metric.MetricFileError, match="real type"):
    metric.load(cplx)
  with pytest.raises(ValueError, match="metric.dtype=complex128 must be a real type"):
    metric.check(np.eye(4) + 0j)


def test_shipped_metric_covers_every_smollm2_layer():
  got = metric.load(metric.SHIPPED)
  assert sorted(got) == list(range(30))
  assert all(a.shape == (64, 64) for a in got.values())
  meta = metric.file_meta(metric.SHIPPED)
  assert len(meta["traces"]) == 3 and meta["eps"] == 0.01 and meta["keys"] == 256


def test_cli_fits_a_metric_and_eval_adds_its_row(tmp_path, capsys):
  rng = np.random.default_rng(1)
  paths, held = saved_prefill_traces(tmp_path, rng, (640, 576))
  out = str(tmp_path / "metric.npz")
  assert cli.main(["fit-metric", "--trace", ",".join(paths), "--out", out]) == 0
  assert "metric for 2 layers from 2 trace(s)" in capsys.readouterr().out
  want = metric.fit_traces([traces.load(p) for p in paths])
  got = metric.load(out)
  assert sorted(got) == [3, 7] and all(np.array_equal(got[x], want[x]) for x in (3, 7))
  opts = ["--k", "16", "--budget", "200", "--seal-window", "64", "--cluster-size", "16",
          "--refit-interval", "256", "--queries", "16"]
  res = tmp_path / "r.json"
  assert cli.main(["eval", "--trace", held, "--metric", out, "--out", str(res)] + opts) == 0
  rows = {r["method"]: r for r in json.loads(res.read_text())["rows"]}
  tr = traces.load(held)
  cfg = ivf.IVFConfig(topk=16, budget=200, seal_window=64, cluster_size=16, refit_interval=256)
  pos = np.unique(np.linspace(64, 639, 16).astype(np.int64))
  per_layer = [float(ivf.evaluate(tr.q[i], tr.k[i], tr.w[i], cfg, query_positions=pos,
                                  metric=got[layer])["recall"].mean())
               for i, layer in enumerate([3, 7])]
  assert rows["IVF, query-aware metric"]["recall"] == pytest.approx(np.mean(per_layer),
                                                                     abs=1e-12)
  capsys.readouterr()
  one = str(tmp_path / "one.npz")
  traces.save(one, clustered_prefill_trace(rng, 640, 2, 16, [9]))
  for argv, msg in [(["--trace", one, "--metric", out], "holds no metric for layers [9]"),
                    (["--trace", held, "--metric", str(tmp_path / "no.npz")], "does not exist")]:
    assert cli.main(["eval"] + argv + opts) == 2
    assert msg in capsys.readouterr().err
  for argv, msg in [(["--trace", paths[0], "--eps", "0"], "--eps=0"),
                    (["--trace", str(tmp_path / "no.npz")], "does not exist")]:
    assert cli.main(["fit-metric", "--out", out] + argv) == 2
    assert msg in capsys.readouterr().err


def test_plans_calibrated_under_a_metric_compare_its_groups_with_blocks(tmp_path, capsys):
  """`plan --metric` measures the content groups under the metric; `eval --plan` then runs
  the layers planned as groups under it and names a missing --metric."""
  from jaxsparse.ivf import plan as ivf_plan
  rng = np.random.default_rng(2)
  (path,), held = saved_prefill_traces(tmp_path, rng, (640,))
  mpath = str(tmp_path / "m.npz")
  assert cli.main(["fit-metric", "--trace", path, "--out", mpath]) == 0
  opts = ["--k", "16", "--budget", "200", "--seal-window", "64", "--cluster-size", "16",
          "--refit-interval", "256", "--queries", "16"]
  out = str(tmp_path / "plan.json")
  assert cli.main(["plan", "--trace", path, "--out", out, "--metric", mpath, "--prefer", "ivf",
                   "--z", "100"] + opts) == 0
  pl = ivf_plan.load(out)
  assert pl["metric"] == "m.npz" and set(pl["methods"].values()) == {"ivf"}
  cfg = ivf.IVFConfig(topk=16, budget=200, seal_window=64, cluster_size=16, refit_interval=256)
  tr = traces.load(path)
  pos = ivf_plan.calibration_positions(640, 64, 16)
  want = ivf.evaluate(tr.q[1], tr.k[1], tr.w[1], cfg, query_positions=pos, metric=mpath,
                      layer=7)["recall"].mean()
  assert pl["recall"][7]["ivf"] == pytest.approx(want, abs=1e-12)
  res = tmp_path / "r.json"
  capsys.readouterr()
  assert cli.main(["eval", "--trace", held, "--plan", out] + opts) == 2
  assert "calibrated with the grouping metric 'm.npz'" in capsys.readouterr().err
  assert cli.main(["eval", "--trace", held, "--plan", out, "--metric", mpath, "--out",
                   str(res)] + opts) == 0
  rows = {r["method"]: r["recall"] for r in json.loads(res.read_text())["rows"]}
  assert rows["IVF planned (per layer)"] == pytest.approx(rows["IVF, query-aware metric"],
                                                           abs=1e-12)


def test_prefill_topk_with_a_metric_runs_under_jit():
  """The metric is a concrete [D, D] array (or file) closed over; q, w and k may be traced."""
  import jax
  q, k, w = _trace()
  a = metric.fit(*_trace(seed=2))
  eager = ivf.prefill_topk(q, k, w, CFG, metric=a)
  jitted = jax.jit(lambda q, w, k: ivf.prefill_topk(q, k, w, CFG, metric=a))(q, w, k)
  for x, y in zip(eager, jitted):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

"""Differential property tests of README "Input rules": the same adversarial inputs (NaN, +-inf,
-0.0, subnormals, ties, empty and ragged rows, out-of-range tables and lengths, positions near
the int32 limit) go to every path of an op, eagerly and under jit, and each must equal the
float64 numpy reference (tests/reference.py) under the documented rules.

Shapes are fixed per test so that each path compiles once; hypothesis varies the values."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import jaxsparse
from jaxsparse import ivf, spin  # noqa: F401  (jaxsparse.spin below)
from tests.reference import np_topk, rule_scores

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
TINY = float(np.finfo(np.float32).tiny)
# scores: ties (small integers), signed zeros, subnormals, infinities, NaN
SCORE = st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, 3.5, TINY / 4, -TINY / 4, TINY,
                         np.inf, -np.inf, np.nan])
# inputs of the indexer: exact float32 arithmetic for these small values at D <= 16
INPUT = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, -2.0, np.inf, -np.inf, np.nan])
WEIGHT = st.sampled_from([0.0, 1.0, 0.5, 2.0, -1.0, np.inf, np.nan])


def _arrays(shape, elements, rare=INPUT):
  """Mostly ordinary values, with adversarial ones mixed in."""
  ordinary = st.sampled_from([0.0, 1.0, -1.0, 2.0, 0.5, -0.5])
  return hnp.arrays(np.float32, shape, elements=st.one_of(ordinary, ordinary, rare))


def _same_topk(got, want):
  v, i = (np.asarray(a) for a in got)
  np.testing.assert_array_equal(i, want[1])
  np.testing.assert_array_equal(np.where(np.abs(v) < TINY, 0, v), want[0])


ROWS, N, K = 3, 200, 7


# jitted once per path (module level, so that every example reuses the compilation)
@functools.partial(jax.jit, static_argnames="impl")
def _topk_jit(x, lengths, *, impl):
  return jaxsparse.topk(x, K, lengths=lengths, implementation=impl)


@functools.partial(jax.jit, static_argnames="impl")
def _scores_jit(q, k, w, pos, *, impl):
  return jaxsparse.indexer_scores(q, k, w, query_positions=pos, implementation=impl)


@functools.partial(jax.jit, static_argnames="impl")
def _paged_topk_jit(q, kc, table, lengths, w, *, impl):
  return jaxsparse.indexer_topk(q, kc, table, lengths, w, 6, implementation=impl)


@functools.partial(jax.jit, static_argnames="impl")
def _paged_scores_jit(q, kc, table, lengths, w, *, impl):
  return jaxsparse.paged_indexer_scores(q, kc, table, lengths, w, implementation=impl)


@SETTINGS
@given(x=hnp.arrays(np.float32, (ROWS, N), elements=SCORE),
       lengths=hnp.arrays(np.int32, (ROWS,), elements=st.integers(-3, N + 5)))
def test_topk_every_path(x, lengths):
  want = np_topk(x, K, np.clip(lengths, 0, N))
  for impl in ("xla", "pallas"):
    _same_topk(jaxsparse.topk(jnp.asarray(x), K, lengths=jnp.asarray(lengths),
                              implementation=impl), want)
    _same_topk(_topk_jit(jnp.asarray(x), jnp.asarray(lengths), impl=impl), want)


@SETTINGS
@given(a=hnp.arrays(np.float32, (2, 6), elements=SCORE),
       b=hnp.arrays(np.float32, (2, 5), elements=SCORE))
def test_merge_topk_is_topk_of_the_union(a, b):
  """Per-part top-K (any order of NaN and ties) merged = top-K of the concatenated row."""
  va, ia = jaxsparse.topk(jnp.asarray(a), 5, implementation="xla")
  vb, ib = jaxsparse.topk(jnp.asarray(b), 5, implementation="xla")
  want = np_topk(np.concatenate([a, b], 1), 5)
  _same_topk(jaxsparse.merge_topk(va, ia, vb, jnp.where(ib >= 0, ib + 6, -1), 5), want)
  with pytest.raises(ValueError, match="k=0"):
    jaxsparse.merge_topk(va, ia, vb, ib, 0)


T, H, D, NK = 8, 2, 16, 24


def _scores_equal(got, want):
  got = np.asarray(got, np.float64)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  np.testing.assert_array_equal(got[ok], want[ok])


@SETTINGS
@given(q=_arrays((T, H, D), None), k=_arrays((NK, D), None),
       w=hnp.arrays(np.float32, (T, H), elements=WEIGHT),
       pos=hnp.arrays(np.int32, (T,), elements=st.integers(-2, NK + 3)))
def test_indexer_scores_and_prefill_topk_every_path(q, k, w, pos):
  """IEEE through the ReLU and the head sum, zero-weight heads add 0 (the kernels pad heads
  with them), NaN scores never chosen, ties to the lower key."""
  want = rule_scores(q, k, w, pos)
  args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(w))
  for impl in ("xla", "pallas"):
    _scores_equal(jaxsparse.indexer_scores(*args, query_positions=jnp.asarray(pos),
                                           implementation=impl), want)
    _scores_equal(_scores_jit(*args, jnp.asarray(pos), impl=impl), want)
  ref = np_topk(want.astype(np.float32), 5)
  for impl in ("xla", "pallas"):
    _same_topk(jaxsparse.prefill_topk(*args, 5, query_positions=jnp.asarray(pos),
                                      implementation=impl, block=8), ref)


def test_positions_near_the_int32_limit():
  """Concrete positions past int32 are refused; traced ones clip before the cast, so a
  uint32 position past 2^31 sees every key instead of wrapping to none."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((NK, D)), jnp.float32)
  w = jnp.ones((T, H), jnp.float32)
  big = np.full((T,), 2 ** 31 + 7, np.uint32)
  with pytest.raises(ValueError, match="query_positions must fit int32"):
    jaxsparse.indexer_scores(q, k, w, query_positions=jnp.asarray(big))
  with pytest.raises(ValueError, match="query_positions.dtype"):
    jaxsparse.prefill_topk(q, k, w, 4, query_positions=np.arange(T) + 0.5)
  want = rule_scores(q, k, w)
  edge = np.full((T,), np.iinfo(np.int32).max, np.int32)
  for impl in ("xla", "pallas"):
    for p in (jnp.asarray(big), jnp.asarray(edge)):
      f = jax.jit(lambda a, impl=impl: jaxsparse.indexer_scores(q, k, w, query_positions=a,
                                                                implementation=impl))
      np.testing.assert_allclose(np.asarray(f(p)), want, rtol=1e-5, atol=1e-5)


B, PAGES, MAXB = 3, 4, 2


@SETTINGS
@given(q=_arrays((B, H, D), None), kc=_arrays((PAGES, 64, D), None),
       table=hnp.arrays(np.int32, (B, MAXB), elements=st.integers(-2, PAGES + 1)),
       lengths=hnp.arrays(np.int32, (B,), elements=st.integers(-5, MAXB * 64 + 9)))
def test_paged_topk_block_tables_outside_the_cache(q, kc, table, lengths):
  """Under jit a length clamps to [0, capacity] and a request whose table points outside the
  cache within its length scores -inf everywhere (top-K all -1): XLA and kernel paths alike,
  and for SPIN's dense step. Concretely the same inputs raise ValueError."""
  w = np.ones((B, H), np.float32)
  lens = np.clip(lengths, 0, MAXB * 64)
  used = (lens[:, None] + 63) // 64 > np.arange(MAXB)[None]
  void = (used & ((table < 0) | (table >= PAGES))).any(1)
  keys = kc[np.clip(table, 0, PAGES - 1)].reshape(B, MAXB * 64, D)
  z = np.full((B, MAXB * 64), -np.inf)
  for b in range(B):
    if not void[b]:
      z[b, :lens[b]] = rule_scores(q[b:b + 1], keys[b, :lens[b]], w[b:b + 1])[0]
  want = np_topk(z.astype(np.float32), 6)
  args = [jnp.asarray(a) for a in (q, kc, table, lengths, w)]
  for impl in ("xla", "pallas"):
    _same_topk(_paged_topk_jit(*args, impl=impl), want)
    _scores_equal(_paged_scores_jit(*args, impl=impl), z)
  if void.any() or (lengths != lens).any():
    with pytest.raises(ValueError):
      jaxsparse.indexer_topk(*args, 6, implementation="xla")


def test_spin_steps_void_requests_outside_the_cache():
  from jaxsparse import spin
  rng = np.random.default_rng(1)
  cfg = spin.SpinConfig(block_size=64, topk=8, sparsity=0.4)
  q = jnp.asarray(rng.integers(-2, 3, (2, H, D)), jnp.float32)  # exact sums in any order
  kc = jnp.asarray(rng.integers(-2, 3, (PAGES, 64, D)), jnp.float32)
  table = jnp.asarray([[0, 1], [PAGES + 3, 1]], jnp.int32)
  lengths = jnp.asarray([100, 100], jnp.int32)
  w = jnp.ones((2, H), jnp.float32)
  state = spin.init_state(MAXB * 64, cfg, (2,))
  for impl in ("xla", "pallas"):
    step = jax.jit(lambda s, t, impl=impl: spin.decode_step(
        s, q, kc, t, lengths, w, cfg, jax.random.PRNGKey(0), implementation=impl))
    vals, slots, _, _ = step(state, table)
    assert (np.asarray(slots)[1] == -1).all() and (np.asarray(vals)[1] == -np.inf).all()
    want = np_topk(rule_scores(q[:1], kc[:2].reshape(128, D)[:100], w[:1]).astype(np.float32),
                   8)
    _same_topk((vals[:1], slots[:1]), want)


CFG = ivf.IVFConfig(topk=5, budget=64, seal_window=16, cluster_size=4, refit_interval=32,
                    sink=2)
NI = 40


@settings(SETTINGS, max_examples=5)
@given(q=_arrays((NI, H, D), None, rare=st.sampled_from([0.0, 1.0, np.nan, np.inf])),
       k=_arrays((NI, D), None, rare=st.sampled_from([0.0, 1.0, np.nan, np.inf, -np.inf])))
def test_ivf_and_hisa_follow_the_rules(q, k):
  """With a budget past N every visible key is a candidate, so AttentionIndex and HiSA must
  return the exact top-K (NaN never chosen, ties to the lower key, -1 tail) on XLA and the
  kernels, as must `evaluate`."""
  w = np.ones((NI, H), np.float32)
  pos = np.arange(NI)
  want = np_topk(rule_scores(q, k, w, pos).astype(np.float32), CFG.topk)[1]
  for method in ("ivf", "hisa"):
    for impl in ("xla", "pallas"):
      idx, _ = ivf.prefill_topk(q=q, k=k, w=w, config=CFG, method=method, implementation=impl)
      np.testing.assert_array_equal(np.asarray(idx), want, err_msg=f"{method} {impl}")
  r = ivf.evaluate(q=q, k=k, w=w, config=CFG, method="ivf", query_positions=pos)
  np.testing.assert_array_equal(r["topk_indices"], want)


@pytest.mark.parametrize("seed", [20, 21])
def test_ivf_and_hisa_keep_finite_keys_beside_nan_inf_and_signed_weights(seed):
  """Keys holding NaN / +-inf make their group's mean (HiSA's block mean, the IVF center) NaN
  or infinite, and a negative or zero head weight turns its score into -inf or NaN: such a
  group ranks last but stays usable, so with a budget past N the finite keys it holds are
  still found (prefill on XLA and the kernels, and `evaluate`, both methods)."""
  rng = np.random.default_rng(seed)
  q = rng.integers(-2, 3, (NI, H, D)).astype(np.float32)
  k = rng.integers(-2, 3, (NI, D)).astype(np.float32)
  rows = rng.choice(NI, 4, replace=False)
  k[rows[0]], k[rows[1], 0], k[rows[2], 1], k[rows[3], 2] = np.nan, np.inf, -np.inf, np.nan
  w = rng.choice([0.0, 1.0, -1.0, 0.5], (NI, H)).astype(np.float32)
  pos = np.arange(NI)
  want = np_topk(rule_scores(q, k, w, pos).astype(np.float32), CFG.topk)[1]
  for method in ("ivf", "hisa"):
    for impl in ("xla", "pallas"):
      idx, _ = ivf.prefill_topk(q=q, k=k, w=w, config=CFG, method=method, implementation=impl)
      np.testing.assert_array_equal(np.asarray(idx), want, err_msg=f"{method} {impl}")
    r = ivf.evaluate(q=q, k=k, w=w, config=CFG, method=method, query_positions=pos)
    np.testing.assert_array_equal(r["topk_indices"], want, err_msg=f"evaluate {method}")


SHARDED = r"""
import json, sys
import numpy as np, jax
from jaxsparse.distributed import sharded_prefill_topk
n, h, d = int(sys.argv[1]), 2, 16
rng = np.random.default_rng(n)
q = rng.integers(-1, 2, (n, h, d)).astype(np.float32)
k = rng.integers(-1, 2, (n, d)).astype(np.float32)
k[3], k[10, 0] = np.nan, np.inf
w = np.ones((n, h), np.float32)
mesh = jax.make_mesh((4,), ("x",))
out = {}
for strategy in ("allgather", "ring"):
  for impl in ("xla", "pallas"):
    v, i = sharded_prefill_topk(q=q, k=k, w=w, topk=6, mesh=mesh, strategy=strategy, block=8,
                                implementation=impl)
    out[f"{strategy}-{impl}"] = np.asarray(i).tolist()
print(json.dumps(out))
"""


def test_sharded_prefill_follows_the_rules():
  """N = 45 on 4 devices (jax.make_mesh, N not divisible): NaN keys are never chosen and ties
  go to the lower position on the all-gather and ring paths, XLA and kernels."""
  import json
  import os
  import subprocess
  import sys
  n = 45
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
  env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu",  # conftest's XLA flags too
         "XLA_FLAGS": " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""),
                                             "--xla_force_host_platform_device_count=4"]))}
  res = subprocess.run([sys.executable, "-c", SHARDED, str(n)], env=env, capture_output=True,
                       text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  got = json.loads(res.stdout.strip().splitlines()[-1])
  rng = np.random.default_rng(n)
  q = rng.integers(-1, 2, (n, H, D)).astype(np.float32)
  k = rng.integers(-1, 2, (n, D)).astype(np.float32)
  k[3], k[10, 0] = np.nan, np.inf
  want = np_topk(rule_scores(q, k, np.ones((n, H), np.float32), np.arange(n)).astype(
      np.float32), 6)[1]
  assert len(got) == 4
  for name, idx in got.items():
    np.testing.assert_array_equal(np.asarray(idx), want, err_msg=name)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA's CPU flush-to-zero")
def test_subnormal_products_times_inf_are_nan_on_a_cpu():
  """README "Input rules": a subnormal q . k (1e-20 x 1e-20) or input (1e-40) flushes to 0, so
  with an infinite weight (or key) it is 0 x inf = NaN, never chosen; key 0 (q . k = 1 or
  1e-40) shows which."""
  cases = [(1e-20, 1e-20, np.inf, [np.inf, np.nan], [0, -1]),
           (1e-40, np.inf, 1.0, [0.0, np.nan], [0, -1]),
           (1e-40, 2.0, np.inf, [np.nan, np.nan], [-1, -1])]
  for qv, kv, wv, scores, idx in cases:
    q = np.zeros((1, 1, 4), np.float32)
    k = np.zeros((2, 4), np.float32)
    q[0, 0, 0], k[0, 0], k[1, 0] = qv, 1.0, kv
    args = (jnp.asarray(q), jnp.asarray(k), jnp.full((1, 1), wv, jnp.float32))
    for impl in ("xla", "pallas"):
      _scores_equal(jaxsparse.indexer_scores(*args, implementation=impl), np.array([scores]))
      got = jaxsparse.prefill_topk(*args, 2, query_positions=jnp.asarray([1]),
                                   implementation=impl)[1]
      np.testing.assert_array_equal(np.asarray(got), [idx], err_msg=f"{qv} {kv} {wv} {impl}")


def test_quantize_fp8_tiny_rows_stay_finite():
  from jaxsparse import prep
  x = jnp.asarray([[1e-40, 0.0, -1e-42, 0.0], [2e-38, 4e-38, 0.0, 0.0],
                   [0.0, 0.0, 0.0, 0.0]], jnp.float32)
  x8, scale = prep.quantize_fp8(x)
  assert np.isfinite(np.asarray(x8, np.float32)).all() and (np.asarray(scale) > 0).all()
  back = np.asarray(x8, np.float32) * np.asarray(scale)[:, None]
  np.testing.assert_allclose(back[1], np.asarray(x[1]), rtol=0.07)


@pytest.mark.parametrize("make, match", [
    (lambda: jaxsparse.spin.SpinConfig(block_size=True), "block_size"),
    (lambda: jaxsparse.spin.SpinConfig(topk=8.0), "topk"),
    (lambda: ivf.IVFConfig(budget=float("inf")), "budget"),
    (lambda: ivf.IVFConfig(seal_window=16.0, cluster_size=4, budget=64, sink=1,
                           refit_interval=0), "seal_window"),
    (lambda: ivf.prefill_topk(q=np.zeros((4, 1, 4), np.complex64), k=np.zeros((4, 4)),
                              w=np.ones((4, 1)), config=CFG), "q.dtype=complex64"),
    (lambda: ivf.evaluate(q=np.zeros((40, 1, 4)), k=np.zeros((40, 4)), w=np.ones((40, 1)),
                          config=CFG, query_positions=np.array([20.5])), "query_positions"),
    (lambda: jaxsparse.causal_prefill_topk(jnp.zeros((8, 1, 4)), jnp.zeros((40, 4)),
                                           jnp.ones((8, 1)), 4,
                                           k_scale=jnp.ones((7,), jnp.float32)),
     r"k_scale.shape=\(7,\) must be \(40,\)"),
])
def test_arguments_refused_with_their_name(make, match):
  with pytest.raises(ValueError, match=match):
    make()


_V, _I = jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32)
_C = np.ones((4, 2, 8), np.complex64)
_K8 = jnp.zeros((2, 64, 8), jnp.float8_e4m3fn)


@pytest.mark.parametrize("make, match", [
    (lambda: jaxsparse.merge_topk(_V, _I.astype(jnp.float32), _V, _I), "indices_a.dtype=float32"),
    (lambda: jaxsparse.merge_topk(_V, _I, _V, _I.astype(jnp.complex64)),
     "indices_b.dtype=complex64"),
    (lambda: jaxsparse.merge_topk(_V.astype(jnp.complex64), _I, _V, _I), "values_a.dtype"),
    (lambda: jaxsparse.prep.quantize_fp8(_C), "x.dtype=complex64"),
    (lambda: jaxsparse.prep.indexer_weights(_C[:, :, 0], head_dim=8), "proj.dtype=complex64"),
    (lambda: jaxsparse.prep.apply_rope(_C, np.arange(4), rope_dims=4), "x.dtype=complex64"),
    (lambda: jaxsparse.prep.indexer_weights(np.ones((4, 2)), head_dim=2.5), "head_dim=2.5"),
    (lambda: jaxsparse.prep.indexer_weights(np.ones((4, 2)), head_dim=0), "head_dim=0"),
    (lambda: jaxsparse.prep.pack_fp8_paged_cache(_K8, jnp.ones((2, 63), jnp.float32)),
     r"k_scale.shape=\(2, 63\)"),
    (lambda: jaxsparse.prep.pack_fp8_paged_cache(_K8.astype(jnp.float32),
                                                 jnp.ones((2, 64), jnp.float32)),
     "k_cache.dtype=float32"),
    (lambda: jaxsparse.spin.init_state(128.0, jaxsparse.spin.SpinConfig(block_size=64)),
     "capacity=128.0"),
    (lambda: jaxsparse.spin.init_state(-64, jaxsparse.spin.SpinConfig(block_size=64)),
     "capacity=-64"),
    (lambda: jaxsparse.spin.init_state(128, jaxsparse.spin.SpinConfig(block_size=64), (2.0,)),
     r"batch=\(2.0,\)"),
])
def test_prep_merge_and_spin_arguments_refused_with_their_name(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_prefill_topk_refuses_a_bool_block():
  q, k, w = jnp.ones((8, 2, 16)), jnp.ones((24, 16)), jnp.ones((8, 2))
  with pytest.raises(ValueError, match="block=True"):
    jaxsparse.prefill_topk(q, k, w, 4, query_positions=jnp.arange(8), block=True,
                           implementation="xla")
  from jaxsparse.distributed import sharded_prefill_topk
  for bad in (True, 2.5):
    with pytest.raises(ValueError, match=f"block={bad}"):
      sharded_prefill_topk(q, k[:8], w, 4, block=bad, implementation="xla")


def test_sharded_ivf_refuses_no_devices():
  from jaxsparse.distributed import sharded_ivf_prefill_topk
  with pytest.raises(ValueError, match="devices"):
    sharded_ivf_prefill_topk(q=np.zeros((40, 1, 4)), k=np.zeros((40, 4)), w=np.ones((40, 1)),
                             config=CFG, devices=[])


def test_spin_commit_checks_accepted():
  from jaxsparse import spin
  cfg = spin.SpinConfig(block_size=64, topk=8)
  state = spin.init_state(128, cfg, (2,))
  pending = {"scores": jnp.zeros((2, 3, 128)), "sel": jnp.zeros((2, 2), jnp.int32),
             "lrows": jnp.ones((2, 3), jnp.int32)}
  for bad, match in ((np.array([0, 3]), r"\[0, 2\]"), (np.array([0.5, 1.0]), "dtype"),
                     (np.array([-1, 0]), r"\[0, 2\]")):
    with pytest.raises(ValueError, match=match):
      spin.commit(state, pending, bad, cfg)


@pytest.mark.parametrize("damage", ["flip", "text", "truncate", "scalar_q", "scalar_meta"])
def test_damaged_trace_files_raise_trace_error_naming_the_file(tmp_path, damage, capsys):
  from jaxsparse import traces
  src = open(traces.default_trace_path(), "rb").read()
  path = str(tmp_path / "t.npz")
  data = bytearray(src)
  if damage.startswith("scalar"):  # a well-formed archive whose member is a 0-d value
    with np.load(traces.default_trace_path(), allow_pickle=False) as z:
      arrays = dict(z)
    arrays[damage[7:]] = np.float32(1.0)
    np.savez(path, **arrays)
    data = bytearray(open(path, "rb").read())
  elif damage == "flip":
    for off in (len(data) // 3, len(data) // 2):
      data[off] ^= 0xFF
  elif damage == "text":
    data = bytearray(b"not an archive at all")
  else:
    data = data[:len(data) // 2]
  open(path, "wb").write(bytes(data))
  with pytest.raises(traces.TraceError, match="t.npz") as e:
    traces.load(path)
  assert "pickle" not in str(e.value)
  from jaxsparse import cli
  assert cli.main(["eval", "--trace", path]) != 0
  err = capsys.readouterr().err.strip().splitlines()
  assert err[0].startswith("usage: jaxsparse eval") and "Traceback" not in "\n".join(err)
  assert [ln for ln in err if "error:" in ln] == [err[-1]] and "t.npz" in err[-1]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_lengths_past_2_31_clamp_instead_of_wrapping(impl):
  """A uint32 / int64 length past 2^31 means the whole row (topk) or the table's capacity
  (paged inputs under jit), never a wrapped small or negative length."""
  x = jnp.asarray([[3., 1., 2., 0.]])
  for lens in (np.array([2**32 + 2], np.int64), np.array([2**32 - 1], np.uint32)):
    np.testing.assert_array_equal(jaxsparse.topk(x, 2, lengths=lens, implementation=impl)[1],
                                  [[0, 2]])
  big = jnp.asarray(np.array([2**32 - 1], np.uint32))
  got = jax.jit(lambda l: jaxsparse.topk(x, 2, lengths=l, implementation=impl))(big)[1]
  np.testing.assert_array_equal(got, [[0, 2]])
  q, w = jnp.ones((1, 1, 4)), jnp.ones((1, 1))
  kc = jnp.arange(64 * 4, dtype=jnp.float32).reshape(1, 64, 4) / 256
  tb = jnp.zeros((1, 1), jnp.int32)
  got = jax.jit(lambda l: jaxsparse.indexer_topk(q, kc, tb, l, w, 2, implementation=impl))(big)
  np.testing.assert_array_equal(got[1], [[63, 62]])  # every slot of the one page visible


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16])
def test_narrow_integer_lengths_and_positions_widen_before_clipping(dtype):
  """int8/int16/uint8/uint16 lengths and positions against bounds their dtype cannot hold
  (300 keys, 320 cache slots): widened first, never wrapped, on every path, eagerly and
  under jit."""
  rng = np.random.default_rng(4)
  n = 300
  x = rng.standard_normal((3, n)).astype(np.float32)
  lens = np.array([100, 127, 5], dtype)
  want = np_topk(np.where(np.arange(n) < lens[:, None].astype(np.int64), x, -np.inf)
                 .astype(np.float32), 4)
  q = rng.integers(-2, 3, (3, 2, 8)).astype(np.float32)  # exact float32 sums
  k = rng.integers(-2, 3, (n, 8)).astype(np.float32)
  w = np.ones((3, 2), np.float32)
  pos = np.array([100, 127, 3], dtype)
  want_z = rule_scores(q, k, w, pos.astype(np.int64))
  kc = rng.integers(-2, 3, (5, 64, 8)).astype(np.float32)
  table = np.tile(np.arange(5, dtype=np.int32), (3, 1))
  want_p = np_topk(np.where(np.arange(320) < lens[:, None].astype(np.int64),
                            np.stack([rule_scores(q[b:b + 1], kc.reshape(-1, 8),
                                                                w[b:b + 1])[0] for b in range(3)]),
                            -np.inf).astype(np.float32), 4)
  for impl in ("xla", "pallas"):
    for jit in (False, True):
      wrap = jax.jit if jit else (lambda f: f)
      _same_topk(wrap(lambda l: jaxsparse.topk(jnp.asarray(x), 4, lengths=l,
                                               implementation=impl))(jnp.asarray(lens)), want)
      _scores_equal(wrap(lambda p: jaxsparse.indexer_scores(
          jnp.asarray(q), jnp.asarray(k), jnp.asarray(w), query_positions=p,
          implementation=impl))(jnp.asarray(pos)), want_z)
      _same_topk(wrap(lambda l: jaxsparse.indexer_topk(
          jnp.asarray(q), jnp.asarray(kc), jnp.asarray(table), l, jnp.asarray(w), 4,
          implementation=impl))(jnp.asarray(lens)), want_p)
  np.testing.assert_array_equal(jaxsparse.row_lengths(jnp.asarray(lens), 2),
                                np.maximum(lens[:, None].astype(np.int64) + [-1, 0], 0))


_Q, _K, _W = np.ones((8, 2, 16), np.float32), np.ones((8, 16), np.float32), np.ones((8, 2))
_IVF = ivf.IVFConfig(topk=4, budget=32, seal_window=16, cluster_size=4, refit_interval=32,
                     sink=1)


@pytest.mark.parametrize("make, match", [
    (lambda: jaxsparse.indexer_scores(None, _K, _W), "q must be an array; got NoneType"),
    (lambda: jaxsparse.indexer_scores(_Q, "k", _W), "k must be an array; got str"),
    (lambda: jaxsparse.paged_indexer_scores(_Q, _K[None], None, [1] * 8, _W[:, :2]),
     "block_table must be an array"),
    (lambda: jaxsparse.topk(jnp.ones((2, 8)), 2, lengths=[[1], [2, 3]]), "lengths must be an array"),
    (lambda: jaxsparse.prefill_topk(_Q, None, _W, 2, query_positions=np.arange(8)),
     "k must be an array"),
    (lambda: jaxsparse.merge_topk(None, _I, _V, _I), "values_a must be an array"),
    (lambda: jaxsparse.merge_topk(_I, _I, _V, _I), "values_a.dtype=int32 must be a float type"),
    (lambda: jaxsparse.merge_topk(_V, np.full((2, 3), 2 ** 33), _V, _I), r"indices_a must lie in"),
    (lambda: jaxsparse.prep.apply_rope(None, np.arange(4), rope_dims=4), "x must be an array"),
    (lambda: jaxsparse.row_lengths(None, 2), "lengths must be an array"),
    (lambda: ivf.prefill_topk(_Q, _K, _W[:, :2].astype(np.float32), None),
     "config must be a IVFConfig; got NoneType"),
    (lambda: ivf.evaluate(_Q, _K, _W.astype(np.float32), "cfg", query_positions=[3]),
     "config must be a IVFConfig; got str"),
    (lambda: jaxsparse.distributed.sharded_prefill_topk(_Q, _K, _W.astype(np.float32), 2,
                                                        mesh="x"), "mesh must be a Mesh"),
    (lambda: jaxsparse.distributed.sharded_prefill_topk(_Q[:0], _K[:0], _W[:0].astype(np.float32),
                                                        2), "k is empty"),
    (lambda: jaxsparse.indexer_scores(_Q[..., :12], _K[:, :12], _W.astype(np.float32),
                                      implementation="pallas"), "power of two"),
    (lambda: jaxsparse.merge_topk(np.float32(1), np.int32(0), _V, _I), "values_a must be an "
     "array with at least one axis"),
    (lambda: jaxsparse.prep.hadamard_rotate(np.float32(1)), "x must be an array with"),
    (lambda: jaxsparse.prep.apply_rope(_Q, np.arange(8) + 0.5, rope_dims=4), "positions.dtype"),
    (lambda: jaxsparse.prep.unpack_fp8_paged_cache(None), "packed must be an array"),
    (lambda: ivf.prefill_topk(_Q[:0], _K[:0], _W[:0].astype(np.float32), _IVF), "k is empty"),
    (lambda: ivf.prefill_topk(_Q, _K, np.ones((8, 2), np.int32), _IVF), "w.dtype=int32"),
    (lambda: ivf.prefill_topk(_Q, _K, _W.astype(np.float32), _IVF, corrector=3),
     "corrector=3 must be"),
    (lambda: ivf.metric.fit(_Q.astype(np.complex64), _K, _W), "q.dtype=complex64"),
    (lambda: ivf.metric.fit(_Q, _K, _W, keys=2.0), "keys=2.0 must be an int"),
    (lambda: ivf.metric.load(None), "path=None"),
    (lambda: __import__("jaxsparse.traces").traces.load(None), "path=None"),
    (lambda: jaxsparse.spin.init_state(128, None), "config must be a SpinConfig"),
    (lambda: jaxsparse.spin.decode_step({}, _Q[:2, :, :], np.ones((1, 64, 16), np.float32),
                                        np.zeros((2, 1), np.int32), np.ones(2, np.int32),
                                        _W[:2].astype(np.float32),
                                        jaxsparse.spin.SpinConfig(block_size=64),
                                        jax.random.PRNGKey(0)), "state lacks V"),
    (lambda: jaxsparse.spin.commit(jaxsparse.spin.init_state(64, jaxsparse.spin.SpinConfig(
        block_size=64), (2,)), None, np.zeros(2, np.int32), jaxsparse.spin.SpinConfig(
        block_size=64)), "pending must be"),
    (lambda: jaxsparse.prep.apply_rope(_Q, np.arange(8), rope_dims=4, interleaved="no"),
     "interleaved='no' must be True or False"),
    (lambda: jaxsparse.distributed.sharded_prefill_topk(_Q, _K, _W, 2, fp8_keys=1),
     "fp8_keys=1 must be True or False"),
    (lambda: jaxsparse.distributed.sharded_ivf_prefill_topk(_Q, _K, _W, _IVF, devices=[None]),
     "devices must be jax devices"),
    (lambda: jaxsparse.paged_indexer_scores(_Q[:2], np.ones((1, 64, 16), np.float32),
                                            np.zeros((2, 1), np.int32), np.ones(2, np.int32),
                                            _W[:2], checked="yes"), "checked='yes'"),
])
def test_wrong_kinds_of_argument_refused_with_their_name(make, match):
  """None, strings, ragged lists, a config or mesh of another type, an empty sequence: one
  ValueError naming the argument, never an AttributeError from inside."""
  import jaxsparse.distributed  # noqa: F401
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("method", ["ivf", "hisa"])
def test_ivf_shorter_than_a_seal_window_on_the_kernel_path(method):
  """Fewer keys than one seal window: nothing seals, every query's top-K is the exact one, on
  the XLA and the kernel path alike."""
  rng = np.random.default_rng(9)
  q = rng.integers(-2, 3, (8, 2, 16)).astype(np.float32)
  k = rng.integers(-2, 3, (8, 16)).astype(np.float32)
  w = np.ones((8, 2), np.float32)
  want = np_topk(rule_scores(q, k, w, np.arange(8)).astype(np.float32), 4)[1]
  for impl in ("xla", "pallas"):
    idx, _ = ivf.prefill_topk(q, k, w, _IVF, method=method, implementation=impl)
    np.testing.assert_array_equal(np.asarray(idx), want)


def test_ivf_groups_keys_with_inf_alike_on_every_path():
  """+-inf and NaN keys inside seal windows and refits, with a budget below N (the grouping
  decides the candidates): the XLA path and the kernels build the same groups, so they return
  the same candidates and top-K."""
  cfg = ivf.IVFConfig(topk=4, budget=24, seal_window=16, cluster_size=4, refit_interval=32,
                      sink=1)
  rng = np.random.default_rng(12)
  n = 80
  q = rng.integers(-2, 3, (n, 2, 16)).astype(np.float32)
  k = rng.integers(-2, 3, (n, 16)).astype(np.float32)
  k[[5, 21, 40, 57], [0, 3, 1, 2]] = np.inf, -np.inf, np.inf, np.nan
  w = np.ones((n, 2), np.float32)
  got = {impl: [np.asarray(a) for a in ivf.prefill_topk(q, k, w, cfg, implementation=impl)]
         for impl in ("xla", "pallas")}
  for a, b in zip(got["xla"], got["pallas"]):
    np.testing.assert_array_equal(a, b)


def test_kernel_paths_under_jax_enable_x64():
  """With jax_enable_x64 on, the public functions still compute in 32 bits: the kernels and
  XLA paths run and agree, int64 positions and lengths clip as documented."""
  rng = np.random.default_rng(3)
  q = rng.integers(-2, 3, (8, 2, 16)).astype(np.float32)
  k = rng.integers(-2, 3, (64, 16)).astype(np.float32)
  w = np.ones((8, 2), np.float32)
  kc, table = k.reshape(1, 64, 16), np.zeros((8, 1), np.int32)
  want = rule_scores(q, k, w, np.arange(40, 48))
  with jax.enable_x64(True):
    pos, lens = jnp.arange(40, 48, dtype=jnp.int64), jnp.full((8,), 30, jnp.int64)
    assert pos.dtype == jnp.int64
    for impl in ("xla", "pallas"):
      _scores_equal(jaxsparse.indexer_scores(q, k, w, query_positions=pos,
                                             implementation=impl), want)
      f = jax.jit(lambda p, impl=impl: jaxsparse.prefill_topk(q, k, w, 3, query_positions=p,
                                                              implementation=impl))
      _same_topk(f(pos), np_topk(want.astype(np.float32), 3))
      got = jaxsparse.indexer_topk(q, kc, table, lens, w, 3, implementation=impl)
      np.testing.assert_array_equal(got[1], np_topk(rule_scores(q, k[:30], w), 3)[1])
      # past 2^31 under jit: clipped in 64 bits, never wrapped
      for big in (2 ** 40, 2 ** 63 - 1):
        _same_topk(f(jnp.full((8,), big, jnp.int64)),
                   np_topk(rule_scores(q, k, w, np.full(8, 63)).astype(np.float32), 3))
        g = jax.jit(lambda l, impl=impl: jaxsparse.indexer_topk(q, kc, table, l, w, 3,
                                                                implementation=impl))
        np.testing.assert_array_equal(g(jnp.full((8,), big, jnp.int64))[1],
                                      np_topk(rule_scores(q, k, w), 3)[1])


def test_float64_inputs_are_float32_on_every_path():
  """float64 arrays (numpy's default) give exactly the float32 results, on every function."""
  import jaxsparse.distributed  # noqa: F401
  rng = np.random.default_rng(5)
  q, k = rng.standard_normal((32, 2, 16)), rng.standard_normal((32, 16))
  w = rng.uniform(0, 1, (32, 2))
  f32 = [a.astype(np.float32) for a in (q, k, w)]
  pos = np.arange(32)
  calls = [lambda q, k, w: jaxsparse.indexer_scores(q, k, w, query_positions=pos),
           lambda q, k, w: jaxsparse.prefill_topk(q, k, w, 4, query_positions=pos),
           lambda q, k, w: jaxsparse.causal_prefill_topk(q, k, w, 4),
           lambda q, k, w: ivf.prefill_topk(q, k, w, _IVF),
           lambda q, k, w: jaxsparse.distributed.sharded_prefill_topk(q, k, w, 4, block=8)]
  for call in calls:
    for a, b in zip(jax.tree.leaves(call(q, k, w)), jax.tree.leaves(call(*f32))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""Sharded prefill top-K (context parallelism with jax.shard_map) and the exact merge of
partial top-K results. The sharded runs use 8 emulated CPU devices in a subprocess
(XLA_FLAGS=--xla_force_host_platform_device_count=8 must precede jax's start)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxsparse
from jaxsparse.selection import topk_xla
from tests.reference import np_topk

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _env(devices: int) -> dict:
  """A CPU subprocess with `devices` emulated devices, under this process's XLA_FLAGS (the
  compile-time flags conftest.py sets: most of a script's time is compiling interpret-mode
  kernels)."""
  flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
  return {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": " ".join(filter(None, flags))}

SCRIPT = r'''
import json, sys
import numpy as np, jax, jax.numpy as jnp
import jaxsparse
from jaxsparse.distributed import sharded_prefill_topk, quantize_keys_fp8, balanced_order
n, h, d, K = int(sys.argv[1]), 4, 32, 40
rng = np.random.default_rng(0)
q = rng.standard_normal((n, h, d)).astype(np.float32)
w = rng.uniform(0, 1, (n, h)).astype(np.float32)
k = rng.standard_normal((n, d)).astype(np.float32)
out = {"devices": len(jax.devices()), "runs": {}, "kernel": {}}
for p in (1, 2, 4, 8):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), ("x",))
  for strat in ("allgather", "ring"):
    for fp8 in ((False, True) if p in (1, 4) else (False,)):
      v, i = sharded_prefill_topk(q, k, w, K, mesh=mesh, strategy=strat, fp8_keys=fp8, block=32)
      out["runs"][f"{p}-{strat}-{fp8}"] = {"i": i.tolist(), "v": np.where(np.isfinite(v), v, -1e30).tolist()}
# the kernel path (interpret mode here): each device runs prefill_topk's kernels. The
# all-gather's query chunks go in 8 // 2P causal segments: on 1 device without a branch, from
# 2 devices through lax.switch on the device's chunks (more devices only add branches of the
# same code to compile: 8 kernel calls for 4 devices, 16 for 8); the ring on 1, 2 and 4
one = jaxsparse.prefill_topk(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w), K,
                             query_positions=jnp.arange(n), implementation="pallas")
out["kernel_one"] = {"i": np.asarray(one[1]).tolist(),
                     "v": np.where(np.isfinite(one[0]), one[0], -1e30).tolist()}
for p in (1, 2, 4):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), ("x",))
  for strat in ("allgather", "ring") if p < 4 else ("ring",):
    v, i = sharded_prefill_topk(q, k, w, K, mesh=mesh, strategy=strat, block=32,
                                implementation="pallas")
    out["kernel"][f"{p}-{strat}"] = {"i": i.tolist(),
                                     "v": np.where(np.isfinite(v), v, -1e30).tolist()}
# DeepSeek-V3.2's fp8 format, already quantised: fp8 q (scale folded into w), fp8 keys, k_scale
from jaxsparse.prep import quantize_fp8
m = 203  # ragged too
(q8, qs), (k8, ks) = quantize_fp8(jnp.asarray(q[:m])), quantize_fp8(jnp.asarray(k[:m]))
w8 = jnp.asarray(w[:m]) * qs
out["fp8"], out["fp8_one"] = {}, {}
for impl in ("xla", "pallas"):
  one = jaxsparse.prefill_topk(q8, k8, w8, K, k_scale=ks, query_positions=jnp.arange(m),
                               implementation=impl)
  out["fp8_one"][impl] = np.asarray(one[1]).tolist()
for impl, strat, p in (("xla", "allgather", 8), ("xla", "ring", 4), ("pallas", "allgather", 2),
                       ("pallas", "ring", 2)):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), ("x",))
  v, i = sharded_prefill_topk(q8, k8, w8, K, mesh=mesh, strategy=strat, k_scale=ks, block=32,
                              implementation=impl)
  out["fp8"][f"{impl}-{strat}-{p}"] = np.asarray(i).tolist()
order = balanced_order(64, 4)
out["order"] = order.tolist()
k8, sc = quantize_keys_fp8(jnp.asarray(k))
out["kq"] = np.asarray(k8.astype(jnp.float32) * sc[:, None]).tolist()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def sharded():
  n = 531  # ragged: not a multiple of 2 x 8 x 32
  res = subprocess.run([sys.executable, "-c", SCRIPT, str(n)], env=_env(8), capture_output=True,
                       text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  return n, json.loads(res.stdout.strip().splitlines()[-1])


def _np_reference(q, w, k, K):
  """float64 numpy: causal scores and top-K, ties to the lower position."""
  n = len(k)
  z = np.einsum("ths,th->ts", np.maximum(np.einsum("thd,sd->ths", q.astype(np.float64),
                                                   k.astype(np.float64)), 0), w)
  z = np.where(np.arange(n)[None, :] <= np.arange(n)[:, None], z, -np.inf)
  idx = np.full((n, K), -1)
  for t in range(n):
    o = np.lexsort((np.arange(n), -z[t]))[: min(K, t + 1)]
    idx[t, :len(o)] = o
  return z, idx


def test_sharded_equals_one_device_for_1_2_4_8_devices_and_both_exchanges(sharded):
  n, out = sharded
  assert out["devices"] == 8
  base = out["runs"]["1-allgather-False"]
  base8 = out["runs"]["1-allgather-True"]
  for name, r in out["runs"].items():
    ref = base8 if name.endswith("True") else base
    assert r["i"] == ref["i"], name  # identical indices, bitwise identical values
    assert r["v"] == ref["v"], name


def test_sharded_kernel_path_equals_one_device_kernels(sharded):
  """implementation="pallas": the all-gather (its chunks in causal segments) on 1 and 2
  devices, the ring on 1, 2 and 4: exactly one device's `prefill_topk` kernel result (indices
  and values)."""
  n, out = sharded
  base = out["kernel_one"]
  assert set(out["kernel"]) == {"1-allgather", "2-allgather", "1-ring", "2-ring", "4-ring"}
  for name, r in out["kernel"].items():
    assert r["i"] == base["i"], name
    assert r["v"] == base["v"], name
  assert (np.asarray(base["i"]) == np.asarray(out["runs"]["1-allgather-False"]["i"])).mean() > 0.999


def test_sharded_top_k_is_the_exact_causal_top_k(sharded):
  n, out = sharded
  rng = np.random.default_rng(0)
  q = rng.standard_normal((n, 4, 32)).astype(np.float32)
  w = rng.uniform(0, 1, (n, 4)).astype(np.float32)
  k = rng.standard_normal((n, 32)).astype(np.float32)
  for name, kk in (("1-allgather-False", k), ("1-allgather-True", np.asarray(out["kq"]))):
    z, idx = _np_reference(q, w, kk, 40)
    got = np.asarray(out["runs"][name]["i"])
    assert (got <= np.arange(n)[:, None]).all()
    np.testing.assert_array_equal(got < 0, idx < 0)
    # the same keys, up to float32 order of near-equal scores: compare the scores they hold
    rows = np.arange(n)[:, None]
    zg = np.where(got >= 0, z[rows, np.maximum(got, 0)], -np.inf)
    zr = np.where(idx >= 0, z[rows, np.maximum(idx, 0)], -np.inf)
    fin = np.isfinite(zr)
    np.testing.assert_allclose(zg[fin], zr[fin], rtol=1e-5, atol=1e-5)
    assert (got == idx).mean() > 0.999


def test_sharded_fp8_inputs_equal_one_device_prefill_topk(sharded):
  """Already quantised fp8 q (its scale folded into w) and fp8 keys with k_scale, both
  exchanges and both implementations on 2 to 8 devices: the indices of the single-device
  `jaxsparse.prefill_topk(q, k, w, K, k_scale=, query_positions=arange)` (the same
  implementation), and the float64 reference's top-K of sum_h w relu(q . k) * k_scale."""
  from jaxsparse.prep import quantize_fp8
  from tests.test_ivf import assert_fp8_topk, fp8_reference
  n, out = sharded
  assert set(out["fp8"]) == {"xla-allgather-8", "xla-ring-4", "pallas-allgather-2",
                             "pallas-ring-2"}
  for name, got in out["fp8"].items():
    assert got == out["fp8_one"][name.split("-")[0]], name
  m = 203
  rng = np.random.default_rng(0)
  q = rng.standard_normal((n, 4, 32)).astype(np.float32)[:m]
  w = rng.uniform(0, 1, (n, 4)).astype(np.float32)[:m]
  k = rng.standard_normal((n, 32)).astype(np.float32)[:m]
  (q8, qs), (k8, ks) = quantize_fp8(jnp.asarray(q)), quantize_fp8(jnp.asarray(k))
  z, tol = fp8_reference(q8, k8, jnp.asarray(w) * qs, ks)
  assert_fp8_topk(np.asarray(out["fp8_one"]["xla"]), z, tol)


def test_balanced_order_pairs_an_early_and_a_late_chunk(sharded):
  _, out = sharded
  order = np.asarray(out["order"]).reshape(4, 16)
  assert sorted(order.ravel().tolist()) == list(range(64))
  work = [(o + 1).sum() for o in order]  # causal work ~ sum of positions
  assert max(work) == min(work)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_merge_topk_equals_topk_of_the_union(rows, na, nb, seed):
  rng = np.random.default_rng(seed)
  n = na + nb
  x = rng.choice([-1.0, 0.0, 0.5, 2.0, np.nan], (rows, n)) if seed % 3 == 0 else \
      rng.standard_normal((rows, n))
  x = x.astype(np.float32)
  perm = rng.permutation(n)
  a, b = np.sort(perm[:na]), np.sort(perm[na:])  # each shard in position order (ties)
  k = int(rng.integers(1, n + 1))
  ka, kb = min(k, na), min(k, nb)
  if ka + kb < k:
    return
  # each shard's top-k and the union's from numpy's reference (the rules of `topk`: ties to the
  # lower index, NaN never chosen, -inf / -1 tail), so that only the merge compiles per shape
  va, ia = np_topk(x[:, a], ka)
  vb, ib = np_topk(x[:, b], kb)
  ia = np.where(ia >= 0, a[np.maximum(ia, 0)], -1)
  ib = np.where(ib >= 0, b[np.maximum(ib, 0)], -1)
  v, i = jaxsparse.merge_topk(jnp.asarray(va), jnp.asarray(ia, jnp.int32), jnp.asarray(vb),
                              jnp.asarray(ib, jnp.int32), k)
  rv, ri = np_topk(x, k)
  np.testing.assert_array_equal(np.asarray(i), ri)
  np.testing.assert_array_equal(np.asarray(v), rv)


def test_ring_merge_in_row_blocks_equals_one_merge(monkeypatch):
  from jaxsparse.distributed import prefill as dp
  rng = np.random.default_rng(3)
  x = rng.standard_normal((32, 20)).astype(np.float32)
  va, ia = topk_xla(jnp.asarray(x[:, :10]), 6)
  vb, ib = topk_xla(jnp.asarray(x[:, 10:]), 6)
  ib = jnp.where(ib >= 0, ib + 10, -1)
  monkeypatch.setattr(dp, "MERGE_ROWS", 8)  # 4 blocks of 8 rows
  v, i = dp._merge_rows(va, ia, vb, ib, 6)
  rv, ri = topk_xla(jnp.asarray(x), 6)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))


def test_merge_topk_bad_input():
  v = jnp.zeros((2, 3))
  i = jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(ValueError, match="exceeds"):
    jaxsparse.merge_topk(v, i, v, i, 7)
  with pytest.raises(ValueError, match="pair up"):
    jaxsparse.merge_topk(v, i, v[:1], i[:1])


def test_sharded_bad_input():
  from jaxsparse.distributed import sharded_prefill_topk
  q = np.zeros((10, 2, 4), np.float32)
  with pytest.raises(ValueError, match="strategy"):
    sharded_prefill_topk(q, q[:, 0], q[:, :, 0], 4, strategy="tree")
  with pytest.raises(ValueError, match=r"\[N, H, D\]"):
    sharded_prefill_topk(q, q[:5, 0], q[:, :, 0], 4)
  with pytest.raises(ValueError, match="topk=0"):
    sharded_prefill_topk(q, q[:, 0], q[:, :, 0], 0)
  k8 = jnp.zeros((10, 4), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="k_scale is required"):
    sharded_prefill_topk(q, k8, q[:, :, 0], 4)
  with pytest.raises(ValueError, match=r"k_scale.shape=\(9,\)"):
    sharded_prefill_topk(q, k8, q[:, :, 0], 4, k_scale=np.ones(9, np.float32))
  with pytest.raises(ValueError, match="k_scale.dtype"):
    sharded_prefill_topk(q, k8, q[:, :, 0], 4, k_scale=np.ones(10, np.float16))
  with pytest.raises(ValueError, match="q.dtype=float8_e4m3fn needs k.dtype"):
    sharded_prefill_topk(q.astype(jnp.float8_e4m3fn), q[:, 0], q[:, :, 0], 4)
  with pytest.raises(ValueError, match="fp8_keys=True"):
    sharded_prefill_topk(q, k8, q[:, :, 0], 4, k_scale=np.ones(10, np.float32), fp8_keys=True)


def test_bench_prefill_command_on_emulated_devices(tmp_path):
  out = tmp_path / "p.json"
  res = subprocess.run([sys.executable, "-m", "jaxsparse.cli", "bench", "prefill", "--devices",
                        "2", "--tokens", "256", "--k", "16", "--heads", "2", "--head-dim", "16",
                        "--reps", "1", "--out", str(out)], env=_env(2), capture_output=True,
                       text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert {(r["devices"], r["strategy"]) for r in rows} == {
      (1, "unsharded"), (1, "causal_segments"), (1, "allgather"), (1, "ring"), (2, "allgather"),
      (2, "ring")}
  assert all(r["speedup_vs_unsharded"] > 0 for r in rows)
  assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


MULTI = r'''
import json, sys
import numpy as np, jax
pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
except Exception:
  pass
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)
from jaxsparse.distributed import sharded_prefill_topk
n, h, d, K = 300, 4, 32, 24
rng = np.random.default_rng(0)
q = rng.standard_normal((n, h, d)).astype(np.float32)
w = rng.uniform(0, 1, (n, h)).astype(np.float32)
k = rng.standard_normal((n, d)).astype(np.float32)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
res = {"process_count": jax.process_count(), "devices": len(jax.devices())}
for strat in ("allgather", "ring"):
  v, i = sharded_prefill_topk(q, k, w, K, mesh=mesh, strategy=strat, block=32)
  res[strat] = i.tolist()
json.dump(res, open(out, "w"))
jax.distributed.shutdown()
'''


def test_two_processes_match_one_device(tmp_path):
  """`jax.distributed.initialize` in two CPU processes with 2 devices each (4 in the mesh,
  gloo collectives): both processes get the whole result, equal to one device's."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen([sys.executable, "-c", MULTI, str(pid), str(port),
                             str(tmp_path / f"p{pid}.json")], env=_env(2),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for pid in (0, 1)]
  for p in procs:
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
  outs = [json.loads((tmp_path / f"p{pid}.json").read_text()) for pid in (0, 1)]
  from jaxsparse.distributed import sharded_prefill_topk
  rng = np.random.default_rng(0)
  n, h, d, K = 300, 4, 32, 24
  q = rng.standard_normal((n, h, d)).astype(np.float32)
  w = rng.uniform(0, 1, (n, h)).astype(np.float32)
  k = rng.standard_normal((n, d)).astype(np.float32)
  import jax
  one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  _, want = sharded_prefill_topk(q, k, w, K, mesh=one, block=32)
  for o in outs:
    assert o["process_count"] == 2 and o["devices"] == 4
    for strat in ("allgather", "ring"):
      np.testing.assert_array_equal(np.asarray(o[strat]), want, err_msg=strat)


IVF_SCRIPT = r'''
import json
import numpy as np, jax
from jaxsparse import ivf
from jaxsparse.distributed import sharded_ivf_prefill_topk
rng = np.random.default_rng(0)
n, h, d = 600, 2, 16  # ragged: not whole windows, chunks or shards
k = (rng.standard_normal((8, d))[rng.integers(0, 8, n)] + 0.3 * rng.standard_normal((n, d)))
k, q = k.astype(np.float32), rng.standard_normal((n, h, d)).astype(np.float32)
w = rng.uniform(0, 1, (n, h)).astype(np.float32)
z = np.einsum("ths,th->ts", np.maximum(np.einsum("thd,sd->ths", q, k), 0), w)
z = np.where(np.arange(n)[None] <= np.arange(n)[:, None], z, -np.inf)
ref = np.argsort(-z, axis=1, kind="stable")[:, :16]
recall = lambda sel: float(np.mean([np.isin(ref[t], sel[t]).mean() for t in range(100, n)]))
out = {}
for refit in (0, 256):
  cfg = ivf.IVFConfig(topk=16, budget=160, seal_window=64, cluster_size=16,
                      refit_interval=refit, sink=4)
  want, wnum = ivf.prefill_topk(q, k, w, cfg)
  out[f"single-{refit}"] = recall(want)
  for p in (1, 2, 8):
    got, num = sharded_ivf_prefill_topk(q, k, w, cfg, devices=jax.devices()[:p])
    out[f"{p}-{refit}"] = {"same": bool(np.array_equal(got, want)),
                          "num_same": bool(np.array_equal(num, wnum)), "recall": recall(got),
                          "budget": int(num.max())}
blk = ivf.IVFConfig(topk=16, budget=160, seal_window=64, cluster_size=16, refit_interval=0,
                    sink=4, query_block=8)
want, wnum = ivf.prefill_topk(q, k, w, blk)
for p in (8,):  # shared query blocks, seal only: exactly one device's
  got, num = sharded_ivf_prefill_topk(q, k, w, blk, devices=jax.devices()[:p])
  out[f"block-{p}"] = bool(np.array_equal(got, want) and np.array_equal(num, wnum))
m = rng.standard_normal((d, d))  # a grouping metric that regroups the keys
a = (np.eye(d) + 0.5 * (m + m.T) / np.sqrt(d)).astype(np.float32)
a = a @ a.T
for refit in (0, 256):
  cfg = ivf.IVFConfig(topk=16, budget=160, seal_window=64, cluster_size=16,
                      refit_interval=refit, sink=4)
  want, wnum = ivf.prefill_topk(q, k, w, cfg, metric=a)
  plain, _ = ivf.prefill_topk(q, k, w, cfg)
  for p in ((1, 8) if refit == 0 else (1,)):
    got, num = sharded_ivf_prefill_topk(q, k, w, cfg, devices=jax.devices()[:p], metric=a)
    out[f"metric-{p}-{refit}"] = {"same": bool(np.array_equal(got, want)),
                                 "num_same": bool(np.array_equal(num, wnum)),
                                 "differs": bool(not np.array_equal(got, plain))}
import jax.numpy as jnp


def corr(state, keys, mean):  # a correction read from the members' own keys: each group's max
  g, a = state["sizes"].shape[0], state["assign"]
  top = jax.ops.segment_max(keys.astype(jnp.float32), jnp.where(a >= 0, a, g), g + 1)[:g]
  return 0.5 * jnp.where(state["sizes"][:, None] > 0, top, 0.0)


cfg = ivf.IVFConfig(topk=16, budget=160, seal_window=64, cluster_size=16, refit_interval=0,
                    sink=4)
for name, extra in (("corrected", {}), ("corrected-metric", dict(metric=a))):
  want, wnum = ivf.prefill_topk(q, k, w, cfg, corrector=corr, **extra)
  plain, _ = ivf.prefill_topk(q, k, w, cfg, **extra)
  got, num = sharded_ivf_prefill_topk(q, k, w, cfg, devices=jax.devices()[:8], corrector=corr,
                                      **extra)
  out[name] = {"same": bool(np.array_equal(got, want)), "num_same": bool(np.array_equal(num, wnum)),
               "differs": bool(not np.array_equal(got, plain))}
m = 330  # the kernels (GPU interpret mode), seal only, on 2 devices: one device's kernels' result
want, wnum = ivf.prefill_topk(q[:m], k[:m], w[:m], cfg, implementation="pallas")
got, num = sharded_ivf_prefill_topk(q[:m], k[:m], w[:m], cfg, devices=jax.devices()[:2],
                                    implementation="pallas")
out["kernels"] = bool(np.array_equal(got, want) and np.array_equal(num, wnum))
from jaxsparse.prep import quantize_fp8  # fp8 q and keys with k_scale, seal only, 2 devices
(q8, qs), (k8, ks) = quantize_fp8(jnp.asarray(q[:m])), quantize_fp8(jnp.asarray(k[:m] * 3))
w8 = jnp.asarray(w[:m]) * qs
want, wnum = ivf.prefill_topk(q8, k8, w8, cfg, k_scale=ks)
got, num = sharded_ivf_prefill_topk(q8, k8, w8, cfg, devices=jax.devices()[:2], k_scale=ks)
out["fp8"] = bool(np.array_equal(got, want) and np.array_equal(num, wnum))
try:
  sharded_ivf_prefill_topk(q, k, w, cfg, implementation="triton")
  out["bad-implementation"] = ""
except ValueError as e:
  out["bad-implementation"] = str(e)
try:
  sharded_ivf_prefill_topk(q, k, w, cfg, metric=np.eye(d + 1))
  out["bad-metric"] = ""
except ValueError as e:
  out["bad-metric"] = str(e)
print(json.dumps(out))
'''


def test_sharded_attention_index(tmp_path):
  """AttentionIndex with one index per shard, on 1, 2 and 8 emulated devices, a ragged
  sequence: seal only, every device count gives exactly one device's top-K and candidate
  counts (a window is sealed by the same k-means wherever it lives); with refits, one shard
  is exactly one device, and more shards (each refitting its own keys) keep recall within
  a few points at 2 shards; candidates never exceed the budget; shared query blocks (seal
  only) on 8 devices are one device's too; under a grouping metric (which changes the
  top-K) the same hold against one device's `prefill_topk(metric=)`, and with a correction
  made from each group's members, with and without the metric; through the Pallas kernels
  (interpret mode) on 2 devices, one device's kernels' result; fp8 q and keys with k_scale on
  2 devices, one device's fp8 result."""
  res = subprocess.run([sys.executable, "-c", IVF_SCRIPT], env=_env(8), capture_output=True,
                       text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  for p in (1, 2, 8):
    assert out[f"{p}-0"]["same"] and out[f"{p}-0"]["num_same"], p
    assert out[f"{p}-256"]["budget"] <= 160
  assert out["1-256"]["same"]
  assert out["2-256"]["recall"] >= out["single-256"] - 0.03, out
  assert out["8-256"]["recall"] >= 0.6, out
  assert out["block-8"], out
  for key in ("metric-1-0", "metric-8-0", "metric-1-256",  # under a grouping metric
              "corrected", "corrected-metric"):  # a learned correction, with and without it
    assert out[key] == {"same": True, "num_same": True, "differs": True}, (key, out[key])
  assert "metric" in out["bad-metric"], out["bad-metric"]
  assert out["kernels"], out
  assert out["fp8"], out  # fp8 q and keys with k_scale: one device's fp8 result
  assert "implementation" in out["bad-implementation"], out["bad-implementation"]

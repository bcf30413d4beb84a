"""SPIN: configuration, block selection, EMA updates, replay, speculative rows, kernels, step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxsparse
from jaxsparse import spin, traces
from jaxsparse.backend import KernelPlatform
from pallas_kernels import indexer_decode
from tests.conftest import export_for
from tests.reference import (index_ordered, np_indexer, np_topk, random_paged,
                             spin_selection_case, spin_state_case, with_block_max)


@settings(max_examples=40, deadline=None)
@given(log_b=st.integers(0, 5), nb=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       bf16=st.booleans(), data=st.data())
def test_max_pooled_block_scores_match_slot_predictions(log_b, nb, seed, bf16, data):
  """A1 / A0's max-pooled block scores from aligned maxima of V and D equal eq. 1's slot
  predictions max(V[i], D[pos - i]) pooled by max, for every query position (incl. an empty
  context, a partly filled newest block and a full cache) and with ties (rounded states)."""
  b = 2 ** log_b
  cap = nb * b
  length = data.draw(st.integers(0, cap))
  rng = np.random.default_rng(seed)
  dt = jnp.bfloat16 if bf16 else jnp.float32
  state = {"V": jnp.asarray(np.round(rng.standard_normal(cap), 1), dt),
           "D": jnp.asarray(np.round(rng.standard_normal(cap), 1), dt)}
  want = spin.algorithm._pool(spin.predicted_slot_scores(state, length - 1, length).reshape(nb, b),
                    spin.SpinConfig(block_size=64, pooling="max"))
  got = spin.algorithm._max_pooled_block_scores(state, length - 1, length, b)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@settings(max_examples=25, deadline=None)
@given(log_b=st.integers(2, 6), nb=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       bf16=st.booleans(), data=st.data())
def test_block_score_kernel_matches_xla(log_b, nb, seed, bf16, data):
  """The GPU kernel for A1's max-pooled block scores (interpret mode) equals
  `_max_pooled_block_scores` for each request: any query position (empty context, partly
  filled newest block, full cache), block counts that are not a multiple of its tile, ties."""
  from pallas_kernels.spin import block_scores_max_gpu
  b = 2 ** log_b
  cap = nb * b
  lengths = np.array([data.draw(st.integers(0, cap)) for _ in range(3)] + [cap, 0], np.int32)
  rng = np.random.default_rng(seed)
  dt = jnp.bfloat16 if bf16 else jnp.float32
  v = jnp.asarray(np.round(rng.standard_normal((5, cap)), 1), dt)
  d = jnp.asarray(np.round(rng.standard_normal((5, cap)), 1), dt)
  vm = v.reshape(5, nb, b).max(-1)
  got = block_scores_max_gpu(vm, v, d, jnp.asarray(lengths - 1), jnp.asarray(lengths), page=b,
                             blocks_per_program=8, interpret=True)
  ref = jax.jit(spin.algorithm._max_pooled_block_scores, static_argnums=3)  # one compile a shape
  for i, length in enumerate(lengths):
    want = ref({"V": v[i], "D": d[i]}, jnp.int32(length - 1), jnp.int32(length), b)
    np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want), err_msg=str(length))


def test_random_exploration_is_uniform_and_seeded():
  """Random exploration keys (16-bit counter hashes, made the same way in XLA and in the GPU
  selection kernel): over 4000 requests each of 64 eligible blocks is explored about as often
  as any other (chi-square far below its 0.1% point), requests of one key differ, and the
  same key repeats its choice."""
  n, nb, pick = 4000, 64, 8
  seeds = spin.request_seeds(jax.random.PRNGKey(0), n)
  prio = jax.vmap(lambda s: spin.algorithm._uniform16(s, nb))(seeds)
  chosen = jax.vmap(lambda p: spin.top_mask(p, jnp.ones(nb, bool), pick))(prio)
  counts = np.asarray(chosen).sum(0)
  expect = n * pick / nb
  chi2 = float(((counts - expect) ** 2 / expect).sum())
  assert chi2 < 104, chi2  # 63 degrees of freedom: the 0.1% point is ~103.4
  assert len({tuple(np.flatnonzero(r)) for r in np.asarray(chosen)}) > 0.99 * n
  again = spin.request_seeds(jax.random.PRNGKey(0), n)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(seeds))
  other = np.asarray(spin.request_seeds(jax.random.PRNGKey(1), n))
  assert (other != np.asarray(seeds)).mean() > 0.99


@pytest.mark.parametrize("kw,match", [
    (dict(sparsity=1.0), "sparsity"), (dict(sparsity=-0.1), "sparsity"),
    (dict(block_size=48), "block_size"), (dict(ema_decay=1.0), "ema_decay"),
    (dict(explore_fraction=0.6), "explore_fraction"), (dict(explore="greedy"), "explore"),
    (dict(pooling="median"), "pooling"), (dict(reduction="A3"), "reduction"),
    (dict(mask_policy="x"), "mask_policy"), (dict(update_policy="x"), "update_policy"),
    (dict(topk=0), "topk"),
])
def test_config_validation(kw, match):
  with pytest.raises(ValueError, match=match):
    spin.SpinConfig(**kw)


def test_budget_formula():
  cfg = spin.SpinConfig(block_size=64, topk=2048, sparsity=0.4)
  nb = jnp.asarray([1, 10, 32, 100, 1000])
  # m = min(B, max(ceil(K / b) = 32, ceil(0.6 B)))
  np.testing.assert_array_equal(spin.num_blocks_budget(nb, cfg), [1, 10, 32, 60, 600])


def _warm_state(cap, cfg, rng):
  st = spin.init_state(cap, cfg)
  st["V"] = jnp.asarray(rng.standard_normal(cap), jnp.float32)
  st["D"] = jnp.asarray(rng.standard_normal(cap), jnp.float32) - 3
  st["warm"] = jnp.asarray(True)
  return with_block_max(st, cfg.block_size)


@pytest.mark.parametrize("explore", ["random", "staleness", "block-age", "none"])
def test_selection_counts_forced_and_exploration(explore):
  rng = np.random.default_rng(0)
  cfg = spin.SpinConfig(block_size=16, topk=64, sparsity=0.5, explore=explore,
                        explore_fraction=0.25)
  st = _warm_state(1024, cfg, rng)
  length = 1000  # 63 blocks
  mask = np.asarray(spin.select_blocks(st, length - 1, length, cfg, jax.random.PRNGKey(1)))
  m = int(spin.num_blocks_budget(jnp.asarray(63), cfg))
  assert mask.sum() == m and mask[0] and mask[62] and not mask[63:].any()
  # exploitation alone picks the best predicted blocks among the non-forced ones
  s = np.asarray(spin.block_scores(st, length - 1, length, cfg))
  n_explore = 0 if explore == "none" else int(np.floor(0.25 * m))
  best = np.argsort(-np.where(np.arange(64) < 63, s, -np.inf)[1:62], kind="stable")[:m - 2 -
                                                                                     n_explore]
  assert mask[1:62][best].all()


def test_cold_state_scores_every_block():
  cfg = spin.SpinConfig(block_size=16, topk=16, sparsity=0.4)
  st = spin.init_state(256, cfg)
  mask = np.asarray(spin.select_blocks(st, 199, 200, cfg, jax.random.PRNGKey(0)))
  assert mask[:13].all() and not mask[13:].any()


def test_update_touches_only_observed_slots():
  cfg = spin.SpinConfig(block_size=4, topk=4, ema_decay=0.5)
  st = spin.init_state(16, cfg)
  scores = jnp.arange(16, dtype=jnp.float32)
  slots = jnp.where(jnp.arange(16) // 4 == 1, jnp.arange(16), -1)  # block 1 observed
  new = spin.update(st, scores, slots, 11, 12, cfg)
  v = np.asarray(new["V"])
  np.testing.assert_allclose(v[4:8], 0.5 * np.arange(4, 8))
  assert (v[:4] == 0).all() and (v[8:] == 0).all()
  d = np.asarray(new["D"])  # offsets 11 - i for i in 4..7 -> 7..4
  np.testing.assert_allclose(d[4:8], 0.5 * np.arange(7, 3, -1))
  assert bool(new["warm"]) and int(new["step"]) == 1
  np.testing.assert_array_equal(np.asarray(new["age"]), [0] * 4)


def _trace(s=30, n=700, r=1, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((s, r, 4, 16)).astype(np.float32)
  w = np.abs(rng.standard_normal((s, r, 4))).astype(np.float32)
  k = rng.standard_normal((n, 16)).astype(np.float32)
  return q, w, k, np.arange(n - s + 1, n + 1)


@pytest.mark.parametrize("reduction", ["A0", "A1", "A2"])
@pytest.mark.parametrize("pooling", ["max", "top4", "mean"])
def test_replay_outputs(reduction, pooling):
  q, w, k, lengths = _trace()
  cfg = spin.SpinConfig(block_size=16, topk=32, sparsity=0.4, reduction=reduction,
                        pooling=pooling)
  r = spin.replay(q[:, 0], k, w[:, 0], lengths, cfg, seed=1)
  assert r["block_masks"].shape == (30, 44) and r["miss_rate"].shape == (30, 1)
  assert r["miss_rate"][0, 0] == 0.0 and r["realized_sparsity"][0] == 0.0  # cold first step
  assert 0 <= r["mean_miss"] <= r["p99_miss"] <= 1
  if reduction != "A0":
    assert 0.35 < r["mean_sparsity"] < 0.45


def test_replay_matches_manual_miss_definition():
  q, w, k, lengths = _trace(s=8)
  cfg = spin.SpinConfig(block_size=16, topk=32, sparsity=0.5, explore="none")
  r = spin.replay(q[:, 0], k, w[:, 0], lengths, cfg)
  for s in range(8):
    z = np_indexer.dense(jnp.asarray(q[s, 0][None]), jnp.asarray(k), jnp.asarray(w[s, 0][None]),
                         None, np.asarray([lengths[s] - 1]))[0]
    _, idx = np_topk(z.astype(np.float32)[None], 32, np.asarray([lengths[s]]))
    kept = np.repeat(r["block_masks"][s], 16)[: len(z)][idx[0]]
    assert abs((1 - kept.mean()) - r["miss_rate"][s, 0]) < 1e-6


@pytest.mark.parametrize("mask_policy", ["union", "row0"])
@pytest.mark.parametrize("update_policy", ["prefix", "row0"])
def test_speculative_rows(mask_policy, update_policy):
  q, w, k, lengths = _trace(r=3)
  cfg = spin.SpinConfig(block_size=16, topk=32, mask_policy=mask_policy,
                        update_policy=update_policy)
  acc = np.random.default_rng(0).integers(0, 3, len(lengths))
  r = spin.replay(q, k, w, lengths, cfg, accepted=acc)
  assert r["miss_rate"].shape == (30, 3) and r["row_masks"].shape == (30, 3, 44)
  # the shared mask covers every row's own mask under union
  if mask_policy == "union":
    assert (r["block_masks"][:, None] >= r["row_masks"]).all()


def test_replay_bad_input():
  q, w, k, lengths = _trace()
  cfg = spin.SpinConfig(block_size=16, topk=32)
  with pytest.raises(ValueError, match="non-decreasing"):
    spin.replay(q[:, 0], k, w[:, 0], lengths[::-1], cfg)
  with pytest.raises(ValueError, match="lengths.shape"):
    spin.replay(q[:, 0], k, w[:, 0], lengths[:3], cfg)
  with pytest.raises(ValueError, match="lengths must lie"):
    spin.replay(q[:, 0], k, w[:, 0], lengths + 10_000, cfg)


def test_real_trace_beats_random_baseline():
  """On the shipped SmolLM2 trace, SPIN at 40% misses far less than 40% of the top-K."""
  tr = traces.load(traces.default_trace_path())
  q, k, w = tr.layer(3)
  cfg = spin.SpinConfig(block_size=64, topk=256, sparsity=0.4)
  r = spin.replay(q[:, 0], k, w[:, 0], tr.lengths, cfg)
  assert r["mean_sparsity"] > 0.35 and r["mean_miss"] < 0.1


@pytest.mark.parametrize("platform", [KernelPlatform("gpu", True), KernelPlatform("tpu", True)],
                         ids=["gpu", "tpu"])
def test_block_sparse_kernel(platform):
  rng = np.random.default_rng(5)
  q, kc, table, lens, w, ks = random_paged(rng, 2, 2, 8, 64, 600, 20, "float8_e4m3fn")
  sel = jnp.asarray([[0, 3, 7, 9, -1], [1, 2, 8, -1, -1]], jnp.int32)
  counts = jnp.asarray([4, 3], jnp.int32)
  z, slots = indexer_decode.block_sparse_scores(
      q, kc, table, lens, w, sel, counts, k_scale=ks, platform=platform,
      config=indexer_decode.DecodeConfig(pages_per_step=1, steps_per_program=2))
  full = np_indexer.paged(q, kc, table, lens, w, ks)  # [B, R, slots]
  zz, sl = np.asarray(z), np.asarray(slots)
  for b in range(2):
    for j in range(sl.shape[1]):
      if sl[b, j] < 0:
        assert np.isneginf(zz[b, :, j]).all()
      else:
        ref = full[b, :, sl[b, j]]
        fin = np.isfinite(ref)
        np.testing.assert_array_equal(np.isfinite(zz[b, :, j]), fin)
        np.testing.assert_allclose(zz[b, fin, j], ref[fin], rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("reduction", ["A1", "A2"])
def test_decode_step_no_recompile_and_matches_reference(reduction):
  rng = np.random.default_rng(0)
  q, kc, table, lens, w, _ = random_paged(rng, 3, 1, 8, 32, 1000, 60)
  q, w = q[:, 0], w[:, 0]
  table = jnp.asarray(np.stack([rng.permutation(60)[:16] for _ in range(3)]), jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.4, reduction=reduction)
  st = spin.init_state(16 * 64, cfg, (3,))
  sx = st
  lens = jnp.asarray([900, 700, 300], jnp.int32)
  sizes = []
  for it in range(4):
    v, i, st, info = spin.decode_step(st, q, kc, table, lens + it, w, cfg,
                                      jax.random.PRNGKey(it), implementation="pallas")
    # the kernels (interpret mode) and XLA pick the same blocks and keep the same state, and
    # VM stays V's block maxima (A1's block-score kernel reads it)
    _, _, sx, info_x = spin.decode_step(sx, q, kc, table, lens + it, w, cfg,
                                        jax.random.PRNGKey(it), implementation="xla")
    np.testing.assert_array_equal(np.asarray(info["block_masks"]),
                                  np.asarray(info_x["block_masks"]))
    for name in st:
      np.testing.assert_allclose(np.asarray(st[name], np.float32), np.asarray(sx[name], np.float32),
                                 rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(st["VM"]),
                                  np.asarray(st["V"]).reshape(3, 16, 64).max(-1))
    sizes.append(spin.serving._decode_step._cache_size())
  assert len(set(sizes)) == 1  # growing lengths never recompile
  z = np_indexer.paged(q[:, None], kc, table, lens + 3, w[:, None])[:, 0]
  m = np.repeat(np.asarray(info["block_masks"]), 64, axis=1)
  rv, ri = np_topk(np.where(m, z, -np.inf).astype(np.float32), 32, np.asarray(lens + 3))
  np.testing.assert_array_equal(np.asarray(i), ri)
  with pytest.raises(ValueError, match="block_size"):
    spin.decode_step(st, q, kc, table, lens, w, spin.SpinConfig(block_size=32, topk=32),
                     jax.random.PRNGKey(0))


def test_decode_step_with_mosaic_scoring_interpret():
  """SPIN's step with the Mosaic GPU decode kernel forced (run by the Mosaic GPU interpreter on
  the CPU): the dense first step and the block-sparse steps after it (selected pages + logical
  ids) give the top-K of the masked reference scores."""
  from pallas_kernels.indexer_decode import DecodeConfig
  rng = np.random.default_rng(4)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 1, 32, 128, 1000, 40)
  q, w = q[:, 0], w[:, 0]
  table = jnp.asarray(np.stack([rng.permutation(40)[:16] for _ in range(2)]), jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.4)
  st = spin.init_state(16 * 64, cfg, (2,))
  lens = jnp.asarray([1000, 500], jnp.int32)
  dc = DecodeConfig(kernel="mosaic")
  for it, warm in enumerate((False, True, True)):
    v, i, st, info = spin.decode_step(st, q, kc, table, lens + it, w, cfg, jax.random.PRNGKey(it),
                                      implementation="pallas", decode_config=dc, warm=warm)
  z = np_indexer.paged(q[:, None], kc, table, lens + 2, w[:, None])[:, 0]
  m = np.repeat(np.asarray(info["block_masks"]), 64, axis=1)
  rv, ri = np_topk(np.where(m, z, -np.inf).astype(np.float32), 32, np.asarray(lens + 2))
  np.testing.assert_array_equal(np.asarray(i), ri)
  assert np.asarray(info["realized_sparsity"]).min() > 0.3


def test_predictor_study_shape():
  tr = traces.load(traces.default_trace_path())
  from jaxsparse.indexer import indexer_scores_xla
  zs = []
  for li in range(3):
    q, k, w = tr.layer(li)
    zs.append(np.stack([np.asarray(indexer_scores_xla(
        jnp.asarray(q[s, 0][None]), jnp.asarray(k), jnp.asarray(w[s, 0][None]), None,
        jnp.asarray([tr.lengths[s] - 1])))[0] for s in range(20)]))
  res = spin.predictor_study(np.stack(zs), tr.lengths[:20], 64)
  assert set(res) == {"random", "prev-layer", "prev-layer best-of-5", "prev-iter",
                      "prev-iter offset 1"}
  assert res["prev-iter"][1] > res["random"][1]


@pytest.mark.parametrize("kind,plat", [("gpu", "cuda"), ("tpu", "tpu")])
def test_block_sparse_kernel_lowers(kind, plat):
  S = jax.ShapeDtypeStruct
  g = lambda q, k, bt, l, w, sel, c: indexer_decode.block_sparse_scores(
      q, k, bt, l, w, sel, c, platform=KernelPlatform(kind, False))
  export_for(g, plat,
          S((4, 1, 64, 128), jnp.bfloat16), S((1000, 64, 128), jnp.bfloat16),
          S((4, 100), jnp.int32), S((4,), jnp.int32), S((4, 1, 64), jnp.float32),
          S((4, 60), jnp.int32), S((4,), jnp.int32))


@pytest.mark.parametrize("mask_policy,update_policy", [("union", "prefix"), ("row0", "row0")])
def test_speculative_serving_step_and_commit(mask_policy, update_policy):
  """decode_step_rows scores every row on the shared mask; commit replays accepted rows."""
  rng = np.random.default_rng(7)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 3, 8, 32, 900, 40)
  table = jnp.asarray(np.stack([rng.permutation(40)[:15] for _ in range(2)]), jnp.int32)
  lens = jnp.asarray([900, 500], jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.4, mask_policy=mask_policy,
                        update_policy=update_policy)
  st = spin.init_state(15 * 64, cfg, (2,))
  st["warm"] = jnp.ones((2,), bool)
  st["V"] = jnp.asarray(rng.standard_normal((2, 960)), jnp.float32)
  st = with_block_max(st, 64)
  outs = {}
  for impl in ("xla", "pallas"):
    v, s, pending, info = spin.decode_step_rows(st, q, kc, table, lens, w, cfg,
                                                jax.random.PRNGKey(0), implementation=impl)
    outs[impl] = (np.asarray(v), np.asarray(s))
  np.testing.assert_array_equal(outs["xla"][1], outs["pallas"][1])
  # reference: each row's exact top-k over the shared mask's slots
  z = np_indexer.paged(q, kc, table, lens, w)
  m = np.repeat(np.asarray(info["block_masks"]), 64, axis=1)[:, None]
  row_lens = np.asarray(jaxsparse.row_lengths(lens, 3))
  _, ri = np_topk(np.where(m, z, -np.inf).astype(np.float32), 32, row_lens)
  np.testing.assert_array_equal(outs["pallas"][1], ri)
  if mask_policy == "union":
    assert (np.asarray(info["block_masks"])[:, None] >= np.asarray(info["row_masks"])).all()
  new = spin.commit(st, pending, jnp.asarray([2, 0]), cfg)
  assert (np.asarray(new["step"]) == ([3, 1] if update_policy == "prefix" else [1, 1])).all()
  with pytest.raises(ValueError, match="q.shape"):
    spin.decode_step_rows(st, q[:, 0], kc, table, lens, w[:, 0], cfg, jax.random.PRNGKey(0))


@pytest.mark.parametrize("ties", [False, True])
def test_select_mask_kernel_matches_argsort(ties):
  """The GPU block-ranking kernel (exact search for the n-th key, one bit per step, no sort)
  picks the same blocks as the stable argsort, ties to the lower index, -0.0 equal to +0.0,
  n = 0 and n = all eligible."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(11 + ties)
  r, length = 5, 512
  x = rng.standard_normal((r, length)).astype(np.float32) * 3
  if ties:
    x = np.round(x)
    x[0, ::2] = -0.0
  elig = rng.random((r, length)) < 0.7
  n = np.array([0, elig[1].sum(), 1, 37, rng.integers(0, elig[4].sum())], np.int32)
  got = np.asarray(kg.select_mask(jnp.asarray(x), jnp.asarray(elig), jnp.asarray(n),
                                  interpret=True))
  for i in range(r):
    ref = np.asarray(spin.algorithm._rank_desc(jnp.asarray(x[i]), jnp.asarray(elig[i])) < n[i])
    np.testing.assert_array_equal(got[i], ref)
    assert got[i].sum() == n[i]
  export_for(lambda x, e, n: kg.select_mask(x, e, n), "cuda",
      jax.ShapeDtypeStruct((64, 2048), jnp.float32), jax.ShapeDtypeStruct((64, 2048), bool),
      jax.ShapeDtypeStruct((64,), jnp.int32))


def test_decode_step_static_warm_matches_cond():
  """warm=False / warm=True (no device-side branch) give what the lax.cond path gives."""
  rng = np.random.default_rng(3)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 1, 8, 32, 800, 40)
  q, w = q[:, 0], w[:, 0]
  table = jnp.asarray(np.stack([rng.permutation(40)[:14] for _ in range(2)]), jnp.int32)
  lens = jnp.asarray([850, 600], jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.4)
  st0 = spin.init_state(14 * 64, cfg, (2,))
  key = jax.random.PRNGKey(1)
  a = spin.decode_step(st0, q, kc, table, lens, w, cfg, key)
  b = spin.decode_step(st0, q, kc, table, lens, w, cfg, key, warm=False)
  np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
  c = spin.decode_step(a[2], q, kc, table, lens + 1, w, cfg, key)
  d = spin.decode_step(b[2], q, kc, table, lens + 1, w, cfg, key, warm=True)
  np.testing.assert_array_equal(np.asarray(c[1]), np.asarray(d[1]))
  assert np.asarray(d[3]["realized_sparsity"]).min() > 0.3
  # sorted=False: the same slots (and values) as a set in ascending slot order, same new state
  e = spin.decode_step(b[2], q, kc, table, lens + 1, w, cfg, key, warm=True, sorted=False)
  rv, ri = index_ordered(d[0], d[1])
  np.testing.assert_array_equal(np.asarray(e[1]), ri)
  np.testing.assert_array_equal(np.asarray(e[0]), rv)
  for name in ("V", "D"):
    np.testing.assert_array_equal(np.asarray(e[2][name]), np.asarray(d[2][name]))
  # the serving-loop form of the README: jitted with the state donated (updated in place)
  step = jax.jit(lambda st, l: spin.decode_step(st, q, kc, table, l, w, cfg, key, warm=True),
                 donate_argnums=0)
  f = step(jax.tree.map(jnp.copy, b[2]), lens + 1)
  np.testing.assert_array_equal(np.asarray(f[1]), np.asarray(d[1]))
  for name in ("V", "D", "VB", "DB", "age", "step"):
    np.testing.assert_array_equal(np.asarray(f[2][name]), np.asarray(d[2][name]))
  with pytest.raises(ValueError, match="warm"):
    spin.decode_step(st0, q, kc, table, lens, w, cfg, key, warm="yes")
  with pytest.raises(ValueError, match="sorted"):
    spin.decode_step(st0, q, kc, table, lens, w, cfg, key, sorted="no")


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_update_kernel_matches_xla_update(state_dtype):
  """The in-place V/D update kernel (GPU, interpret) equals `update_blocks` per request:
  ragged lengths, a partly filled newest block, padding (-1) selections, pos near capacity."""
  rng = np.random.default_rng(9)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.4, ema_decay=0.3,
                        state_dtype=state_dtype)
  dt = jnp.dtype(state_dtype)
  bsz, nb, width = 3, 12, 9
  cap = nb * 64
  st = spin.init_state(cap, cfg, (bsz,))
  assert st["V"].dtype == dt
  st = with_block_max({**st, "V": jnp.asarray(rng.standard_normal((bsz, cap)), dt),
                        "D": jnp.asarray(rng.standard_normal((bsz, cap)), dt),
                        "VB": jnp.asarray(rng.standard_normal((bsz, nb)), dt),
                        "step": jnp.asarray([3, 5, 7], jnp.int32)}, 64)
  lengths = jnp.asarray([cap, 700, 130], jnp.int32)
  pos = lengths - 1
  sel = np.full((bsz, width), -1, np.int32)
  sel[0, :9] = [0, 1, 3, 4, 6, 7, 9, 10, 11]
  sel[1, :6] = [0, 2, 5, 8, 9, 10]
  sel[2, :3] = [0, 1, 2]
  sel = jnp.asarray(sel)
  z = jnp.asarray(rng.standard_normal((bsz, width * 64)), jnp.float32)
  want = jax.vmap(spin.update_blocks, in_axes=(0, 0, 0, 0, 0, None))(st, z, sel, pos, lengths,
                                                                     cfg)
  for bpp in (8, 4):
    got, gm = spin.update_batched(st, z, sel, pos, lengths, cfg, interpret=True,
                                  blocks_per_program=bpp, group=8)
    np.testing.assert_array_equal(np.asarray(gm), np.asarray(z).reshape(bsz, -1, 8).max(-1))
    for name in want:
      assert got[name].dtype == want[name].dtype, name
      np.testing.assert_allclose(np.asarray(got[name], np.float32),
                                 np.asarray(want[name], np.float32), rtol=1e-5, atol=1e-6,
                                 err_msg=name)
  from pallas_kernels.spin import update_states_gpu
  names = ("V", "D", "VM", "VB", "DB", "age", "step")
  export_for(lambda z, s, p, l, *a: update_states_gpu(dict(zip(names, a)), z, s, p, l,
                                                      decay=0.5, page=64, group=4), "cuda",
             *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (z, sel, pos, lengths,
                                                                *(st[n] for n in names))))


def test_bfloat16_state_keeps_quality_on_real_trace():
  """bfloat16 EMAs (half the state traffic) select almost the same blocks as float32 on the
  shipped SmolLM2 trace: mean miss within 0.5 points, same realized sparsity."""
  tr = traces.load(traces.default_trace_path())
  q, k, w = tr.layer(3)
  res = {}
  for dt in ("float32", "bfloat16"):
    cfg = spin.SpinConfig(block_size=64, topk=256, sparsity=0.4, state_dtype=dt)
    res[dt] = spin.replay(q[:128, 0], k, w[:128, 0], tr.lengths[:128], cfg)
  assert abs(res["bfloat16"]["mean_miss"] - res["float32"]["mean_miss"]) < 0.005
  assert abs(res["bfloat16"]["mean_sparsity"] - res["float32"]["mean_sparsity"]) < 1e-3
  with pytest.raises(ValueError, match="state_dtype"):
    spin.SpinConfig(state_dtype="float16")



def test_a2_step_updates_only_block_states():
  """Under A2 the step's update touches only the block states: VB, DB, ages, step and warm
  equal the full update's (`update_blocks` per request) and V, D come back unchanged; a
  decode step with A2 then selects from those block states."""
  rng = np.random.default_rng(21)
  b, nb, bsz, width = 16, 12, 3, 8
  cfg = spin.SpinConfig(block_size=b, topk=16, sparsity=0.4, reduction="A2")
  st = spin.init_state(nb * b, cfg, (bsz,))
  st = with_block_max({**st, "V": jnp.asarray(rng.standard_normal((bsz, nb * b)), st["V"].dtype),
                        "DB": jnp.asarray(rng.standard_normal((bsz, nb)), st["DB"].dtype)}, b)
  sel = np.full((bsz, width), -1, np.int32)
  sel[0, :5] = [0, 2, 3, 7, 11]
  sel[1, :2] = [0, 1]
  sel[2, :8] = np.arange(8)
  lengths = jnp.asarray([nb * b, 2 * b - 3, 8 * b - 1], jnp.int32)
  pos = lengths - 1
  z = jnp.asarray(rng.standard_normal((bsz, width * b)), jnp.float32)
  got = spin.update_block_states(st, z, jnp.asarray(sel), pos, lengths, cfg)
  ref = jax.vmap(spin.update_blocks, in_axes=(0, 0, 0, 0, 0, None))(st, z, jnp.asarray(sel), pos,
                                                                    lengths, cfg)
  for name in ("VB", "DB", "age", "step", "warm"):
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(ref[name]), err_msg=name)
  for name in ("V", "D"):
    assert got[name] is st[name]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([2, 50, 1e6]))
def test_select_mask_property(seed, spread):
  """Every n from 0 to the eligible count, on rows of few distinct values (ties everywhere)
  or many: the ranking kernel's n best equal the stable argsort's."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(seed)
  length = 64
  x = np.round(rng.standard_normal(length) * spread).astype(np.float32)
  elig = rng.random(length) < 0.8
  n_all = np.arange(int(elig.sum()) + 1, dtype=np.int32)
  # always length + 1 rows (the most n values a row can have), the rows past the last n asking
  # for every eligible entry again: one shape, so every example runs one compiled kernel
  rows = length + 1
  n_rows = np.concatenate([n_all, np.full(rows - len(n_all), n_all[-1], np.int32)])
  got = np.asarray(kg.select_mask(jnp.asarray(np.tile(x, (rows, 1))),
                                  jnp.asarray(np.tile(elig, (rows, 1))), jnp.asarray(n_rows),
                                  interpret=True))
  rank = np.asarray(spin.algorithm._rank_desc(jnp.asarray(x), jnp.asarray(elig)))
  for row, n in enumerate(n_rows):
    np.testing.assert_array_equal(got[row], rank < n)


@pytest.mark.parametrize("reduction,pooling,state_dtype", [
    ("A1", "max", "bfloat16"), ("A1", "mean", "bfloat16"), ("A2", "max", "bfloat16"),
    ("A2", "max", "float32")])
@pytest.mark.parametrize("explore", ["random", "block-age", "staleness", "none"])
def test_select_compact_kernel_matches_xla(reduction, pooling, state_dtype, explore):
  """The one-launch selection kernel (interpret mode) picks and compacts exactly the blocks of
  `select_blocks_batched` + `compact_blocks` for the same key: ragged lengths, one cold
  request, tied and negative scores (16-bit ranking for bfloat16 states), and a width that
  cuts the cold request's blocks."""
  rng = np.random.default_rng(5)
  cfg = spin.SpinConfig(block_size=16, topk=48, sparsity=0.5, explore_fraction=0.2,
                        explore=explore, pooling=pooling, reduction=reduction,
                        state_dtype=state_dtype)
  nb = 37
  lengths = jnp.asarray([nb * 16, 300, 250, 17, 16], jnp.int32)
  st = spin_state_case(rng, cfg, 5, nb, lengths, warm=[True, True, False, True, True])
  key = jax.random.PRNGKey(3)
  # a block table with out-of-range pages: the kernel clips them as the scoring wrapper did
  table = jnp.asarray(rng.integers(-3, 60, (5, nb)), jnp.int32)
  for width in (spin.serving._aligned_width(spin.max_selected_blocks(nb, cfg), nb), 12):
    want = spin.select_compact_batched(st, lengths - 1, lengths, cfg, key, width,
                                       block_table=table, num_pages=50, advance_step=True)
    got = spin.select_compact_batched(st, lengths - 1, lengths, cfg, key, width, kernel=True,
                                      interpret=True, block_table=table, num_pages=50,
                                      advance_step=True)
    assert len(got) == len(want) == 7
    for name, g, r in zip(("masks", "sel", "counts", "selected", "pages", "length rows",
                           "step"), got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=f"{name} {width}")
    sel = np.asarray(want[1])
    np.testing.assert_array_equal(  # pages are the selected blocks' table entries, clipped
        np.asarray(want[4]),
        np.where(sel >= 0, np.take_along_axis(np.clip(np.asarray(table), 0, 49),
                                              np.maximum(sel, 0), 1), 0))
  assert int(want[2][2]) == 12  # the cold request (16 valid blocks) is cut to the width
  from pallas_kernels.spin import block_scores_max_gpu, select_compact_gpu
  with pytest.raises(ValueError, match="block_table and num_pages"):
    select_compact_gpu(jnp.zeros((2, 64)), jnp.zeros((2,), jnp.uint32), lengths[:2],
                       jnp.ones((2,), bool), 8, budget=lambda n: spin.algorithm._budget(n, cfg),
                       block=16, block_table=table[:2], interpret=True)
  # The lowerings for cuda: the exported kernel depends on the config only through its budget
  # (sparsity, exploration share, explore="none"), the same for every reduction, pooling and
  # state dtype, so one case of those per exploration lowers it; the block-score kernel
  # takes no config, lowered once.
  if (reduction, pooling, state_dtype) != ("A1", "max", "bfloat16"):
    return
  S = jax.ShapeDtypeStruct
  for prio in (S((64, 2048), jnp.float32), S((2,), jnp.uint32)):  # priorities, key words
    export_for(lambda s, p, ln, wm, t, sp: select_compact_gpu(
        s, p, ln, wm, 1280, budget=lambda n: spin.algorithm._budget(n, cfg), block=64, score_bits=16,
        block_table=t, num_pages=4096, step=sp), "cuda",
        S((64, 2048), jnp.float32), prio, S((64,), jnp.int32), S((64,), jnp.bool_),
        S((64, 2048), jnp.int32), S((64,), jnp.int32))
  if explore == "random":
    export_for(lambda vm, v, d, p, l: block_scores_max_gpu(vm, v, d, p, l, page=64), "cuda",
               S((64, 2048), jnp.bfloat16), S((64, 131072), jnp.bfloat16),
               S((64, 131072), jnp.bfloat16),
               S((64,), jnp.int32), S((64,), jnp.int32))


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
def test_block_state_update_kernel_matches_xla(state_dtype):
  """The update kernel under A2 (block states only, in place; interpret mode) equals
  `update_block_states`, and the group maxima it emits for the top-K equal those of the
  scores (-inf groups included)."""
  rng = np.random.default_rng(17)
  cfg = spin.SpinConfig(block_size=16, topk=16, sparsity=0.4, ema_decay=0.3, reduction="A2",
                        state_dtype=state_dtype)
  bsz, nb, width = 4, 21, 13
  sel, z, lengths = spin_selection_case(rng, bsz, nb, 16, width)
  st = spin_state_case(rng, cfg, bsz, nb, lengths)
  want = spin.update_block_states(st, z, sel, lengths - 1, lengths, cfg)
  for group in (0, 4):
    got, gm = spin.update_batched(st, z, sel, lengths - 1, lengths, cfg, group=group,
                                  interpret=True)
    for name in ("VB", "DB", "age", "step", "warm"):
      assert got[name].dtype == want[name].dtype, name
      np.testing.assert_allclose(np.asarray(got[name], np.float32),  # EMAs: 1 ulp (fma)
                                 np.asarray(want[name], np.float32), rtol=1e-6, err_msg=name)
    if group:
      np.testing.assert_array_equal(np.asarray(gm),
                                    np.asarray(z).reshape(bsz, -1, group).max(-1))
    else:
      assert gm is None
  from pallas_kernels.spin import update_states_gpu
  st = spin.init_state(2048 * 64, cfg, (64,))
  names = ("VB", "DB", "age", "step")
  export_for(lambda z, s, p, l, *a: update_states_gpu(dict(zip(names, a)), z, s, p, l,
                                                      decay=0.5, page=64, slots=False, group=4),
             "cuda", jax.ShapeDtypeStruct((64, 1280 * 64), jnp.float32),
             jax.ShapeDtypeStruct((64, 1280), jnp.int32),
             *(jax.ShapeDtypeStruct((64,), jnp.int32) for _ in range(2)),
             *(jax.ShapeDtypeStruct(st[n].shape, st[n].dtype) for n in names))


def test_a2_step_kernels_match_xla_step():
  """Under A2 the Pallas step (selection kernel, block-sparse scoring, block-state kernel with
  the fused group maxima, threshold top-K; interpret mode) selects the same blocks, returns the
  same top-K and leaves the same state as the XLA step, warm-up step included."""
  rng = np.random.default_rng(2)
  q, kc, table, lens, w, _ = random_paged(rng, 3, 1, 8, 32, 1000, 60)
  q, w = q[:, 0], w[:, 0]
  table = jnp.asarray(np.stack([rng.permutation(60)[:16] for _ in range(3)]), jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=96, sparsity=0.4, reduction="A2")
  lens = jnp.asarray([1000, 700, 300], jnp.int32)
  out = {}
  for impl in ("xla", "pallas"):
    st = spin.init_state(16 * 64, cfg, (3,))
    for it in range(3):
      v, i, st, info = spin.decode_step(st, q, kc, table, lens + it, w, cfg,
                                        jax.random.PRNGKey(it), implementation=impl)
    out[impl] = (i, st, info["block_masks"])
  np.testing.assert_array_equal(np.asarray(out["pallas"][2]), np.asarray(out["xla"][2]))
  np.testing.assert_array_equal(np.asarray(out["pallas"][0]), np.asarray(out["xla"][0]))
  for name in ("VB", "DB", "age", "step"):
    np.testing.assert_allclose(np.asarray(out["pallas"][1][name], np.float32),
                               np.asarray(out["xla"][1][name], np.float32), rtol=1e-2,
                               atol=1e-2, err_msg=name)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_decode_step_input_rules(implementation):
  """The step checks its paged inputs as the scoring API does: fp8 keys without k_scale and
  concrete out-of-range pages raise ValueError naming them; under jit a request reading a page
  outside the cache is void (no blocks, -1 top-K) while the others are unaffected, and
  checked=True raises through checkify."""
  from jax.experimental import checkify
  from jaxsparse.prep import quantize_fp8
  rng = np.random.default_rng(8)
  q, kc, _, _, w, _ = random_paged(rng, 2, 1, 8, 32, 1000, 40)
  q, w = q[:, 0], w[:, 0]
  table = np.stack([rng.permutation(40)[:16] for _ in range(2)]).astype(np.int32)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.4, reduction="A1")
  st = spin.init_state(16 * 64, cfg, (2,))
  lens = jnp.asarray([1000, 600], jnp.int32)
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="k_scale is required"):
    spin.decode_step(st, q, quantize_fp8(kc)[0], jnp.asarray(table), lens, w, cfg, key)
  bad = table.copy()
  bad[1, 3] = 40
  with pytest.raises(ValueError, match=r"block_table\[1, 3\]=40"):
    spin.decode_step(st, q, kc, jnp.asarray(bad), lens, w, cfg, key)
  step = jax.jit(lambda s, t, l: spin.decode_step(s, q, kc, t, l, w, cfg, key,
                                                  implementation=implementation))
  _, idx, new, info = step(st, jnp.asarray(bad), lens)
  _, idx_ok, new_ok, info_ok = step(st, jnp.asarray(table), lens)
  assert (np.asarray(idx[1]) == -1).all() and not np.asarray(info["block_masks"][1]).any()
  np.testing.assert_array_equal(np.asarray(idx[0]), np.asarray(idx_ok[0]))
  np.testing.assert_array_equal(np.asarray(new["V"][0]), np.asarray(new_ok["V"][0]))
  np.testing.assert_array_equal(np.asarray(new["V"][1]), np.zeros(16 * 64))
  g = checkify.checkify(jax.jit(lambda s, t, l: spin.decode_step(
      s, q, kc, t, l, w, cfg, key, implementation=implementation, checked=True)))
  err, _ = g(st, jnp.asarray(bad), lens)
  with pytest.raises(checkify.JaxRuntimeError, match="block_table holds a page id"):
    err.throw()
  err, _ = g(st, jnp.asarray(table), lens)
  err.throw()

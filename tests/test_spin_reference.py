"""Every SPIN path, XLA and kernels (interpret mode), against the float64 numpy reference of
Algorithm 1 in tests/reference.py: selection for A0/A1/A2 under every pooling and exploration
policy, forced blocks, cold state; the EMA update with decays other than 0.5 (a swap of the
two weights fails); the serving step; speculative rows with their deferred commit; replay."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import spin
from tests.reference import (np_block_key_means, np_indexer, np_query_priorities, np_request_seed, np_spin_budget, np_spin_commit,
                             np_spin_rows, np_spin_select, np_spin_state, np_spin_update, np_topk,
                             random_paged, spin_selection_case, spin_state_case)

NB, B = 23, 16


def _state(rng, cfg, lengths, *, continuous=False, warm=None):
  st = spin_state_case(rng, cfg, len(lengths), NB, jnp.asarray(lengths), warm=warm)
  if continuous:  # no ties: products and sums order the same in float32 and float64
    for k, n in (("V", NB * B), ("D", NB * B), ("VB", NB), ("DB", NB)):
      st[k] = jnp.asarray(rng.standard_normal((len(lengths), n)), st[k].dtype)
    st["VM"] = st["V"].reshape(len(lengths), NB, B).max(-1)
  return st


def _ema_tol(cfg):
  """One rounding of the stored EMA: float32 ~1.2e-7, bfloat16 2**-8 (relative)."""
  return dict(rtol=4e-7, atol=1e-7) if cfg.state_dtype == "float32" else dict(rtol=2**-7,
                                                                               atol=1e-6)


def test_reference_hash_matches_the_documented_seeds():
  key = jax.random.PRNGKey(11)
  seeds = np.asarray(spin.request_seeds(key, 5))
  np.testing.assert_array_equal(seeds, [np_request_seed(key, r) for r in range(5)])


@pytest.mark.parametrize("sparsity,n_blocks", [(0.4, 100), (0.5, 63), (0.9, 7), (0.0, 1),
                                               (0.75, 12)])
def test_budget_matches_reference(sparsity, n_blocks):
  cfg = spin.SpinConfig(block_size=16, topk=48, sparsity=sparsity, explore_fraction=0.1)
  m, n_exploit, n_explore = np_spin_budget(n_blocks, cfg)
  assert int(spin.num_blocks_budget(n_blocks, cfg)) == m
  got = spin.algorithm._budget(jnp.asarray(n_blocks), cfg)
  assert (int(got[0]), int(got[1])) == (n_exploit, n_explore)


@pytest.mark.parametrize("reduction,pooling", [("A0", "max"), ("A1", "max"), ("A1", "top4"),
                                               ("A1", "mean"), ("A2", "max")])
@pytest.mark.parametrize("explore", ["random", "block-age", "staleness", "none"])
def test_selection_matches_reference(reduction, pooling, explore):
  """XLA selection (one request and batched) and, for A1/A2, the selection kernel: the same
  masks as the reference on ragged lengths (a one-block request, a request ending mid-block),
  one cold request, tied and negative scores."""
  rng = np.random.default_rng(7)
  state_dtype = "bfloat16" if explore in ("random", "none") else "float32"  # both ranked exactly
  cfg = spin.SpinConfig(block_size=B, topk=40, sparsity=0.5, explore_fraction=0.2,
                        explore=explore, pooling=pooling, reduction=reduction,
                        state_dtype=state_dtype)
  lengths = np.array([NB * B, 300, 201, 12, 250], np.int32)
  st = _state(rng, cfg, lengths, continuous=explore == "staleness",
              warm=[True, True, True, True, False])
  key = jax.random.PRNGKey(5)
  want = np.stack([np_spin_select(np_spin_state(st, i), int(l) - 1, int(l), cfg,
                                  np_request_seed(key, i)) for i, l in enumerate(lengths)])
  assert want[4].sum() == -(-250 // B)  # cold: every visible block
  pos, lens = jnp.asarray(lengths - 1), jnp.asarray(lengths)
  got = np.asarray(spin.select_blocks_batched(st, pos, lens, cfg, key))
  np.testing.assert_array_equal(got, want)
  one = jax.tree.map(lambda x: x[1], st)
  np.testing.assert_array_equal(  # one request with its own seed
      np.asarray(spin.algorithm._select_blocks(one, 299, 300, cfg, spin.request_seeds(key, 5)[1])),
      want[1])
  if reduction != "A0":
    masks = spin.select_compact_batched(st, pos, lens, cfg, key, NB, kernel=True,
                                        interpret=True)[0]
    np.testing.assert_array_equal(np.asarray(masks), want)


@pytest.mark.parametrize("decay", [0.3, 0.85])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_update_matches_reference(decay, state_dtype):
  """The XLA updates (by slots, by blocks, batched blocks) and the in-place update kernel equal
  the reference EMA; A2's updates touch the block states only."""
  rng = np.random.default_rng(3)
  width = 9
  for reduction in ("A1", "A2"):
    cfg = spin.SpinConfig(block_size=B, topk=16, ema_decay=decay, reduction=reduction,
                          state_dtype=state_dtype)
    sel, z, lengths = spin_selection_case(rng, 4, NB, B, width)
    slot = np.repeat(np.asarray(sel), B, 1) * B + np.tile(np.arange(B), width)
    z = jnp.where(jnp.asarray(slot) < lengths[:, None], jnp.where(jnp.isfinite(z), z, 2.5),
                  -jnp.inf)  # indexer scores are finite inside the context, -inf past it
    st = _state(rng, cfg, np.asarray(lengths), continuous=True)
    pos = lengths - 1
    ref = []
    for i in range(4):
      zs = np.full(NB * B, 0.0)
      obs = np.zeros(NB * B, bool)
      for c, blk in enumerate(np.asarray(sel[i])):
        if blk >= 0:
          zs[blk * B:(blk + 1) * B] = np.asarray(z[i, c * B:(c + 1) * B], np.float64)
          obs[blk * B:(blk + 1) * B] = True
      ref.append(np_spin_update(np_spin_state(st, i), zs, obs, int(pos[i]), int(lengths[i]), cfg))
    outs = {"kernel": spin.update_batched(st, z, sel, pos, lengths, cfg, interpret=True)[0]}
    if reduction == "A1":
      outs["xla"] = jax.vmap(spin.update_blocks, in_axes=(0, 0, 0, 0, 0, None))(
          st, z, sel, pos, lengths, cfg)
    else:
      outs["xla"] = spin.update_block_states(st, z, sel, pos, lengths, cfg)
    for name, got in outs.items():
      for i in range(4):
        for k in ("V", "D", "VB", "DB", "VM"):
          # A2 passes V, D and VM through untouched
          want = ref[i][k] if reduction == "A1" or k in ("VB", "DB") else np.asarray(
              st[k][i], np.float64)
          np.testing.assert_allclose(np.asarray(got[k][i], np.float64), want, **_ema_tol(cfg),
                                     err_msg=f"{name} {reduction} {k} {i}")
        np.testing.assert_array_equal(np.asarray(got["age"][i]), ref[i]["age"])
        assert int(got["step"][i]) == ref[i]["step"] and bool(got["warm"][i])


def test_update_weights_are_not_symmetric():
  """decay 0.3 keeps 30% of the old value: the reference itself, by hand."""
  cfg = spin.SpinConfig(block_size=4, topk=4, ema_decay=0.3, state_dtype="float32")
  st = {"V": np.full(8, 10.0), "D": np.zeros(8), "VB": np.full(2, 10.0), "DB": np.zeros(2),
        "age": np.zeros(2, np.int64), "step": 3, "warm": True}
  obs = np.zeros(8, bool)
  obs[4:6] = True
  new = np_spin_update(st, np.arange(8.0), obs, 7, 8, cfg)
  np.testing.assert_allclose(new["V"][4:6], [0.3 * 10 + 0.7 * 4, 0.3 * 10 + 0.7 * 5])
  np.testing.assert_allclose(new["D"][[3, 2]], [0.7 * 4, 0.7 * 5])
  np.testing.assert_allclose(new["VB"], [10.0, 0.3 * 10 + 0.7 * 5], rtol=1e-7)
  assert list(new["age"]) == [0, 3] and new["step"] == 4


@pytest.mark.parametrize("reduction", ["A0", "A1", "A2"])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_decode_step_matches_reference(reduction, implementation):
  """Three steps of the serving step (decay 0.7, float32 state) against the reference: each
  step's mask, the top-K of the observed float64 scores, and the state after it."""
  rng = np.random.default_rng(1)
  q, kc, _, _, w, _ = random_paged(rng, 3, 1, 8, 32, 1000, 60)
  q, w = q[:, 0], w[:, 0]
  table = jnp.asarray(np.stack([rng.permutation(60)[:16] for _ in range(3)]), jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=48, sparsity=0.4, reduction=reduction,
                        ema_decay=0.7, state_dtype="float32", explore_fraction=0.1)
  st = spin.init_state(16 * 64, cfg, (3,))
  ref = [np_spin_state(st, i) for i in range(3)]
  lens0 = np.array([900, 700, 300])
  for it in range(3):
    lens = lens0 + it
    key = jax.random.PRNGKey(it)
    v, idx, st, info = spin.decode_step(st, q, kc, table, jnp.asarray(lens, jnp.int32), w, cfg,
                                        key, implementation=implementation)
    z = np_indexer.paged(q[:, None], kc, table, lens, w[:, None])[:, 0]
    for i in range(3):
      mask = np_spin_select(ref[i], int(lens[i]) - 1, int(lens[i]), cfg, np_request_seed(key, i))
      np.testing.assert_array_equal(np.asarray(info["block_masks"][i]), mask, err_msg=f"{it} {i}")
      obs = np.repeat(mask, 64)
      rv, ri = np_topk(np.where(obs, z[i], -np.inf).astype(np.float32)[None], 48, [lens[i]])
      np.testing.assert_array_equal(np.asarray(idx[i]), ri[0])
      np.testing.assert_allclose(np.asarray(v[i]), rv[0], rtol=2e-5, atol=1e-5)
      ref[i] = np_spin_update(ref[i], np.where(obs, z[i], 0.0), obs, int(lens[i]) - 1,
                              int(lens[i]), cfg)
      keys = ("VB", "DB") if reduction == "A2" else ("V", "D", "VB", "DB", "VM")
      for k in keys:  # scores: float32 sums of bf16 products, then one EMA rounding
        np.testing.assert_allclose(np.asarray(st[k][i], np.float64), ref[i][k], rtol=2e-5,
                                   atol=2e-5, err_msg=f"{it} {i} {k}")
      np.testing.assert_array_equal(np.asarray(st["age"][i]), ref[i]["age"])


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_decode_step_query_exploration_matches_reference(implementation):
  """explore="query" in the serving step: a dense first step fills every block's mean key, then
  each step refreshes the newest blocks (request 0 completes a block on the way) and explores
  the blocks whose mean key the current query scores highest; masks, top-K and state against
  the reference fed float64 priorities from the cache's own blocks."""
  rng = np.random.default_rng(5)
  q, kc, _, _, w, _ = random_paged(rng, 3, 1, 4, 32, 1000, 60)
  q, w = q[:, 0], w[:, 0]
  table = np.stack([rng.permutation(60)[:16] for _ in range(3)])
  cfg = spin.SpinConfig(block_size=64, topk=48, sparsity=0.5, ema_decay=0.7,
                        state_dtype="float32", explore="query", explore_fraction=0.25)
  st = spin.init_state(16 * 64, cfg, (3,), head_dim=32)
  ref = [np_spin_state(st, i) for i in range(3)]
  lens0 = np.array([958, 701, 330])  # request 0 fills block 14 at its third step
  for it in range(4):
    lens = lens0 + it
    qi = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)  # a new query every step
    key = jax.random.PRNGKey(it)
    v, idx, st, info = spin.decode_step(st, qi, kc, jnp.asarray(table, jnp.int32),
                                        jnp.asarray(lens, jnp.int32), w, cfg, key,
                                        implementation=implementation)
    z = np_indexer.paged(qi[:, None], kc, table, lens, w[:, None])[:, 0]
    for i in range(3):
      km = np_block_key_means(kc, table[i], lens[i])
      mask = np_spin_select(ref[i], int(lens[i]) - 1, int(lens[i]), cfg, 0,
                            np_query_priorities(qi[i], w[i], km))
      np.testing.assert_array_equal(np.asarray(info["block_masks"][i]), mask, err_msg=f"{it} {i}")
      obs = np.repeat(mask, 64)
      _, ri = np_topk(np.where(obs, z[i], -np.inf).astype(np.float32)[None], 48, [lens[i]])
      np.testing.assert_array_equal(np.asarray(idx[i]), ri[0])
      ref[i] = np_spin_update(ref[i], np.where(obs, z[i], 0.0), obs, int(lens[i]) - 1,
                              int(lens[i]), cfg)
      np.testing.assert_allclose(np.asarray(st["VB"][i], np.float64), ref[i]["VB"], rtol=2e-5,
                                 atol=2e-5)
      # complete blocks hold their full mean (bf16 keys summed in float32: ~1e-6 relative)
      full = int(lens[i]) // 64
      np.testing.assert_allclose(np.asarray(st["KM"][i, :full], np.float64), km[:full],
                                 rtol=1e-5, atol=1e-6)
    if it == 0:
      assert (np.asarray(info["realized_sparsity"]) == 0).all()  # cold: dense
    else:
      assert (np.asarray(info["realized_sparsity"]) > 0.3).all()


def test_speculative_rows_query_exploration_match_reference():
  """Verifier rows with explore="query": each row's own priorities, the shared mask, and the
  commit carrying the blocks' mean keys."""
  rng = np.random.default_rng(11)
  r = 3
  q, kc, _, _, w, _ = random_paged(rng, 2, r, 4, 32, 1000, 60)
  table = np.stack([rng.permutation(60)[:16] for _ in range(2)])
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.5, ema_decay=0.6,
                        state_dtype="float32", explore="query", explore_fraction=0.25)
  lens = np.array([1000, 650])
  kms = [np_block_key_means(kc, table[b], lens[b] - r) for b in range(2)]  # the last step's
  st = {**_state_paged(rng, cfg, 2, 16), "KM": jnp.asarray(np.stack(kms), jnp.float32)}
  key = jax.random.PRNGKey(4)
  vals, slots, pending, info = spin.decode_step_rows(st, q, kc, jnp.asarray(table, jnp.int32),
                                                     jnp.asarray(lens), w, cfg, key,
                                                     implementation="xla")
  new = spin.commit(st, pending, np.array([2, 1]), cfg)
  for b in range(2):
    lrows = lens[b] - (r - 1) + np.arange(r)
    km = np_block_key_means(kc, table[b], lens[b])
    prios = [np_query_priorities(q[b, i], w[b, i], km) for i in range(r)]
    shared, rows = np_spin_rows(np_spin_state(st, b), lrows, cfg, [0] * r, prios)
    np.testing.assert_array_equal(np.asarray(info["row_masks"][b]), rows)
    np.testing.assert_array_equal(np.asarray(info["block_masks"][b]), shared)
    np.testing.assert_allclose(np.asarray(new["KM"][b, :lens[b] // 64], np.float64),
                               km[:lens[b] // 64], rtol=1e-5, atol=1e-6)
  assert int(new["step"][0]) == int(st["step"][0]) + 3  # rows 0..2 accepted, in order


def test_query_exploration_needs_the_mean_keys_in_the_state():
  rng = np.random.default_rng(0)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 1, 4, 32, 256, 8)
  cfg = spin.SpinConfig(block_size=64, topk=16, explore="query")
  st = spin.init_state(4 * 64, cfg, (2,))
  with pytest.raises(ValueError, match="head_dim=32"):
    spin.decode_step(st, q[:, 0], kc, table, lens, w[:, 0], cfg, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="head_dim"):
    spin.init_state(4 * 64, cfg, (2,), head_dim=0)


@pytest.mark.parametrize("mask_policy", ["union", "row0"])
@pytest.mark.parametrize("update_policy", ["prefix", "row0"])
def test_speculative_rows_match_reference(mask_policy, update_policy):
  """Verifier rows: each row's mask, the shared mask, the scores on it, and the commit of
  rows 0..accepted (or row 0) against the reference, from a warm state."""
  rng = np.random.default_rng(9)
  r = 3
  q, kc, _, _, w, _ = random_paged(rng, 2, r, 8, 32, 1000, 60)
  table = jnp.asarray(np.stack([rng.permutation(60)[:16] for _ in range(2)]), jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.5, ema_decay=0.6,
                        state_dtype="float32", mask_policy=mask_policy,
                        update_policy=update_policy, explore_fraction=0.1)
  lens = np.array([1000, 650])
  st = _state_paged(rng, cfg, 2, 16)
  key = jax.random.PRNGKey(4)
  vals, slots, pending, info = spin.decode_step_rows(st, q, kc, table, jnp.asarray(lens), w,
                                                     cfg, key, implementation="xla")
  accepted = np.array([1, 0])
  new = spin.commit(st, pending, accepted, cfg)
  z = np_indexer.paged(q, kc, table, lens, w)  # [B, R, cap]
  keys = jax.random.split(key, 2)
  for b in range(2):
    lrows = lens[b] - (r - 1) + np.arange(r)
    seeds = [np_request_seed(keys[b], i) for i in range(r)]
    shared, rows = np_spin_rows(np_spin_state(st, b), lrows, cfg, seeds)
    np.testing.assert_array_equal(np.asarray(info["row_masks"][b]), rows)
    np.testing.assert_array_equal(np.asarray(info["block_masks"][b]), shared)
    obs = np.repeat(shared, 64)
    zr = np.where(obs[None], z[b], -np.inf)
    _, ri = np_topk(zr.astype(np.float32), 32, lrows)
    got = np.asarray(slots[b])
    np.testing.assert_array_equal(got, ri)
    want = np_spin_commit(np_spin_state(st, b), np.where(obs[None], z[b], 0.0), shared, lrows,
                          int(accepted[b]), cfg)
    for k in ("V", "D", "VB", "DB"):
      np.testing.assert_allclose(np.asarray(new[k][b], np.float64), want[k], rtol=2e-5,
                                 atol=2e-5, err_msg=f"{b} {k}")
    assert int(new["step"][b]) == want["step"]


def _state_paged(rng, cfg, bsz, nb):
  st = spin.init_state(nb * cfg.block_size, cfg, (bsz,))
  v = jnp.asarray(rng.standard_normal((bsz, nb * cfg.block_size)), jnp.float32)
  return {**st, "V": v, "D": jnp.asarray(rng.standard_normal(v.shape), jnp.float32),
          "VM": v.reshape(bsz, nb, -1).max(-1),
          "VB": jnp.asarray(rng.standard_normal((bsz, nb)), jnp.float32),
          "DB": jnp.asarray(rng.standard_normal((bsz, nb)), jnp.float32),
          "step": jnp.full((bsz,), 4, jnp.int32), "warm": jnp.ones((bsz,), bool)}


@pytest.mark.parametrize("explore", ["random", "none"])
def test_replay_matches_reference(explore):
  """`spin.replay` over a short trace, step by step against the reference (reset state, a
  dense first step, then predicted masks; decay 0.8)."""
  rng = np.random.default_rng(2)
  s, n = 6, 400
  q = rng.standard_normal((s, 4, 16)).astype(np.float32)
  w = np.abs(rng.standard_normal((s, 4))).astype(np.float32)
  k = rng.standard_normal((n, 16)).astype(np.float32)
  lengths = np.arange(n - s + 1, n + 1)
  cfg = spin.SpinConfig(block_size=16, topk=32, sparsity=0.5, ema_decay=0.8,
                        state_dtype="float32", explore=explore, explore_fraction=0.2)
  out = spin.replay(q, k, w, lengths, cfg, seed=3)
  cap = -(-n // 16) * 16
  st = np_spin_state(spin.init_state(cap, cfg))
  key = jax.random.PRNGKey(3)
  for t in range(s):
    key, sub = jax.random.split(key)
    length = int(lengths[t])
    z = np.full(cap, -np.inf)
    z[:n] = np_indexer.dense(jnp.asarray(q[t][None]), jnp.asarray(k), jnp.asarray(w[t][None]),
                             None, [length - 1])[0]
    mask = np_spin_select(st, length - 1, length, cfg, np_request_seed(sub, 0))
    np.testing.assert_array_equal(out["block_masks"][t], mask, err_msg=str(t))
    obs = np.repeat(mask, 16)
    _, ri = np_topk(z.astype(np.float32)[None], 32, [length])
    kept = obs[ri[0][ri[0] >= 0]].mean()
    assert abs((1 - kept) - out["miss_rate"][t, 0]) < 1e-6
    st = np_spin_update(st, np.where(obs, z, 0.0), obs & np.isfinite(z), length - 1, length, cfg)


@pytest.mark.parametrize("reduction,pooling", [("A1", "max"), ("A1", "mean"), ("A2", "max")])
@pytest.mark.parametrize("explore", ["random", "block-age", "staleness", "none"])
def test_tpu_selection_kernel_matches_reference(reduction, pooling, explore):
  """The TPU selection + compaction kernel (TPU interpret mode): the reference's masks, the
  selected ids ascending, their count; ragged, cold and one-block requests; a width that cuts
  the cold request."""
  rng = np.random.default_rng(17)
  cfg = spin.SpinConfig(block_size=B, topk=40, sparsity=0.5, explore_fraction=0.2,
                        explore=explore, pooling=pooling, reduction=reduction,
                        state_dtype="float32")
  lengths = np.array([NB * B, 300, 201, 12, 250], np.int32)
  st = _state(rng, cfg, lengths, continuous=explore == "staleness",
              warm=[True, True, True, True, False])
  key = jax.random.PRNGKey(8)
  want = np.stack([np_spin_select(np_spin_state(st, i), int(l) - 1, int(l), cfg,
                                  np_request_seed(key, i)) for i, l in enumerate(lengths)])
  for width in (NB, 10):
    masks, sel, counts, total = spin.select_compact_batched(
        st, jnp.asarray(lengths - 1), jnp.asarray(lengths), cfg, key, width, kernel=True,
        kind="tpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(masks), want)
    np.testing.assert_array_equal(np.asarray(total), want.sum(1))
    for i in range(5):
      ids = np.flatnonzero(want[i])[:width]
      np.testing.assert_array_equal(np.asarray(sel[i]),
                                    np.concatenate([ids, -np.ones(width - ids.size, int)]))
      assert int(counts[i]) == ids.size


@pytest.mark.parametrize("reduction", ["A0", "A1", "A2"])
def test_decode_step_on_tpu_kernels_matches_reference(reduction, monkeypatch):
  """The serving step with the TPU kernels (A1's block scores, selection, block-sparse decode
  scoring with manual DMA, top-K, the slot update; TPU interpret mode) against the
  reference, three steps."""
  monkeypatch.setenv("JAXSPARSE_INTERPRET", "tpu")
  jax.clear_caches()
  try:
    test_decode_step_matches_reference(reduction, "pallas")
  finally:
    jax.clear_caches()


def test_tpu_spin_step_lowers_to_mosaic_kernels():
  """For TPU the step's block scores, selection, scoring, update and top-K lower to Mosaic
  kernels; the selection has no XLA sort (the one left is the top-K's overflow fallback)."""
  from jaxsparse.backend import KernelPlatform
  from pallas_kernels import indexer_decode, topk as ktopk
  from tests.conftest import export_for
  cfg = spin.SpinConfig(block_size=64, topk=2048, sparsity=0.4)
  bsz, nb = 4, 2048
  st = spin.init_state(nb * 64, cfg, (bsz,))
  tpu = KernelPlatform("tpu", False)
  width = spin.serving._aligned_width(spin.max_selected_blocks(nb, cfg), nb)

  def select(state, lengths, key):
    return spin.select_compact_batched(state, lengths - 1, lengths, cfg, key, width,
                                       kernel=True, kind="tpu")

  S = jax.ShapeDtypeStruct
  shapes = (jax.tree.map(lambda a: S(a.shape, a.dtype), st), S((bsz,), jnp.int32),
            S((2,), jnp.uint32))
  text = export_for(select, "tpu", *shapes).mlir_module()
  assert 'kernel_name = "jaxsparse_spin_select_tpu"' in text and "stablehlo.sort" not in text

  def step(state, q, kc, table, lengths, w, key):
    masks, sel, counts, _ = select(state, lengths, key)
    z, _ = indexer_decode.block_sparse_scores(q[:, None], kc, table, lengths, w[:, None], sel,
                                              counts, platform=tpu)
    new = spin.kernels.update_batched_tpu(state, z[:, 0], sel, lengths - 1, lengths, cfg)
    return ktopk.topk_rows(z[:, 0], lengths, cfg.topk, ktopk.TopkConfig(), tpu), new

  text = export_for(step, "tpu", *shapes[:1], S((bsz, 64, 128), jnp.bfloat16),
                    S((4096, 64, 128), jnp.bfloat16), S((bsz, nb), jnp.int32), shapes[1],
                    S((bsz, 64), jnp.float32), shapes[2]).mlir_module()
  for name in ("spin_block_scores_tpu", "spin_select_tpu", "decode_scores_tpu", "spin_update_tpu",
               "topk_threshold_tpu", "topk_compact_tpu", "topk_bitonic_tpu"):
    assert f'kernel_name = "jaxsparse_{name}"' in text, name


@pytest.mark.parametrize("decay", [0.3, 0.85])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page", [16, 64])
def test_tpu_block_scores_and_update_match_reference(decay, state_dtype, page):
  """The TPU kernels for A1's max-pooled block scores and the slot update (TPU interpret
  mode) against the float64 reference: scores exact (maxima of state values), V, D and VM
  within one rounding of the stored EMA; a request ending mid-block and a one-slot request."""
  from pallas_kernels.spin.tpu import block_scores_max_tpu, update_slots_tpu
  from tests.reference import np_spin_block_scores
  rng = np.random.default_rng(page)
  cfg = spin.SpinConfig(block_size=page, topk=16, ema_decay=decay, state_dtype=state_dtype)
  nb, width = 19, 9
  sel, z, lengths = spin_selection_case(rng, 4, nb, page, width)
  lengths = lengths.at[3].set(1)
  sel = sel.at[3].set(jnp.asarray([0] + [-1] * (width - 1), jnp.int32))
  slot = np.repeat(np.asarray(sel), page, 1) * page + np.tile(np.arange(page), width)
  z = jnp.where(jnp.asarray(slot) < lengths[:, None], jnp.where(jnp.isfinite(z), z, 1.5),
                -jnp.inf)
  st = spin_state_case(rng, cfg, 4, nb, lengths)
  got = np.asarray(block_scores_max_tpu(st["VM"], st["V"], st["D"], lengths, page=page,
                                        interpret=True))
  v, d, vm = update_slots_tpu(st["V"], st["D"], z, sel, lengths, page=page, decay=decay,
                              interpret=True)
  for i in range(4):
    ref = np_spin_state(st, i)
    length = int(lengths[i])
    np.testing.assert_array_equal(got[i], np_spin_block_scores(ref, length - 1, length, cfg))
    zs, obs = np.zeros(nb * page), np.zeros(nb * page, bool)
    for c, blk in enumerate(np.asarray(sel[i])):
      if blk >= 0:
        zs[blk * page:(blk + 1) * page] = np.asarray(z[i, c * page:(c + 1) * page])
        obs[blk * page:(blk + 1) * page] = True
    want = np_spin_update(ref, np.where(np.isfinite(zs), zs, 0.0), obs, length - 1, length, cfg)
    for k, a in (("V", v), ("D", d), ("VM", vm)):
      np.testing.assert_allclose(np.asarray(a[i], np.float64), want[k], **_ema_tol(cfg),
                                 err_msg=f"{k} {i}")

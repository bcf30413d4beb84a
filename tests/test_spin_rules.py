"""SPIN under the input rules: non-finite and tied EMA states and priorities rank the same
blocks on every path (XLA, the GPU and TPU selection kernels in interpret mode, the float64
reference) with the budget always filled; replay's miss of an empty top-K; what a mixed
warm / cold step reports; argument checks (PRNG keys, complex trace arrays)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import spin
from tests.reference import (np_indexer, np_request_seed, np_spin_budget, np_spin_select,
                             np_spin_state, np_topk, random_paged)

NB, B = 23, 16
# request lengths: full, ragged, one block, mid-block, and a cold request
LENGTHS = np.array([NB * B, 300, 201, 12, 250, 333], np.int32)
WARM = [True, True, True, True, False, True]


def _adversarial_state(cfg, seed):
  """Per request a different mix of block kinds: tied grid values (-0.0 among them), a NaN
  slot, all -inf, a +inf slot, partly -inf; D mostly -inf with a few grid / NaN / +-inf / -0.0
  offsets; request 0 NaN-heavy (NaN blocks must fill its budget), request 2 all NaN, request 3
  (one block) and request 5 all -inf."""
  rng = np.random.default_rng(seed)
  bsz, cap = len(LENGTHS), NB * B
  grid = lambda *s: np.round(rng.standard_normal(s) * 2) / 2
  v = grid(bsz, NB, B)
  v[v == 0] = -0.0
  kinds = rng.choice(5, (bsz, NB), p=[0.4, 0.15, 0.15, 0.1, 0.2])
  kinds[0] = rng.choice([0, 1], NB, p=[0.3, 0.7])
  for b in range(bsz):
    for j in range(NB):
      k, lane = kinds[b, j], rng.integers(B)
      if k == 1:
        v[b, j, lane] = np.nan
      elif k == 2:
        v[b, j] = -np.inf
      elif k == 3:
        v[b, j, lane] = np.inf
      elif k == 4:
        v[b, j, rng.random(B) < 0.5] = -np.inf
  v[2] = np.nan
  v[5] = -np.inf
  d = np.full((bsz, cap), -np.inf)
  for b in (0, 1, 4):
    at = rng.choice(cap, 12, replace=False)
    d[b, at] = np.concatenate([grid(8), [np.nan, np.inf, -0.0, -np.inf]])
  vb = grid(bsz, NB)
  vb[rng.random(vb.shape) < 0.3] = np.nan
  vb[rng.random(vb.shape) < 0.2] = -np.inf
  vb[rng.random(vb.shape) < 0.05] = np.inf
  vb[vb == 0] = -0.0
  vb[5] = -np.inf
  db = np.full((bsz, NB), -np.inf)
  db[1, :5] = [np.nan, 0.5, -0.0, np.inf, 0.5]
  dt = jnp.dtype(cfg.state_dtype)
  st = spin.init_state(cap, cfg, (bsz,))
  vj = jnp.asarray(v.reshape(bsz, cap), dt)
  age = (np.full((bsz, NB), 7) if cfg.explore == "staleness"  # float32 / float64 order alike
         else rng.integers(0, 10, (bsz, NB)))
  return {**st, "V": vj, "D": jnp.asarray(d, dt), "VM": vj.reshape(bsz, NB, B).max(-1),
          "VB": jnp.asarray(vb, dt), "DB": jnp.asarray(db, dt),
          "age": jnp.asarray(age, jnp.uint32), "step": jnp.full((bsz,), 10, jnp.int32),
          "warm": jnp.asarray(WARM)}


def _priorities(seed):
  """explore="query" priorities with NaN, +-inf, -0.0 and ties."""
  rng = np.random.default_rng(seed)
  p = np.round(rng.standard_normal((len(LENGTHS), NB)) * 2) / 2
  p[p == 0] = -0.0
  p[rng.random(p.shape) < 0.25] = np.nan
  p[rng.random(p.shape) < 0.2] = -np.inf
  p[rng.random(p.shape) < 0.05] = np.inf
  p[0, ::2] = np.nan  # most of request 0's blocks NaN or -inf
  p[0, 1::4] = -np.inf
  return jnp.asarray(p, jnp.float32)


@pytest.mark.parametrize("reduction,pooling,state_dtype", [
    ("A1", "max", "bfloat16"), ("A1", "mean", "float32"), ("A1", "top4", "float32"),
    ("A2", "max", "bfloat16")])
@pytest.mark.parametrize("explore", ["random", "block-age", "staleness", "query", "none"])
def test_nonfinite_states_select_the_same_blocks_everywhere(reduction, pooling, state_dtype,
                                                            explore):
  """NaN, +-inf, -0.0 and ties in the EMA states (and in query priorities): XLA, the GPU and
  TPU selection kernels (interpret mode) and the float64 reference pick identical masks; a
  warm request's mask holds exactly its budget m_t (NaN and -inf blocks rank last but fill
  it), a cold one every visible block."""
  cfg = spin.SpinConfig(block_size=B, topk=40, sparsity=0.5, explore_fraction=0.2,
                        explore=explore, pooling=pooling, reduction=reduction,
                        state_dtype=state_dtype)
  st = _adversarial_state(cfg, seed=11)
  prio = _priorities(12) if explore == "query" else None
  key = jax.random.PRNGKey(9)
  want = np.stack([
      np_spin_select(np_spin_state(st, i), int(l) - 1, int(l), cfg, np_request_seed(key, i),
                     None if prio is None else np.asarray(prio[i]))
      for i, l in enumerate(LENGTHS)])
  for i, l in enumerate(LENGTHS):
    n_blocks = -(-int(l) // B)
    assert want[i].sum() == (np_spin_budget(n_blocks, cfg)[0] if WARM[i] else n_blocks), i
  pos, lens = jnp.asarray(LENGTHS - 1), jnp.asarray(LENGTHS)
  got = {"xla": spin.select_blocks_batched(st, pos, lens, cfg, key, prio)}
  if pooling != "top4":  # the kernels take XLA's top-4 pooled scores as they take the mean's
    for kind in ("gpu", "tpu"):
      got[kind] = spin.select_compact_batched(st, pos, lens, cfg, key, NB, kernel=True,
                                              kind=kind, interpret=True, priorities=prio)[0]
  for name, masks in got.items():
    np.testing.assert_array_equal(np.asarray(masks), want, err_msg=name)


def test_rank_rule_on_one_row():
  """The ranking itself: +inf first, -0.0 / 0 / subnormals tie at 0 (lower index first), NaN
  and -inf last in index order, and n entries taken for every n up to the eligible count."""
  x = jnp.asarray([1.0, np.nan, -np.inf, 3.0, -0.0, 0.0, np.nan, np.inf, 1e-40, -np.inf, 2.0],
                  jnp.float32)
  elig = jnp.asarray([1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1], bool)
  rank = np.asarray(spin.algorithm._rank_desc(x, elig))
  np.testing.assert_array_equal(rank, [2, 6, 7, 11, 3, 4, 8, 0, 5, 11, 1])
  for n in range(int(elig.sum()) + 1):
    assert int(spin.top_mask(x, elig, n).sum()) == n


def test_query_priorities_rank_nan_last():
  """query_priorities of a NaN key mean are -inf: that block ranks last and still counts."""
  q = jnp.ones((2, 4), jnp.float32)
  km = jnp.asarray(np.eye(4)[[0, 1, 2, 3, 0]], jnp.float32).at[4, 0].set(jnp.nan)
  p = spin.query_priorities(q, jnp.ones(2), km)
  np.testing.assert_array_equal(np.asarray(p), [2, 2, 2, 2, -np.inf])
  assert int(spin.top_mask(p, jnp.ones(5, bool), 5).sum()) == 5


def test_replay_counts_only_steps_with_a_top_k():
  """A step whose exact top-K is empty (an all-NaN query, or zero head weights on a -inf
  shifted score) has nothing to miss: miss 0, not counted, and left out of mean_miss /
  p99_miss, which equal the float64 reference's over the counted steps."""
  rng = np.random.default_rng(4)
  s, n = 8, 200
  q = rng.standard_normal((s, 2, 8)).astype(np.float32)
  w = np.abs(rng.standard_normal((s, 2))).astype(np.float32)
  k = rng.standard_normal((n, 8)).astype(np.float32)
  q[3] = np.nan  # step 3: every score NaN
  lengths = np.arange(n - s + 1, n + 1)
  cfg = spin.SpinConfig(block_size=16, topk=24, sparsity=0.5, explore="none")
  scores = np_indexer.dense(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w), None, lengths - 1)
  scores[5] = -np.inf  # step 5: every score -inf
  r = spin.replay(q, k, w, lengths, cfg, scores=scores.astype(np.float32))
  miss, counted = [], []
  for t in range(s):
    _, idx = np_topk(scores[t].astype(np.float32)[None], 24, [lengths[t]])
    idx = idx[0][idx[0] >= 0]
    counted.append(len(idx) > 0)
    kept = np.repeat(r["block_masks"][t], 16)[idx]
    miss.append(1 - kept.mean() if len(idx) else 0.0)
  np.testing.assert_array_equal(r["counted"][:, 0], counted)
  np.testing.assert_allclose(r["miss_rate"][:, 0], miss, atol=1e-6)
  assert not counted[3] and not counted[5] and r["n_counted"] == s - 3
  tail = np.asarray(miss)[1:][np.asarray(counted)[1:]]
  assert abs(r["mean_miss"] - tail.mean()) < 1e-6
  assert abs(r["p99_miss"] - np.percentile(tail, 99)) < 1e-6
  none = spin.replay(q[:2], k, w[:2], lengths[:2], cfg,
                     scores=np.full((2, n), -np.inf, np.float32))
  assert none["n_counted"] == 0 and none["mean_miss"] == 0.0 and not none["counted"].any()


@pytest.mark.parametrize("arg", ["q", "k", "w", "scores"])
def test_replay_refuses_complex_arrays(arg):
  rng = np.random.default_rng(0)
  args = {"q": rng.standard_normal((3, 2, 8)).astype(np.float32),
          "k": rng.standard_normal((64, 8)).astype(np.float32),
          "w": np.ones((3, 2), np.float32), "scores": np.zeros((3, 64), np.float32)}
  args[arg] = args[arg] * (1 + 1j)
  with pytest.raises(ValueError, match=rf"^{arg}\.dtype=complex"):
    spin.replay(args["q"], args["k"], args["w"], np.array([62, 63, 64]),
                spin.SpinConfig(block_size=16, topk=8), scores=args["scores"])


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_mixed_warm_and_cold_batch_reports_the_dense_step(implementation):
  """A batch with one request just reset scores every request densely that step: info shows
  all visible blocks and realized sparsity 0 for every request, the top-K is the reference's
  over all scores; the next (all warm) step reports its sparse masks."""
  rng = np.random.default_rng(6)
  q, kc, _, _, w, _ = random_paged(rng, 3, 1, 8, 32, 1000, 40)
  q, w = q[:, 0], w[:, 0]
  table = jnp.asarray(np.stack([rng.permutation(40)[:16] for _ in range(3)]), jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.5)
  lens = np.array([1000, 640, 1])
  st = spin.init_state(16 * 64, cfg, (3,))
  key = jax.random.PRNGKey(1)
  step = lambda s, l: spin.decode_step(s, q, kc, table, jnp.asarray(l, jnp.int32), w, cfg, key,
                                       implementation=implementation)
  _, _, st, _ = step(st, lens)  # all cold: dense, now warm
  st = {k: v.at[1].set(jnp.zeros_like(v[1])) for k, v in st.items()}  # request 1 reset
  _, idx, st, info = step(st, lens + 1)
  n_blocks = -(-(lens + 1) // 64)
  np.testing.assert_array_equal(np.asarray(info["block_masks"]),
                                np.arange(16)[None] < n_blocks[:, None])
  np.testing.assert_array_equal(np.asarray(info["realized_sparsity"]), 0.0)
  z = np_indexer.paged(q[:, None], kc, table, lens + 1, w[:, None])[:, 0]
  np.testing.assert_array_equal(np.asarray(idx),
                                np_topk(z.astype(np.float32), 32, lens + 1)[1])
  _, _, _, info = step(st, lens + 2)  # all warm: sparse masks of m_t blocks each
  m = [np_spin_budget(int(nb), cfg)[0] for nb in -(-(lens + 2) // 64)]
  np.testing.assert_array_equal(np.asarray(info["block_masks"]).sum(1), m)
  np.testing.assert_allclose(np.asarray(info["realized_sparsity"]),
                             1 - np.asarray(m) / -(-(lens + 2) // 64), rtol=1e-6)


def test_rows_step_scores_a_cold_request_on_every_block():
  """decode_step_rows with a cold request whose blocks outnumber the compacted width: it is
  scored on every block (the info's shared mask), its top-K is the reference's over all
  scores, and the warm request keeps its sparse mask; warm=True with a concrete cold state
  raises."""
  rng = np.random.default_rng(3)
  r, nb = 2, 40
  q, kc, _, _, w, _ = random_paged(rng, 2, r, 4, 32, nb * 64, 48)
  table = jnp.asarray(np.stack([rng.permutation(48)[:nb] for _ in range(2)]), jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=32, sparsity=0.6)
  width = spin.serving._aligned_width(spin.max_selected_blocks(nb, cfg) * r, nb)
  assert width < nb
  st = spin.init_state(nb * 64, cfg, (2,))
  st = {**st, "warm": jnp.asarray([False, True]), "step": jnp.asarray([0, 3], jnp.int32)}
  lens = np.array([nb * 64 - 5, 1500])
  key = jax.random.PRNGKey(2)
  vals, slots, pending, info = spin.decode_step_rows(st, q, kc, table, jnp.asarray(lens), w,
                                                     cfg, key, implementation="xla")
  masks = np.asarray(info["block_masks"])
  assert masks[0].all() and float(info["realized_sparsity"][0]) == 0.0
  assert masks[1].sum() <= width and float(info["realized_sparsity"][1]) > 0.3
  z = np_indexer.paged(q, kc, table, lens, w)  # [B, R, cap]
  lrows = lens[:, None] - (r - 1) + np.arange(r)
  obs = np.repeat(masks, 64, axis=1)[:, None]
  _, ri = np_topk(np.where(obs, z, -np.inf).astype(np.float32), 32, lrows)
  np.testing.assert_array_equal(np.asarray(slots), ri)
  with pytest.raises(ValueError, match="warm=True"):
    spin.decode_step_rows(st, q, kc, table, jnp.asarray(lens), w, cfg, key, warm=True)


def test_keys_are_checked_and_both_kinds_agree():
  """key=0 (or any non-key) raises ValueError naming `key` in every SPIN entry point; a typed
  key and the raw uint32 key of the same seed select the same blocks."""
  cfg = spin.SpinConfig(block_size=16, topk=16, sparsity=0.5)
  st = _adversarial_state(cfg, seed=1)
  pos, lens = jnp.asarray(LENGTHS - 1), jnp.asarray(LENGTHS)
  one = jax.tree.map(lambda x: x[1], st)
  for bad in (0, 1.5, np.zeros(2, np.int32), jax.random.split(jax.random.key(0), 2)):
    for call in (lambda k: spin.select_blocks(one, 299, 300, cfg, k),
                 lambda k: spin.select_blocks_batched(st, pos, lens, cfg, k),
                 lambda k: spin.select_rows(one, jnp.asarray([299, 300]), cfg, k),
                 lambda k: spin.request_seeds(k, 3),
                 lambda k: spin.select_compact_batched(st, pos, lens, cfg, k, NB)):
      with pytest.raises(ValueError, match="^key must be one PRNG key"):
        call(bad)
  rng = np.random.default_rng(0)
  q, kc, table, plens, w, _ = random_paged(rng, 2, 1, 4, 32, 256, 8)
  cfg64 = spin.SpinConfig(block_size=64, topk=16)
  st2 = spin.init_state(4 * 64, cfg64, (2,))
  with pytest.raises(ValueError, match="^key must be one PRNG key"):
    spin.decode_step(st2, q[:, 0], kc, table, plens, w[:, 0], cfg64, 0)
  with pytest.raises(ValueError, match="^key must be one PRNG key"):
    spin.decode_step_rows(st2, q, kc, table, plens, w, cfg64, 0)
  np.testing.assert_array_equal(
      np.asarray(spin.select_blocks_batched(st, pos, lens, cfg, jax.random.key(7))),
      np.asarray(spin.select_blocks_batched(st, pos, lens, cfg, jax.random.PRNGKey(7))))

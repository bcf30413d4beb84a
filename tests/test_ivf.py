"""AttentionIndex: causality, candidate packing against a float64 loop reference, seal and refit
invariants (Hamerly bounds), HiSA and full DSA, and bad configurations."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import ivf
from jaxsparse.ivf import index

CFG = ivf.IVFConfig(topk=16, budget=96, seal_window=64, cluster_size=16, refit_interval=128,
                    sink=4, refit_batch=32)


def _trace(n=400, h=4, d=16, seed=0):
  rng = np.random.default_rng(seed)
  # clustered keys (so groups mean something) plus noise
  centers = rng.standard_normal((12, d))
  k = centers[rng.integers(0, 12, n)] + 0.3 * rng.standard_normal((n, d))
  q = rng.standard_normal((n, h, d))
  w = rng.uniform(0.1, 1.0, (n, h))
  return q.astype(np.float32), k.astype(np.float32), w.astype(np.float32)


def _np_candidates(gs, sizes, assign, rank, gend, pos, budget, sink):
  """Loop reference of candidate packing for one query."""
  n = len(assign)
  fixed = [i for i in range(n) if i <= pos and (i < sink or i >= gend)]
  room = budget - len(fixed)
  chosen = set(fixed)
  order = sorted([g for g in range(len(gs)) if np.isfinite(gs[g])], key=lambda g: (-gs[g], g))
  for g in order:
    if room <= 0:
      break
    members = sorted(i for i in range(n) if assign[i] == g and i <= pos)
    assert [rank[i] for i in members] == list(range(len(members)))
    take = members[:room]
    chosen.update(take)
    room -= len(take)
  return chosen


def test_candidate_packing_matches_loop_reference():
  rng = np.random.default_rng(1)
  n, g, qn = 120, 9, 6
  assign = np.where(np.arange(n) >= 5, rng.integers(0, g, n), -1).astype(np.int32)
  assign[100:] = -1  # ungrouped tail
  rank = np.zeros(n, np.int32)
  for gg in range(g):
    m = np.nonzero(assign == gg)[0]
    rank[m] = np.arange(len(m))
  sizes = np.bincount(assign[assign >= 0], minlength=g).astype(np.int32)
  gs = rng.standard_normal((qn, g)).astype(np.float32)
  gs[0, 3] = -np.inf  # an unusable group
  gs[1, :] = gs[1, 0]  # all tied: lower group id first
  pos = np.asarray([119, 110, 105, 100, 119, 101], np.int32)
  gend = np.full(qn, 100, np.int32)
  for budget in (20, 40, 77, 500):
    mask, num = ivf.candidate_mask(jnp.asarray(gs), jnp.asarray(sizes), jnp.asarray(assign),
                                   jnp.asarray(rank), jnp.asarray(gend), jnp.asarray(pos),
                                   budget=budget, sink=5)
    mask = np.asarray(mask)
    for i in range(qn):
      want = _np_candidates(gs[i], sizes, assign, rank, gend[i], pos[i], budget, 5)
      assert set(np.nonzero(mask[i])[0]) == want, (budget, i)
      assert num[i] == len(want) and (len(want) <= budget or budget < 25)


def test_no_query_sees_a_key_after_its_position():
  """Changing every key, query and weight after position n leaves query n's top-K unchanged,
  for every method, with seals and refits happening inside the sequence."""
  q, k, w = _trace()
  pos = np.asarray([3, 63, 64, 100, 127, 128, 129, 200, 255, 256, 300, 399])
  rng = np.random.default_rng(9)
  for method in ("ivf", "hisa", "full"):
    base = ivf.evaluate(q, k, w, CFG, method=method, query_positions=pos)
    assert (base["topk_indices"] <= pos[:, None]).all()
    assert (base["num_candidates"] <= pos + 1).all()
    for j, n in enumerate(pos):
      q2, w2, k2 = q.copy(), w.copy(), k.copy()
      k2[n + 1:] = 5 * rng.standard_normal(k2[n + 1:].shape)
      q2[n + 1:] = rng.standard_normal(q2[n + 1:].shape)
      r = ivf.evaluate(q2, k2, w2, CFG, method=method, query_positions=pos[j:j + 1])
      np.testing.assert_array_equal(r["topk_indices"][0], base["topk_indices"][j])


def test_before_the_first_seal_queries_score_every_key():
  q, k, w = _trace()
  pos = np.arange(0, 63)
  r = ivf.evaluate(q, k, w, CFG, query_positions=pos)
  np.testing.assert_array_equal(r["num_candidates"], pos + 1)
  assert (r["recall"] == 1).all()


def test_full_is_exact_and_budget_bounds_candidates():
  q, k, w = _trace()
  pos = np.arange(64, 400, 5)
  full = ivf.evaluate(q, k, w, CFG, method="full", query_positions=pos)
  assert (full["recall"] == 1).all()
  for m in ("ivf", "hisa"):
    r = ivf.evaluate(q, k, w, CFG, method=m, query_positions=pos)
    assert (r["num_candidates"] <= CFG.budget).all()
    assert (r["num_candidates"][pos >= CFG.budget] == CFG.budget).all()
    # recall is exactly the share of the reference top-K found
    ref = full["topk_indices"]
    want = [np.isin(ref[i], r["topk_indices"][i]).mean() for i in range(len(pos))]
    np.testing.assert_allclose(r["recall"], want)


def test_budget_covering_everything_is_exact():
  q, k, w = _trace(n=200)
  cfg = dataclasses.replace(CFG, budget=4096)
  r = ivf.evaluate(q, k, w, cfg, query_positions=np.arange(64, 200, 3))
  assert (r["recall"] == 1).all()


def test_oracle_ranking_is_at_least_as_good_as_representatives():
  q, k, w = _trace()
  pos = np.arange(70, 400, 3)
  for m in ("ivf", "hisa"):
    a = ivf.evaluate(q, k, w, CFG, method=m, query_positions=pos)["recall"].mean()
    o = ivf.evaluate(q, k, w, CFG, method=m, query_positions=pos, oracle=True)["recall"].mean()
    assert o >= a - 1e-9


@pytest.mark.parametrize("compact", [True, False])
def test_seal_appends_groups_and_leaves_old_ones_untouched(compact):
  _, k, _ = _trace()
  kj = jnp.asarray(k)
  cfg = dataclasses.replace(CFG, compact=compact)
  st = index.init_state(400, 16, cfg)
  st1 = index.seal(st, kj, 64, config=cfg)
  st2 = index.seal(st1, kj, 128, config=cfg)
  a1, a2 = np.asarray(st1["assign"]), np.asarray(st2["assign"])
  per = CFG.seal_window // CFG.cluster_size
  assert int(st2["groups"]) == 2 * per and int(st2["grouped_end"]) == 128
  np.testing.assert_array_equal(a2[:64], a1[:64])  # the first seal's groups are untouched
  np.testing.assert_array_equal(np.asarray(st2["centers"])[:per],
                                np.asarray(st1["centers"])[:per])
  assert (a2[:CFG.sink] == -1).all() and (a2[CFG.sink:128] >= 0).all() and (a2[128:] == -1).all()
  assert set(a2[64:128]) <= set(range(per, 2 * per))
  np.testing.assert_array_equal(np.asarray(st2["sizes"])[:2 * per],
                                np.bincount(a2[a2 >= 0], minlength=2 * per))
  # each center is its members' mean (rounded to bfloat16 when compact: 2^-9 relative)
  c = np.asarray(st2["centers"], np.float64)
  rtol = 2.0 ** -8 if compact else 1e-4
  for g in range(2 * per):
    m = a2 == g
    if m.any():
      np.testing.assert_allclose(c[g], k[m].mean(0), rtol=rtol, atol=1e-5)
  # right after a seal the bounds are the distances to the window's stored centers themselves
  # (no slack), stored rounded outward: upper >= own, lower <= second nearest
  up, lo = np.asarray(st2["upper"], np.float64), np.asarray(st2["lower"], np.float64)
  for (a, b), cw in (((CFG.sink, 64), c[:per]), ((64, 128), c[per:2 * per])):
    dd = np.sqrt(((k[a:b, None, :].astype(np.float64) - cw[None]) ** 2).sum(-1))
    srt = np.sort(dd, 1)
    tol = 1e-6 * (1 + srt[:, 1])
    assert (up[a:b] >= srt[:, 0] - tol).all() and (lo[a:b] <= srt[:, 1] + tol).all()



@pytest.mark.parametrize("kernel", [None, "gpu", "tpu"], ids=["xla", "gpu-interpret",
                                                               "tpu-interpret"])
def test_batched_window_clusters_give_the_same_seals(kernel):
  """cluster_windows runs every window's k-means at once (vmapped; on GPU/TPU the assignment
  kernel batched); sealing from it gives the sequential seals' groups, and centers equal to
  float32 rounding. Also lowers for GPU and TPU."""
  from jaxsparse.backend import KernelPlatform
  from tests.conftest import export_for
  _, k, _ = _trace()
  kj = jnp.asarray(k)
  plat = KernelPlatform(kernel, True) if kernel else None
  cl = index.cluster_windows(kj, CFG, platform=plat)
  assert cl[0].shape == (400 // 64, 64) and cl[1].shape == (400 // 64, 4, 16)
  a, b = index.init_state(400, 16, CFG), index.init_state(400, 16, CFG)
  for p in range(64, 401, 64):
    a = index.seal(a, kj, p, config=CFG, platform=plat)
    b = index.seal(b, kj, p, config=CFG, platform=plat, clusters=cl)
  for name in ("assign", "rank", "sizes", "last", "groups", "grouped_end"):
    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)
  for name in ("centers", "upper", "lower"):
    np.testing.assert_allclose(np.asarray(a[name], np.float32), np.asarray(b[name], np.float32),
                               rtol=1e-5, atol=1e-5, err_msg=name)
  import jax
  for kind, target in (("gpu", "cuda"), ("tpu", "tpu")):
    export_for(lambda x, p_=KernelPlatform(kind, False): index.cluster_windows(
        x, CFG, platform=p_), target, jax.ShapeDtypeStruct((4096, 128), jnp.bfloat16))

def test_incremental_seal_bookkeeping_equals_a_full_recount():
  """Seals count sizes, newest members and member ranks from the window alone; after every
  seal and refit they equal a recount over all keys (ranks of grouped keys, saturated as
  stored)."""
  _, k, _ = _trace(n=512)
  kj = jnp.asarray(k, jnp.float32)
  st = index.init_state(512, 16, CFG)
  g = st["sizes"].shape[0]
  for p in range(64, 513, 64):
    st = index.seal(st, kj, p, config=CFG)
    if p % CFG.refit_interval == 0:
      st = index.refit(st, kj, p, config=CFG)
    a = jnp.asarray(st["assign"], jnp.int32)
    sizes, _, last = index._group_stats(a, kj, g)
    np.testing.assert_array_equal(np.asarray(st["sizes"]), np.asarray(sizes))
    np.testing.assert_array_equal(np.asarray(st["last"]), np.asarray(last))
    grouped = np.asarray(a) >= 0  # an ungrouped key's rank is never read
    want = np.asarray(index._store_rank(index._members_rank(a, g), st["rank"]))
    np.testing.assert_array_equal(np.asarray(st["rank"])[grouped], want[grouped])


@pytest.mark.parametrize("compact,interval", [(True, 128), (False, 128), (True, 0)])
def test_refit_assigns_to_the_nearest_warm_start_center_with_valid_bounds(compact, interval):
  """Assignments to the nearest center (of the stored, warm-start centers), and bounds that
  hold against the stored centers after the update: no tolerance beyond float32 rounding
  (compact bounds are rounded outward). interval=0: refits called every 128 keys by hand,
  so the centers the seals added come in two blocks of seal_window / cluster_size."""
  _, k, _ = _trace(n=512)
  kj = jnp.asarray(k, jnp.float32)
  cfg = dataclasses.replace(CFG, compact=compact, refit_interval=interval)
  st = index.init_state(512, 16, cfg)
  compared = []
  for p in range(64, 513, 64):
    st = index.seal(st, kj, p, config=cfg)
    if p % CFG.refit_interval == 0:
      before = np.asarray(st["centers"], np.float64)[: int(st["groups"])]
      st = index.refit(st, kj, p, config=cfg)
      a = np.asarray(st["assign"])[CFG.sink:p]
      d = ((k[CFG.sink:p, None, :].astype(np.float64) - before[None]) ** 2).sum(-1)
      best = d.min(1)
      np.testing.assert_allclose(d[np.arange(len(a)), a], best, rtol=1e-4, atol=1e-4)
      c = np.asarray(st["centers"], np.float64)[: int(st["groups"])]
      dd = np.sqrt(((k[CFG.sink:p, None, :].astype(np.float64) - c[None]) ** 2).sum(-1))
      own = dd[np.arange(len(a)), a]
      dd[np.arange(len(a)), a] = np.inf
      tol = 1e-5 * (1 + own)
      assert (np.asarray(st["upper"], np.float64)[CFG.sink:p] >= own - tol).all()
      assert (np.asarray(st["lower"], np.float64)[CFG.sink:p] <= dd.min(1) + tol).all()
      compared.append((int(st["compared"]), p - CFG.sink))
  assert compared[0][0] == compared[0][1]  # the first refit knows no bounds yet
  assert all(c < n for c, n in compared[1:])  # later ones skip keys the bounds settle


def test_refit_compares_settled_keys_with_every_center_a_seal_added():
  """Keys whose bounds settle them must still move to a closer center any seal added since
  the last refit, in every block of new centers: the window [192, 256) repeats the keys of
  [0, 64), so its seal's centers (the second block here) sit among those old keys."""
  rng = np.random.default_rng(3)
  k = rng.standard_normal((256, 16)).astype(np.float32)
  k[128:192] += 40.0  # a far window: the first block of new centers
  k[192:256] = k[0:64] + 1e-3 * rng.standard_normal((64, 16)).astype(np.float32)
  kj = jnp.asarray(k)
  cfg = dataclasses.replace(CFG, refit_interval=0, compact=False)
  st = index.init_state(256, 16, cfg)
  for p in (64, 128):
    st = index.seal(st, kj, p, config=cfg)
  st = index.refit(st, kj, 128, config=cfg)
  for p in (192, 256):
    st = index.seal(st, kj, p, config=cfg)
  before = np.asarray(st["centers"], np.float64)[: int(st["groups"])]
  st = index.refit(st, kj, 256, config=cfg)
  assert int(st["compared"]) < 256 - cfg.sink  # some old keys were settled by their bounds
  a = np.asarray(st["assign"])[cfg.sink:256]
  d = ((k[cfg.sink:256, None, :].astype(np.float64) - before[None]) ** 2).sum(-1)
  np.testing.assert_allclose(d[np.arange(len(a)), a], d.min(1), rtol=1e-4, atol=1e-4)


def test_index_memory_is_small_against_the_key_cache():
  """Compact (default): 8 bytes a key + 2 x 256-byte bf16 center / representative per 128
  keys, under 10% of an fp8 indexer key cache (128 bytes + a float32 scale a key); the
  float32 state (16 + 8) stays under 10% of bf16 keys only. The stored dtypes are the
  documented ones."""
  n, d = 1 << 20, 128
  b = ivf.index_bytes(n, d, ivf.IVFConfig())
  assert 12 * n <= b <= 12.2 * n and b <= 0.10 * n * (d + 4)
  b32 = ivf.index_bytes(n, d, ivf.IVFConfig(compact=False))
  assert 24 * n <= b32 <= 0.10 * n * d * 2
  st = ivf.init_state(n, d, ivf.IVFConfig())
  assert st["assign"].dtype == jnp.int16 and st["rank"].dtype == jnp.int16
  assert st["upper"].dtype == st["centers"].dtype == jnp.bfloat16
  big = ivf.init_state(1 << 23, 8, ivf.IVFConfig(budget=40000))  # > 32767 groups and ranks
  assert big["assign"].dtype == big["rank"].dtype == jnp.int32


@pytest.mark.parametrize("kw,msg", [
    (dict(budget=1000), "fixed slots"),
    (dict(cluster_size=2048), "cluster_size=2048 must not exceed"),
    (dict(cluster_size=100), "must divide"),
    (dict(refit_interval=1500), "multiple of seal_window"),
    (dict(topk=0), "topk=0"),
    (dict(sink=-1), "sink=-1"),
    (dict(query_block=3), "query_block=3 must divide"),
    (dict(query_block=0), "query_block=0"),
])
def test_bad_configurations_name_the_argument(kw, msg):
  with pytest.raises(ValueError, match=msg):
    ivf.IVFConfig(**kw)


def test_bad_inputs_name_the_argument():
  q, k, w = _trace(n=100)
  with pytest.raises(ValueError, match="query_positions"):
    ivf.evaluate(q, k, w, CFG, query_positions=[100])
  with pytest.raises(ValueError, match="query_positions"):
    ivf.evaluate(q, k, w, CFG, query_positions=[-1])
  with pytest.raises(ValueError, match="method"):
    ivf.evaluate(q, k, w, CFG, method="lsh", query_positions=[5])
  with pytest.raises(ValueError, match=r"\[N, H, D\]"):
    ivf.evaluate(q[:, 0], k, w, CFG, query_positions=[5])


def test_gathered_candidates_equal_the_mask():
  """candidate_indices (what a prefill kernel gathers) holds exactly candidate_mask's keys."""
  q, k, w = _trace(n=400)
  kj = jnp.asarray(k)
  st = index.init_state(400, 16, CFG)
  for p in (64, 128, 192):
    st = index.seal(st, kj, p, config=CFG)
  pos = np.arange(191, 255)
  reps = index.representatives(st, kj)
  valid = (st["sizes"][None, :] > 0) & (st["last"][None, :] < 192)
  gs = ivf.representative_scores(jnp.asarray(q[pos]), jnp.asarray(w[pos]), reps, valid)
  gend = jnp.full((len(pos),), 192, jnp.int32)
  pj = jnp.asarray(pos, jnp.int32)
  mask, num = ivf.candidate_mask(gs, st["sizes"], st["assign"], st["rank"], gend, pj,
                                 budget=CFG.budget, sink=CFG.sink)
  members, offsets = ivf.inverted_lists(st["assign"], st["sizes"].shape[0])
  # the prefill's lists from the stored ranks (one scatter) hold the same group ranges
  m2, o2 = ivf.lists_by_rank(st["assign"], st["rank"], st["sizes"])
  np.testing.assert_array_equal(np.asarray(o2), np.asarray(offsets))
  grouped = int(np.asarray(st["sizes"]).sum())
  np.testing.assert_array_equal(np.asarray(m2)[:grouped], np.asarray(members)[:grouped])
  assert (np.asarray(m2)[grouped:] == -1).all()
  idx, num2 = ivf.candidate_indices(gs, st["sizes"], members, offsets, gend, pj,
                                    budget=CFG.budget, sink=CFG.sink, window=CFG.seal_window)
  np.testing.assert_array_equal(np.asarray(num), np.asarray(num2))
  mask, idx = np.asarray(mask), np.asarray(idx)
  for i in range(len(pos)):
    got = idx[i][idx[i] >= 0]
    assert len(set(got)) == len(got)
    assert set(got) == set(np.nonzero(mask[i])[0])


def test_hisa_prefill_equals_the_evaluation_path_for_every_query():
  """`prefill_topk(method="hisa")` (fixed blocks through the chunked candidate path) takes the
  candidates of `evaluate(method="hisa")` for every query: the same counts and a top-K of the
  same float64 scores (ties among equal scores may pick other keys), never a later key."""
  n = 400
  q, k, w = _trace(n=n)
  idx, num = map(np.asarray, ivf.prefill_topk(q, k, w, CFG, method="hisa"))
  ref = ivf.evaluate(q, k, w, CFG, method="hisa", query_positions=np.arange(n))
  np.testing.assert_array_equal(num, ref["num_candidates"])
  s = np.einsum("nhd,md->nhm", q.astype(np.float64), k.astype(np.float64))
  z = np.einsum("nhm,nh->nm", np.maximum(s, 0), w.astype(np.float64))
  for i in range(n):
    got, want = idx[i][idx[i] >= 0], ref["topk_indices"][i][ref["topk_indices"][i] >= 0]
    assert len(got) == len(want) and (got <= i).all()
    np.testing.assert_allclose(np.sort(z[i, got]), np.sort(z[i, want]), rtol=1e-6, atol=1e-9)
  # HiSA's candidates are not AttentionIndex's: the two paths differ somewhere
  assert (idx != ivf.prefill_topk(q, k, w, CFG)[0]).any()
  with pytest.raises(ValueError, match="method"):
    ivf.prefill_topk(q, k, w, CFG, method="blocks")
  with pytest.raises(ValueError, match="corrector"):
    ivf.prefill_topk(q, k, w, CFG, method="hisa", corrector=lambda st, kk, m: 0 * m)


BLOCK_CFG = dataclasses.replace(CFG, query_block=8)


def _shift_corrector(state, keys, mean):
  """A stand-in correction that changes the ranking: every representative moved along a
  fixed direction, scaled by its group's size."""
  d = jnp.linspace(-1.0, 1.0, mean.shape[1])
  return 0.5 * jnp.log1p(state["sizes"].astype(jnp.float32))[:, None] * d[None, :]


@pytest.mark.parametrize("cfg,corr", [(CFG, None), (BLOCK_CFG, None), (CFG, _shift_corrector)],
                         ids=["per-query", "shared-blocks", "corrected"])
def test_prefill_topk_equals_the_evaluation_path_for_every_query(cfg, corr):
  """The chunked prefill gives every query the top-K and candidate count of `evaluate`'s
  candidates; with query_block = 8 those are the block's shared ones (ranked by the 8 queries
  ending at its first position, the slots of its last), scored densely; with a corrector both
  rank the corrected representatives (and differ from the plain means)."""
  q, k, w = _trace(n=400)
  idx, num = map(np.asarray, ivf.prefill_topk(q, k, w, cfg, corrector=corr))
  ref = ivf.evaluate(q, k, w, cfg, query_positions=np.arange(400), corrector=corr)
  if corr is not None:
    plain = ivf.evaluate(q, k, w, cfg, query_positions=np.arange(400))["topk_indices"]
    assert (plain != ref["topk_indices"]).any()
  np.testing.assert_array_equal(num, ref["num_candidates"])
  for i in range(400):
    assert set(idx[i][idx[i] >= 0]) == set(ref["topk_indices"][i][ref["topk_indices"][i] >= 0])
  assert (idx <= np.arange(400)[:, None]).all() and num.max() <= cfg.budget
  if cfg.query_block > 1:  # a different selection from the per-query one
    own = ivf.evaluate(q, k, w, CFG, query_positions=np.arange(400))["topk_indices"]
    assert (own != ref["topk_indices"]).any()


def test_shared_blocks_never_use_a_later_key_or_query():
  """Changing every key, query and weight after position n leaves query n's top-K unchanged
  with shared blocks (n at every place in its block, and blocks that start a window)."""
  q, k, w = _trace()
  pos = np.asarray([63, 64, 70, 71, 127, 128, 134, 200, 255, 399])
  rng = np.random.default_rng(4)
  base = ivf.evaluate(q, k, w, BLOCK_CFG, query_positions=pos)
  for j, n in enumerate(pos):
    q2, w2, k2 = q.copy(), w.copy(), k.copy()
    k2[n + 1:] = 5 * rng.standard_normal(k2[n + 1:].shape)
    q2[n + 1:] = 5 * rng.standard_normal(q2[n + 1:].shape)
    w2[n + 1:] = rng.uniform(0, 3, w2[n + 1:].shape)
    r = ivf.evaluate(q2, k2, w2, BLOCK_CFG, query_positions=pos[j:j + 1])
    np.testing.assert_array_equal(r["topk_indices"][0], base["topk_indices"][j])
    got = np.asarray(ivf.prefill_topk(q2, k2, w2, BLOCK_CFG)[0])
    assert set(got[n][got[n] >= 0]) == set(base["topk_indices"][j][base["topk_indices"][j] >= 0])


def test_prefill_topk_runs_under_jit():
  """A user may jit the whole prefill (config and method static): the same indices and counts
  as the eager call, with refits and a last window of fewer queries (600 = 9 x 64 + 24)."""
  q, k, w = _trace(n=600)
  cfg = dataclasses.replace(CFG, refit_interval=4 * CFG.seal_window)
  f = jax.jit(ivf.prefill_topk, static_argnames=("config", "method"))
  for method in ("ivf", "hisa"):
    want = ivf.prefill_topk(q, k, w, cfg, method=method)
    got = f(q, k, w, cfg, method=method)
    for a, b in zip(want, got):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (np.asarray(got[0]) >= 0).sum(1).min() > 0


# DeepSeek-V3.2's fp8 format end to end (issue 69): float8_e4m3fn q (its scale folded into w)
# and keys with a float32 scale per key.

FP8_CFG = ivf.IVFConfig(topk=12, budget=64, seal_window=32, cluster_size=8, refit_interval=0,
                        sink=4, refit_batch=32)
FP8_N = 95  # windows sealed at 32 and 64, and no last window of fewer queries (one compilation)


def fp8_trace(n=FP8_N, h=2, d=16, seed=0, pow2=True):
  """(q8 [N, H, D], k8 [N, D] float8_e4m3fn, w [N, H] float32 with q's scale folded in, k_scale
  [N] float32): clustered keys of magnitudes spread over 2^-3 .. 2^3 (so the scales matter),
  quantised by `jaxsparse.prep.quantize_fp8`; pow2=False multiplies each scale by a factor in
  [0.6, 1.7) (scales need not be powers of two)."""
  from jaxsparse.prep import quantize_fp8
  q, k, w = _trace(n=n, h=h, d=d, seed=seed)
  rng = np.random.default_rng(seed + 1)
  k = k * np.exp2(rng.uniform(-3, 3, (n, 1))).astype(np.float32)
  (q8, qs), (k8, ks) = quantize_fp8(jnp.asarray(q)), quantize_fp8(jnp.asarray(k))
  if not pow2:
    ks = ks * jnp.asarray(rng.uniform(0.6, 1.7, n), jnp.float32)
  return q8, k8, jnp.asarray(w) * qs, ks


def fp8_reference(q8, k8, w, ks):
  """float64 causal scores of the fp8 format, (z [N, N], tol [N, N]): q and k dequantised
  exactly, z = sum_h w relu(q . k) * k_scale, -inf after each query; tol bounds float32
  accumulation's error (the sum of |terms| times 2^-24 per term summed, doubled)."""
  f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)  # noqa: E731
  q, k, w, s = f64(q8), f64(k8), f64(w), f64(ks)
  n, h, d = q.shape
  z = np.einsum("thn,th->tn", np.maximum(np.einsum("thd,nd->thn", q, k), 0), w) * s[None]
  mag = np.einsum("thn,th->tn", np.einsum("thd,nd->thn", np.abs(q), np.abs(k)), np.abs(w))
  tol = 2 * (h + d) * 2.0 ** -24 * mag * np.abs(s)[None]
  causal = np.arange(n)[None, :] <= np.arange(n)[:, None]
  return np.where(causal, z, -np.inf), tol


def assert_fp8_topk(idx, z, tol, positions=None, max_tied=0.05):
  """Every row of idx [Q, K] (-1 tail; query r at positions[r], default r) is the reference's
  top-K of z [N, N] (descending, ties to the lower index): indices equal where no two of the
  row's K + 1 best differ by less than their float32 tolerance (equal ones, such as ReLU's
  zeros, are exact on every path), else the same scores within it; near-tied rows at most
  `max_tied` of all."""
  idx = np.asarray(idx)
  rows, kk = idx.shape
  n = z.shape[1]
  positions = np.arange(rows) if positions is None else np.asarray(positions)
  tied = 0
  for r, t in enumerate(positions):
    order = np.lexsort((np.arange(n), -z[t]))[:min(kk, t + 1) + 1]
    want = order[:min(kk, t + 1)]
    got = idx[r][idx[r] >= 0]
    assert len(got) == len(want) and (idx[r][len(got):] == -1).all(), t
    live = order[np.isfinite(z[t, order])]
    gaps = -np.diff(z[t, live])
    if ((gaps == 0) | (gaps > tol[t, live[1:]] + tol[t, live[:-1]])).all():
      np.testing.assert_array_equal(got, want, err_msg=f"query {t}")
    else:
      tied += 1
      np.testing.assert_allclose(np.sort(z[t, got]), np.sort(z[t, want]), rtol=0,
                                 atol=2 * tol[t].max(), err_msg=f"query {t}")
  assert tied <= max_tied * rows, tied


@pytest.mark.parametrize("method,block,impl", [("ivf", 1, "xla"), ("ivf", 8, "xla"),
                                               ("hisa", 1, "xla"), ("hisa", 1, "pallas")])
def test_fp8_prefill_matches_float64_reference(method, block, impl, monkeypatch):
  """fp8 q and keys with (not power-of-two) per-key scales, every key a candidate (budget
  covering the sequence): each query's top-K is the float64 reference's of
  sum_h w relu(q . k) * k_scale, through the seals, the gathered candidates
  (`evaluate(k_scale=)`'s too), shared query blocks and HiSA's blocks; through the kernels
  (GPU interpret mode: representative scoring, the ranked-group walk, gathered scoring and the
  top-K) on HiSA's blocks."""
  monkeypatch.setenv("JAXSPARSE_INTERPRET", "gpu")
  q8, k8, w, ks = fp8_trace(pow2=False)
  n = k8.shape[0]
  cfg = dataclasses.replace(FP8_CFG, budget=n, query_block=block)
  idx, num = ivf.prefill_topk(q8, k8, w, cfg, method=method, k_scale=ks, implementation=impl)
  np.testing.assert_array_equal(np.asarray(num), np.arange(n) + 1)  # every visible key
  z, tol = fp8_reference(q8, k8, w, ks)
  assert_fp8_topk(idx, z, tol)
  if impl == "xla" and block == 1:
    pos = np.arange(0, n, 4)
    ev = ivf.evaluate(q8, k8, w, cfg, method=method, query_positions=pos, k_scale=ks)
    assert (ev["recall"] == 1).all()
    assert_fp8_topk(ev["topk_indices"], z, tol, pos)


def test_fp8_index_groups_the_dequantised_keys():
  """`prefill_inputs` splits the format: q and k to score upcast exactly to bfloat16, the keys
  the index groups dequantised (k * k_scale in float32; @ A under a grouping metric). With a
  real budget the fp8 prefill then gives exactly what float32 q and keys k * k_scale give
  (power-of-two scales: the dequantisation is exact and a scale after the head sum equals one
  inside it): the same groups, ranking and candidates."""
  from jaxsparse.ivf.prefill import prefill_inputs
  q8, k8, w, ks = fp8_trace()
  qd, kd = q8.astype(jnp.float32), k8.astype(jnp.float32) * ks[:, None]
  x = prefill_inputs(q8, k8, w, k_scale=ks)
  assert x.q.dtype == x.k.dtype == jnp.bfloat16 and x.index_keys.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(x.q, np.float32), np.asarray(qd))
  np.testing.assert_array_equal(np.asarray(x.k, np.float32), np.asarray(k8, np.float32))
  np.testing.assert_array_equal(np.asarray(x.index_keys), np.asarray(kd))
  a = np.diag(np.linspace(0.5, 2, k8.shape[1])).astype(np.float32)  # a grouping metric
  xm = prefill_inputs(q8, k8, w, k_scale=ks, metric=a)
  np.testing.assert_allclose(np.asarray(xm.index_keys), np.asarray(kd) @ a, rtol=1e-6)
  want = ivf.prefill_topk(qd, kd, w, FP8_CFG)
  got = ivf.prefill_topk(q8, k8, w, FP8_CFG, k_scale=ks)
  for g, r in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  assert (np.asarray(got[1]) < np.arange(FP8_N) + 1).any()  # the budget binds


def test_fp8_bad_inputs_name_the_argument():
  q8, k8, w, ks = fp8_trace(n=40)
  for call in (lambda **kw: ivf.prefill_topk(q8, k8, w, FP8_CFG, **kw),
               lambda **kw: ivf.evaluate(q8, k8, w, FP8_CFG, query_positions=[5], **kw)):
    with pytest.raises(ValueError, match="k_scale is required"):
      call()
    with pytest.raises(ValueError, match=r"k_scale.shape=\(39,\) must be \(40,\)"):
      call(k_scale=ks[:-1])
    with pytest.raises(ValueError, match="k_scale.dtype=bfloat16"):
      call(k_scale=ks.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="q.dtype=float8_e4m3fn needs k.dtype=float8_e4m3fn"):
    ivf.prefill_topk(q8, k8.astype(jnp.float32), w, FP8_CFG)

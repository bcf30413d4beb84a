"""AttentionIndex's Pallas kernels (GPU Triton and TPU Mosaic, interpret mode) against float64
numpy: the k-means assignment step, gathered-candidate scoring and representative scoring;
both lower for their platform; the whole prefill with the kernels equals the XLA path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import ivf
from jaxsparse.ivf import candidates
from pallas_kernels import ivf as kivf
from pallas_kernels._platform import KernelPlatform
from tests.conftest import assert_scores_close, export_for

PLATFORMS = [KernelPlatform("gpu", True), KernelPlatform("tpu", True)]
IDS = ["gpu", "tpu"]


@pytest.mark.parametrize("platform", PLATFORMS, ids=IDS)
@pytest.mark.parametrize("m,g,d", [(300, 70, 32), (17, 5, 16), (1000, 300, 64)])
def test_assignment_matches_numpy(platform, m, g, d):
  """Nearest used center (ties to the lower id), its squared distance and the second
  smallest: distances within float32 rounding of |x|^2 - 2 x.c + |c|^2 (relative to the
  norms), and the assignment exact wherever the two nearest are farther apart than that."""
  rng = np.random.default_rng(m + g)
  # bf16 keys and centers (the compact index on a GPU: a bf16 dot) at one shape
  dtype = jnp.bfloat16 if m == 1000 else jnp.float32
  x = np.array(jnp.asarray(rng.standard_normal((m, d)), dtype).astype(jnp.float32))
  c = np.array(jnp.asarray(rng.standard_normal((g, d)), dtype).astype(jnp.float32))
  c[1] = c[0]  # a tie: the lower id wins
  used = rng.random(g) < 0.8
  used[:2] = True
  dd = ((x[:, None].astype(np.float64) - c[None]) ** 2).sum(-1)
  dd[:, ~used] = np.inf
  srt = np.sort(dd, 1)
  a, d1, d2 = (np.asarray(t) for t in kivf.assign_nearest(
      jnp.asarray(x, dtype), jnp.asarray(c, dtype), jnp.asarray(used), platform=platform))
  scale = (x ** 2).sum(1) + (c[used] ** 2).sum(1).max()
  tol = 8 * 2.0 ** -24 * d * scale
  np.testing.assert_array_less(np.abs(d1 - srt[:, 0]), tol)
  np.testing.assert_array_less(np.abs(d2 - srt[:, 1]), tol)
  clear = srt[:, 1] - srt[:, 0] > 2 * tol
  np.testing.assert_array_equal(a[clear], dd.argmin(1)[clear])
  assert used[a].all() and 1 not in a  # center 1 ties with 0: never chosen


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("platform", PLATFORMS, ids=IDS)
def test_gathered_and_representative_scores_match_numpy(platform, dtype):
  """Scores of gathered candidates (ids with -1 holes, repeated ids, S not a multiple of the
  block; on a GPU with few queries split into two runs a query, with many one run of two
  blocks) and of representatives (invalid ones -inf), to float32 accumulation error. bf16
  inputs are exact in the products (the GPU scores them as bf16)."""
  rng = np.random.default_rng(4)
  h, d, n, s, g = 8, 32, 400, 200, 37
  cfg = kivf.IVFKernelConfig(gather_min_programs=16)
  for nq in ((5, 16) if platform.kind == "gpu" else (5,)):  # the split rule is the GPU's
    q = np.asarray(jnp.asarray(rng.standard_normal((nq, h, d)), dtype).astype(jnp.float32))
    w = rng.uniform(0, 1, (nq, h)).astype(np.float32)
    k = np.asarray(jnp.asarray(rng.standard_normal((n, d)), dtype).astype(jnp.float32))
    idx = rng.integers(-1, n, (nq, s)).astype(np.int32)
    idx[0, :10] = 7
    want = np.einsum("qh,qhs->qs", w.astype(np.float64), np.maximum(
        np.einsum("qhd,qsd->qhs", q.astype(np.float64), k[np.maximum(idx, 0)]), 0))
    want[idx < 0] = -np.inf
    got = kivf.gathered_scores(jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(k, dtype),
                               jnp.asarray(idx), platform=platform, config=cfg)
    assert_scores_close(got, want, reduction=h * d)
  reps = rng.standard_normal((g, d)).astype(np.float32)
  valid = rng.random((nq, g)) < 0.7
  want = np.einsum("qh,qhg->qg", w.astype(np.float64), np.maximum(
      np.einsum("qhd,gd->qhg", q.astype(np.float64), reps), 0))
  want[~valid] = -np.inf
  got = kivf.representative_scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(reps),
                                   jnp.asarray(valid), platform=platform)
  # the prefill kernel's float32 dots are TF32 on a GPU (2^-11 per operand; the H200 measured
  # 1.9e-4 here), enough to rank groups; interpreted they are exact float32
  tf32 = platform.kind == "gpu" and not platform.interpret
  assert_scores_close(got, want, reduction=h * d, dtype_tol=2e-3 if tf32 else None)
  # bf16 queries: the representatives are rounded to bf16, products then exact
  qb = jnp.asarray(q, jnp.bfloat16)
  rb = np.asarray(jnp.asarray(reps, jnp.bfloat16).astype(jnp.float32), np.float64)
  want = np.einsum("qh,qhg->qg", w.astype(np.float64), np.maximum(
      np.einsum("qhd,gd->qhg", np.asarray(qb.astype(jnp.float32), np.float64), rb), 0))
  want[~valid] = -np.inf
  got = kivf.representative_scores(qb, jnp.asarray(w), jnp.asarray(reps), jnp.asarray(valid),
                                   platform=platform)
  assert_scores_close(got, want, reduction=h * d)


@pytest.mark.parametrize("kind,plat", [("gpu", "cuda"), ("tpu", "tpu")])
def test_ivf_kernels_lower(kind, plat):
  S = jax.ShapeDtypeStruct
  p = KernelPlatform(kind, False)
  export_for(lambda x, c, u: kivf.assign_nearest(x, c, u, platform=p), plat,
             S((4096, 128), jnp.float32), S((512, 128), jnp.float32), S((512,), jnp.bool_))
  export_for(lambda q, w, k, i: kivf.gathered_scores(q, w, k, i, platform=p), plat,
             S((256, 64, 128), jnp.bfloat16), S((256, 64), jnp.float32),
             S((65536, 128), jnp.bfloat16), S((256, 4096), jnp.int32))
  if kind == "gpu":
    i32 = lambda *sh: S(sh, jnp.int32)
    export_for(lambda q, w, k, m, a, b, c, u: kivf.ranked_scores(
        q, w, k, m, a, b, c, u, slots=24560, platform=p), plat,
        S((256, 64, 128), jnp.bfloat16), S((256, 64), jnp.float32),
        S((65536, 128), jnp.bfloat16), i32(65536), i32(256, 520), i32(256, 520),
        i32(256, 520), i32(256))
  export_for(lambda q, w, r, v: kivf.representative_scores(q, w, r, v, platform=p), plat,
             S((256, 64, 128), jnp.bfloat16), S((256, 64), jnp.float32),
             S((512, 128), jnp.float32), S((256, 512), jnp.bool_))


# A grouping metric changes the kernels' inputs (keys mapped before the assignment kernel,
# ranking queries before the representative kernel), not which kernels run: the GPU case
# covers that plumbing, and ("tpu", "ivf", 1, False) runs each TPU kernel of the prefill (a
# mapped TPU case took 23 s more of interpret-mode DMAs, one per gathered key, for no path
# of its own).
@pytest.mark.parametrize("kind,method,block,mapped", [
    ("gpu", "ivf", 1, False), ("tpu", "ivf", 1, False), ("gpu", "hisa", 1, False),
    ("gpu", "ivf", 8, False), ("tpu", "ivf", 16, False), ("gpu", "ivf", 1, True)])
def test_prefill_with_kernels_equals_xla(kind, method, block, mapped, monkeypatch):
  """`ivf.prefill_topk(implementation="pallas")` (seals, refits, representative and candidate
  scoring through the kernels, interpret mode) gives the XLA path's top-K, and its candidate
  counts, on clustered keys; HiSA's blocks through the same kernels too; shared query blocks
  through the dense prefill scoring kernel; and under a grouping metric (mapped keys through the
  assignment kernel, mapped queries through the representative kernel)."""
  monkeypatch.setenv("JAXSPARSE_INTERPRET", kind)
  rng = np.random.default_rng(1)
  # TPU interpret mode models each DMA: a shorter sequence, still seals, a refit and a tail
  n, h, d = (400, 2, 16) if kind == "gpu" else (100, 2, 16)
  k = (rng.standard_normal((6, d))[rng.integers(0, 6, n)]
       + 0.3 * rng.standard_normal((n, d))).astype(np.float32)
  q = rng.standard_normal((n, h, d)).astype(np.float32)
  w = rng.uniform(0, 1, (n, h)).astype(np.float32)
  cfg = (ivf.IVFConfig(topk=16, budget=120, seal_window=64, cluster_size=16, refit_interval=128,
                       sink=4, query_block=block) if kind == "gpu" else
         ivf.IVFConfig(topk=16, budget=60, seal_window=32, cluster_size=8, refit_interval=64,
                       sink=4, query_block=block))
  extra = {}
  if mapped:
    from jaxsparse.ivf import metric
    a = metric.fit(rng.standard_normal((n, h, d)) * np.linspace(0.3, 2, d),
                   k, rng.uniform(0, 1, (n, h)))
    extra = dict(metric=a)
  want = ivf.prefill_topk(q, k, w, cfg, method=method, implementation="xla", **extra)
  got = ivf.prefill_topk(q, k, w, cfg, method=method, implementation="pallas", **extra)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_ranked_group_walk_scores_the_packed_candidates(dtype, platform=PLATFORMS[0]):
  """The GPU kernel that walks each query's ranked groups through the inverted lists fills
  exactly `candidate_indices`' grouped slots (ids and order), scored to float32 accumulation
  error against float64 numpy: ragged groups, empty groups, the last group cut, a query with
  no room, and room beyond every group."""
  rng = np.random.default_rng(7)
  nq, h, d, n, g = 6, 8, 32, 500, 40
  k = np.asarray(jnp.asarray(rng.standard_normal((n, d)), dtype).astype(jnp.float32))
  q = np.asarray(jnp.asarray(rng.standard_normal((nq, h, d)), dtype).astype(jnp.float32))
  w = rng.uniform(0, 1, (nq, h)).astype(np.float32)
  assign = rng.integers(-1, g, n).astype(np.int32)
  assign[assign == 3] = -1  # an empty group
  sizes = np.bincount(assign[assign >= 0], minlength=g).astype(np.int32)
  members, offsets = ivf.inverted_lists(jnp.asarray(assign), g)
  gs = rng.standard_normal((nq, g)).astype(np.float32)
  gs[1, ::3] = -np.inf
  gs[3, 5:] = -np.inf  # five groups: fewer members than the room
  room = jnp.asarray([150, 37, 0, 300, 64, 200], jnp.int32)
  slots = 300
  start, take, slot, used = candidates.ranked_groups(jnp.asarray(gs), jnp.asarray(sizes), offsets,
                                              room)
  z, ids = kivf.ranked_scores(jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(k, dtype),
                              members, start, take, slot, used, slots=slots, platform=platform,
                              config=kivf.IVFKernelConfig(group_block=16))
  # the reference: every usable group's members by position, groups in rank order (ties to
  # the lower id), cut at the room
  want_ids = []
  for i in range(nq):
    order = sorted(range(g), key=lambda j: (-gs[i, j], j))
    row = []
    for j in order:
      if np.isfinite(gs[i, j]):
        row += list(np.nonzero(assign == j)[0])
    row = row[:min(int(room[i]), slots)]
    want_ids.append(row + [-1] * (slots - len(row)))
  want_ids = np.asarray(want_ids)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  want = np.einsum("qh,qhs->qs", w.astype(np.float64), np.maximum(
      np.einsum("qhd,qsd->qhs", q.astype(np.float64), k[np.maximum(want_ids, 0)]), 0))
  want[want_ids < 0] = -np.inf
  assert_scores_close(z, want, reduction=h * d)

"""Exact top-K: reference and threshold-filter kernels (GPU and TPU interpret) against numpy."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxsparse
from jaxsparse.backend import KernelPlatform
from pallas_kernels import topk as ktopk
from pallas_kernels._util import next_pow2
from pallas_kernels.topk._tuning import TUNING, Tuning
from tests.conftest import export_for, topk_options
from tests.reference import index_ordered, np_topk, random_paged

PLATFORMS = [KernelPlatform("gpu", True), KernelPlatform("tpu", True)]
IDS = ["gpu", "tpu"]


def _rows(x, lens, k, platform, config=ktopk.TopkConfig(), tuning=TUNING):
  return ktopk.topk_rows(jnp.asarray(x), jnp.asarray(lens, jnp.int32), k, config, platform,
                         tuning=tuning)


def _check(out, x, k, lens):
  rv, ri = np_topk(x, k, lens)
  np.testing.assert_array_equal(np.asarray(out[1]), ri)
  np.testing.assert_array_equal(np.asarray(out[0]), rv)


# Every size on the GPU interpreter; on the TPU's all but the largest. (70000, 256) is the TPU's
# large case: it takes every pass (group maxima, exact threshold, compaction, bitonic finish)
# with a 512-entry buffer of 4 lane rows, so the network's row rotations run too; at (262144,
# 4096) the TPU runs the same kernels, only a longer network over a 64-row buffer, and it cost
# 30 s of interpret-mode DMAs. The GPU's (262144, 4096) stays: the only default-tuning case
# here of the split bitonic finish with its middle kernel and the rank merge (k >= 1024).
@pytest.mark.parametrize("n,k,platform", [
    (n, k, p) for n, k in [(70000, 256), (20000, 64), (4096, 100), (65536, 2), (262144, 4096)]
    for p in PLATFORMS if p.kind == "gpu" or k < 4096],
    ids=lambda v: v.kind if isinstance(v, KernelPlatform) else str(v))
def test_random_rows_ragged(platform, n, k):
  rng = np.random.default_rng(n + k)
  x = rng.standard_normal((4, n)).astype(np.float32)
  lens = np.array([n, n // 2 + 3, 1, 0])
  _check(_rows(x, lens, k, platform), x, k, lens)


@pytest.mark.parametrize("platform", PLATFORMS, ids=IDS)
def test_heavy_ties_and_special_values(platform):
  rng = np.random.default_rng(1)
  n, k = 65536, 128
  x = rng.integers(0, 4, (4, n)).astype(np.float32)  # massive ties: falls back, still exact
  x[1] = rng.standard_normal(n)
  x[1, ::7] = np.nan
  x[2] = -np.inf
  x[3] = rng.standard_normal(n)
  x[3, 1000:1300] = 9.0  # ties at the top, in index order
  lens = np.full(4, n)
  _check(_rows(x, lens, k, platform), x, k, lens)


@pytest.mark.parametrize("platform", PLATFORMS, ids=IDS)
def test_overflow_falls_back_exactly(platform):
  """More candidates than the buffer holds (structured rows): the full-sort path is exact."""
  n, k = 65536, 64
  x = np.tile(np.arange(64, dtype=np.float32), n // 64)[None].repeat(2, 0)
  lens = np.array([n, n - 5])
  _check(_rows(x, lens, k, platform, ktopk.TopkConfig(capacity_factor=1)), x, k, lens)


def test_overflow_repair_mixed_rows_gpu_kernel():
  """GPU path: overflowing rows (ties across the k-th value, negative values, -0.0, NaN,
  -inf, ragged) are redone by the repair kernel while ordinary rows in the same call are
  left as the filter found them; no lax.cond involved."""
  rng = np.random.default_rng(4)
  n, k = 16384, 64
  x = rng.standard_normal((5, n)).astype(np.float32)
  x[0] = np.tile(np.arange(64, dtype=np.float32), n // 64) - 40.0  # overflow, ties at k-th
  x[1] = -np.round(np.abs(rng.standard_normal(n)) * 2) / 2  # overflow, all <= 0 with -0.0
  x[1, ::5] = -0.0
  x[1, 3::11] = np.nan
  x[1, 7::13] = -np.inf
  x[3] = np.repeat(np.arange(n // 256, dtype=np.float32), 256)  # sorted runs: overflow
  lens = np.array([n, n - 9, n // 3, 5000, 40])
  plat = KernelPlatform("gpu", True)
  _check(_rows(x, lens, k, plat, ktopk.TopkConfig(capacity_factor=1)), x, k, lens)


def test_finishes_repair_overflowing_rows():
  """The rank finish (with preloads and a loop, blocks of 8, two value buckets) and the split
  bitonic finish (with and without a middle merge kernel, and with the rank merge: runs sorted
  descending, entries placed by binary searches), GPU kernels in interpret mode: no repair
  kernel; the finish repairs overflowing rows itself (ties across the k-th value, all-equal
  runs, a group list longer than the buffer, next to ordinary, ragged and empty rows), for
  every compaction ("scan", "lane", gathered); SPIN's block map through the repairing merge;
  the rank finish on candidates in any order against numpy; the bucketed compaction puts each
  candidate in its bucket."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(18)
  n, k = 16384, 64
  x = rng.standard_normal((6, n)).astype(np.float32)
  x[0] = np.tile(np.arange(64, dtype=np.float32), n // 64) - 40.0  # overflow, ties at k-th
  x[1, ::5] = -0.0
  x[1, 3::11] = np.nan
  x[3] = np.repeat(np.arange(n // 256, dtype=np.float32), 256)  # sorted runs: overflow
  x[4] = -5.0
  x[4, :4000] = 1.0  # many groups reach the threshold: the group list overflows
  lens = np.array([n, n - 9, n // 3, 5000, n, 0])
  plat = KernelPlatform("gpu", True)
  base = dict(capacity_factor=1)
  for extra in (dict(finish="rank", rank_buckets=False, rank_block_j=16),  # loads, then a loop
                dict(finish="rank", rank_buckets=False, rank_block_j=16, rank_preload=1),
                dict(finish="rank", rank_buckets=False, gather=True, compact="lane"),
                dict(finish="rank", rank_buckets=False, compact="lane"),
                dict(finish="rank", rank_buckets=True, rank_buckets_min_k=64, rank_block_j=16),
                dict(finish="rank", rank_buckets=True, rank_buckets_min_k=64, rank_block_i=8),
                dict(finish="bitonic", bitonic_run=16),
                dict(finish="bitonic", bitonic_run=16, bitonic_mid=32, compact="lane"),
                dict(finish="bitonic", bitonic_run=16, bitonic_mid=32, gather=True),
                dict(finish="bitonic", bitonic_run=16, bitonic_rank_merge=16),
                dict(finish="bitonic", bitonic_run=32, bitonic_rank_merge=16,
                     compact="lane")):
    _check(_rows(x, lens, k, plat, *topk_options(**base, **extra)), x, k, lens)
  # block-mapped rows (SPIN) through the repairing merge, and through the rank merge
  sel = np.stack([rng.permutation(64)[:n // 256] for _ in range(6)]).astype(np.int32)
  sel[2, 3] = -1
  rv, ri = np_topk(x, k, lens)
  want = np.where(ri >= 0, np.take_along_axis(sel, np.maximum(ri, 0) // 256, 1) * 256
                  + np.maximum(ri, 0) % 256, -1)
  for extra in (dict(bitonic_mid=32), dict(bitonic_rank_merge=16)):
    cfg, tun = topk_options(**base, finish="bitonic", bitonic_run=16, **extra)
    v, i = ktopk.topk_rows(jnp.asarray(x), jnp.asarray(lens, jnp.int32), k, cfg, plat,
                           block_map=(jnp.asarray(sel), 256), tuning=tun)
    np.testing.assert_array_equal(np.asarray(v), rv)
    np.testing.assert_array_equal(np.asarray(i), np.where(want < 0, -1, want))
  # the rank finish alone on candidates in any order (ties broken by index), against numpy
  cap = 256
  cv = rng.standard_normal((3, 2 * cap)).astype(np.float32)
  cv[0, :90] = 1.0  # ties, broken by index
  cv[2, 5] = -np.inf
  ci = np.stack([rng.permutation(2 * cap) for _ in range(3)]).astype(np.int32)
  args = (jnp.asarray(cv), jnp.asarray(ci), jnp.asarray([200, 60, 256], jnp.int32), 100, cap)
  live = [200, 60, 256]
  order = np.argsort(ci, axis=1)  # the candidates by index: numpy's row order
  by_index = np.full((3, 2 * cap), -np.inf, np.float32)
  for r in range(3):
    keep = order[r][np.isin(order[r], np.arange(live[r]))]
    by_index[r, ci[r, keep]] = cv[r, keep]
  wv, wi = np_topk(by_index, 100)
  for kw in (dict(), dict(preload=1), dict(block_i=8)):
    got = kg.rank_finish(*args, **{"block_i": 16, "block_j": 64, **kw}, interpret=True)
    np.testing.assert_array_equal(np.asarray(got[0]), wv)
    np.testing.assert_array_equal(np.asarray(got[1]), wi)
  assert np.asarray(got[1])[1, 60:].tolist() == [-1] * 40  # fewer live than k: the tail
  with pytest.raises(ValueError, match="mid=64"):
    kg.bitonic_finish_split(*args, run=64, mid=64, interpret=True)
  with pytest.raises(ValueError, match="live"):
    kg.bitonic_finish_split(*args[:2], jnp.zeros((3, 5), jnp.int32), 100, cap, run=64,
                            interpret=True)
  assert Tuning(bitonic_mid=2048).mid_for(4096) == 2048
  assert Tuning(bitonic_mid=512).mid_for(4096) == 0  # not above the run
  # two value buckets: the pivot splits the candidates, the upper ones fill the front
  xb = jnp.asarray(x[:3])
  gm = kg.group_max(xb, None, chunk=256, group=16, num_warps=4, interpret=True)
  thr, ctr, piv = kg.threshold(gm, k, iters=14, num_warps=4, interpret=True,
                               counter=jnp.float32, slack=8, pivot=True)
  bv, bi_, bc = kg.compact_atomic(xb, None, thr, capacity=512, chunk=256, num_warps=4,
                                  interpret=True, counter=ctr, pivot=piv)
  for r in (1, 2):  # (row 0's values tie at the pivot's either side)
    up, low = int(bc[r, 1]), int(bc[r, 2])
    assert int(bc[r, 0]) == 0 and up > 0 and low > 0
    cand = x[r] >= float(thr[r])
    assert up == int((cand & (x[r] >= float(piv[r]))).sum()) and up + low == int(cand.sum())
    assert np.all(np.asarray(bv[r, :up]) >= float(piv[r]))
    assert np.all(np.asarray(bv[r, 512 - low:512]) < float(piv[r]))
    assert sorted(np.asarray(bi_[r, :up]).tolist() + np.asarray(
        bi_[r, 512 - low:512]).tolist()) == np.flatnonzero(cand).tolist()
  with pytest.raises(ValueError, match="pivot="):
    kg.compact_atomic(xb, None, thr, capacity=256, chunk=256, num_warps=4, interpret=True,
                      pivot=piv, placement="lane")
  with pytest.raises(ValueError, match="16 bits"):  # a chunk's packed counts
    kg.compact_atomic(xb, None, thr, capacity=256, chunk=1 << 16, num_warps=4, interpret=True,
                      pivot=piv)
  with pytest.raises(ValueError, match="buckets=True"):
    kg.rank_finish(*args, interpret=True, buckets=True)
  cfg = ktopk.TopkConfig()
  assert not Tuning(rank_buckets=True).buckets_for(ktopk.TopkConfig(gather=True), "rank", 1,
                                                   1 << 15, 64, 128)
  # the defaults bucket one row's rank finish from k = rank_buckets_min_k (1024) on
  assert TUNING.buckets_for(cfg, "rank", 1, 1 << 15, 2048, 4096)
  assert not TUNING.buckets_for(cfg, "rank", 1, 1 << 15, 512, 1024)
  assert not TUNING.buckets_for(cfg, "bitonic", 8, 1 << 15, 2048, 4096)
  assert not TUNING.buckets_for(cfg, "rank", 1, (1 << 24) + 4096, 2048, 4096)
  # the falsi search's slack admits ~falsi_slack_entries extra entries: more maxima for
  # small groups, never fewer than falsi_slack; bisection has none
  assert [TUNING.slack_for(cfg, g) for g in (4, 8, 16, 256)] == [256, 128, 64, 64]
  assert Tuning(falsi_slack_entries=0).slack_for(cfg, 4) == 64
  assert TUNING.slack_for(ktopk.TopkConfig(threshold="bisect"), 4) == 0
  for bad in (dict(bitonic_mid=3), dict(rank_preload=-1), dict(rank_block_i=4),
              dict(rank_buckets=1), dict(rank_buckets_min_k=0),
              dict(falsi_slack_entries=-1), dict(bitonic_rank_merge=8),
              dict(rank_merge_warps=0), dict(rank_merge_max_rows=-1), dict(rank_merge_min_k=0),
              dict(rank_merge_run_warps=0), dict(compact="rows"), dict(finish="persistent")):
    with pytest.raises(ValueError, match=next(iter(bad))):
      topk_options(**bad)
  # the rank merge: at most rank_merge_max_rows rows, k >= rank_merge_min_k, <= the run
  assert (TUNING.rank_merge_for(8, 2048), TUNING.rank_merge_for(9, 2048),
          TUNING.rank_merge_for(8, 512)) == (32, 0, 0)
  assert Tuning(bitonic_rank_merge=1024).rank_merge_for(2, 1024) == 512
  # its run-sorting programs take rank_merge_run_warps; elsewhere bitonic_run_warps
  assert (TUNING.run_warps_for(8, 2048), TUNING.run_warps_for(9, 2048),
          TUNING.run_warps_for(8, 512)) == (8, 4, 4)


# (20000, 100): a small buffer (256, runs of 64 split it in four), k not a power of two, rows
# not a whole number of chunks (it stands for the former (20000, 64) and (4096, 100), which
# took the same kernels); (65536, 512): the default split bitonic finish (runs of 512 in a
# 1024 buffer); (3000, 2048): too few groups for the filter, the direct sort.
@pytest.mark.parametrize("n,k", [(20000, 100), (65536, 512), (3000, 2048)])
def test_rank_finish_matches_numpy(n, k):
  """The rank-counting and bitonic finishes (GPU kernels, interpret; both after the one-pass
  atomic compaction): ties by index, overflow rows after the repair, fewer valid entries than
  k, -0.0, NaN and -inf."""
  rng = np.random.default_rng(n + k)
  x = rng.standard_normal((5, n)).astype(np.float32)
  x[1] = np.round(x[1])  # heavy ties: overflow, repaired, then ranked
  x[2, : n // 4] = 1.5
  x[3, ::3] = np.nan
  x[3, 1::3] = -np.inf
  x[4, ::2] = -0.0
  lens = np.array([n, n // 2 + 3, n, n, 7])
  plat = KernelPlatform("gpu", True)
  # finish="auto" picks the bitonic finish for these 5 rows (the rank finish is one row's):
  # the same kernels as finish="bitonic", so checked as that choice, not compiled twice
  assert TUNING.finish_for(ktopk.TopkConfig(finish="auto"), 5, k) == "bitonic"
  for opts in (dict(finish="rank"), dict(finish="bitonic"), dict(bitonic_run=64)):
    _check(_rows(x, lens, k, plat, *topk_options(**opts)), x, k, lens)
  with pytest.raises(ValueError, match="finish"):
    ktopk.TopkConfig(finish="radix")
  with pytest.raises(ValueError, match="bitonic_warps"):
    Tuning(bitonic_warps=0)


def test_auto_finish_ranks_single_rows():
  """finish="auto" (the default) sorts one row at k >= 512 by counting and everything else
  with the bitonic network; calls of at most 2**18 scores filter in chunks of 512; the
  single-row path (regula falsi threshold, chunks of 512, or 1024 where the compaction
  fills value buckets from 2**16 scores, rank finish) matches numpy (interpret), ties
  included."""
  cfg = ktopk.TopkConfig()
  assert [TUNING.finish_for(cfg, r, k) for r, k in ((1, 2048), (1, 1024), (1, 512), (1, 256),
                                                   (2, 2048))] == [
      "rank", "rank", "rank", "bitonic", "bitonic"]
  assert TUNING.finish_for(ktopk.TopkConfig(finish="sort"), 1, 2048) == "sort"
  assert [TUNING.chunk_for(r, n) for r, n in ((1, 1 << 17), (8, 1 << 15), (1, 1 << 19),
                                              (64, 1 << 17))] == [512, 512, 2048, 2048]
  assert Tuning(small_chunk_entries=0).chunk_for(1, 1024) == 2048
  # the bucketed compaction (one row, k >= 1024) of a small call from 2**16 scores reads
  # chunks of 1024
  assert [TUNING.chunk_for(1, n, buckets=True) for n in (1 << 15, 1 << 16, 1 << 17, 1 << 20)
          ] == [512, 1024, 1024, 2048]
  assert Tuning(bucket_chunk=0).chunk_for(1, 1 << 17, buckets=True) == 512
  assert [ktopk.gpu_chunk(cfg, r, n, k, ktopk.group_size(n, k, cfg, "gpu", rows=r),
                          TUNING.finish_for(cfg, r, k))
          for r, n, k in ((1, 1 << 17, 2048), (1, 1 << 17, 512), (8, 1 << 15, 2048),
                          (1, 20000, 1024))] == [(1024, True), (512, False), (512, False),
                                                 (512, True)]
  for bad in (dict(small_chunk=100), dict(small_chunk_entries=-1), dict(bucket_chunk=100),
              dict(bucket_chunk_min_entries=-1)):
    with pytest.raises(ValueError, match=next(iter(bad))):
      Tuning(**bad)
  rng = np.random.default_rng(7)
  x = np.round(rng.standard_normal((1, 20000)) * 8).astype(np.float32)
  for lens in (np.array([20000]), np.array([777])):
    for k in (1024, 512):
      _check(_rows(x, lens, k, KernelPlatform("gpu", True)), x, k, lens)
    # value buckets in chunks of 1024 (bucket_chunk, here below its 2**16 scores)
    _check(_rows(x, lens, 1024, KernelPlatform("gpu", True), cfg,
                 Tuning(bucket_chunk_min_entries=0)), x, 1024, lens)


def test_large_groups():
  """TopkConfig.max_group: groups past 64 entries on GPU for calls of at most 8 rows (TPU
  stays at 64; groups whose maxima another kernel emits tile its tiles, `fused_groups`), and
  a long row with groups of 256 matches numpy (interpret)."""
  cfg = ktopk.TopkConfig(max_group=256)
  assert ktopk.group_size(1 << 20, 512, cfg, "gpu", rows=8) == 256
  assert ktopk.group_size(1 << 20, 512, cfg, "gpu", rows=9) == 64  # max_group_rows
  assert ktopk.group_size(1 << 20, 512, ktopk.TopkConfig(max_group=64), "gpu", rows=1) == 64
  assert ktopk.group_size(1 << 20, 512, cfg, "tpu", rows=1) == 64
  with pytest.raises(ValueError, match="max_group"):
    ktopk.TopkConfig(max_group=96)
  # groups that another kernel emits (decode scoring steps, SPIN blocks) must tile its tiles
  assert ktopk.fused_groups(cfg, 128).max_group == 64
  assert ktopk.fused_groups(cfg, 48).max_group == 16
  assert ktopk.group_size(1 << 20, 512, ktopk.fused_groups(cfg, 128), "gpu", rows=1) == 64
  rng = np.random.default_rng(3)
  n, k = 1 << 18, 128
  assert ktopk.group_size(n, k, cfg, "gpu", rows=1) == 256
  x = rng.standard_normal((1, n)).astype(np.float32)
  x[0, 1000:1300] = 9.0  # ties across the threshold
  for lens in (np.array([n]), np.array([n - 5000])):
    _check(_rows(x, lens, k, KernelPlatform("gpu", True), cfg), x, k, lens)


@pytest.mark.parametrize("cap,k,block_i,block_j", [(64, 16, 16, 16), (256, 100, 32, 64),
                                                   (1024, 512, 64, 256)])
def test_rank_finish_tiles(cap, k, block_i, block_j):
  """`rank_finish` alone (interpret): candidates in any slot order with heavy ties (by index),
  -inf slots, rows whose live count is 0, under k, at cap and not a multiple of a tile (the
  place kernel masks the partial counts of dead tiles), and the -inf / -1 tail."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(cap)
  live = np.array([cap * 5 // 8, cap, 0, k - 1, k + 1])
  v = rng.integers(0, 20, (5, cap)).astype(np.float32)
  v[0, 3] = v[1, 5] = -np.inf
  i = np.stack([rng.permutation(cap * 3)[:cap] for _ in range(5)]).astype(np.int32)
  vo, io = kg.rank_finish(jnp.asarray(v), jnp.asarray(i), jnp.asarray(live, jnp.int32), k, cap,
                          block_i=block_i, block_j=block_j, interpret=True)
  for r in range(5):
    got = sorted((-v[r, j], i[r, j]) for j in range(live[r]) if v[r, j] > -np.inf)[:k]
    want_v = [-a for a, _ in got] + [-np.inf] * (k - len(got))
    want_i = [b for _, b in got] + [-1] * (k - len(got))
    np.testing.assert_array_equal(np.asarray(vo[r]), np.array(want_v, np.float32))
    np.testing.assert_array_equal(np.asarray(io[r]), np.array(want_i))


@pytest.mark.parametrize("run", [0, 512])
def test_compactions_and_finishes(run):
  """Both compaction kernels (the one-pass atomic one before the bitonic finish, single or
  split into runs, and the count-then-compact one before the index-order set), same results
  as numpy: ties by index, NaN, -0.0, ragged and empty rows, an overflowing (repaired) row,
  and a chunk shorter than the default (reading only groups that reach the threshold)."""
  rng = np.random.default_rng(run)
  n, k = 30000, 256
  x = rng.standard_normal((5, n)).astype(np.float32)
  x[1] = np.round(x[1])  # heavy ties: overflow, repaired
  x[2, ::5] = np.nan
  x[3, ::2] = -0.0
  lens = np.array([n, n // 2 + 3, n, n, 0])
  plat = KernelPlatform("gpu", True)
  for cfg, tun in (topk_options(bitonic_run=run),
                   topk_options(bitonic_run=run, compact="lane"),
                   topk_options(bitonic_run=run, chunk=512)):
    _check(_rows(x, lens, k, plat, cfg, tun), x, k, lens)
    v, i = ktopk.topk_rows(jnp.asarray(x), jnp.asarray(lens, jnp.int32), k, cfg, plat,
                           ordered=False, tuning=tun)
    rv, ri = index_ordered(*np_topk(x, k, lens))
    np.testing.assert_array_equal(np.asarray(i), ri)
    np.testing.assert_array_equal(np.asarray(v), rv)
  with pytest.raises(ValueError, match="bitonic_run"):
    Tuning(bitonic_run=-4)
  with pytest.raises(ValueError, match="compact"):
    ktopk.TopkConfig(compact="warp")
  auto = ktopk.TopkConfig()  # "lane" only for many long rows, never past 2**24 entries
  assert TUNING.placement(auto, 64, 1 << 19, 2048) == "lane"
  assert TUNING.placement(auto, 64, 1 << 17, 2048) == "scan"
  assert TUNING.placement(auto, 1, 1 << 20, 2048) == "scan"
  assert TUNING.placement(auto, 64, 1 << 25, 512) == "scan"
  assert TUNING.placement(ktopk.TopkConfig(compact="lane"), 1, 1 << 20, 2048) == "lane"
  from pallas_kernels.topk import gpu as kg
  with pytest.raises(ValueError, match="run=8"):
    kg.bitonic_finish_split(jnp.zeros((1, 8)), jnp.zeros((1, 8), jnp.int32),
                            jnp.ones((1,), jnp.int32), 4, 8, run=8, interpret=True)



@pytest.mark.parametrize("k", [1, 100])
def test_repair_finds_the_kth_key_digit_by_digit(k):
  """Rows that all overflow a one-k buffer (random walks: runs of near-equal scores; integer
  ties; all negative; a few ulps apart, so the last digit decides; one finite entry past the
  k-th) go through the exact repair, whose search takes the k-th key four bits a sweep: every
  row matches numpy."""
  rng = np.random.default_rng(k)
  n = 8192
  x = np.cumsum(rng.standard_normal((6, n)), axis=1).astype(np.float32)
  x[1] = np.round(x[1])
  x[2] = -np.abs(x[2]) - 1e-3
  x[3, :] = -np.inf
  x[3, : k + 5] = rng.standard_normal(k + 5)
  # values a few ulps apart: the k-th key differs from its neighbours in the last bits only
  x[4] = (np.float32(1.5).view(np.int32) + rng.integers(0, 37, n)).astype(np.int32).view(
      np.float32)
  lens = np.array([n, n, n - 7, n, n, k + 1])
  for gather in (False, True):
    opts = topk_options(capacity_factor=1, gather=gather, refine_edges=0)
    _check(_rows(x, lens, k, KernelPlatform("gpu", True), *opts), x, k, lens)

def test_gather_compaction_lists_groups_and_overflows():
  """TopkConfig(gather=True), GPU kernels in interpret mode: the threshold kernel lists, in
  ascending order, exactly the groups whose maximum reaches the threshold; a row listing more
  groups than the buffer holds starts its counter past the capacity (the repair kernel then
  redoes it), and a row with few groups but many candidates in them overflows through the
  count; both match numpy, alongside ordinary and ragged rows, for every placement."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(21)
  n, k = 16384, 64
  g = ktopk.group_size(n, k, ktopk.TopkConfig(), "gpu", rows=5)
  cap = 2 * k
  x = rng.standard_normal((5, n)).astype(np.float32)
  x[1] = np.repeat(np.arange(n // g) % 3 > 0, g).astype(np.float32)  # 2 of 3 groups tie at 1
  x[1, ::5] = -0.0
  x[2, :] = -5.0
  x[2, : 70 * g] = 1.0  # 70 groups (>= k), 70 * g > cap candidates
  x[3, ::3] = np.nan
  lens = np.array([n, n, n, n, n // 2 + 1])
  gm = kg.group_max(jnp.asarray(x), jnp.asarray(lens, jnp.int32), chunk=2048, group=g,
                    num_warps=4, interpret=True)
  thr, ctr, glist, nl = kg.threshold(gm, k, iters=14, num_warps=8, interpret=True,
                                     counter=jnp.int32, list_width=cap)
  gm, thr, nl, glist, ctr = map(np.asarray, (gm, thr, nl, glist, ctr))
  for r in range(5):
    want = np.flatnonzero((gm[r] >= thr[r]) & (gm[r] > -np.inf))
    assert nl[r] == want.size
    np.testing.assert_array_equal(glist[r, : min(want.size, cap)], want[:cap])
    assert ctr[r, 0] == (cap + 1 if want.size > cap else 0)
  assert nl[1] > cap and nl[2] <= cap and 70 * g > cap and nl[0] >= k
  plat = KernelPlatform("gpu", True)
  for compact in ("scan", "lane"):
    _check(_rows(x, lens, k, plat, ktopk.TopkConfig(gather=True, compact=compact)), x, k, lens)
  with pytest.raises(ValueError, match="gather"):
    ktopk.TopkConfig(gather=1)
  with pytest.raises(ValueError, match="counter"):
    kg.threshold(gm, k, iters=14, num_warps=8, interpret=True, list_width=cap)
  auto = ktopk.TopkConfig()  # "auto": gather from 2**23 scores in the call
  assert TUNING.placement(auto, 64, 1 << 20, 2048, gather=True) == "scan"
  assert TUNING.gathers(auto, 64, 1 << 17) and TUNING.gathers(auto, 8, 1 << 20)
  assert not TUNING.gathers(auto, 8, 1 << 17) and not TUNING.gathers(auto, 1, 1 << 20)
  assert TUNING.gathers(ktopk.TopkConfig(gather=True), 1, 1024)
  with pytest.raises(ValueError, match="gather_min_entries"):
    Tuning(gather_min_entries=0)

def test_refined_threshold_keeps_correlated_rows_in_the_buffer():
  """Rows whose neighbouring scores rise together (a smooth random walk, as real score rows
  near a relevant stretch of keys): the group-maxima threshold admits more entries than the
  buffer holds; `count_groups` counts the listed groups' entries per edge exactly as numpy
  does, the refined threshold keeps between k and the capacity, and topk_rows with refining
  matches numpy (GPU kernels in interpret mode)."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(5)
  n, k, rows = 16384, 64, 4
  cfg, tun = topk_options(gather=True, refine_min_rows=1)
  g = ktopk.group_size(n, k, cfg, "gpu", rows=rows, tuning=tun)
  cap = 2 * k
  x = np.cumsum(rng.standard_normal((rows, n)), axis=1).astype(np.float32)
  x[2, ::7] = np.nan
  lens = np.array([n, n, n - 333, 3 * k])
  xj, lj = jnp.asarray(x), jnp.asarray(lens, jnp.int32)
  gm = kg.group_max(xj, lj, chunk=2048, group=g, num_warps=4, interpret=True)
  thr, ctr, glist, nl = kg.threshold(gm, k, iters=14, num_warps=8, interpret=True,
                                     slack=tun.slack_for(cfg, g), counter=jnp.int32, list_width=cap)
  valid = np.where((np.arange(n)[None] < lens[:, None]) & ~np.isnan(x), x, -np.inf)
  edges = np.asarray(thr)[:, None] + np.linspace(0, 1, 8, endpoint=False)[None] * 3.0
  got = np.asarray(kg.count_groups(xj, lj, jnp.asarray(edges, jnp.float32), glist, nl,
                                   group=g, list_width=cap, lanes=256, num_warps=4,
                                   interpret=True))
  gl, nl_ = np.asarray(glist), np.asarray(nl)
  for r in range(rows):
    member = np.zeros(n, bool)
    for gid in gl[r, :min(nl_[r], cap)]:
      member[gid * g:(gid + 1) * g] = True
    want = [(member & (valid[r] >= e) & (valid[r] > -np.inf)).sum() for e in edges[r]]
    np.testing.assert_array_equal(got[r], want)
  before = ((valid >= np.asarray(thr)[:, None]) & (valid > -np.inf)).sum(1)
  refined = np.asarray(kg.refine_threshold(thr, gm, lambda e: kg.count_groups(
      xj, lj, e, glist, nl, group=g, list_width=cap, lanes=256, num_warps=4, interpret=True),
                                           k, 16))
  after = ((valid >= refined[:, None]) & (valid > -np.inf)).sum(1)
  assert (before[:3] > cap).all()  # the maxima's threshold overflows every long row
  assert ((after[:3] >= k) & (after[:3] <= cap)).all(), (before, after)
  assert after[3] >= k and np.all(refined >= np.asarray(thr))
  _check(_rows(x, lens, k, KernelPlatform("gpu", True), cfg, tun), x, k, lens)
  assert tun.refines(256, True) and not tun.refines(256, False)
  assert not TUNING.refines(64, True) and TUNING.refines(256, True)
  with pytest.raises(ValueError, match="refine_edges"):
    Tuning(refine_edges=3)
  with pytest.raises(ValueError, match="edges"):
    kg.count_groups(xj, lj, jnp.zeros((rows, 3)), glist, nl, group=g, list_width=cap,
                    lanes=256, num_warps=4, interpret=True)


@pytest.mark.parametrize("platform", PLATFORMS, ids=IDS)
@pytest.mark.parametrize("ordered", [True, False])
def test_block_map_returns_slots(platform, ordered):
  """block_map=(sel, page): indices come back as slots sel[p // page] * page + p % page, -1 for
  the tail and for positions in padding blocks (-1 ids); on GPU with the default split
  bitonic finish the merge kernel maps them (interpret), elsewhere XLA does."""
  rng = np.random.default_rng(11 + ordered)
  page, width, k = 64, 40, 300
  sel = np.stack([np.sort(rng.choice(200, width, replace=False)) for _ in range(3)])
  sel[1, 30:] = -1  # padding blocks
  sel = sel.astype(np.int32)
  x = rng.standard_normal((3, width * page)).astype(np.float32)
  x[1, 30 * page:] = -np.inf  # padding blocks hold no scores (as the block-sparse kernel)
  x[2, ::3] = np.round(x[2, ::3])  # ties
  lens = np.array([width * page, width * page, 100], np.int32)
  v, i = ktopk.topk_rows(jnp.asarray(x), jnp.asarray(lens), k, ktopk.TopkConfig(), platform,
                         ordered=ordered, block_map=(jnp.asarray(sel), page))
  rv, ri = np_topk(x, k, lens)
  if not ordered:
    rv, ri = index_ordered(rv, ri)
  blk = np.take_along_axis(sel, np.maximum(ri, 0) // page, axis=1)
  slots = np.where((ri >= 0) & (blk >= 0), blk * page + np.maximum(ri, 0) % page, -1)
  np.testing.assert_array_equal(np.asarray(v), rv)
  np.testing.assert_array_equal(np.asarray(i), slots)
  assert (np.asarray(i)[2, 100:] == -1).all() and (np.asarray(i)[0] >= 0).all()


@pytest.mark.parametrize("platform", PLATFORMS, ids=IDS)
@pytest.mark.parametrize("n,k", [(20000, 64), (65536, 512), (3000, 2048), (100, 300)])
def test_unsorted_set_in_index_order(platform, n, k):
  """ordered=False: the same k entries as the sorted top-k (ties by index), in ascending index
  order; on GPU through the no-sort finish kernel (interpret), incl. overflow-repaired rows."""
  rng = np.random.default_rng(n + 2 * k)
  x = rng.standard_normal((5, n)).astype(np.float32)
  x[1] = np.round(x[1])  # heavy ties (overflow -> repair)
  x[2, : n // 4] = 1.5
  x[3, ::3] = np.nan
  x[4, ::2] = -0.0
  lens = np.array([n, n // 2 + 3, n, n, 7])
  kk = min(k, n)
  v, i = ktopk.topk_rows(jnp.asarray(x), jnp.asarray(lens, jnp.int32), kk, ktopk.TopkConfig(),
                         platform, ordered=False)
  rv, ri = index_ordered(*np_topk(x, kk, lens))
  np.testing.assert_array_equal(np.asarray(i), ri)
  np.testing.assert_array_equal(np.asarray(v), rv)


def test_public_api_unsorted():
  rng = np.random.default_rng(5)
  x = rng.standard_normal((2, 3, 5000)).astype(np.float32)
  lens = np.array([[5000, 10, 0], [3, 4999, 5000]])
  ref = index_ordered(*np_topk(x.reshape(6, -1), 40, lens.reshape(-1)))
  for impl in ("xla", "pallas"):
    v, i = jaxsparse.topk(jnp.asarray(x), 40, lengths=jnp.asarray(lens), implementation=impl,
                          sorted=False)
    np.testing.assert_array_equal(np.asarray(i).reshape(6, -1), ref[1])
    np.testing.assert_array_equal(np.asarray(v).reshape(6, -1), ref[0])
  with pytest.raises(ValueError, match="sorted"):
    jaxsparse.topk(jnp.asarray(x), 4, sorted=1)


def test_public_api_shapes_dtypes_k_larger_than_n():
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 3, 50)).astype(np.float32)
  lens = np.array([[50, 10, 0], [3, 49, 50]])
  for impl in ("xla", "pallas"):
    v, i = jaxsparse.topk(jnp.asarray(x), 60, lengths=jnp.asarray(lens), implementation=impl)
    assert v.shape == (2, 3, 60) and i.dtype == jnp.int32
    _check((v, i), x, 60, lens)
  xb = jnp.asarray(x, jnp.bfloat16)
  v, i = jaxsparse.topk(xb, 5, implementation="pallas")
  assert v.dtype == jnp.bfloat16
  _check((v.astype(jnp.float32), i), np.asarray(xb.astype(jnp.float32)), 5, None)


def test_k_equals_n_and_jit_vmap():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
  _check(jaxsparse.topk(x, 40, implementation="pallas"), np.asarray(x), 40, None)
  f = jax.jit(jax.vmap(lambda r: jaxsparse.topk(r, 7, implementation="pallas")))
  _check(f(x), np.asarray(x), 7, None)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3000), k=st.integers(1, 80), seed=st.integers(0, 9999),
       ties=st.booleans())
def test_topk_property(n, k, seed, ties):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((2, n)).astype(np.float32)
  if ties:
    x = np.round(x, 1)
  lens = rng.integers(0, n + 1, 2)
  v, i = jaxsparse.topk(jnp.asarray(x), k, lengths=jnp.asarray(lens), implementation="pallas")
  _check((v, i), x, k, lens)


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_indexer_topk_matches_scores_then_topk(kind, monkeypatch):
  monkeypatch.setenv("JAXSPARSE_INTERPRET", kind)
  rng = np.random.default_rng(4)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 2, 8, 64, 4100, 70)
  z = np.asarray(jaxsparse.paged_indexer_scores(q, kc, table, lens, w, implementation="xla"))
  v, i = jaxsparse.indexer_topk(q, kc, table, lens, w, 16, implementation="pallas",
                                fuse_group_max=kind == "gpu")
  row_lens = np.asarray(jaxsparse.row_lengths(lens, 2))
  rv, ri = np_topk(z, 16, row_lens)
  np.testing.assert_array_equal(np.asarray(i), ri)
  np.testing.assert_allclose(np.asarray(v), rv, rtol=1e-5)
  v, i = jaxsparse.indexer_topk(q, kc, table, lens, w, 16, implementation="pallas", sorted=False)
  rv, ri = index_ordered(rv, ri)
  np.testing.assert_array_equal(np.asarray(i), ri)
  np.testing.assert_allclose(np.asarray(v), rv, rtol=1e-5)


@settings(max_examples=5, deadline=None)
@given(log_cap=st.integers(1, 7), seed=st.integers(0, 2**31 - 1), ties=st.booleans())
def test_order_free_finishes_any_order(log_cap, seed, ties):
  """The bitonic (one kernel, or split into sorted runs then merges or a rank merge), and rank
  finishes sort candidates given in any order (the atomic compaction leaves chunk ranges in
  run order) by value, ties by lower index; -inf entries and slots past `live` never come
  out; fewer than k live entries leave a -inf / -1 tail."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(seed)
  cap = 2 ** log_cap
  k = int(rng.integers(1, cap + 1))
  x = rng.standard_normal((3, cap)).astype(np.float32)
  if ties:
    x = np.round(x)
  x[rng.random((3, cap)) < 0.1] = -np.inf
  idx = np.stack([rng.permutation(4 * cap)[:cap] for _ in range(3)]).astype(np.int32)
  live = rng.integers(0, cap + 1, 3).astype(np.int32)
  args = (jnp.asarray(x), jnp.asarray(idx), jnp.asarray(live), k, cap)
  outs = [kg.bitonic_finish(*args, interpret=True), kg.rank_finish(*args, interpret=True)]
  if cap >= 4:  # runs of 2 and of cap / 2
    outs += [kg.bitonic_finish_split(*args, run=run, interpret=True) for run in {2, cap // 2}]
    # rank merges: blocks of a quarter run (at least 2; fewer interpreted programs than
    # blocks of 2 at large caps) and of a whole run
    outs += [kg.bitonic_finish_split(*args, run=run, rank_merge=b, interpret=True)
             for run in {2, cap // 2} for b in {max(2, run // 4), run}]
  for v, i in outs:
    for r in range(3):
      ent = sorted((-x[r, p], idx[r, p]) for p in range(live[r]) if x[r, p] > -np.inf)[:k]
      want_v = np.full(k, -np.inf, np.float32)
      want_i = np.full(k, -1, np.int32)
      want_v[:len(ent)] = [-a for a, _ in ent]
      want_i[:len(ent)] = [b for _, b in ent]
      np.testing.assert_array_equal(np.asarray(v[r]), want_v)
      np.testing.assert_array_equal(np.asarray(i[r]), want_i)


def test_rank_merge_places_every_entry():
  """The rank merge with k = capacity: every entry must come out at its exact place,
  including the last entries, which come after every entry of the other runs (where the
  binary search must stop at the run's last slot), and an all-tied row (ties by index)."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(11)
  cap, rows = 16, 6
  x = np.stack([rng.permutation(cap) for _ in range(rows - 1)]
               + [np.zeros(cap)]).astype(np.float32)  # the last row: all tied
  idx = np.stack([rng.permutation(4 * cap)[:cap] for _ in range(rows)]).astype(np.int32)
  want = np.argsort(-x + np.argsort(np.argsort(idx, 1), 1) * 1e-3, 1)  # ties: lower index
  for run, block in ((8, 2), (8, 8), (4, 2)):
    v, i = kg.bitonic_finish_split(jnp.asarray(x), jnp.asarray(idx),
                                   jnp.full((rows,), cap, jnp.int32), cap, cap, run=run,
                                   rank_merge=block, interpret=True)
    np.testing.assert_array_equal(np.asarray(i), np.take_along_axis(idx, want, 1))
    np.testing.assert_array_equal(np.asarray(v), np.take_along_axis(x, want, 1))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([1, 3, 1000]),
       n=st.sampled_from([3001, 8191]), k=st.sampled_from([64, 256]))  # few shapes: few compiles
def test_compaction_is_exact(seed, spread, n, k):
  """The compaction passes ("scan" and "lane") give numpy's top-k, sorted and as a set:
  heavy ties at the threshold, NaN, -0.0, ragged lengths, rows that are not a
  whole number of chunks, and group maxima handed in for the unpadded row (as the fused decode
  and SPIN paths pass them)."""
  rng = np.random.default_rng(seed)
  x = np.round(rng.standard_normal((4, n)) * spread).astype(np.float32)
  x[1, ::7] = np.nan
  x[2, ::3] = -0.0
  lens = np.array([n, rng.integers(k, n), rng.integers(1, k), n], np.int32)
  plat = KernelPlatform("gpu", True)
  tun = Tuning(chunk=1024)
  for cfg in (ktopk.TopkConfig(compact="lane"), ktopk.TopkConfig()):
    _check(_rows(x, lens, k, plat, cfg, tun), x, k, lens)
    v, i = ktopk.topk_rows(jnp.asarray(x), jnp.asarray(lens), k, cfg, plat, ordered=False,
                           tuning=tun)
    rv, ri = index_ordered(*np_topk(x, k, lens))
    np.testing.assert_array_equal(np.asarray(i), ri)
    np.testing.assert_array_equal(np.asarray(v), rv)
  g = ktopk.group_size(n, k, cfg, "gpu", rows=4, tuning=tun)
  if n % g == 0:  # maxima from outside, NaN as -inf, past-length entries -inf (as emitted)
    xm = np.where((np.arange(n) < lens[:, None]) & ~np.isnan(x), x, -np.inf)
    gm = jnp.asarray(xm.reshape(4, n // g, g).max(-1))
    out = ktopk.topk_rows(jnp.asarray(x), jnp.asarray(lens), k, cfg, plat, gm, tuning=tun)
    _check(out, x, k, lens)


@pytest.mark.parametrize("slack,iters", [(0, 14), (64, 14), (8, 40)])
def test_threshold_search(slack, iters):
  """The threshold kernel's search (interpret), bisection (slack 0) and regula falsi: over
  normal, heavy-tailed and tied maxima, -inf groups and pieces that are not one power of two,
  the threshold is valid (at least k maxima reach it) and no higher than the k-th largest
  maximum; bisection is within (max - min) / 2**iters of it, regula falsi within k + slack
  maxima (a tied row: exactly the maxima tied with the k-th, given enough probes); fewer
  than k finite maxima give -inf. The whole call with it matches numpy; it lowers for cuda."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(slack)
  k, g = 100, 5120
  m = rng.standard_normal((5, g)).astype(np.float32)
  m[1] = np.round(m[1] * 2)  # heavy ties at the k-th value
  m[2, ::3] = -np.inf
  m[3, 90:] = -np.inf  # fewer finite maxima than k
  m[4] = rng.standard_t(1.5, g)  # heavy tail: the maximum far out
  thr = np.asarray(kg.threshold(jnp.asarray(m), k, iters=iters, num_warps=8, interpret=True,
                                slack=slack))
  for r in (0, 1, 2, 4):
    fin = m[r][m[r] > -np.inf]
    kth = np.sort(fin)[-k]
    n = (m[r] >= thr[r]).sum()
    assert n >= k and thr[r] <= kth
    if slack == 0:
      assert kth - thr[r] <= (fin.max() - fin.min()) / 2 ** iters * (1 + 1e-5)
    elif r == 1:
      assert n <= max(k + slack, (fin >= kth).sum())
    else:
      assert n <= k + slack
  assert thr[3] == -np.inf
  with pytest.raises(ValueError, match="slack"):
    kg.threshold(jnp.asarray(m), k, iters=iters, num_warps=8, interpret=True, slack=-1)
  with pytest.raises(ValueError, match="falsi_slack"):
    Tuning(falsi_slack=0)
  with pytest.raises(ValueError, match="threshold"):
    ktopk.TopkConfig(threshold="secant")
  x = rng.standard_normal((2, 20000)).astype(np.float32)
  x[1] = np.round(x[1] * 4)
  lens = np.array([20000, 12345])
  opts = topk_options(threshold="falsi" if slack else "bisect", falsi_slack=slack or 64,
                      bisect_iters=iters)
  _check(_rows(x, lens, 512, KernelPlatform("gpu", True), *opts), x, 512, lens)
  export_for(lambda x: kg.threshold(x, 2048, iters=iters, num_warps=8, interpret=False,
                                    slack=slack), "cuda",
             jax.ShapeDtypeStruct((1, 8192), jnp.float32))


@pytest.mark.parametrize("g", [8192, 5120, 300, 4095])
def test_threshold_on_widths_that_are_not_powers_of_two(g):
  """The bisection threshold over G group maxima kept as power-of-two pieces (G = 5120: SPIN's
  compacted 80K slots in groups of 16) equals the one over the maxima padded with -inf to a
  power of two, empty groups and all; it lowers for cuda without a padded copy."""
  from pallas_kernels.topk import gpu as kg
  rng = np.random.default_rng(g)
  m = rng.standard_normal((3, g)).astype(np.float32)
  m[1, ::3] = -np.inf
  m[2, 40:] = -np.inf  # fewer finite maxima than k: no threshold (-inf)
  run = lambda x: np.asarray(kg.threshold(jnp.asarray(x), 64, iters=14, num_warps=8,
                                          interpret=True))
  want = run(np.pad(m, ((0, 0), (0, next_pow2(g) - g)), constant_values=-np.inf))
  np.testing.assert_array_equal(run(m), want)
  assert want[2] == -np.inf and np.isfinite(want[:2]).all()
  if g == 5120:
    export_for(lambda x: kg.threshold(x, 2048, iters=14, num_warps=8, interpret=False), "cuda",
               jax.ShapeDtypeStruct((64, g), jnp.float32))


def test_topk_lowers_for_tpu_and_gpu():
  S = jax.ShapeDtypeStruct
  for kind, plat in (("tpu", "tpu"), ("gpu", "cuda")):
    f = lambda x, l: ktopk.topk_rows(x, l, 2048, ktopk.TopkConfig(), KernelPlatform(kind, False))
    export_for(f, plat, S((8, 131072), jnp.float32), S((8,), jnp.int32))
  # TopkConfig() sorted (the bitonic finish) was exported above
  for opts, ordered in ((dict(finish="rank"), True), (dict(), False),
                        (dict(bitonic_run=0), True), (dict(compact="lane"), True),
                        (dict(gather=True), True), (dict(gather=True, compact="lane"), True),
                        (dict(gather=True, bitonic_mid=2048), True),
                        (dict(gather=True, refine_min_rows=1), True),
                        (dict(finish="rank", rank_block_i=16), True),
                        (dict(finish="rank", rank_buckets=False), True),
                        (dict(bitonic_rank_merge=256), True), (dict(threshold="bisect"), True),
                        (dict(threshold="sort", finish="sort"), True),
                        (dict(compact="lane"), False)):
    cfg, tun = topk_options(**opts)
    g = lambda x, l: ktopk.topk_rows(x, l, 2048, cfg, KernelPlatform("gpu", False),
                                     ordered=ordered, tuning=tun)
    export_for(g, "cuda", S((8, 131072), jnp.float32), S((8,), jnp.int32))
  # SPIN's block-mapped rows at the defaults: the repairing merge kernel maps the slots
  h = lambda x, l, s: ktopk.topk_rows(x, l, 2048, ktopk.TopkConfig(),
                                      KernelPlatform("gpu", False), block_map=(s, 64))
  export_for(h, "cuda", S((8, 81920), jnp.float32), S((8,), jnp.int32), S((8, 1280), jnp.int32))
  # and through the rank merge
  h = lambda x, l, s: ktopk.topk_rows(x, l, 2048, ktopk.TopkConfig(),
                                      KernelPlatform("gpu", False), block_map=(s, 64),
                                      tuning=Tuning(bitonic_rank_merge=256))
  export_for(h, "cuda", S((8, 81920), jnp.float32), S((8,), jnp.int32), S((8, 1280), jnp.int32))


def test_bad_input():
  x = jnp.zeros((2, 10), jnp.float32) + 1.0
  with pytest.raises(ValueError, match="k=0"):
    jaxsparse.topk(x, 0)
  with pytest.raises(ValueError, match="k=2.5"):
    jaxsparse.topk(x, 2.5)
  with pytest.raises(ValueError, match="scores.dtype"):
    jaxsparse.topk(x.astype(jnp.int32), 2)
  with pytest.raises(ValueError, match="lengths.shape"):
    jaxsparse.topk(x, 2, lengths=jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="lengths.dtype"):
    jaxsparse.topk(x, 2, lengths=jnp.zeros((2,), jnp.float32))
  with pytest.raises(ValueError, match="scores is empty"):
    jaxsparse.topk(x[:, :0], 2)
  with pytest.raises(ValueError, match="chunk"):
    Tuning(chunk=100)


@pytest.mark.parametrize("n,bound", [(262144, 1.5), (81920, 1.5), (20480, 1.6)])
def test_filter_path_keeps_few_candidates_on_random_rows(n, bound):
  """The threshold leaves ~k candidates, far under the buffer (2k), so no repair is needed;
  also for rows that are not a power of two (SPIN's compacted 80K-slot width), whose group
  maxima are padded to one for the threshold kernel (so the group size counts the padding)."""
  from pallas_kernels.topk import gpu as kgpu
  rng = np.random.default_rng(0)
  k = 2048
  x = jnp.asarray(rng.standard_normal((2, n)), jnp.float32)
  lens = jnp.asarray([n, n], jnp.int32)
  cfg = ktopk.TopkConfig()
  g = ktopk.group_size(n, k, cfg, "gpu", rows=2)
  assert g >= 4
  gm = kgpu.group_max(x, lens, chunk=4096, group=g, num_warps=4, interpret=True)
  gp = jnp.pad(gm, ((0, 0), (0, next_pow2(gm.shape[1]) - gm.shape[1])),
               constant_values=-np.inf)
  assert gp.shape[1] == TUNING.groups_per_k * k  # the threshold kernel's input, padded
  thr = kgpu.threshold(gp, k, iters=20, num_warps=8, interpret=True)
  total = np.asarray(kgpu.count(x, lens, thr, chunk=4096, num_warps=4, interpret=True)).sum(1)
  assert (total >= k).all() and (total <= bound * k).all(), total


@pytest.mark.parametrize("platform", PLATFORMS, ids=IDS)
def test_whole_rows_without_lengths(platform):
  """lengths=None (whole rows; on GPU the kernels then take no lengths input) gives what
  lengths=N gives, with NaN, -inf and a row too short for the filter path."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((3, 9000)).astype(np.float32)
  x[0, ::7] = np.nan
  x[1, :4000] = -np.inf
  full = jnp.full((3,), 9000, jnp.int32)
  for n, k in ((9000, 300), (200, 300)):
    xs = jnp.asarray(x[:, :n])
    got = ktopk.topk_rows(xs, None, min(k, n), ktopk.TopkConfig(), platform)
    want = ktopk.topk_rows(xs, full.clip(max=n), min(k, n), ktopk.TopkConfig(), platform)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    _check(got, x[:, :n], min(k, n), np.full(3, n))


def test_tpu_topk_is_mosaic_kernels():
  """The TPU top-K lowers to Mosaic kernels for every pass (group maxima, threshold,
  compaction, bitonic finish); an XLA sort remains only in the overflow fallback's branch.
  The kernels one at a time (TPU interpret mode) against numpy: the threshold is exactly the
  k-th largest group maximum, the compaction keeps every candidate in index order (ties,
  -0.0, NaN, ragged rows, a row with fewer finite maxima than k), the finish sorts by value
  then index."""
  from pallas_kernels.topk import tpu as kt
  S = jax.ShapeDtypeStruct
  exp = export_for(lambda x, l: ktopk.topk_rows(x, l, 2048, ktopk.TopkConfig(),
                                                KernelPlatform("tpu", False)),
                   "tpu", S((8, 131072), jnp.float32), S((8,), jnp.int32))
  text = exp.mlir_module()
  for name in ("group_max", "threshold", "compact", "bitonic"):
    assert f'kernel_name = "jaxsparse_topk_{name}_tpu"' in text, name
  rng = np.random.default_rng(4)
  n, k = 8192, 150
  x = rng.standard_normal((4, n)).astype(np.float32)
  x[1] = np.round(x[1] * 2)  # heavy ties
  x[2, ::3] = np.nan
  x[2, 1::3] = -0.0
  x[3] = -np.inf
  x[3, :40 * 128:128] = 1.0  # 40 finite entries, 40 finite maxima < k: threshold -inf
  lens = np.array([n, 5000, 3001, n], np.int32)
  gm = kt.group_max(jnp.asarray(x), jnp.asarray(lens), chunk=1024, interpret=True)
  thr = np.asarray(kt.threshold(gm, k, interpret=True))
  srt = -np.sort(-np.asarray(gm), axis=1)
  np.testing.assert_array_equal(thr[:3], srt[:3, k - 1])
  assert thr[3] == -np.inf
  v, i, t = kt.compact(jnp.asarray(x), jnp.asarray(lens), jnp.asarray(thr), capacity=1024,
                       interpret=True)
  for r in range(4):
    xr = np.where(np.isnan(x[r, :lens[r]]), -np.inf, x[r, :lens[r]])
    want = np.flatnonzero((xr >= thr[r]) & (xr > -np.inf))
    assert int(t[r]) == want.size
    m = min(want.size, 1024)
    np.testing.assert_array_equal(np.asarray(i[r, :m]), want[:m])
    np.testing.assert_array_equal(np.asarray(v[r, :m]), np.where(xr[want[:m]] == 0, 0.0,
                                                                 xr[want[:m]]))
    assert (np.asarray(i[r, m:]) == -1).all()
  sv, si = kt.bitonic_finish(v, i, interpret=True)
  for r in range(4):
    vv, ii = np.asarray(v[r]), np.asarray(i[r])
    o = np.lexsort((ii, -vv))
    np.testing.assert_array_equal(np.asarray(si[r]), ii[o])
    np.testing.assert_array_equal(np.asarray(sv[r]), vv[o])

"""Compiled kernels on a real GPU against the float64 reference (skipped without a GPU)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse.prep import quantize_fp8
from tests.conftest import assert_scores_close, topk_options

GPU_TOL = 2e-3  # TF32 / MMA accumulation orders on the GPU; a 1% error still fails
from tests.reference import (index_ordered, np_indexer, np_topk, prefill_case, random_paged,
                             spin_selection_case, spin_state_case, with_block_max)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("key_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("bsz,rows,n,num_blocks", [(3, 1, 5000, 300), (2, 4, 70000, 2500)])
def test_decode_gpu(key_dtype, bsz, rows, n, num_blocks):
  rng = np.random.default_rng(bsz * n)
  q, kc, table, lens, w, ks = random_paged(rng, bsz, rows, 64, 128, n, num_blocks, key_dtype)
  out = jaxsparse.paged_indexer_scores(q, kc, table, lens, w, k_scale=ks, implementation="pallas")
  ref = np_indexer.paged(q, kc, table, lens, w, ks)
  assert_scores_close(out, ref, reduction=64 * 128, dtype_tol=GPU_TOL)


@pytest.mark.parametrize("key_dtype,kernel", [("bfloat16", "auto"), ("bfloat16", "triton"),
                                              ("float8_e4m3fn", "auto")])
def test_prefill_gpu(key_dtype, kernel):
  """Public prefill scoring on the H200 (bf16 "auto" runs the Mosaic GPU kernel) at sizes that
  are not multiples of any tile."""
  from pallas_kernels.indexer_prefill import PrefillConfig
  rng = np.random.default_rng(7)
  t, h, d, n = 300, 64, 128, 9000
  q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
  ks = None
  if key_dtype == "float8_e4m3fn":
    k, ks = quantize_fp8(k)
  w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  pos = jnp.asarray(np.sort(rng.integers(0, n, t)), jnp.int32)
  out = jaxsparse.indexer_scores(q, k, w, k_scale=ks, query_positions=pos, implementation="pallas",
                                config=PrefillConfig(kernel=kernel))
  assert_scores_close(out, np_indexer.dense(q, k, w, ks, pos), reduction=h * d, dtype_tol=GPU_TOL)


@pytest.mark.parametrize("finish", ["sort", "rank", "bitonic"])
@pytest.mark.parametrize("n,k", [(131072, 2048), (1 << 20, 512), (40000, 2048)])
def test_topk_gpu(n, k, finish):
  rng = np.random.default_rng(n)
  x = rng.standard_normal((8, n)).astype(np.float32)
  x[1, :5000] = 1.5  # ties across the threshold: overflows the buffer, repaired in-kernel
  x[4] = (np.arange(n) // 256).astype(np.float32)  # sorted runs: overflow, repaired
  lens = np.array([n, n // 3, n, 17, n, n - 1, 0, n], np.int32)
  from pallas_kernels.topk import TopkConfig
  v, i = jaxsparse.topk(jnp.asarray(x), k, lengths=jnp.asarray(lens), implementation="pallas",
                        config=TopkConfig(finish=finish))
  rv, ri = np_topk(x, k, lens)
  np.testing.assert_array_equal(np.asarray(i), ri)
  np.testing.assert_array_equal(np.asarray(v), rv)
  if finish == "sort":  # the top-k set in index order: the no-sort finish kernel
    v, i = jaxsparse.topk(jnp.asarray(x), k, lengths=jnp.asarray(lens), implementation="pallas",
                          sorted=False)
    rv, ri = index_ordered(rv, ri)
    np.testing.assert_array_equal(np.asarray(i), ri)
    np.testing.assert_array_equal(np.asarray(v), rv)


@pytest.mark.parametrize("rows,n,k,compact,mid,rank", [
    (1, 32768, 2048, "auto", 0, False), (1, 1 << 20, 2048, "auto", 0, False),
    (8, 32768, 2048, "auto", 2048, False), (8, 131072, 2048, "lane", 1024, False),
    (8, 1 << 20, 512, "auto", 0, False), (1, 32768, 2048, "auto", 0, True),
    (1, 131072, 512, "auto", 0, True), (8, 32768, 2048, "auto", 0, True),
    (1, 1 << 20, 2048, "auto", 0, True)])
def test_topk_gpu_finish_repairs(rows, n, k, compact, mid, rank):
  """The finishes compiled: no repair kernel; rows overflowing by ties and by sorted runs,
  next to ordinary, ragged and empty ones, repaired by the rank finish (one program per
  block of candidates at one and 8 rows, in value buckets at k = 2048 by default) or the
  split bitonic finish's merge program (8 rows; with a middle merge kernel; scan, lane and
  gathering compactions), against numpy."""
  _check_repaired_rows(dict(compact=compact, bitonic_mid=mid, finish="rank" if rank else "auto",
                            rank_max_rows=rows if rank else 1), rows, n, k)


def _pallas_topk(x, k: int, lengths, options: dict, sorted: bool = True):  # noqa: A002
  """What jaxsparse.topk(implementation="pallas") runs for scores [R, N] (k <= N), with the
  config and tuning table of `topk_options(**options)`."""
  from jaxsparse.backend import KernelPlatform
  from pallas_kernels.topk import topk_rows
  cfg, tun = topk_options(**options)
  return topk_rows(x, lengths, k, cfg, KernelPlatform("gpu", False), ordered=sorted,
                   tuning=tun)


def _check_repaired_rows(options: dict, rows: int, n: int, k: int):
  """Calls of `rows` (1 or 8) rows of the top-K with `topk_options(**options)` against numpy:
  rows overflowing by ties and by sorted runs next to ordinary, ragged and empty ones."""
  rng = np.random.default_rng(n + rows)
  x = rng.standard_normal((8, n)).astype(np.float32)
  x[1, :5000] = 1.5  # ties across the threshold: overflow
  x[4] = (np.arange(n) // 256).astype(np.float32)  # sorted runs: overflow
  lens = np.array([n, n // 3, n, 17, n, n - 1, 0, n], np.int32)
  for r0 in range(0, 8, rows) if rows == 8 else (0, 1, 3, 4, 6):
    xs, ls = x[r0:r0 + rows], lens[r0:r0 + rows]
    v, i = _pallas_topk(jnp.asarray(xs), k, jnp.asarray(ls), options)
    rv, ri = np_topk(xs, k, ls)
    np.testing.assert_array_equal(np.asarray(i), ri)
    np.testing.assert_array_equal(np.asarray(v), rv)


@pytest.mark.parametrize("rows,n,k", [(8, 32768, 2048), (8, 131072, 1024), (8, 1 << 20, 2048)])
def test_topk_gpu_rank_merge(rows, n, k):
  """The split bitonic finish with the rank merge (the default at these shapes: runs sorted
  descending, each entry placed by binary searches in every run, overflowing rows repaired
  inside) compiled, with overflowing, ragged and empty rows (`_check_repaired_rows`), and
  SPIN's block map through it."""
  from pallas_kernels.topk import TopkConfig
  from pallas_kernels.topk._tuning import TUNING
  cfg = TopkConfig()
  assert TUNING.rank_merge_for(rows, k) == 32
  _check_repaired_rows({}, rows, n, k)
  if n == 32768:
    rng = np.random.default_rng(5)
    sel = np.stack([rng.permutation(1024)[:n // 64] for _ in range(rows)]).astype(np.int32)
    sel[2, 7] = -1
    x = rng.standard_normal((rows, n)).astype(np.float32)
    from pallas_kernels.topk import topk_rows
    from jaxsparse.backend import KernelPlatform
    v, i = topk_rows(jnp.asarray(x), jnp.full((rows,), n, jnp.int32), k, cfg,
                     KernelPlatform("gpu", False), block_map=(jnp.asarray(sel), 64))
    rv, ri = np_topk(x, k, np.full(rows, n))
    blk = np.take_along_axis(sel, np.maximum(ri, 0) // 64, axis=1)
    np.testing.assert_array_equal(np.asarray(v), rv)
    np.testing.assert_array_equal(np.asarray(i), np.where((ri >= 0) & (blk >= 0),
                                                          blk * 64 + np.maximum(ri, 0) % 64, -1))


def _check_single_rows(options: dict, n: int, k: int, seed: int):
  """One-row calls of the top-K with `topk_options(**options)` against numpy: rows with and without ties
  among the candidates (scores rounded to 1/64 tie often; a tile of 64 distinct values
  overflows the buffer), ragged and empty rows."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((5, n)).astype(np.float32)
  x[1] = np.round(x[1] * 64) / 64  # ties inside the candidates, no overflow
  x[2] = np.tile(np.arange(64, dtype=np.float32), n // 64)  # ties at the k-th: overflow
  lens = np.array([n, n - 5, n, 17, 0], np.int32)
  for r in range(5):
    v, i = _pallas_topk(jnp.asarray(x[r:r + 1]), k, jnp.asarray(lens[r:r + 1]), options)
    rv, ri = np_topk(x[r:r + 1], k, lens[r:r + 1])
    np.testing.assert_array_equal(np.asarray(i), ri)
    np.testing.assert_array_equal(np.asarray(v), rv)


@pytest.mark.parametrize("n,k", [(32768, 2048), (131072, 512)])
@pytest.mark.parametrize("block_i,buckets", [(8, False), (16, False), (16, True), (8, True)])
def test_topk_gpu_rank_variants(n, k, block_i, buckets):
  """The rank finish (one row) compiled with blocks of 8 or 16 candidates, with and without
  two value buckets (`_check_single_rows`)."""
  _check_single_rows(dict(rank_block_i=block_i, rank_buckets=buckets,
                          rank_buckets_min_k=512), n, k, seed=n + block_i)


@pytest.mark.parametrize("run,compact", [
    (0, "scan"), (256, "scan"), (512, "scan"), (1024, "scan"), (512, "lane"), (0, "lane")])
def test_topk_gpu_split_bitonic(run, compact):
  """Runs of r (`Tuning.bitonic_run`) and compact=c compiled: sorted (one-pass atomic compaction, by
  chunk ranges or one atomic per candidate; bitonic finish, split into runs and merges when
  r > 0) and as a set (count, compaction in index order), overflowing rows repaired."""
  rng = np.random.default_rng(run)
  n, k = 131072, 2048
  x = rng.standard_normal((8, n)).astype(np.float32)
  x[1, :5000] = 1.5
  lens = np.array([n, n // 3, n, 17, n, n - 1, 0, n], np.int32)
  rv, ri = np_topk(x, k, lens)
  for srt in (True, False):
    v, i = _pallas_topk(jnp.asarray(x), k, jnp.asarray(lens),
                        dict(bitonic_run=run, compact=compact), sorted=srt)
    wv, wi = (rv, ri) if srt else index_ordered(rv, ri)
    np.testing.assert_array_equal(np.asarray(i), wi)
    np.testing.assert_array_equal(np.asarray(v), wv)


def _hard_rows(n: int, k: int, lengths: bool):
  """8 rows of n scores (seeded by n + k): ties across the threshold, NaN, -0.0, sorted runs
  (overflow, repaired), -inf; and lengths [8] int32 with ragged, tiny and empty rows (None
  when lengths is False: whole rows)."""
  rng = np.random.default_rng(n + k)
  x = rng.standard_normal((8, n)).astype(np.float32)
  x[1, :5000] = 1.5
  x[2, ::7] = np.nan
  x[3, ::2] = -0.0
  x[4] = (np.arange(n) // 256).astype(np.float32)
  x[5, ::3] = -np.inf
  lens = np.array([n, n // 3, n, 17, n, n - 1, 0, n], np.int32) if lengths else None
  return x, lens


@pytest.mark.parametrize("compact", ["auto", "lane"])
@pytest.mark.parametrize("n,k,lengths", [(131072, 2048, True), (1 << 20, 512, False),
                                         (40000, 2048, True), (32768, 64, False)])
def test_topk_gpu_gather(n, k, lengths, compact):
  """TopkConfig(gather=True) compiled: the threshold kernel lists the groups that reach the
  threshold and the compaction gathers only those; ties across the threshold, sorted runs
  (more listed groups than the buffer holds: repaired), NaN, -0.0, -inf, ragged and empty
  rows, with and without lengths."""
  from pallas_kernels.topk import TopkConfig
  x, lens = _hard_rows(n, k, lengths)
  v, i = jaxsparse.topk(jnp.asarray(x), k, lengths=None if lens is None else jnp.asarray(lens),
                        implementation="pallas", config=TopkConfig(gather=True, compact=compact))
  rv, ri = np_topk(x, k, np.full(8, n) if lens is None else lens)
  np.testing.assert_array_equal(np.asarray(i), ri)
  np.testing.assert_array_equal(np.asarray(v), rv)


@pytest.mark.parametrize("n,k", [(50000, 2048), (131072, 2048), (16384, 64)])
def test_topk_gpu_refined_threshold(n, k):
  """256 rows (the refined threshold's call size): random walks, whose group maxima admit
  several times k entries, beside the hard rows (ties, NaN, -0.0, -inf, ragged, empty), with
  lengths; compiled, against numpy."""
  from pallas_kernels.topk import TopkConfig
  from pallas_kernels.topk._tuning import TUNING
  hard, lens8 = _hard_rows(n, k, True)
  rng = np.random.default_rng(n)
  x = np.cumsum(rng.standard_normal((256, n)), axis=1).astype(np.float32)
  x[:8] = hard
  lens = np.full(256, n, np.int32)
  lens[:8] = lens8
  lens[8::3] = rng.integers(0, n + 1, lens[8::3].shape)
  assert TUNING.refines(256, True)
  v, i = jaxsparse.topk(jnp.asarray(x), k, lengths=jnp.asarray(lens), implementation="pallas",
                        config=TopkConfig(gather=True))
  rv, ri = np_topk(x, k, lens)
  np.testing.assert_array_equal(np.asarray(i), ri)
  np.testing.assert_array_equal(np.asarray(v), rv)


@pytest.mark.parametrize("block_i,block_j,warps", [(32, 256, 4), (64, 64, 4), (16, 256, 2),
                                                  (16, 512, 4), (16, 1024, 4)])
@pytest.mark.parametrize("n,k,lengths", [(32768, 2048, True), (1 << 20, 2048, False),
                                         (20000, 64, True), (4096, 1000, False)])
def test_topk_gpu_rank_finish(n, k, lengths, block_i, block_j, warps):
  """The rank-counting finish compiled (tiles of block_i x block_j compares, then the place
  kernel): 8 rows with ties across the threshold, sorted runs (repaired), NaN, -0.0, -inf,
  heavy ties, ragged and empty rows, with and without lengths; and each row alone, which
  the default config (finish="auto") also sends to the rank finish."""
  x, lens = _hard_rows(n, k, lengths)
  x[7] = np.round(x[7] * 2)  # heavy ties everywhere
  rv, ri = np_topk(x, k, np.full(8, n) if lens is None else lens)
  v, i = _pallas_topk(jnp.asarray(x), k, None if lens is None else jnp.asarray(lens),
                      dict(finish="rank", rank_block_i=block_i, rank_block_j=block_j,
                           rank_warps=warps))
  np.testing.assert_array_equal(np.asarray(i), ri)
  np.testing.assert_array_equal(np.asarray(v), rv)
  for r in (0, 1, 4, 7):
    v, i = jaxsparse.topk(jnp.asarray(x[r:r + 1]), k, implementation="pallas",
                          lengths=None if lens is None else jnp.asarray(lens[r:r + 1]))
    np.testing.assert_array_equal(np.asarray(i), ri[r:r + 1])
    np.testing.assert_array_equal(np.asarray(v), rv[r:r + 1])


@pytest.mark.parametrize("slack", [64, 4])
@pytest.mark.parametrize("n,k,lengths", [(32768, 2048, True), (1 << 20, 512, False),
                                         (131072, 64, True)])
def test_topk_gpu_falsi(n, k, lengths, slack):
  """The whole call compiled with the regula falsi threshold (`TopkConfig(threshold=
  "falsi")`): the hard rows of `_hard_rows` together (bitonic finish) and one at a time (rank
  finish), against numpy."""
  x, lens = _hard_rows(n, k, lengths)
  rv, ri = np_topk(x, k, np.full(8, n) if lens is None else lens)
  for r0, r1 in ((0, 8), (0, 1), (4, 5), (7, 8)):
    v, i = _pallas_topk(jnp.asarray(x[r0:r1]), k,
                        None if lens is None else jnp.asarray(lens[r0:r1]),
                        dict(threshold="falsi", falsi_slack=slack))
    np.testing.assert_array_equal(np.asarray(i), ri[r0:r1])
    np.testing.assert_array_equal(np.asarray(v), rv[r0:r1])


@pytest.mark.parametrize("n,k,lengths", [(1 << 20, 512, False), (1 << 19, 512, True),
                                         (1 << 20, 2048, True)])
def test_topk_gpu_large_groups(n, k, lengths):
  """TopkConfig(max_group=256) compiled (groups of up to 256 scores on long rows): the hard
  rows together and one at a time, against numpy."""
  from pallas_kernels.topk import TopkConfig, group_size
  cfg = TopkConfig(max_group=256)
  assert group_size(n, k, cfg, "gpu", rows=1) > 64
  x, lens = _hard_rows(n, k, lengths)
  rv, ri = np_topk(x, k, np.full(8, n) if lens is None else lens)
  for r0, r1 in ((0, 8), (0, 1), (4, 5)):
    v, i = jaxsparse.topk(jnp.asarray(x[r0:r1]), k, implementation="pallas", config=cfg,
                          lengths=None if lens is None else jnp.asarray(lens[r0:r1]))
    np.testing.assert_array_equal(np.asarray(i), ri[r0:r1])
    np.testing.assert_array_equal(np.asarray(v), rv[r0:r1])


@pytest.mark.parametrize("ordered", [True, False])
def test_topk_gpu_block_map(ordered):
  """Compiled: indices mapped to slots through SPIN's block ids in the merge kernel."""
  from jaxsparse.backend import KernelPlatform
  from tests import test_topk
  test_topk.test_block_map_returns_slots(KernelPlatform("gpu", False), ordered)


def test_indexer_topk_fused_gpu():
  rng = np.random.default_rng(3)
  q, kc, table, lens, w, ks = random_paged(rng, 4, 1, 64, 128, 131072, 2100, "bfloat16")
  v, i = jaxsparse.indexer_topk(q[:, 0], kc, table, lens, w[:, 0], 2048, implementation="pallas",
                                fuse_group_max=True)
  z = jaxsparse.paged_indexer_scores(q[:, 0], kc, table, lens, w[:, 0], implementation="pallas")
  rv, ri = np_topk(np.asarray(z), 2048, np.asarray(lens))
  # the fused kernel may round the head sum differently from the unfused one (1 ulp), which
  # can reorder near-ties: check values, and that each index carries its value
  np.testing.assert_allclose(np.asarray(v), rv, rtol=1e-6)
  got = np.take_along_axis(np.asarray(z), np.asarray(i), axis=1)
  np.testing.assert_allclose(got, rv, rtol=1e-6)
  assert (np.sort(np.asarray(i), axis=1)[:, 1:] != np.sort(np.asarray(i), axis=1)[:, :-1]).all()


def test_decode_group_max_gpu():
  from jaxsparse.backend import KernelPlatform
  from pallas_kernels import indexer_decode
  rng = np.random.default_rng(4)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 1, 64, 128, 8192, 300, "bfloat16")
  z, gm = indexer_decode.decode_scores(q, kc, table, lens, w, platform=KernelPlatform("gpu", False),
                                       group_max=8)
  want = np.asarray(z).reshape(2, 1, -1, 8).max(-1)
  np.testing.assert_array_equal(np.asarray(gm), want)


@pytest.mark.parametrize("group,slack,iters", [(2, 0, 20), (8, 0, 20), (64, 0, 20), (8, 64, 14),
                                               (8, 4, 40)])
def test_topk_group_max_and_threshold_gpu(group, slack, iters):
  from pallas_kernels.topk import gpu as kgpu
  rng = np.random.default_rng(group)
  x = jnp.asarray(rng.standard_normal((4, 65536)), jnp.float32)
  lens = jnp.asarray([65536, 1000, 0, 65535], jnp.int32)
  gm = kgpu.group_max(x, lens, chunk=4096, group=group, num_warps=4, interpret=False)
  xm = np.where(np.arange(65536)[None] < np.asarray(lens)[:, None], np.asarray(x), -np.inf)
  np.testing.assert_array_equal(np.asarray(gm), xm.reshape(4, -1, group).max(-1))
  thr = np.asarray(kgpu.threshold(gm, 100, iters=iters, num_warps=8, interpret=False,
                                  slack=slack))
  counts = (np.asarray(gm) >= thr[:, None]).sum(1)
  assert (counts[[0, 1, 3]] >= 100).all() and thr[2] == -np.inf
  kth = -np.sort(-np.asarray(gm), axis=1)[:, 99]
  assert (thr[[0, 3]] <= kth[[0, 3]]).all()
  if slack:  # regula falsi: within k + slack maxima
    assert (counts[[0, 1, 3]] <= 100 + slack).all()
  else:
    assert (thr[[0, 3]] > kth[[0, 3]] - 1e-3).all()
  # widths that are not powers of two (power-of-two pieces) equal the -inf padded width
  part = gm[:, :gm.shape[1] * 5 // 8]
  padded = jnp.pad(part, ((0, 0), (0, gm.shape[1] - part.shape[1])), constant_values=-np.inf)
  # (regula falsi's first probe sums the maxima piece by piece, so there the two may round
  # apart: both must be valid and within the slack)
  ts = [np.asarray(kgpu.threshold(m, 100, iters=14, num_warps=8, interpret=False, slack=slack))
        for m in (part, padded)]
  if not slack:
    np.testing.assert_array_equal(*ts)
  for m, t in zip((part, padded), ts):
    n = (np.asarray(m) >= t[:, None]).sum(1)
    assert (n[[0, 1, 3]] >= 100).all() and (slack == 0 or (n[[0, 1, 3]] <= 100 + slack).all())


def test_fp8_queries_gpu():
  rng = np.random.default_rng(12)
  q, kc, table, lens, w, ks = random_paged(rng, 3, 2, 64, 128, 9000, 400, "float8_e4m3fn")
  q8, qs = quantize_fp8(q)
  out = jaxsparse.paged_indexer_scores(q8, kc, table, lens, w * qs, k_scale=ks,
                                       implementation="pallas")
  assert_scores_close(out, np_indexer.paged(q8, kc, table, lens, w * qs, ks), reduction=64 * 128, dtype_tol=GPU_TOL)
  t, n = 200, 5000
  qd = jnp.asarray(rng.standard_normal((t, 64, 128)), jnp.bfloat16)
  kd, sd = quantize_fp8(jnp.asarray(rng.standard_normal((n, 128)), jnp.float32))
  qd8, qds = quantize_fp8(qd)
  wd = jnp.asarray(rng.standard_normal((t, 64)), jnp.float32) * qds
  pos = jnp.asarray(np.sort(rng.integers(0, n, t)), jnp.int32)
  outd = jaxsparse.indexer_scores(qd8, kd, wd, k_scale=sd, query_positions=pos,
                                  implementation="pallas")
  assert_scores_close(outd, np_indexer.dense(qd8, kd, wd, sd, pos), reduction=64 * 128, dtype_tol=GPU_TOL)


@pytest.mark.parametrize("reduction,explore", [("A1", "random"), ("A2", "random"),
                                               ("A1", "query")])
def test_spin_step_gpu_matches_masked_reference(reduction, explore):
  from jaxsparse import spin
  rng = np.random.default_rng(13)
  bsz = 4
  q, kc, table, lens, w, _ = random_paged(rng, bsz, 1, 64, 128, 40000, 3000, "bfloat16")
  q, w = q[:, 0], w[:, 0]
  table = jnp.asarray(np.stack([rng.permutation(3000)[:625] for _ in range(bsz)]), jnp.int32)
  cfg = spin.SpinConfig(block_size=64, topk=512, sparsity=0.4, reduction=reduction,
                        explore=explore)
  st = spin.init_state(625 * 64, cfg, (bsz,), head_dim=128 if explore == "query" else None)
  key = jax.random.PRNGKey(0)
  _, _, st, _ = spin.decode_step(st, q, kc, table, lens, w, cfg, key, implementation="pallas")
  v, i, st, info = spin.decode_step(st, q, kc, table, lens, w, cfg, key, implementation="pallas")
  z = np_indexer.paged(q[:, None], kc, table, lens, w[:, None])[:, 0]
  m = np.repeat(np.asarray(info["block_masks"]), 64, axis=1)
  rv, _ = np_topk(np.where(m, z, -np.inf).astype(np.float32), 512, np.asarray(lens))
  np.testing.assert_allclose(np.asarray(v), rv, rtol=2e-2, atol=1e-2)
  assert (np.asarray(info["realized_sparsity"]) > 0.3).all()


def test_spin_block_ranking_kernel_gpu():
  """spin.top_mask runs the Pallas ranking kernel on a GPU: same blocks as the stable argsort."""
  from jaxsparse import spin
  rng = np.random.default_rng(21)
  for length, ties in ((2048, False), (8192, True), (100, True)):
    x = rng.standard_normal(length).astype(np.float32)
    if ties:
      x = np.round(x * 4) / 4
    elig = rng.random(length) < 0.8
    for n in (0, 1, int(elig.sum()) // 2, int(elig.sum())):
      got = np.asarray(jax.jit(spin.top_mask)(jnp.asarray(x), jnp.asarray(elig), n))
      ref = np.asarray(spin.algorithm._rank_desc(jnp.asarray(x), jnp.asarray(elig)) < n)
      np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_spin_update_kernel_gpu(state_dtype):
  """The in-place V/D update kernel, compiled, equals the XLA update per request."""
  from jaxsparse import spin
  rng = np.random.default_rng(23)
  cfg = spin.SpinConfig(block_size=64, topk=64, sparsity=0.4, state_dtype=state_dtype)
  bsz, nb, width = 4, 40, 30
  cap = nb * 64
  st = spin.init_state(cap, cfg, (bsz,))
  st = with_block_max({**st, "V": jnp.asarray(rng.standard_normal((bsz, cap)), state_dtype),
                        "D": jnp.asarray(rng.standard_normal((bsz, cap)), state_dtype)}, 64)
  lengths = jnp.asarray([cap, 2000, 700, 65], jnp.int32)
  sel = np.full((bsz, width), -1, np.int32)
  for b in range(bsz):
    nblk = -(-int(lengths[b]) // 64)
    pick = np.sort(rng.choice(nblk, min(width, max(1, nblk * 3 // 5)), replace=False))
    sel[b, :len(pick)] = pick
  sel = jnp.asarray(sel)
  z = jnp.asarray(rng.standard_normal((bsz, width * 64)), jnp.float32)
  want = jax.vmap(spin.update_blocks, in_axes=(0, 0, 0, 0, 0, None))(st, z, sel, lengths - 1,
                                                                     lengths, cfg)
  for bpp, warps, pos in ((8, None, True), (32, None, False), (8, 4, True)):
    got = jax.jit(lambda s, z, sel, l: spin.update_batched(
        s, z, sel, l - 1 if pos else None, l, cfg, blocks_per_program=bpp,
        num_warps=warps)[0])(st, z, sel, lengths)
    for name in want:
      np.testing.assert_allclose(np.asarray(got[name], np.float32),
                                 np.asarray(want[name], np.float32), rtol=1e-5, atol=1e-6,
                                 err_msg=name)


@pytest.mark.parametrize("reduction,state_dtype", [("A2", "bfloat16"), ("A1", "float32"),
                                                   ("A1", "bfloat16")])
def test_spin_select_kernel_gpu(reduction, state_dtype):
  """The compiled selection kernel picks and compacts what the XLA selection does (same key):
  2048 blocks, ragged lengths, a cold request."""
  from jaxsparse import spin
  rng = np.random.default_rng(41)
  cfg = spin.SpinConfig(block_size=64, topk=2048, sparsity=0.4, reduction=reduction,
                        state_dtype=state_dtype)
  nb = 2048
  lengths = jnp.asarray([nb * 64, 100000, 5000, 64, 70], jnp.int32)
  st = spin_state_case(rng, cfg, 5, nb, lengths, warm=[True, True, True, True, False])
  width = spin.serving._aligned_width(spin.max_selected_blocks(nb, cfg), nb)
  key = jax.random.PRNGKey(7)
  table = jnp.asarray(rng.integers(-5, 9000, (5, nb)), jnp.int32)  # some out of range
  f = jax.jit(lambda st, l, kernel: spin.select_compact_batched(
      st, None if kernel else l - 1, l, cfg, key, width, kernel=kernel, block_table=table,
      num_pages=8192, advance_step=True), static_argnums=2)
  got, want = f(st, lengths, True), f(st, lengths, False)
  assert len(got) == len(want) == 7  # masks, sel, counts, selected, pages, length rows, step
  for g, r in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_spin_block_score_kernel_gpu():
  """The compiled A1 block-score kernel equals the XLA max pooling at 2048 blocks: full,
  ragged, block-aligned, one-slot and empty contexts."""
  from jaxsparse import spin
  from pallas_kernels.spin import block_scores_max_gpu
  rng = np.random.default_rng(47)
  cap = 131072
  lengths = jnp.asarray([cap, 100001, 4096, 1, 0], jnp.int32)
  v = jnp.asarray(np.round(rng.standard_normal((5, cap)) * 4) / 4, jnp.bfloat16)
  d = jnp.asarray(np.round(rng.standard_normal((5, cap)) * 4) / 4, jnp.bfloat16)
  vm = v.reshape(5, -1, 64).max(-1)
  got = jax.jit(lambda vm, v, d, l: block_scores_max_gpu(vm, v, d, l - 1, l, page=64))(
      vm, v, d, lengths)
  want = jax.vmap(lambda v, d, l: spin.algorithm._max_pooled_block_scores({"V": v, "D": d}, l - 1, l, 64))(
      v, d, lengths)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_spin_block_state_kernel_gpu():
  """The compiled update kernel under A2 equals the XLA update; its group maxima equal z's."""
  from jaxsparse import spin
  rng = np.random.default_rng(43)
  cfg = spin.SpinConfig(block_size=64, topk=64, sparsity=0.4, reduction="A2")
  bsz, nb, width = 4, 40, 30
  sel, z, lengths = spin_selection_case(rng, bsz, nb, 64, width)
  st = spin_state_case(rng, cfg, bsz, nb, lengths)
  want = spin.update_block_states(st, z, sel, lengths - 1, lengths, cfg)
  got, gm = jax.jit(lambda s, z, sel, l: spin.update_batched(
      s, z, sel, l - 1, l, cfg, group=4))(st, z, sel, lengths)
  for name in ("VB", "DB", "age", "step", "warm"):
    np.testing.assert_allclose(np.asarray(got[name], np.float32),
                               np.asarray(want[name], np.float32), rtol=1e-6, err_msg=name)
  np.testing.assert_array_equal(np.asarray(gm), np.asarray(z).reshape(bsz, -1, 4).max(-1))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("bt,bn,stages", [(4, 64, 2), (8, 128, 2), (2, 64, 4)])
def test_prefill_mosaic_kernel_gpu(bt, bn, stages, fp8):
  """The Mosaic GPU prefill kernel against the float32 reference: random causal positions
  (some queries see nothing), key tiles past every query of a group; bf16, and fp8 q and k
  with per-key scales."""
  from pallas_kernels.indexer_prefill.mgpu import prefill_scores_mgpu
  rng = np.random.default_rng(31)
  t, h, d, n = 64, 64, 128, 2048
  q, k, w, pos, ks = prefill_case(rng, t, h, d, n, fp8=fp8, max_pos=n // 2)
  got = jax.jit(lambda *a: prefill_scores_mgpu(*a, block_t=bt, block_n=bn,
                                               max_concurrent_steps=stages))(q, k, w, pos, ks)
  assert_scores_close(got, np_indexer.dense(q, k, w, ks, pos), reduction=h * d, dtype_tol=GPU_TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8 q+k", "fp8 keys"])
@pytest.mark.parametrize("pages,steps", [(32, 4), (64, 2)])
def test_decode_mosaic_kernel_gpu(dtype, pages, steps):
  """The Mosaic GPU paged decode kernel against the reference: random block tables, ragged
  lengths (1 slot, one page, mid-page, full), runs past every length."""
  from pallas_kernels.indexer_decode.mgpu import decode_scores_mgpu
  from jaxsparse._bench.cases import ragged_paged_case
  q, kc, table, lens, w = ragged_paged_case(np.random.default_rng(37))
  h, d = q.shape[1:]
  ks = None
  if dtype == "fp8 q+k":
    q, qs = quantize_fp8(q)
    w = w * qs
  if dtype != "bfloat16":
    kc, ks = quantize_fp8(kc)
  got = jax.jit(lambda *a: decode_scores_mgpu(*a, pages=pages, steps=steps))(q, kc, table, lens,
                                                                           w, ks)
  ref = np_indexer.paged(q[:, None], kc, table, lens, w[:, None], ks)[:, 0]
  assert_scores_close(got, ref, reduction=h * d, dtype_tol=GPU_TOL)


def test_decode_mosaic_kernel_block_sparse_gpu():
  """The Mosaic decode kernel in block-sparse mode (SPIN's selected pages + logical ids, -1
  padding last) equals the full scores gathered at the selected slots."""
  from pallas_kernels.indexer_decode.mgpu import decode_scores_mgpu
  rng = np.random.default_rng(41)
  b, h, d, nb, mb = 3, 64, 128, 500, 80
  q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
  kc = jnp.asarray(rng.standard_normal((nb, 64, d)), jnp.bfloat16)
  table = rng.integers(0, nb, (b, mb)).astype(np.int32)
  lens = np.asarray([mb * 64, 3000, 100], np.int32)
  w = jnp.asarray(rng.standard_normal((b, h)), jnp.float32)
  width = 40
  sel = np.full((b, width), -1, np.int32)
  for i in range(b):
    nblk = -(-int(lens[i]) // 64)
    pick = np.sort(rng.choice(nblk, min(width, max(1, nblk * 3 // 5)), replace=False))
    sel[i, :len(pick)] = pick
  phys = np.take_along_axis(table, np.maximum(sel, 0), axis=1)
  got = np.asarray(jax.jit(lambda *a: decode_scores_mgpu(*a[:5], logical=a[5]))(
      q, kc, jnp.asarray(phys), jnp.asarray(lens), w, jnp.asarray(sel)))
  full = np_indexer.paged(q[:, None], kc, table, lens, w[:, None])[:, 0]
  slots = (sel[:, :, None] * 64 + np.arange(64)).reshape(b, -1)
  ok = (np.repeat(sel, 64, axis=1) >= 0) & (slots < lens[:, None])
  ref = np.where(ok, np.take_along_axis(full, np.where(ok, slots, 0), axis=1), -np.inf)
  assert_scores_close(got, ref, reduction=h * d, dtype_tol=GPU_TOL)


def test_kernel_time_gpu():
  """The device-trace timer sees the kernels of a call: a 1 GiB bf16 scale-and-copy moves 2 GiB,
  so it takes at least what the H200's ~4.9 TB/s HBM peak allows and at most ten times that."""
  from jaxsparse._bench.timing import kernel_time
  x = jnp.ones((1 << 29,), jnp.bfloat16)
  total, per = kernel_time(jax.jit(lambda x: x * 2), (x,), calls=5)
  floor = 2 * x.nbytes / 4.9e12
  assert floor <= total <= 10 * floor, (total, per)
  assert abs(sum(per.values()) - total) < 1e-9
  # a donated, threaded state is updated in place: no copy kernel beside the update
  step = jax.jit(lambda s, x: s + x, donate_argnums=0)
  total, per = kernel_time(step, (jnp.zeros_like(x), x), calls=5, carry=(0, None))
  assert not any("memcpy" in name or "copy" in name for name in per), per
  assert floor * 1.5 <= total <= 10 * floor * 1.5, (total, per)


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_topk_gpu(fp8):
  """prefill_topk's kernel path compiled (on Hopper the Mosaic scoring kernel with keys split
  over CTAs: 16-query chunks are 4 query groups) gives exactly the kernel scores' top-K, and
  its values are the float64 scores of the keys it picks."""
  rng = np.random.default_rng(2 + fp8)
  q, k, w, pos, ks = prefill_case(rng, 300, 64, 128, 5000, fp8=fp8)
  v, i = jaxsparse.prefill_topk(q, k, w, 256, k_scale=ks, query_positions=pos)
  z = jaxsparse.indexer_scores(q, k, w, k_scale=ks, query_positions=pos)
  zv, zi = jaxsparse.topk(z, 256)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(zi))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(zv))
  ref = np_indexer.dense(q, k, w, ks, pos)
  ii = np.asarray(i)
  picked = np.where(ii >= 0, np.take_along_axis(ref, np.maximum(ii, 0), 1), -np.inf)
  assert_scores_close(v, picked, reduction=64 * 128, dtype_tol=GPU_TOL)


def test_causal_prefill_topk_gpu():
  """causal_prefill_topk compiled: segments of a 3,000-token sequence give exactly
  prefill_topk's entries over all keys."""
  rng = np.random.default_rng(7)
  q, k, w, _, _ = prefill_case(rng, 3000, 64, 128, 3000)
  v, i = jaxsparse.causal_prefill_topk(q, k, w, 512, segments=5)
  fv, fi = jaxsparse.prefill_topk(q, k, w, 512, query_positions=jnp.arange(3000))
  np.testing.assert_array_equal(np.asarray(i), np.asarray(fi))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(fv))


def test_ivf_kernels_gpu():
  """AttentionIndex's kernels compiled (k-means assignment, gathered-candidate, ranked-group
  walk and representative scoring) against float64, and the whole prefill with them against
  XLA, also under a grouping metric, and through the sharded driver."""
  from jaxsparse.backend import KernelPlatform
  from tests import test_ivf_kernels as t
  gpu = KernelPlatform("gpu", False)
  t.test_assignment_matches_numpy(gpu, 1000, 300, 64)
  t.test_assignment_matches_numpy(gpu, 300, 70, 32)
  for dt in (jnp.float32, jnp.bfloat16):
    t.test_gathered_and_representative_scores_match_numpy(gpu, dt)
    t.test_ranked_group_walk_scores_the_packed_candidates(dt, gpu)
  from jaxsparse import ivf
  rng = np.random.default_rng(1)
  n, h, d = 2048, 8, 64
  k = (rng.standard_normal((16, d))[rng.integers(0, 16, n)]
       + 0.3 * rng.standard_normal((n, d))).astype(np.float32)
  q = rng.standard_normal((n, h, d)).astype(np.float32)
  w = rng.uniform(0, 1, (n, h)).astype(np.float32)
  q, k = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)  # exact products in the MMAs
  cfg = ivf.IVFConfig(topk=64, budget=768, seal_window=256, cluster_size=32, refit_interval=1024)
  want = ivf.prefill_topk(q, k, w, cfg, implementation="xla")
  got = ivf.prefill_topk(q, k, w, cfg, implementation="pallas")
  assert (got[0] == want[0]).mean() > 0.999  # float32 sums in another order: rare near-ties
  # shared query blocks: the dense prefill scoring kernel over each block's gathered keys
  cfg = dataclasses.replace(cfg, budget=1536, query_block=64)
  want = ivf.prefill_topk(q, k, w, cfg, implementation="xla")
  got = ivf.prefill_topk(q, k, w, cfg, implementation="pallas")
  np.testing.assert_array_equal(got[1], want[1])
  assert (got[0] == want[0]).mean() > 0.999
  # under a grouping metric: mapped keys through the assignment kernel, mapped queries
  # through the representative kernel; the metric changes the result
  from jaxsparse.ivf import metric
  a = metric.fit(np.asarray(q, np.float32) * np.linspace(0.3, 2, d), np.asarray(k, np.float32), w)
  cfg = dataclasses.replace(cfg, budget=768, query_block=1)
  want = ivf.prefill_topk(q, k, w, cfg, implementation="xla", metric=a)
  got = ivf.prefill_topk(q, k, w, cfg, implementation="pallas", metric=a)
  plain = ivf.prefill_topk(q, k, w, cfg, implementation="pallas")
  np.testing.assert_array_equal(got[1], want[1])
  assert (got[0] == want[0]).mean() > 0.999 and (got[0] != plain[0]).any()
  # the sharded driver on this one device, seal only: the single-device kernels' result
  from jaxsparse.distributed import sharded_ivf_prefill_topk
  cfg = dataclasses.replace(cfg, refit_interval=0)
  want = ivf.prefill_topk(q, k, w, cfg, implementation="pallas")
  got = sharded_ivf_prefill_topk(q, k, w, cfg, implementation="pallas")
  np.testing.assert_array_equal(got[1], np.asarray(want[1]))
  assert (got[0] == np.asarray(want[0])).mean() > 0.999


@pytest.mark.parametrize("script,args", [
    ("decode_mgpu.py", ["--shapes", "2x8192", "--configs", "32:4"]),
    ("prefill_mgpu.py", ["--keys", "8192", "--configs", "4:64:2"])])
def test_mosaic_tuning_scripts_run(script, args, tmp_path):
  """The Mosaic GPU tuning sweeps at one small shape: they check, time and write rows."""
  import json
  from tests.test_benchmarks import _run
  out = tmp_path / "r.json"
  _run(script, *args, "--out", str(out))
  rows = json.loads(out.read_text())["rows"]
  assert rows and not any(r.get("error") for r in rows)

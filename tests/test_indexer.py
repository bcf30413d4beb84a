"""Indexer reference and kernels (GPU and TPU kernels in interpret mode) against float64 numpy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxsparse
from jaxsparse.backend import KernelPlatform
from jaxsparse.prep import quantize_fp8
from pallas_kernels import indexer_decode, indexer_prefill
from tests.conftest import assert_scores_close, export_for
from tests.reference import np_indexer, prefill_case, random_paged

GPU_I = KernelPlatform("gpu", True)
TPU_I = KernelPlatform("tpu", True)
DTYPES = ["bfloat16", "float32", "float8_e4m3fn"]


def _dense_inputs(rng, t, h, d, n, key_dtype):
  q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  ks = None
  if key_dtype == "float8_e4m3fn":
    k, ks = quantize_fp8(k)
  else:
    k = k.astype(key_dtype)
  w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  return q, k, w, ks


@pytest.mark.parametrize("key_dtype", DTYPES)
def test_xla_reference_matches_numpy(key_dtype):
  rng = np.random.default_rng(0)
  q, k, w, ks = _dense_inputs(rng, 9, 4, 32, 77, key_dtype)
  pos = jnp.asarray(rng.integers(-1, 77, 9), jnp.int32)
  out = jaxsparse.indexer_scores(q, k, w, k_scale=ks, query_positions=pos, implementation="xla")
  assert_scores_close(out, np_indexer.dense(q, k, w, ks, pos), dtype_tol=1e-5)


@pytest.mark.parametrize("platform", [GPU_I, TPU_I], ids=["gpu", "tpu"])
@pytest.mark.parametrize("key_dtype", DTYPES)
@pytest.mark.parametrize("t,h,n,causal", [(13, 8, 300, True), (8, 16, 256, False),
                                          (1, 8, 129, True)])
def test_prefill_kernel(platform, key_dtype, t, h, n, causal):
  rng = np.random.default_rng(t * n + h)
  q, k, w, ks = _dense_inputs(rng, t, h, 64, n, key_dtype)
  pos = jnp.asarray(np.sort(rng.integers(0, n, t)), jnp.int32) if causal else None
  cfg = (indexer_prefill.PrefillConfig(block_t=2, block_n=32, tiles_per_program=2)
         if platform.kind == "gpu" else indexer_prefill.PrefillConfig(block_t=8, block_n=128,
                                                                      tiles_per_program=1))
  out = indexer_prefill.prefill_scores(q, k, w, k_scale=ks, query_positions=pos, config=cfg,
                                       platform=platform)
  assert_scores_close(out, np_indexer.dense(q, k, w, ks, pos), reduction=h * 64)


def test_prefill_skips_tiles_above_diagonal_and_writes_them():
  """Queries at the very start: nearly every tile is above the diagonal and must still be -inf."""
  rng = np.random.default_rng(5)
  q, k, w, _ = _dense_inputs(rng, 4, 8, 64, 512, "bfloat16")
  pos = jnp.asarray([0, 1, 2, 3], jnp.int32)
  for platform, cfg in [(GPU_I, indexer_prefill.PrefillConfig(block_t=2, block_n=32,
                                                              tiles_per_program=2)),
                        (TPU_I, indexer_prefill.PrefillConfig(block_t=8, block_n=128,
                                                              tiles_per_program=1))]:
    out = np.asarray(indexer_prefill.prefill_scores(q, k, w, query_positions=pos, config=cfg,
                                                    platform=platform))
    assert np.isneginf(out[:, 4:]).all()
    assert np.isfinite(out[3, :4]).all()


@pytest.mark.parametrize("platform", [GPU_I, TPU_I], ids=["gpu", "tpu"])
@pytest.mark.parametrize("key_dtype", DTYPES)
@pytest.mark.parametrize("bsz,rows,heads,max_len", [(3, 1, 8, 300), (2, 3, 8, 130),
                                                    (1, 4, 16, 64)])
def test_decode_kernel(platform, key_dtype, bsz, rows, heads, max_len):
  rng = np.random.default_rng(bsz * 100 + rows * 10 + heads)
  q, kc, table, lens, w, ks = random_paged(rng, bsz, rows, heads, 64, max_len, 11, key_dtype)
  cfg = indexer_decode.DecodeConfig(pages_per_step=1, steps_per_program=2)
  out = indexer_decode.decode_scores(q, kc, table, lens, w, k_scale=ks, config=cfg,
                                     platform=platform)
  assert_scores_close(out, np_indexer.paged(q, kc, table, lens, w, ks), reduction=heads * 64)


def test_decode_public_api_single_row_and_jit():
  rng = np.random.default_rng(1)
  q, kc, table, lens, w, ks = random_paged(rng, 2, 1, 8, 64, 200, 9)
  ref = np_indexer.paged(q, kc, table, lens, w)[:, 0]
  for impl in ("xla", "pallas"):
    out = jaxsparse.paged_indexer_scores(q[:, 0], kc, table, lens, w[:, 0], implementation=impl)
    assert out.shape == (2, 256)
    assert_scores_close(out, ref, reduction=8 * 64)
  f = jax.jit(lambda *a: jaxsparse.paged_indexer_scores(*a, implementation="pallas"))
  a = f(q[:, 0], kc, table, lens, w[:, 0])
  b = f(q[:, 0], kc, table, lens, w[:, 0])
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # deterministic


def test_decode_group_max_output():
  rng = np.random.default_rng(2)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 1, 8, 64, 500, 12)
  z, gm = indexer_decode.decode_scores(q, kc, table, lens, w, platform=GPU_I, group_max=16,
                                       config=indexer_decode.DecodeConfig(pages_per_step=1,
                                                                          steps_per_program=2))
  np.testing.assert_array_equal(np.asarray(gm), np.asarray(z).reshape(2, 1, -1, 16).max(-1))


@settings(max_examples=8, deadline=None)
@given(t=st.integers(1, 12), n=st.integers(1, 200), h=st.sampled_from([4, 8]),
       seed=st.integers(0, 10_000))
def test_prefill_kernel_property(t, n, h, seed):
  rng = np.random.default_rng(seed)
  q, k, w, _ = _dense_inputs(rng, t, h, 32, n, "bfloat16")
  pos = jnp.asarray(rng.integers(-1, n + 3, t), jnp.int32)
  out = jaxsparse.indexer_scores(q, k, w, query_positions=pos, implementation="pallas",
                                 config=indexer_prefill.PrefillConfig(block_t=2, block_n=32,
                                                                      tiles_per_program=2))
  assert_scores_close(out, np_indexer.dense(q, k, w, None, pos), reduction=h * 32)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kernels_lower_from_cpu(platform):
  """TPU kernels lower for TPU (Mosaic) and GPU kernels to Triton IR, without the hardware."""
  S = jax.ShapeDtypeStruct
  kind = "tpu" if platform == "tpu" else "gpu"
  plat = KernelPlatform(kind, False)
  cfg = indexer_prefill.config.TPU_DEFAULT if kind == "tpu" else None
  for kd in (jnp.bfloat16, jnp.float8_e4m3fn):
    sc = S((4096,), jnp.float32) if kd == jnp.float8_e4m3fn else None
    f = lambda q, k, w, s, p: indexer_prefill.prefill_scores(q, k, w, k_scale=s,
                                                             query_positions=p, platform=plat,
                                                             config=cfg)
    ex = export_for(f, platform,
        S((64, 64, 128), jnp.bfloat16), S((4096, 128), kd), S((64, 64), jnp.float32), sc,
        S((64,), jnp.int32))
    assert "jaxsparse_prefill" in ex.mlir_module() or "tpu_custom_call" in ex.mlir_module() \
        or "triton" in ex.mlir_module()
    sc2 = S((100, 64), jnp.float32) if kd == jnp.float8_e4m3fn else None
    g = lambda q, k, t, l, w, s: indexer_decode.decode_scores(q, k, t, l, w, k_scale=s,
                                                              platform=plat)
    export_for(g, platform,
        S((2, 2, 64, 128), jnp.bfloat16), S((100, 64, 128), kd), S((2, 32), jnp.int32),
        S((2,), jnp.int32), S((2, 2, 64), jnp.float32), sc2)


# ----------------------------------------------------------------------------- bad input


def _good_dense():
  rng = np.random.default_rng(0)
  return _dense_inputs(rng, 4, 8, 32, 50, "bfloat16")


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, w: (q, k[:, :16], w), "k.shape\\[1\\]"),
    (lambda q, k, w: (q, k, w[:, :4]), "w.shape"),
    (lambda q, k, w: (q.astype(jnp.int32), k, w), "q.dtype"),
    (lambda q, k, w: (q, k.astype(jnp.int8), w), "k.dtype"),
    (lambda q, k, w: (q[:0], k, w[:0]), "q is empty"),
    (lambda q, k, w: (q, k[:0], w), "k is empty"),
    (lambda q, k, w: (q[0], k, w), "q must be"),
])
def test_dense_bad_input(mutate, match):
  q, k, w, _ = _good_dense()
  with pytest.raises(ValueError, match=match):
    jaxsparse.indexer_scores(*mutate(q, k, w))


def test_dense_bad_scale_positions_implementation():
  q, k, w, _ = _good_dense()
  kf, ks = quantize_fp8(k)
  with pytest.raises(ValueError, match="k_scale is required"):
    jaxsparse.indexer_scores(q, kf, w)
  with pytest.raises(ValueError, match="k_scale.shape"):
    jaxsparse.indexer_scores(q, kf, w, k_scale=ks[:3])
  with pytest.raises(ValueError, match="k_scale.dtype"):
    jaxsparse.indexer_scores(q, kf, w, k_scale=ks.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="query_positions.shape"):
    jaxsparse.indexer_scores(q, k, w, query_positions=jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="query_positions.dtype"):
    jaxsparse.indexer_scores(q, k, w, query_positions=jnp.zeros((4,), jnp.float32))
  with pytest.raises(ValueError, match="implementation"):
    jaxsparse.indexer_scores(q, k, w, implementation="cuda")


def test_paged_bad_input():
  rng = np.random.default_rng(0)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 1, 8, 32, 100, 5)
  q, w = q[:, 0], w[:, 0]
  call = jaxsparse.paged_indexer_scores
  with pytest.raises(ValueError, match="block_table\\[0, 1\\]=9 points past the cache"):
    call(q, kc, table.at[0, 1].set(9), lens, w)
  with pytest.raises(ValueError, match="lengths must lie in"):
    call(q, kc, table, lens.at[0].set(10_000), w)
  with pytest.raises(ValueError, match="lengths must lie in"):
    call(q, kc, table, lens.at[0].set(-1), w)
  with pytest.raises(ValueError, match="k_cache.shape\\[1\\]"):
    call(q, kc[:, :32], table, lens, w)
  with pytest.raises(ValueError, match="q.shape\\[-1\\]"):
    call(q[..., :16], kc, table, lens, w)
  with pytest.raises(ValueError, match="w.shape"):
    call(q, kc, table, lens, w[:, :3])
  with pytest.raises(ValueError, match="block_table.shape\\[0\\]"):
    call(q, kc, table[:1], lens, w)
  with pytest.raises(ValueError, match="lengths.shape"):
    call(q, kc, table, lens[:1], w)
  with pytest.raises(ValueError, match="block_table.dtype"):
    call(q, kc, table.astype(jnp.float32), lens, w)
  with pytest.raises(ValueError, match="k_scale is required"):
    call(q, kc.astype(jnp.float8_e4m3fn), table, lens, w)
  with pytest.raises(ValueError, match="k_cache is empty"):
    call(q, kc[:0], table, lens, w)


@pytest.mark.parametrize("bad,match", [
    (dict(pages_per_step=3), "pages_per_step"), (dict(num_warps=0), "num_warps"),
    (dict(num_stages=0), "num_stages")])
def test_decode_config_validation(bad, match):
  with pytest.raises(ValueError, match=match):
    indexer_decode.DecodeConfig(**bad)


def test_prefill_config_validation():
  with pytest.raises(ValueError, match="block_n"):
    indexer_prefill.PrefillConfig(block_n=100)
  rng = np.random.default_rng(0)
  q, k, w, _ = _dense_inputs(rng, 4, 8, 64, 50, "bfloat16")
  with pytest.raises(NotImplementedError, match="block_t % 8"):
    indexer_prefill.prefill_scores(q, k, w, platform=TPU_I,
                                   config=indexer_prefill.PrefillConfig(block_t=2))


@pytest.mark.parametrize("platform", [GPU_I, TPU_I], ids=["gpu", "tpu"])
def test_fp8_queries_all_paths(platform):
  """fp8 x fp8 scoring (DeepSeek-V3.2's precision) matches the float64 reference on fp8 inputs."""
  rng = np.random.default_rng(11)
  q, kc, table, lens, w, ks = random_paged(rng, 2, 2, 8, 64, 200, 9, "float8_e4m3fn")
  q8, qs = quantize_fp8(q)
  w8 = w * qs
  out = indexer_decode.decode_scores(q8, kc, table, lens, w8, k_scale=ks, platform=platform,
                                     config=indexer_decode.DecodeConfig(pages_per_step=1,
                                                                        steps_per_program=2))
  assert_scores_close(out, np_indexer.paged(q8, kc, table, lens, w8, ks), reduction=8 * 64)
  qd, kd, wd, sd = _dense_inputs(rng, 5, 8, 64, 140, "float8_e4m3fn")
  qd8, qds = quantize_fp8(qd)
  pos = jnp.asarray(rng.integers(0, 140, 5), jnp.int32)
  cfg = (indexer_prefill.PrefillConfig(block_t=2, block_n=32, tiles_per_program=2)
         if platform.kind == "gpu" else indexer_prefill.config.TPU_DEFAULT)
  outd = indexer_prefill.prefill_scores(qd8, kd, wd * qds, k_scale=sd, query_positions=pos,
                                        platform=platform, config=cfg)
  assert_scores_close(outd, np_indexer.dense(qd8, kd, wd * qds, sd, pos), reduction=8 * 64)
  ref = jaxsparse.indexer_scores(qd8, kd, wd * qds, k_scale=sd, query_positions=pos,
                                 implementation="xla")
  assert_scores_close(ref, np_indexer.dense(qd8, kd, wd * qds, sd, pos), dtype_tol=1e-5)


def test_fp8_queries_need_fp8_keys():
  q, k, w, _ = _good_dense()
  with pytest.raises(ValueError, match="q.dtype=float8_e4m3fn needs k.dtype=float8_e4m3fn"):
    jaxsparse.indexer_scores(q.astype(jnp.float8_e4m3fn), k, w)


@settings(max_examples=8, deadline=None)
@given(bsz=st.integers(1, 3), rows=st.integers(1, 3), max_len=st.integers(1, 300),
       seed=st.integers(0, 10_000), kind=st.sampled_from(["gpu", "tpu"]))
def test_decode_kernel_property(bsz, rows, max_len, seed, kind):
  """Ragged lengths and row counts, shuffled block tables poisoned past each length."""
  rng = np.random.default_rng(seed)
  max_len = max(max_len, rows)
  q, kc, table, lens, w, _ = random_paged(rng, bsz, rows, 8, 32, max_len, 9, "bfloat16")
  out = indexer_decode.decode_scores(q, kc, table, lens, w, platform=KernelPlatform(kind, True),
                                     config=indexer_decode.DecodeConfig(pages_per_step=1,
                                                                        steps_per_program=2))
  assert_scores_close(out, np_indexer.paged(q, kc, table, lens, w), reduction=8 * 32)


def test_vmap_over_query_sets():
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((3, 5, 8, 32)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((70, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((3, 5, 8)), jnp.float32)
  pos = jnp.asarray(rng.integers(0, 70, (3, 5)), jnp.int32)
  f = jax.vmap(lambda q, w, p: jaxsparse.indexer_scores(
      q, k, w, query_positions=p, implementation="pallas",
      config=indexer_prefill.PrefillConfig(block_t=2, block_n=32, tiles_per_program=2)))
  out = f(q, w, pos)
  for i in range(3):
    assert_scores_close(out[i], np_indexer.dense(q[i], k, w[i], None, pos[i]), reduction=8 * 32)


@pytest.mark.parametrize("bt,bn,stages", [(4, 64, 2), (8, 128, 2)])
def test_prefill_mosaic_kernel_lowers_for_cuda(bt, bn, stages):
  """The Mosaic GPU prefill kernel (TMA + wgmma) lowers for CUDA from the CPU; shapes it cannot
  tile are refused by name (its numbers are checked on the H200: tests/test_gpu.py)."""
  from pallas_kernels.indexer_prefill.mgpu import prefill_scores_mgpu
  t, h, d, n = 64, 64, 128, 1024
  sds = [jax.ShapeDtypeStruct(s, dt) for s, dt in (((t, h, d), jnp.bfloat16),
                                                    ((n, d), jnp.bfloat16),
                                                    ((t, h), jnp.float32), ((t,), jnp.int32))]
  exp = export_for(lambda q, k, w, p: prefill_scores_mgpu(
      q, k, w, p, block_t=bt, block_n=bn, max_concurrent_steps=stages), "cuda", *sds)
  assert "mosaic_gpu" in exp.mlir_module()
  with pytest.raises(ValueError, match="block_n"):
    prefill_scores_mgpu(jnp.zeros((t, h, d), jnp.bfloat16), jnp.zeros((n + 8, d), jnp.bfloat16),
                        jnp.zeros((t, h)), jnp.zeros((t,), jnp.int32), block_n=bn)


def test_prefill_kernel_choice_is_validated():
  """PrefillConfig.kernel: unknown names are refused; "mosaic" where it cannot run (float32
  inputs) raises instead of silently running another kernel."""
  with pytest.raises(ValueError, match="kernel"):
    indexer_prefill.PrefillConfig(kernel="cutlass")
  with pytest.raises(ValueError, match="mosaic_steps"):
    indexer_prefill.PrefillConfig(mosaic_steps=0)
  q = jnp.zeros((8, 64, 128), jnp.float32)
  k = jnp.zeros((256, 128), jnp.float32)
  w = jnp.zeros((8, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match="Mosaic"):  # no float32 wgmma path
    indexer_prefill.prefill_scores(q, k, w, config=indexer_prefill.PrefillConfig(kernel="mosaic"),
                                   platform=GPU_I)


@pytest.mark.parametrize("dtype,scaled", [("bfloat16", False), ("float8_e4m3fn", True),
                                          ("mixed", True)])
def test_decode_mosaic_kernel_lowers_for_cuda(dtype, scaled):
  """The Mosaic GPU paged decode kernel lowers for CUDA from the CPU (bf16, and fp8 q+k with
  per-slot scales); mismatched dtypes and bad tilings are refused by name."""
  from pallas_kernels.indexer_decode.mgpu import decode_scores_mgpu
  b, h, d, nb, mb = 4, 64, 128, 300, 70
  dt = jnp.dtype(jnp.float8_e4m3fn if dtype == "mixed" else dtype)
  qt = jnp.dtype(jnp.bfloat16) if dtype == "mixed" else dt
  sds = [jax.ShapeDtypeStruct(s, t) for s, t in (((b, h, d), qt), ((nb, 64, d), dt),
                                                  ((b, mb), jnp.int32), ((b,), jnp.int32),
                                                  ((b, h), jnp.float32))]
  if scaled:
    sds.append(jax.ShapeDtypeStruct((nb, 64), jnp.float32))
  for pages in (32, 16, 8):  # runs shorter than a 32-entry table row share it
    exp = export_for(lambda *a: decode_scores_mgpu(*a, pages=pages, steps=4), "cuda", *sds)
    assert "mosaic_gpu" in exp.mlir_module()
  z = jnp.zeros
  with pytest.raises(ValueError, match="q and k_cache"):
    decode_scores_mgpu(z((b, h, d), jnp.float8_e4m3fn), z((nb, 64, d), jnp.bfloat16),
                       z((b, mb), jnp.int32), z((b,), jnp.int32), z((b, h)))
  with pytest.raises(ValueError, match="pages"):
    decode_scores_mgpu(z((b, h, d), jnp.bfloat16), z((nb, 64, d), jnp.bfloat16),
                       z((b, mb), jnp.int32), z((b,), jnp.int32), z((b, h)), pages=48)


def test_decode_mosaic_run_length_follows_the_cta_count():
  """mosaic_pages=None: 32-page runs while a call gets >= MOSAIC_MIN_CTAS CTAs, shorter runs
  for small batches; an explicit value is kept."""
  from pallas_kernels.indexer_decode.config import MOSAIC_MIN_CTAS
  cfg = indexer_decode.DecodeConfig()
  assert cfg.mosaic_pages_for(64, 2048) == 32
  assert cfg.mosaic_pages_for(1, 16384) == 32
  assert cfg.mosaic_pages_for(1, 2048) == 16  # 1 x 128K slots: 64 CTAs of 32 pages are too few
  assert cfg.mosaic_pages_for(1, 512) == 8
  assert 1 * -(-2048 // 16) >= MOSAIC_MIN_CTAS > 2048 // 32
  assert indexer_decode.DecodeConfig(mosaic_pages=64).mosaic_pages_for(1, 512) == 64


def test_decode_kernel_choice_is_validated():
  """DecodeConfig.kernel / mosaic_*: bad values are refused by name; "mosaic" where it cannot
  run (two verifier rows) raises instead of running another kernel."""
  for kw, name in ((dict(kernel="cuda"), "kernel"), (dict(mosaic_pages=48), "mosaic_pages"),
                   (dict(mosaic_pages=4), "mosaic_pages"),
                   (dict(mosaic_steps=0), "mosaic_steps")):
    with pytest.raises(ValueError, match=name):
      indexer_decode.DecodeConfig(**kw)
  rng = np.random.default_rng(3)
  q, kc, table, lens, w, _ = random_paged(rng, 2, 2, 8, 64, 300, 10)
  with pytest.raises(NotImplementedError, match="Mosaic"):  # verifier rows: Triton only
    indexer_decode.decode_scores(q, kc, table, lens, w, platform=GPU_I,
                                 config=indexer_decode.DecodeConfig(kernel="mosaic"))


@pytest.mark.parametrize("dtype,pages", [("bfloat16", 32), ("fp8 q+k", 32), ("fp8 keys", 32),
                                         ("block-sparse", 32), ("bfloat16", 8),
                                         ("block-sparse", 16)])
def test_decode_mosaic_kernel_interpret(dtype, pages):
  """The Mosaic GPU decode kernel in the Mosaic GPU interpreter (its TMA page gathers, pipeline,
  epilogue and masks; the MMA is a float32 dot there) against the reference: random block
  tables, ragged lengths, a run past every length; fp8 scales; SPIN's block-sparse mode; runs of
  8 and 16 pages (several CTAs per table row). Also through the public API with
  DecodeConfig(kernel="mosaic", mosaic_pages=pages)."""
  from pallas_kernels.indexer_decode.mgpu import decode_scores_mgpu
  rng = np.random.default_rng(17)
  b, h, d, nb, mb = 3, 32, 128, 90, 70
  q, kc, table, lens, w, _ = random_paged(rng, b, 1, h, d, mb * 64, nb)
  q, w = q[:, 0], w[:, 0]
  lens = jnp.asarray([mb * 64, 1, 1000], jnp.int32)
  ks = None
  if dtype == "fp8 q+k":
    q, qs = quantize_fp8(q)
    w = w * qs
  if dtype.startswith("fp8"):
    kc, ks = quantize_fp8(kc)
  ref = np_indexer.paged(q[:, None], kc, table, lens, w[:, None], ks)[:, 0]
  if dtype == "block-sparse":
    sel = np.full((b, 40), -1, np.int32)
    sel[0, :30] = np.sort(rng.choice(mb, 30, replace=False))
    sel[1, :1] = [0]
    sel[2, :10] = np.sort(rng.choice(16, 10, replace=False))
    phys = np.take_along_axis(np.asarray(table), np.maximum(sel, 0), axis=1)
    got = decode_scores_mgpu(q, kc, jnp.asarray(phys), lens, w, logical=jnp.asarray(sel),
                             pages=pages, interpret=True)
    slots = (sel[:, :, None] * 64 + np.arange(64)).reshape(b, -1)
    ok = (np.repeat(sel, 64, axis=1) >= 0) & (slots < np.asarray(lens)[:, None])
    ref = np.where(ok, np.take_along_axis(ref, np.where(ok, slots, 0), axis=1), -np.inf)
  else:
    got = decode_scores_mgpu(q, kc, table, lens, w, ks, pages=pages, interpret=True)
    api = jaxsparse.paged_indexer_scores(
        q, kc, table, lens, w, k_scale=ks, implementation="pallas",
        config=indexer_decode.DecodeConfig(kernel="mosaic", mosaic_pages=pages))
    np.testing.assert_array_equal(np.asarray(api), np.asarray(got))
  assert_scores_close(got, ref, reduction=h * d)


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_mosaic_kernel_interpret(fp8):
  """The Mosaic GPU prefill kernel in the Mosaic GPU interpreter against the reference: causal
  positions (some queries see nothing), key tiles past every query of a group, fp8 q and k with
  per-key scales; and through the public API with PrefillConfig(kernel="mosaic") at sizes that
  are not multiples of the tiles."""
  from pallas_kernels.indexer_prefill.mgpu import prefill_scores_mgpu
  rng = np.random.default_rng(19)
  t, h, d, n = 8, 16, 128, 512
  q, k, w, pos, ks = prefill_case(rng, t, h, d, n, fp8=fp8, max_pos=n // 2)
  got = prefill_scores_mgpu(q, k, w, pos, ks, block_t=4, block_n=64, interpret=True)
  assert_scores_close(got, np_indexer.dense(q, k, w, ks, pos), reduction=h * d)
  t2, n2 = 6, 300
  api = jaxsparse.indexer_scores(q[:t2], k[:n2], w[:t2], k_scale=None if ks is None else ks[:n2],
                                 query_positions=jnp.minimum(pos[:t2], n2 - 1),
                                 implementation="pallas",
                                 config=indexer_prefill.PrefillConfig(kernel="mosaic"))
  assert_scores_close(api, np_indexer.dense(q[:t2], k[:n2], w[:t2],
                                            None if ks is None else ks[:n2],
                                            jnp.minimum(pos[:t2], n2 - 1)), reduction=h * d)


def test_score_tolerance_catches_a_one_percent_error():
  """The kernels' oracle: a kernel whose outputs are 1% off fails assert_scores_close."""
  rng = np.random.default_rng(0)
  ref = rng.standard_normal((8, 300))
  ref[:, 250:] = -np.inf
  assert_scores_close(ref * (1 + 1e-7), ref, reduction=64 * 128)
  with pytest.raises(AssertionError, match="relative error"):
    assert_scores_close(ref * 1.01, ref, reduction=64 * 128)
  with pytest.raises(AssertionError, match="relative error"):
    assert_scores_close(ref * 1.001, ref, reduction=64 * 128)


def test_kernels_never_import_the_library_above_them():
  """pallas_kernels/ sits below jaxsparse/: no module there imports jaxsparse."""
  import ast
  import pathlib
  root = pathlib.Path(__file__).resolve().parents[1] / "pallas_kernels"
  bad = []
  for path in root.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "jaxsparse"]
  assert not bad, bad


def test_no_kernel_module_changes_the_jit_cache_key_after_import():
  """Importing any kernel module, or the Pallas backends they use, after `import jaxsparse`
  leaves jax's trace context (part of every jit cache key) as it was, so a compiled program is
  not compiled again: jax 0.11's `jax.experimental.pallas.tpu` adds a trace-context option,
  and a lazy import of it recompiled everything once (a fresh interpreter: this process has
  imported them all already)."""
  import subprocess
  import sys
  code = """
import importlib, pathlib, jax, jax.numpy as jnp
from jax._src import config
import jaxsparse, pallas_kernels
f = jax.jit(lambda x: x * 2)
f(jnp.ones(3))
before = config.trace_context()
root = pathlib.Path(pallas_kernels.__file__).parent
for p in sorted(root.rglob("*.py")):
  parts = p.relative_to(root.parent).with_suffix("").parts
  importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
for m in ("jax.experimental.pallas", "jax.experimental.pallas.tpu",
          "jax.experimental.pallas.triton", "jax.experimental.pallas.mosaic_gpu",
          "jax.experimental.checkify"):
  importlib.import_module(m)
f(jnp.ones(3))
print(len(before), len(config.trace_context()), f._cache_size())
"""
  root = __import__("pathlib").Path(__file__).resolve().parents[1]
  out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  n_before, n_after, compiled = map(int, out.stdout.split()[-3:])
  assert n_after == n_before and compiled == 1, out.stdout


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_traced_out_of_range_inputs_follow_the_documented_rule(implementation):
  """Under jit, lengths clamp to the table's capacity and a request that reads a page outside
  the cache scores -inf everywhere (`sanitize_paged`); checked=True raises through checkify,
  naming the argument."""
  from jax.experimental import checkify
  rng = np.random.default_rng(21)
  q, kc, table, _, w, _ = random_paged(rng, 3, 1, 8, 32, 8 * 64, 12)
  table = np.asarray(table).copy()
  table[:, :] = np.stack([rng.permutation(12)[:8] for _ in range(3)])
  table[1, 2] = 12  # past the cache, inside request 1's length
  table[2, 7] = -1  # past request 2's length: ignored
  lens = jnp.asarray([8 * 64 + 40, 300, 200], jnp.int32)
  f = jax.jit(lambda *a: jaxsparse.paged_indexer_scores(*a, implementation=implementation))
  z = np.asarray(f(q, kc, jnp.asarray(table), lens, w))
  want = np_indexer.paged(q, kc, table, np.asarray([8 * 64, 0, 200]), w)
  assert np.isneginf(z[1]).all() and np.isneginf(want[1]).all()
  assert_scores_close(z, want, reduction=8 * 32)
  with pytest.raises(ValueError, match="block_table"):  # concrete: eager ValueError
    jaxsparse.paged_indexer_scores(q, kc, jnp.asarray(table), jnp.asarray([512, 300, 200]), w)
  g = checkify.checkify(jax.jit(lambda *a: jaxsparse.paged_indexer_scores(
      *a, implementation=implementation, checked=True)))
  err, _ = g(q, kc, jnp.asarray(table), jnp.asarray([512, 300, 200], jnp.int32), w)
  with pytest.raises(checkify.JaxRuntimeError, match=r"block_table holds a page id outside \[0, 12\)"):
    err.throw()
  ok = table.copy()
  ok[1, 2] = 3
  err, _ = g(q, kc, jnp.asarray(ok), lens, w)
  with pytest.raises(checkify.JaxRuntimeError, match=r"lengths must lie in \[0, 512\]"):
    err.throw()
  err, _ = g(q, kc, jnp.asarray(ok), jnp.asarray([512, 300, 200], jnp.int32), w)
  err.throw()  # in range: no error


@pytest.mark.parametrize("pages_per_step,steps", [(1, 1), (2, 4), (4, 2), (1, 8)])
def test_tpu_decode_kernel_streams_runs_of_pages(pages_per_step, steps):
  """The TPU decode kernel honours its config: a run of pages_per_step * steps pages per
  program, pages_per_step copies per step double-buffered by hand (TPU interpret mode models
  the DMAs and semaphores); ragged lengths leave runs partly or wholly dead, verifier rows
  and fp8 scales ride along; it lowers for TPU with every tiling."""
  rng = np.random.default_rng(pages_per_step * 10 + steps)
  cfg = indexer_decode.DecodeConfig(pages_per_step=pages_per_step, steps_per_program=steps)
  for key_dtype, rows in (("bfloat16", 1), ("float8_e4m3fn", 2)):
    q, kc, table, lens, w, ks = random_paged(rng, 3, rows, 8, 64, 1100, 25, key_dtype)
    out = indexer_decode.decode_scores(q, kc, table, lens, w, k_scale=ks, config=cfg,
                                       platform=TPU_I)
    assert_scores_close(out, np_indexer.paged(q, kc, table, lens, w, ks), reduction=8 * 64)
  S = jax.ShapeDtypeStruct
  export_for(lambda q, kc, t, l, w: indexer_decode.decode_scores(
      q, kc, t, l, w, config=cfg, platform=KernelPlatform("tpu", False)), "tpu",
      S((4, 1, 64, 128), jnp.bfloat16), S((512, 64, 128), jnp.bfloat16),
      S((4, 128), jnp.int32), S((4,), jnp.int32), S((4, 1, 64), jnp.float32))

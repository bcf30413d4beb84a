"""DeepSeek-V3.2 indexer input preparation: RoPE, Hadamard, fp8, weights, packed cache."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse import prep


def test_rope_preserves_norm_and_relative_positions():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 2, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 16)), jnp.float32)
  for inter in (False, True):
    dots = []
    for shift in (0, 37):
      qr = prep.apply_rope(q, jnp.array([10 + shift]), rope_dims=8, interleaved=inter)
      kr = prep.apply_rope(k, jnp.array([3 + shift]), rope_dims=8, interleaved=inter)
      np.testing.assert_allclose(np.linalg.norm(qr, axis=-1), np.linalg.norm(q, axis=-1),
                                 rtol=1e-5)
      np.testing.assert_array_equal(qr[..., 8:], q[..., 8:])  # un-rotated tail passes through
      dots.append(np.asarray(jnp.einsum("thd,td->th", qr, kr)))
    np.testing.assert_allclose(dots[0], dots[1], rtol=1e-4, atol=1e-4)  # depends on offset only


def test_rope_pair_forms_differ_and_validate():
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8)), jnp.float32)
  a = prep.apply_rope(x, jnp.array([1, 2]), rope_dims=8)
  b = prep.apply_rope(x, jnp.array([1, 2]), rope_dims=8, interleaved=True)
  assert not np.allclose(a, b)
  with pytest.raises(ValueError, match="rope_dims"):
    prep.apply_rope(x, jnp.array([1, 2]), rope_dims=7)
  with pytest.raises(ValueError, match="x.shape"):
    prep.apply_rope(x, jnp.array([1, 2, 3]), rope_dims=8)


def test_hadamard_is_orthonormal_and_preserves_dots():
  rng = np.random.default_rng(2)
  q, k = rng.standard_normal((5, 64)), rng.standard_normal((7, 64))
  qh = prep.hadamard_rotate(jnp.asarray(q, jnp.float32))
  kh = prep.hadamard_rotate(jnp.asarray(k, jnp.float32))
  np.testing.assert_allclose(np.asarray(qh) @ np.asarray(kh).T, q @ k.T, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="power of two"):
    prep.hadamard_matrix(48)


def test_fp8_quantisation_power_of_two_scale():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((100, 128)).astype(np.float32) * rng.uniform(0.01, 100, (100, 1))
  x[5] = 0.0
  q, s = prep.quantize_fp8(jnp.asarray(x))
  s = np.asarray(s)
  assert q.dtype == jnp.float8_e4m3fn and s.dtype == np.float32
  np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))  # powers of two
  assert (np.abs(np.asarray(q, np.float32)).max(axis=1) <= 448).all()
  back = np.asarray(q, np.float32) * s[:, None]
  rel = np.abs(back - x).max(axis=1) / np.maximum(np.abs(x).max(axis=1), 1e-30)
  assert rel[np.arange(100) != 5].max() < 0.07
  assert s[5] == 1.0 and (back[5] == 0).all()


def test_fp8_scale_exact_over_the_float32_range():
  """Every amax from 2^-140 to 2^127 (powers of two and 3 x them): the scale is exactly
  2^ceil(log2(amax / 448)) (float64 reference), floored at 2^-126, 1 for a zero (or flushed
  subnormal) row; eagerly and under jit, in quantize_fp8 and the sharded prefill's copy."""
  import jax
  from jaxsparse.distributed import quantize_keys_fp8
  amax = np.array([m * 2.0 ** e for m in (1, 3) for e in range(-140, 128)]) * 448
  amax = amax[amax < np.finfo(np.float32).max].astype(np.float32)
  x = np.zeros((amax.size, 8), np.float32)
  x[:, 3] = -amax
  a = np.abs(x).max(-1).astype(np.float64)
  ref = np.where(a < 2.0 ** -126, 1.0, np.maximum(2.0 ** np.ceil(np.log2(a / 448)), 2.0 ** -126))
  for f in (prep.quantize_fp8, jax.jit(prep.quantize_fp8), quantize_keys_fp8):
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x))[1]), ref)
  with pytest.raises(ValueError, match="x.shape"):
    prep.quantize_fp8(jnp.zeros((3, 0)))


def test_hadamard_of_integers_is_float():
  x = np.arange(8, dtype=np.int32)
  r = prep.hadamard_rotate(jnp.asarray(x))
  assert r.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(r), x @ prep.hadamard_matrix(8) / np.sqrt(8),
                             rtol=1e-6, atol=1e-5)


def test_weights_scaling():
  proj = jnp.ones((3, 64), jnp.float32)
  w = prep.indexer_weights(proj, head_dim=128)
  np.testing.assert_allclose(w, np.full((3, 64), 64 ** -0.5 * 128 ** -0.5), rtol=1e-6)
  w2 = prep.indexer_weights(proj, head_dim=128, q_scale=jnp.full((3, 64), 2.0))
  np.testing.assert_allclose(w2, 2 * np.asarray(w), rtol=1e-6)


@pytest.mark.parametrize("fp8", [True, False])
def test_prepare_end_to_end_matches_unrotated_scores(fp8):
  """Hadamard leaves scores unchanged; fp8 keys stay close; each step can be switched off."""
  rng = np.random.default_rng(4)
  t, h, d, n = 6, 4, 64, 40
  q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  proj = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  pq, pk = jnp.arange(n - t, n), jnp.arange(n)
  q1, k1, s1, w1 = prep.prepare_indexer_inputs(q, k, proj, pq, pk, rope_dims=32, hadamard=True,
                                               fp8_keys=fp8)
  q0, k0, s0, w0 = prep.prepare_indexer_inputs(q, k, proj, pq, pk, rope_dims=32, hadamard=False,
                                               fp8_keys=False)
  assert (s1 is not None) == fp8 and s0 is None
  z1 = jaxsparse.indexer_scores(q1, k1, w1, k_scale=s1, implementation="xla")
  z0 = jaxsparse.indexer_scores(q0, k0, w0, implementation="xla")
  err = np.linalg.norm(np.asarray(z1) - np.asarray(z0)) / np.linalg.norm(np.asarray(z0))
  assert err < (0.06 if fp8 else 0.02)


def test_packed_fp8_cache_roundtrip():
  rng = np.random.default_rng(5)
  k, s = prep.quantize_fp8(jnp.asarray(rng.standard_normal((3 * 64, 128)), jnp.float32))
  kc, sc = k.reshape(3, 64, 128), s.reshape(3, 64)
  packed = prep.pack_fp8_paged_cache(kc, sc)
  assert packed.shape == (3, 64, 1, 132) and packed.dtype == jnp.uint8
  k2, s2 = prep.unpack_fp8_paged_cache(packed)
  np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(kc, np.float32))
  np.testing.assert_array_equal(np.asarray(s2), np.asarray(sc))
  with pytest.raises(ValueError, match="packed.shape"):
    prep.unpack_fp8_paged_cache(packed[:, :32])
  with pytest.raises(ValueError, match="packed.dtype"):
    prep.unpack_fp8_paged_cache(packed.astype(jnp.int8))

"""Causal prefill indexer scoring: public wrapper over the GPU and TPU kernels."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsparse.backend import KernelPlatform
from pallas_kernels._util import is_pow2, next_pow2, pad_axis
from pallas_kernels.indexer_prefill.config import TPU_DEFAULT, PrefillConfig
from pallas_kernels.indexer_prefill import gpu as _gpu
from pallas_kernels.indexer_prefill import tpu as _tpu

__all__ = ["PrefillConfig", "prefill_scores"]


def prefill_scores(q, k, w, *, k_scale=None, query_positions=None, config=None,
                   platform: KernelPlatform):
  """Kernel path of `jaxsparse.indexer_scores` (inputs already validated).

  q [T, H, D], k [N, D], w [T, H], k_scale [N] | None, query_positions [T] | None -> [T, N].
  Without query_positions every key is visible (non-causal scoring).
  """
  if config is None:
    config = TPU_DEFAULT if platform.kind == "tpu" else PrefillConfig()
  if not isinstance(config, PrefillConfig):
    raise ValueError(f"config={config!r} must be a PrefillConfig")
  return _prefill(q, k, w, k_scale, query_positions, config, platform)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _prefill(q, k, w, k_scale, query_positions, config, platform):
  t, h, d = q.shape
  n = k.shape[0]
  if not is_pow2(d):
    raise NotImplementedError(f"head dim D={d} must be a power of two for the Pallas kernels")
  if query_positions is None:
    pos = jnp.full((t,), n - 1, jnp.int32)
  else:
    pos = jnp.clip(query_positions.astype(jnp.int32), -1, n - 1)
  bt = config.block_t
  span = config.block_n * (config.tiles_per_program if platform.kind == "gpu" else 1)
  t_pad = -(-t // bt) * bt
  n_pad = -(-n // span) * span
  h_pad = next_pow2(h) if platform.kind == "gpu" else -(-h // 8) * 8
  if platform.kind == "gpu":
    h_pad = max(h_pad, 16 // bt)  # Triton dots need M >= 16
  qp = pad_axis(pad_axis(q, 0, t_pad), 1, h_pad)
  wp = pad_axis(pad_axis(w.astype(jnp.float32), 0, t_pad), 1, h_pad)
  pp = pad_axis(pos, 0, t_pad, value=-1)
  kp = pad_axis(k, 0, n_pad)
  sp = None if k_scale is None else pad_axis(k_scale, 0, n_pad, value=1.0)
  fn = _gpu.prefill_scores_gpu if platform.kind == "gpu" else _tpu.prefill_scores_tpu
  out = fn(qp, kp, wp, sp, pp, config=config, interpret=platform.interpret)
  return out[:t, :n]

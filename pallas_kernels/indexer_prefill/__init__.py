"""Causal prefill indexer scoring: public wrapper over the GPU and TPU kernels."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._platform import KernelPlatform
from pallas_kernels._util import clip_positions, is_pow2, next_pow2, pad_axis
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


def _use_mosaic(q, k, k_scale, config: PrefillConfig, platform: KernelPlatform) -> bool:
  """Whether the Mosaic GPU kernel takes this call (see `PrefillConfig.kernel`). A forced
  "mosaic" on a CPU-only machine runs it in the Mosaic GPU interpreter; "auto" never does."""
  from pallas_kernels import _mosaic
  from pallas_kernels.indexer_prefill import mgpu
  from pallas_kernels.indexer_prefill.config import MOSAIC_AUTO
  _, h, d = q.shape
  h8 = -(-h // 8) * 8
  item = jnp.dtype(q.dtype).itemsize
  bf16 = q.dtype == jnp.bfloat16 and k.dtype == jnp.bfloat16 and k_scale is None
  fp8 = q.dtype == jnp.float8_e4m3fn and k.dtype == jnp.float8_e4m3fn
  fits = ((bf16 or fp8) and (d * item) % 128 == 0 and h8 <= 256
          and mgpu.tiling_fits(config.block_t, config.block_n, h8, d, config.mosaic_steps, item))
  if config.kernel == "mosaic":
    if not (fits and (platform.interpret or _mosaic.is_hopper_or_newer())):
      raise NotImplementedError(
          "the Mosaic GPU prefill kernel needs a Hopper (or newer) GPU or interpret mode, q and k "
          "both bfloat16 (no k_scale) or both float8_e4m3fn, 128-byte key rows, H <= 256 and a "
          f"tiling that fits shared memory (got q {q.dtype} {q.shape}, k {k.dtype}, k_scale "
          f"{'set' if k_scale is not None else 'None'}, interpret={platform.interpret}, {config})")
    return True
  return (config.kernel == "auto" and fits and not platform.interpret and _mosaic.is_hopper_or_newer()
          and jnp.dtype(q.dtype).name in MOSAIC_AUTO)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _prefill(q, k, w, k_scale, query_positions, config, platform):
  t, h, d = q.shape
  n = k.shape[0]
  if not is_pow2(d):
    raise ValueError(f"head dim D={d} (q.shape[-1]) must be a power of two for the Pallas "
                     "kernels; implementation=\"xla\" takes any D")
  if query_positions is None:
    pos = jnp.full((t,), n - 1, jnp.int32)
  else:
    pos = clip_positions(query_positions, n)
  if platform.kind == "gpu" and _use_mosaic(q, k, k_scale, config, platform):
    from pallas_kernels.indexer_prefill import mgpu
    bt, bn = config.block_t, config.block_n
    t_pad, h_pad = -(-t // bt) * bt, -(-h // 8) * 8
    splits = config.key_splits_for(t_pad // bt, -(-n // bn))
    n_pad = -(-n // (bn * splits)) * bn * splits
    out = mgpu.prefill_scores_mgpu(
        pad_axis(pad_axis(q, 0, t_pad), 1, h_pad), pad_axis(k, 0, n_pad),
        pad_axis(pad_axis(w.astype(jnp.float32), 0, t_pad), 1, h_pad),
        pad_axis(pos, 0, t_pad, value=-1),
        None if k_scale is None else pad_axis(k_scale, 0, n_pad, value=1.0), block_t=bt, block_n=bn,
        max_concurrent_steps=config.mosaic_steps, key_splits=splits,
        interpret=platform.interpret)
    return out[:t, :n]
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

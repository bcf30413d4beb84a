"""Paged decode indexer scoring: public wrapper over the GPU and TPU kernels."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._platform import KernelPlatform
from pallas_kernels._util import is_pow2, next_pow2, pad_axis
from pallas_kernels.indexer_decode.config import DecodeConfig
from pallas_kernels.indexer_decode import gpu as _gpu
from pallas_kernels.indexer_decode import tpu as _tpu

__all__ = ["DecodeConfig", "decode_scores", "block_sparse_scores"]


def decode_scores(q, k_cache, block_table, lengths, w, *, k_scale=None, config=None,
                  platform: KernelPlatform, group_max: int = 0):
  """Kernel path of `jaxsparse.paged_indexer_scores` (inputs already validated).

  q [B, R, H, D], k_cache [num_blocks, 64, D], block_table [B, max_blocks] int32,
  lengths [B] int32, w [B, R, H] -> [B, R, max_blocks * 64] float32.
  With group_max=g > 0 (GPU only) also returns [B, R, slots/g] maxima of g consecutive slots.
  """
  config = config or DecodeConfig()
  if not isinstance(config, DecodeConfig):
    raise ValueError(f"config={config!r} must be a DecodeConfig")
  return _decode(q, k_cache, block_table, lengths, w, k_scale, config, platform, group_max)


def block_sparse_scores(q, k_cache, block_table, lengths, w, sel_blocks, counts, *,
                        k_scale=None, config=None, platform: KernelPlatform, pages=None):
  """Score only selected blocks (SPIN). sel_blocks [B, M] int32 logical block ids, the first
  counts[b] valid (ascending), -1 after; -> (z [B, R, M * 64] float32 in selection order,
  slots [B, M * 64] int32, -1 for padding). pages: (table [B, M] int32, the selected blocks'
  cache pages already gathered from block_table and clipped to [0, num_blocks); length rows
  [B, 32] int32, lengths repeated), both written by SPIN's selection kernel, sel_blocks then
  already -1 past counts: no XLA gather or broadcast."""
  config = config or DecodeConfig()
  page = k_cache.shape[1]
  if pages is None:
    sel = jnp.where(jnp.arange(sel_blocks.shape[1])[None] < counts[:, None], sel_blocks, -1)
    table = jnp.take_along_axis(block_table, jnp.maximum(sel, 0), axis=1)
  else:
    sel, (table, len_rows) = sel_blocks, pages
  z = _decode(q, k_cache, table, lengths, w, k_scale, config, platform, 0, sel,
              counts.astype(jnp.int32), None if pages is None else len_rows,
              clipped=pages is not None)
  slots = (sel[:, :, None] * page + jnp.arange(page)[None, None]).reshape(sel.shape[0], -1)
  slots = jnp.where(jnp.repeat(sel, page, axis=1) >= 0, slots, -1)
  return z, slots


def _use_mosaic(q, k_cache, max_blocks: int, config: DecodeConfig,
                platform: KernelPlatform) -> bool:
  """Whether the Mosaic GPU kernel scores this call (see `DecodeConfig.kernel`). A forced
  "mosaic" on a CPU-only machine runs it in the Mosaic GPU interpreter; "auto" never does."""
  from pallas_kernels.indexer_decode import mgpu
  from pallas_kernels.indexer_decode.config import MOSAIC_AUTO
  from pallas_kernels import _mosaic
  _, rows, heads, d = q.shape
  pair = (jnp.dtype(q.dtype).name, jnp.dtype(k_cache.dtype).name)
  item = jnp.dtype(k_cache.dtype).itemsize
  dtypes_ok = pair in (("bfloat16", "bfloat16"), ("float8_e4m3fn", "float8_e4m3fn"),
                       ("bfloat16", "float8_e4m3fn"))
  pages = config.mosaic_pages_for(q.shape[0], max_blocks)
  fits = (rows == 1 and dtypes_ok and (d * item) % 128 == 0
          and mgpu.tiling_fits(pages, config.mosaic_steps, heads, d))
  if config.kernel == "mosaic":
    if not (fits and (platform.interpret or _mosaic.is_hopper_or_newer())):
      raise NotImplementedError(
          "the Mosaic GPU decode kernel needs a Hopper (or newer) GPU or interpret mode, one row "
          "per request, q and the cache both bfloat16 or both float8_e4m3fn (or a bfloat16 q "
          "with an fp8 cache), 128-byte key rows and a tiling that fits shared memory (got q "
          f"{q.dtype} {q.shape}, cache {k_cache.dtype}, interpret={platform.interpret}, {config})")
    return True
  return (config.kernel == "auto" and fits and not platform.interpret and _mosaic.is_hopper_or_newer()
          and pair in MOSAIC_AUTO)


@functools.partial(jax.jit, static_argnums=(6, 7, 8), static_argnames=("clipped",))
def _decode(q, k_cache, block_table, lengths, w, k_scale, config, platform, group_max,
            logical=None, counts=None, len_rows=None, *, clipped: bool = False):
  from pallas_kernels._util import row_lengths
  bsz, rows, heads, d = q.shape
  max_blocks = block_table.shape[1]
  if not is_pow2(d):
    raise ValueError(f"head dim D={d} (q.shape[-1]) must be a power of two for the Pallas "
                     "kernels; implementation=\"xla\" takes any D")
  lens = row_lengths(lengths, rows)  # [B, R]
  if (platform.kind == "gpu" and not group_max
      and _use_mosaic(q, k_cache, max_blocks, config, platform)):
    from pallas_kernels.indexer_decode import mgpu
    z = mgpu.decode_scores_mgpu(q[:, 0], k_cache, block_table, lens[:, 0], w[:, 0], k_scale,
                                pages=config.mosaic_pages_for(bsz, max_blocks),
                                steps=config.mosaic_steps,
                                logical=logical, clipped=clipped, len_rows=len_rows,
                                interpret=platform.interpret)
    return z[:, None]
  if platform.kind == "gpu":
    r2 = next_pow2(rows)
    h2 = max(next_pow2(heads), 16 // r2)  # Triton dots need M = R * H >= 16
  else:
    r2, h2 = rows, -(-heads // 8) * 8
  qp = pad_axis(pad_axis(q, 1, r2), 2, h2)
  wp = pad_axis(pad_axis(w.astype(jnp.float32), 1, r2), 2, h2)
  lp = pad_axis(lens, 1, r2)
  if platform.kind == "gpu":
    out = _gpu.decode_scores_gpu(qp, k_cache, block_table, lp, wp, k_scale, config=config,
                                 interpret=platform.interpret, group_max=group_max,
                                 logical=logical, counts=counts)
  else:
    if group_max:
      raise NotImplementedError("group_max is fused only in the GPU decode kernel")
    out = _tpu.decode_scores_tpu(qp, k_cache, block_table, lp, wp, k_scale, config=config,
                                 interpret=platform.interpret, logical=logical, counts=counts)
  slots = max_blocks * k_cache.shape[1]
  if group_max:
    z, gm = out
    return z[:, :rows, :slots], gm[:, :rows, : slots // group_max]
  return out[:, :rows, :slots]

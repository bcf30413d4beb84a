"""Causal prefill indexer scoring on Hopper with Mosaic GPU (TMA -> shared memory -> wgmma).

One CTA per group of `block_t` queries and range of keys (`key_splits` ranges; more than one
when few query groups would leave SMs idle, as in chunked top-K prefill): their q rows ([block_t * H, D] bf16) and weights stay in
shared memory while key tiles of `block_n` keys stream through a TMA pipeline. Per key tile and
query, one wgmma computes S = K_tile @ q_t^T ([block_n, H] f32 in registers); the epilogue applies
ReLU, multiplies column h by w[t, h] and sums the H columns of each row, giving block_n scores
of query t. The [block_t, block_n] score tile leaves through shared memory with a TMA store.
Key tiles entirely past every query of the group are not multiplied (they are still streamed:
the grid of the pipeline is static) and are written as -inf.

q and k both bfloat16 (bf16 wgmma) or both float8_e4m3fn (fp8 wgmma; q's scale folded into w,
per-key scales multiplied after the head sum); H a multiple of 8 (<= 256), 128-byte key rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mosaic
from pallas_kernels._util import masked_relu

__all__ = [
    "NEG_INF", "POS_ROW", "tiling_fits", "prefill_scores_mgpu"
]


NEG_INF = float("-inf")
POS_ROW = 32  # int32 positions per group row: 128 bytes


def tiling_fits(block_t: int, block_n: int, heads: int, head_dim: int, steps: int,
                itemsize: int = 2) -> bool:
  """Whether a tiling fits shared memory and the 128-byte granularity of the kernel's copies:
  q group (block_t * heads * D), `steps` key tiles (+ scales), two score tiles, weights,
  positions."""
  smem = (block_t * heads * head_dim * itemsize + steps * block_n * (head_dim * itemsize + 4)
          + 2 * block_t * block_n * 4 + block_t * heads * 4 + POS_ROW * 4 + 1024)
  return (smem <= _mosaic.SMEM_BYTES and (block_t * block_n) % 128 == 0
          and (block_t * heads) % 32 == 0 and block_n % 64 == 0 and 0 < block_t <= POS_ROW)


def prefill_scores_mgpu(q, k, w, pos, k_scale=None, *, block_t: int = 4, block_n: int = 64,
                        max_concurrent_steps: int = 2, key_splits: int = 1,
                        interpret: bool = False):
  """q [T, H, D], k [N, D] (both bfloat16, or both float8_e4m3fn with q's scale folded into w),
  w [T, H] f32, pos [T] int32 (key i visible to query t iff i <= pos[t]), k_scale [N] float32 or
  None -> [T, N] float32 scores (-inf where invisible). T % block_t == 0 and
  N % (block_n * key_splits) == 0 (the caller pads). key_splits: CTAs per query group, each
  streaming N / key_splits consecutive keys. interpret: run in the Mosaic GPU interpreter (CPU; for tests)."""
  t, h, d = q.shape
  n = k.shape[0]
  if q.dtype != k.dtype or jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                       jnp.dtype(jnp.float8_e4m3fn)):
    raise ValueError(f"q and k must both be bfloat16 or both float8_e4m3fn, got {q.dtype} and "
                     f"{k.dtype}")
  if not tiling_fits(block_t, block_n, h, d, max_concurrent_steps, jnp.dtype(q.dtype).itemsize):
    raise ValueError(f"block_t={block_t}, block_n={block_n}, steps={max_concurrent_steps} with "
                     f"H={h}, D={d} do not fit shared memory or the 128-byte copy granularity")
  has_scale = k_scale is not None
  tf = _mosaic.mma_transforms(q.dtype)
  if not isinstance(key_splits, int) or key_splits < 1:
    raise ValueError(f"key_splits={key_splits!r} must be a positive int")
  if t % block_t or n % (block_n * key_splits):
    raise ValueError(f"T={t} and N={n} must be multiples of block_t={block_t} and "
                     f"block_n * key_splits={block_n * key_splits}")
  q2 = q.reshape(t * h, d)
  steps = n // (block_n * key_splits)  # key tiles per CTA

  def body(q_gmem, k_gmem, w_gmem, pos_gmem, *refs):
    if has_scale:
      s_gmem, *refs = refs
    o_gmem, q_smem, w_smem, pos_smem, o_smem, bar = refs
    g = lax.axis_index("g")
    first = lax.axis_index("s") * steps  # this CTA's first key tile
    plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(g * block_t * h, block_t * h)], q_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(g * block_t, block_t)], w_smem, bar.at[1])
    plgpu.copy_gmem_to_smem(pos_gmem.at[g], pos_smem, bar.at[2])
    for i in range(3):
      plgpu.barrier_wait(bar.at[i])
    last = pos_smem[block_t - 1]
    for i in range(1, block_t):
      last = jnp.maximum(last, pos_smem[block_t - 1 - i])

    def step(idx, k_smem, *s_smem):
      (jl,) = idx
      slot = lax.rem(jl, 2)
      j = first + jl  # the key tile
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this slot is done
      out = o_smem.at[slot]
      key = j * block_n + _mosaic.iota((block_n,), 0, plgpu.Layout.WGMMA.reduce(1), interpret)

      @pl.when(j * block_n <= last)
      def _():
        for r in range(block_t):
          s = _mosaic.scores_nt(k_smem, q_smem.at[pl.ds(r * h, h)], interpret)
          wv = _mosaic.load(w_smem.at[r], plgpu.Layout.WGMMA.reduce(0), interpret)
          wb = lax.broadcast_in_dim(wv, (block_n, h), [1])
          z = (masked_relu(s, wb) * wb).sum(axis=1)
          if has_scale:
            z = z * _mosaic.load(s_smem[0], plgpu.Layout.WGMMA.reduce(1), interpret)
          out[r] = jnp.where(key <= pos_smem[r], z, NEG_INF)

      @pl.when(j * block_n > last)
      def _():
        out[...] = jnp.full((block_t, block_n), NEG_INF, jnp.float32)

      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out, o_gmem.at[pl.ds(g * block_t, block_t),
                                             pl.ds(j * block_n, block_n)])

    specs = [plgpu.BlockSpec((block_n, d), lambda jl: (first + jl, 0), transforms=tf)]
    if has_scale:
      specs.append(plgpu.BlockSpec((block_n,), lambda jl: (first + jl,)))
    plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs,
                        max_concurrent_steps=max_concurrent_steps)(
        k_gmem, *((s_gmem,) if has_scale else ()))
    plgpu.wait_smem_to_gmem(0)

  f = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((t, n), jnp.float32),
      scratch_types=[
          plgpu.SMEM((block_t * h, d), q.dtype, transforms=tf),
          plgpu.SMEM((block_t, h), jnp.float32),
          plgpu.SMEM((POS_ROW,), jnp.int32),
          plgpu.SMEM((2, block_t, block_n), jnp.float32),
          plgpu.Barrier(num_barriers=3),
      ],
      grid=(t // block_t, key_splits), grid_names=("g", "s"),
      kernel_name="jaxsparse_prefill_mgpu",
      interpret=_mosaic.interpret_params(interpret),
  )
  # each group's positions padded to a 128-byte row (TMA copies move multiples of 128 bytes)
  pos_rows = jnp.pad(pos.astype(jnp.int32).reshape(t // block_t, block_t),
                     ((0, 0), (0, POS_ROW - block_t)), constant_values=-1)
  return f(q2, k, w.astype(jnp.float32), pos_rows,
           *((k_scale.astype(jnp.float32),) if has_scale else ()))

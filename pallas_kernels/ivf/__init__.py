"""AttentionIndex's kernels: the k-means assignment step (nearest center, its distance and the
second smallest, for Hamerly's bounds), the scoring of gathered candidate keys, and the
scoring of group representatives (the dense indexer kernel with representatives as keys)."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._platform import KernelPlatform
from pallas_kernels._util import next_pow2, pad_axis
from pallas_kernels.ivf.config import IVFKernelConfig

__all__ = ["IVFKernelConfig", "assign_nearest", "gathered_scores", "representative_scores"]


def assign_nearest(x, centers, used, *, platform: KernelPlatform, config=None):
  """x [M, D] keys, centers [G, D], used [G] bool -> (assign [M] int32 nearest used center,
  ties to the lower id; d1 [M] float32 its squared distance; d2 [M] float32 the second
  smallest squared distance, +inf with one center)."""
  config = config or IVFKernelConfig()
  m, d = x.shape
  g = centers.shape[0]
  bc = min(config.assign_centers, next_pow2(max(g, 16)))
  gp = -(-g // bc) * bc
  bm = min(config.assign_rows, next_pow2(max(m, 16)))
  mp = -(-m // bm) * bm
  cf = pad_axis(centers.astype(jnp.float32), 0, gp)
  cn = jnp.where(pad_axis(used, 0, gp, value=False), jnp.sum(cf * cf, axis=1), jnp.inf)[None]
  xp = pad_axis(x.astype(jnp.float32), 0, mp)
  if platform.kind == "gpu":
    from pallas_kernels.ivf import gpu
    a, d1, d2 = gpu.assign_gpu(xp, cf, cn, block_m=bm, block_c=bc, num_warps=config.num_warps,
                               interpret=platform.interpret)
  else:
    from pallas_kernels.ivf import tpu
    a, d1, d2 = tpu.assign_tpu(xp, cf, cn, block_m=bm, block_c=bc,
                               interpret=platform.interpret)
  return a[:m, 0], d1[:m, 0], d2[:m, 0]


def gathered_scores(q, w, k, idx, *, platform: KernelPlatform, config=None):
  """Indexer scores of gathered candidates: q [Q, H, D], w [Q, H], k [N, D], idx [Q, S] int32
  key ids (-1: none) -> [Q, S] float32, sum_h w relu(q_h . k[idx]) (-inf for -1)."""
  config = config or IVFKernelConfig()
  nq, h, d = q.shape
  s = idx.shape[1]
  block = min(config.gather_block, next_pow2(max(s, 16)))
  sp = -(-s // block) * block
  hp = max(next_pow2(h), 16) if platform.kind == "gpu" else -(-h // 8) * 8
  qp = pad_axis(q.astype(jnp.float32), 1, hp)
  wp = pad_axis(w.astype(jnp.float32), 1, hp)[:, :, None]
  ip = pad_axis(idx.astype(jnp.int32), 1, sp, value=-1)
  if platform.kind == "gpu":
    from pallas_kernels.ivf import gpu
    z = gpu.gathered_scores_gpu(qp, wp, k.astype(jnp.float32), ip, block=block,
                                num_warps=config.num_warps, interpret=platform.interpret)
  else:
    from pallas_kernels.ivf import tpu
    z = tpu.gathered_scores_tpu(qp, wp, k.astype(jnp.float32), ip, block=block,
                                interpret=platform.interpret)
  return z[:, :s]


def representative_scores(q, w, reps, valid, *, platform: KernelPlatform):
  """Indexer scores of group representatives: q [Q, H, D], w [Q, H], reps [G, D], valid
  [Q, G] -> [Q, G] float32 (-inf where not valid): the dense indexer kernel, non-causal,
  with the representatives as keys."""
  from pallas_kernels import indexer_prefill
  # bf16 q and representatives (the compact index) go in as they are: exact products; other
  # dtypes as float32 (TF32 dots on a GPU)
  dt = jnp.bfloat16 if q.dtype == reps.dtype == jnp.bfloat16 else jnp.float32
  z = indexer_prefill.prefill_scores(q.astype(dt), reps.astype(dt), w.astype(jnp.float32),
                                     platform=platform)
  return jnp.where(valid, z, -jnp.inf)

"""AttentionIndex's kernels: the k-means assignment step (nearest center, its distance and the
second smallest, for Hamerly's bounds), the scoring of gathered candidate keys, and the
scoring of group representatives (the dense indexer kernel with representatives as keys)."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._platform import KernelPlatform
from pallas_kernels._util import next_pow2, pad_axis
from pallas_kernels.ivf.config import IVFKernelConfig

__all__ = ["IVFKernelConfig", "assign_nearest", "gathered_scores", "ranked_scores",
           "representative_scores"]


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
  # bf16 keys and centers go in as they are on a GPU (exact products, float32 sums)
  dt = jnp.bfloat16 if (platform.kind == "gpu" and x.dtype == centers.dtype == jnp.bfloat16) \
      else jnp.float32
  cf = pad_axis(centers.astype(dt), 0, gp)
  c32 = cf.astype(jnp.float32)
  cn = jnp.where(pad_axis(used, 0, gp, value=False), jnp.sum(c32 * c32, axis=1), jnp.inf)[None]
  xp = pad_axis(x.astype(dt), 0, mp)
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
  key ids (-1: none) -> [Q, S] float32, sum_h w relu(q_h . k[idx]) (-inf for -1). On a GPU
  bf16 q and keys are read as they are (exact products, float32 sums: no copy of the key
  cache); other dtypes, and every dtype on a TPU, as float32."""
  config = config or IVFKernelConfig()
  nq, h, d = q.shape
  s = idx.shape[1]
  block = min(config.gather_block, next_pow2(max(s, 16)))
  if platform.kind == "gpu":
    from pallas_kernels.ivf import gpu
    # enough programs to fill the GPU when there are few queries
    splits = max(1, min(config.gather_min_programs // max(nq, 1), -(-s // block)))
    sp = -(-s // (block * splits)) * block * splits
    dt = jnp.bfloat16 if q.dtype == k.dtype == jnp.bfloat16 else jnp.float32
    qp = pad_axis(q.astype(dt), 1, max(next_pow2(h), 16))
    wp = pad_axis(w.astype(jnp.float32), 1, qp.shape[1])[:, :, None]
    ip = pad_axis(idx.astype(jnp.int32), 1, sp, value=-1)
    z = gpu.gathered_scores_gpu(qp, wp, k.astype(dt), ip, block=block, splits=splits,
                                num_warps=config.num_warps, interpret=platform.interpret)
  else:
    from pallas_kernels.ivf import tpu
    sp = -(-s // block) * block
    qp = pad_axis(q.astype(jnp.float32), 1, -(-h // 8) * 8)
    wp = pad_axis(w.astype(jnp.float32), 1, qp.shape[1])[:, :, None]
    ip = pad_axis(idx.astype(jnp.int32), 1, sp, value=-1)
    z = tpu.gathered_scores_tpu(qp, wp, k.astype(jnp.float32), ip, block=block,
                                interpret=platform.interpret)
  return z[:, :s]


def ranked_scores(q, w, k, members, start, take, slot, used, *, slots: int,
                  platform: KernelPlatform, config=None):
  """Scores of each query's ranked groups' members, read from the inverted lists inside the
  kernel (GPU only; no [Q, slots] index array is built before it).

  q [Q, H, D], w [Q, H], k [N, D], members [N] int32 (inverted lists), start / take / slot
  [Q, G] int32 and used [Q] int32 in rank order (`jaxsparse.ivf.candidates.ranked_groups`):
  of ranked group u, take[u] members from members[start[u]:] fill slots slot[u] onwards
  (the room they were cut to must not exceed `slots`; nothing is written past it).
  Returns (scores [Q, slots] float32, -inf past the filled slots; key ids [Q, slots] int32,
  -1 there). bf16 q and keys are read as they are (exact products, float32 sums)."""
  if platform.kind != "gpu":
    raise ValueError(f"platform={platform.kind!r}: ranked_scores runs on a GPU; elsewhere use "
                     "candidate_indices + gathered_scores")
  from pallas_kernels.ivf import gpu
  config = config or IVFKernelConfig()
  nq, h, d = q.shape
  g = start.shape[1]
  block = min(config.group_block, next_pow2(max(slots, 16)))
  width = -(-slots // block) * block
  dt = jnp.bfloat16 if q.dtype == k.dtype == jnp.bfloat16 else jnp.float32
  qp = pad_axis(q.astype(dt), 1, max(next_pow2(h), 16))
  wp = pad_axis(w.astype(jnp.float32), 1, qp.shape[1])[:, :, None]
  u = jnp.clip(used - 1, 0, g - 1)[:, None]
  last = jnp.take_along_axis(slot + take, u, 1)[:, 0]
  filled = jnp.where(used > 0, last, 0)
  meta = jnp.stack([used, filled], axis=1).astype(jnp.int32)
  z, ids = gpu.ranked_scores_gpu(qp, wp, meta, start, take, slot, members.astype(jnp.int32),
                                 k.astype(dt), width=width, block=block,
                                 num_warps=config.num_warps, interpret=platform.interpret)
  return z[:, :slots], ids[:, :slots]


def representative_scores(q, w, reps, valid, *, platform: KernelPlatform):
  """Indexer scores of group representatives: q [Q, H, D], w [Q, H], reps [G, D], valid
  [Q, G] -> [Q, G] float32 (-inf where not valid): the dense indexer kernel, non-causal,
  with the representatives as keys (rounded to bfloat16 when q is bfloat16). A valid group's
  NaN or -inf score (a NaN / inf mean) becomes -float32 max: ranked last, still usable."""
  from pallas_kernels import indexer_prefill
  # bf16 queries rank against representatives rounded to bf16 (2^-9 relative: enough to rank
  # groups, and the MMA's bf16 rate); float32 queries as float32 (TF32 dots on a GPU)
  dt = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
  z = indexer_prefill.prefill_scores(q.astype(dt), reps.astype(dt), w.astype(jnp.float32),
                                     platform=platform)
  low = jnp.float32(-jnp.finfo(jnp.float32).max)
  return jnp.where(valid, jnp.where(z > -jnp.inf, z, low), -jnp.inf)

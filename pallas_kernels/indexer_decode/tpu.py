"""Paged decode indexer scoring on TPU (Pallas, Mosaic TPU), with manual double-buffered DMA.

One program scores one run of `pages_per_step * steps_per_program` pages of one request
(`DecodeConfig`): the cache stays in HBM and the program copies each step's pages
(`pages_per_step` 64-slot pages, one DMA each, page ids from the scalar-prefetched block table)
into one half of a VMEM double buffer while the MXU scores the other half. Pages past the
request's live count are neither copied nor scored (their slots are -inf). The output block is
the run's [R, run * 64] scores, written in slot order: no transpose after the kernel.

VMEM per program: the double buffer 2 * pages_per_step * 64 * D * itemsize (bf16, D = 128, 2
pages a step: 64 KB), q [R * H, D] and the output [R, run * 64] float32 (16 pages: 4 KB a
row); far under the 16 MB (v5e) to 32 MB (v5p, v6e) of VMEM a core has, so the run length is
set by the grid, not by memory: enough programs to keep both TensorCores of a v5p busy at
B=1 x 128K (128 runs of 16 pages). The dot is [R * H, D] x [D, 64] per page: M = R * H rows
(H padded to a multiple of 8) on the MXU (128 x 128 on v5e, 256 x 256 on v6e).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._util import masked_relu, tpu_interpret_params
from pallas_kernels.indexer_decode.config import DecodeConfig

__all__ = ["NEG_INF", "decode_scores_tpu", "run_pages"]

NEG_INF = float("-inf")


def run_pages(config: DecodeConfig) -> int:
  """Pages per program: pages_per_step * steps_per_program, at least 2 (a 128-lane block)."""
  return max(config.pages_per_step * config.steps_per_program, 2)


def _decode_kernel(table_ref, maxlen_ref, logical_ref, q_ref, w_ref, lens_ref, k_hbm, *rest,
                   rows: int, heads: int, page: int, per_step: int, steps: int,
                   has_scale: bool, max_blocks: int):
  """table_ref / logical_ref [B * max_blocks] (SMEM): page ids and the logical block of each
  entry; maxlen_ref [B] (SMEM): slots to score (dense) or selected pages * 64 (sparse);
  q_ref [R*H, D]; w_ref [R*H, 1]; lens_ref [R, 1]; k_hbm [num_blocks, page, D] (HBM);
  scale [num_blocks, 1, page] (HBM); o_ref [R, run * page] float32; then the VMEM buffers
  and the DMA semaphores."""
  if has_scale:
    s_hbm, o_ref, kbuf, sbuf, sem = rest
  else:
    o_ref, kbuf, sem = rest
    s_hbm = sbuf = None
  b, run = pl.program_id(0), pl.program_id(1)
  first = run * per_step * steps  # the run's first table entry

  def entry(step: int, p: int):
    j = first + step * per_step + p
    jc = jnp.minimum(j, max_blocks - 1)
    live = (j < max_blocks) & (j * page < maxlen_ref[b])
    return live, table_ref[b * max_blocks + jc], logical_ref[b * max_blocks + jc]

  def copies(step: int, p: int, slot: int, pid):
    cps = [pltpu.make_async_copy(k_hbm.at[pid], kbuf.at[slot, p], sem.at[0, slot, p])]
    if has_scale:
      cps.append(pltpu.make_async_copy(s_hbm.at[pid], sbuf.at[slot, p], sem.at[1, slot, p]))
    return cps

  def start(step: int):
    for p in range(per_step):
      live, pid, _ = entry(step, p)

      @pl.when(live)
      def _(p=p, pid=pid):
        for c in copies(step, p, step % 2, pid):
          c.start()

  start(0)
  cd = jnp.bfloat16 if q_ref.dtype == jnp.float8_e4m3fn else q_ref.dtype
  q = q_ref[...].astype(cd)
  w = w_ref[...]
  for step in range(steps):
    if step + 1 < steps:
      start(step + 1)  # the next step's pages land while this step's are scored
    for p in range(per_step):
      live, pid, logical = entry(step, p)
      col = (step * per_step + p) * page
      lo = logical * page

      @pl.when(live & (logical >= 0))
      def _(p=p, pid=pid, col=col, lo=lo):
        for c in copies(step, p, step % 2, pid):
          c.wait()
        k = kbuf[step % 2, p].astype(cd)  # [page, D]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [R*H, page]
        prod = masked_relu(s, w) * w
        z = jnp.concatenate(
            [jnp.sum(prod[r * heads:(r + 1) * heads], axis=0, keepdims=True)
             for r in range(rows)], axis=0)  # [R, page]
        if has_scale:
          z = z * sbuf[step % 2, p]
        slot = lo + lax.broadcasted_iota(jnp.int32, (rows, page), 1)
        o_ref[:, col:col + page] = jnp.where(slot < lens_ref[...], z, NEG_INF)

      @pl.when(live & (logical < 0))
      def _(p=p, pid=pid):  # a copied page of a padding entry: drain its DMA
        for c in copies(step, p, step % 2, pid):
          c.wait()

      @pl.when(jnp.logical_not(live & (logical >= 0)))
      def _(col=col):
        o_ref[:, col:col + page] = jnp.full((rows, page), NEG_INF, jnp.float32)


def decode_scores_tpu(q, k_cache, block_table, lens, w, k_scale, *, config: DecodeConfig,
                      interpret: bool = False, logical=None, counts=None):
  """q [B, R, H, D] (H a multiple of 8), lens [B, R] -> z [B, R, >= max_blocks * 64].

  logical / counts (SPIN's block-sparse scoring): block_table holds the selected pages, entry
  j of request b the logical block logical[b, j] (-1: padding), the first counts[b] in use."""
  bsz, rows, heads, d = q.shape
  num_blocks, page, _ = k_cache.shape
  max_blocks = block_table.shape[1]
  per_step = config.pages_per_step
  run = run_pages(config)
  steps = run // per_step if run % per_step == 0 else config.steps_per_program
  per_step = run // steps
  n_runs = -(-max_blocks // run)
  table = jnp.clip(block_table, 0, num_blocks - 1).reshape(-1)
  if logical is None:  # dense: entry j is logical block j; score the pages under maxlen
    maxlen = jnp.max(lens, axis=1)  # [B]
    logical = jnp.broadcast_to(jnp.arange(max_blocks, dtype=jnp.int32), (bsz, max_blocks))
  else:  # sparse: the first counts[b] entries are selected pages (x page: the same test)
    maxlen = counts * page
  qf = q.reshape(bsz, rows * heads, d)
  wf = w.reshape(bsz, rows * heads, 1)
  lf = lens.reshape(bsz, rows, 1)
  has_scale = k_scale is not None
  per_b = lambda b, r, *_: (b, 0, 0)
  in_specs = [pl.BlockSpec((None, rows * heads, d), per_b),
              pl.BlockSpec((None, rows * heads, 1), per_b),
              pl.BlockSpec((None, rows, 1), per_b),
              pl.BlockSpec(memory_space=pl.ANY)]
  args = [qf, wf, lf, k_cache]
  scratch = [pltpu.VMEM((2, per_step, page, d), k_cache.dtype)]
  if has_scale:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    args.append(k_scale.reshape(num_blocks, 1, page))
    scratch.append(pltpu.VMEM((2, per_step, 1, page), jnp.float32))
  scratch.append(pltpu.SemaphoreType.DMA((2, 2, per_step)))
  kernel = functools.partial(_decode_kernel, rows=rows, heads=heads, page=page,
                             per_step=per_step, steps=steps, has_scale=has_scale,
                             max_blocks=max_blocks)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(bsz, n_runs),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((None, rows, run * page), lambda b, r, *_: (b, 0, r)),
          scratch_shapes=scratch,
      ),
      out_shape=jax.ShapeDtypeStruct((bsz, rows, n_runs * run * page), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=tpu_interpret_params() if interpret else False,
      name="jaxsparse_decode_scores_tpu",
  )(table, maxlen.astype(jnp.int32), logical.reshape(-1).astype(jnp.int32), *args)

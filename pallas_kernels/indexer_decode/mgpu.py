"""Paged decode indexer scoring on Hopper with Mosaic GPU (TMA page gathers -> wgmma).

One CTA per (request b, run of `pages` pages). q[b] ([H, D]) and w[b] sit in shared memory; the
run's block-table entries are copied in once, and a TMA pipeline then gathers one 64-slot page
per step from the cache (the page id read from that table) with `steps` pages in flight. Per
page one wgmma computes S = K_page @ q^T ([64, H] float32 in registers); the epilogue applies
ReLU, multiplies column h by w[h], sums the H columns of each row, multiplies by the per-slot
key scale (fp8) and masks slots past the length. The run's [pages, 64] scores leave through
shared memory with one TMA store.

q and the cache: both bfloat16 (bf16 wgmma); both float8_e4m3fn (fp8 wgmma, both operands
K-major as Hopper requires, which is how a [64, D] page and [H, D] q are stored; the caller
folds q's scale into w, `jaxsparse.prep.quantize_fp8`, as DeepSeek-V3.2 does); or a bfloat16 q
with an fp8 cache (each page is converted to float16 in registers, the only fp8 conversion
Hopper has, and q is passed as float16: exact for 2**-14 <= |q| <= 65504).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mosaic
from pallas_kernels._util import masked_relu
from pallas_kernels.indexer_decode.config import run_length_ok

__all__ = [
    "NEG_INF", "ROW", "DTYPES", "tiling_fits", "decode_scores_mgpu"
]


NEG_INF = float("-inf")
ROW = 32  # int32 entries per 128-byte row (TMA copies move multiples of 128 bytes)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn))


def tiling_fits(pages: int, steps: int, heads: int, head_dim: int) -> bool:
  """Whether q, `steps` pages (+ scales) in flight, the run's scores, weights and tables fit
  shared memory, counted at 2 bytes per element (an upper bound for fp8)."""
  smem = (heads * head_dim * 2 + steps * 64 * (head_dim * 2 + 4) + pages * 64 * 4
          + heads * 4 + 2 * ROW * 4 + 1024)
  # heads % 32: the [H] float32 weight row is one TMA copy, a multiple of 128 bytes
  return (smem <= _mosaic.SMEM_BYTES and run_length_ok(pages) and heads % 32 == 0
          and heads <= 256)


def decode_scores_mgpu(q, k_cache, block_table, lengths, w, k_scale=None, *, pages: int = 32,
                       steps: int = 4, logical=None, clipped: bool = False, len_rows=None,
                       interpret: bool = False):
  """q [B, H, D], k_cache [num_blocks, 64, D] (both bfloat16 or both float8_e4m3fn),
  block_table [B, max_blocks] int32, lengths [B] int32, w [B, H] float32, k_scale
  [num_blocks, 64] float32 or None -> [B, max_blocks * 64] float32 (-inf past each length).
  `pages` (8, 16 or a multiple of 32) pages per CTA, `steps` page gathers in flight. Fewer
  pages per CTA give more CTAs to a small batch (B=1 x 128K: 64 CTAs of 32 pages for 132 SMs).

  logical [B, max_blocks] int32 (SPIN's block-sparse scoring): the table then lists only the
  selected pages and logical[b, j] is the block id of table entry j (-1: padding, which must
  come last); output entry j * 64 + i holds slot logical[b, j] * 64 + i (-inf for padding and
  slots at or past the length). Runs whose first entry is padding load nothing.
  clipped: every table entry is already in [0, num_blocks) (skips XLA's clip). len_rows
  [B, 32] int32: the lengths already repeated over rows (skips XLA's broadcast).
  interpret: run in the Mosaic GPU interpreter (CPU; for tests)."""
  bsz, h, d = q.shape
  num_blocks, page, _ = k_cache.shape
  if page != 64:
    raise ValueError(f"k_cache pages must hold 64 slots, got {page}")
  mixed = q.dtype == jnp.bfloat16 and k_cache.dtype == jnp.float8_e4m3fn
  if not mixed and (q.dtype != k_cache.dtype or q.dtype not in DTYPES):
    raise ValueError(f"q and k_cache must both be bfloat16 or both float8_e4m3fn (or bfloat16 q "
                     f"with a float8_e4m3fn cache), got {q.dtype} and {k_cache.dtype}")
  if not run_length_ok(pages):
    raise ValueError(f"pages={pages} must be 8, 16 or a multiple of {ROW}")
  if not tiling_fits(pages, steps, h, d):
    raise ValueError(f"heads={h} must be a multiple of 32 (<= 256) and pages={pages} x "
                     f"steps={steps} must fit shared memory")
  max_blocks = block_table.shape[1]
  # table rows of `tw` entries (a TMA copy moves a multiple of 128 bytes): a CTA of fewer than
  # 32 pages copies the 32-entry row it shares with its neighbours and reads its own part
  tw = max(pages, ROW)
  per_row = tw // pages
  padded = -(-max_blocks // tw) * tw
  runs = padded // pages
  table = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, padded - max_blocks)))
  if not clipped:
    table = jnp.clip(table, 0, num_blocks - 1)
  table = table.reshape(bsz, padded // tw, tw)
  if len_rows is not None and len_rows.shape != (bsz, ROW):
    raise ValueError(f"len_rows {len_rows.shape} must be [B, {ROW}] = ({bsz}, {ROW})")
  lens = (jnp.broadcast_to(lengths.astype(jnp.int32)[:, None], (bsz, ROW)) if len_rows is None
          else len_rows)
  sparse = logical is not None
  if sparse:
    lg = jnp.pad(logical.astype(jnp.int32), ((0, 0), (0, padded - max_blocks)),
                 constant_values=-1).reshape(bsz, padded // tw, tw)
  has_scale = k_scale is not None
  if mixed:
    # Hopper converts fp8 only to float16 in registers, so the MMA runs in float16: q's bf16
    # values are exact in float16 when 2**-14 <= |q| <= 65504 (smaller ones lose low bits)
    q = q.astype(jnp.float16)
  tf = _mosaic.mma_transforms(q.dtype)
  ktf = _mosaic.mma_transforms(k_cache.dtype)

  def body(q_gmem, k_gmem, t_gmem, l_gmem, w_gmem, *refs):
    if has_scale:
      s_gmem, *refs = refs
    if sparse:
      g_gmem, *refs = refs
    o_gmem, q_smem, w_smem, t_smem, l_smem, g_smem, o_smem, bar = refs
    b = lax.axis_index("b")
    c = lax.axis_index("c")
    base = (c % per_row) * pages  # this CTA's first entry in its table row
    plgpu.copy_gmem_to_smem(q_gmem.at[b], q_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(w_gmem.at[b], w_smem, bar.at[1])
    plgpu.copy_gmem_to_smem(t_gmem.at[b, c // per_row], t_smem, bar.at[2])
    plgpu.copy_gmem_to_smem(l_gmem.at[b], l_smem, bar.at[3])
    if sparse:
      plgpu.copy_gmem_to_smem(g_gmem.at[b, c // per_row], g_smem, bar.at[4])
    for i in range(5 if sparse else 4):
      plgpu.barrier_wait(bar.at[i])
    length = l_smem[0]

    def first_slot(j):  # slot of the page's first entry (-1 entries: past any length)
      if sparse:
        lb = g_smem[base + j]
        return jnp.where(lb >= 0, lb * page, length)
      return (c * pages + j) * page
    wv = _mosaic.load(w_smem, plgpu.Layout.WGMMA.reduce(0), interpret)
    lane = _mosaic.iota((page,), 0, plgpu.Layout.WGMMA.reduce(1), interpret)

    def step(idx, k_smem, *s_smem):
      (j,) = idx
      first = first_slot(j)

      @pl.when(first < length)
      def _():
        # mixed: the fp8 page goes to registers as f16, then a register-A wgmma
        s = _mosaic.scores_nt(k_smem[...].astype(q.dtype) if mixed else k_smem, q_smem,
                              interpret)
        wb = lax.broadcast_in_dim(wv, (page, h), [1])
        z = (masked_relu(s, wb) * wb).sum(axis=1)
        if has_scale:
          z = z * _mosaic.load(s_smem[0], plgpu.Layout.WGMMA.reduce(1), interpret)
        o_smem[j] = jnp.where(first + lane < length, z, NEG_INF)

      @pl.when(first >= length)
      def _():
        o_smem[j] = jnp.where(lane < 0, 0.0, NEG_INF)

    specs = [plgpu.BlockSpec((None, page, d), lambda j: (t_smem[base + j], 0, 0),
                             transforms=ktf)]
    if has_scale:
      specs.append(plgpu.BlockSpec((None, page), lambda j: (t_smem[base + j], 0)))
    live = first_slot(0) < length  # a run past the length (or all padding) loads nothing

    @pl.when(live)
    def _():
      plgpu.emit_pipeline(step, grid=(pages,), in_specs=specs, max_concurrent_steps=steps)(
          k_gmem, *((s_gmem,) if has_scale else ()))

    @pl.when(~live)
    def _():
      o_smem[...] = jnp.full((pages, page), NEG_INF, jnp.float32)

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, pl.ds(c * pages, pages)])
    plgpu.wait_smem_to_gmem(0)

  f = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((bsz, runs * pages, page), jnp.float32),
      scratch_types=[
          plgpu.SMEM((h, d), q.dtype, transforms=tf),
          plgpu.SMEM((h,), jnp.float32),
          plgpu.SMEM((tw,), jnp.int32),
          plgpu.SMEM((ROW,), jnp.int32),
          plgpu.SMEM((tw if sparse else ROW,), jnp.int32),
          plgpu.SMEM((pages, page), jnp.float32),
          plgpu.Barrier(num_barriers=5),
      ],
      grid=(bsz, runs), grid_names=("b", "c"),
      kernel_name="jaxsparse_decode_mgpu",
      interpret=_mosaic.interpret_params(interpret),
  )
  args = (q, k_cache, table, lens, w.astype(jnp.float32))
  out = f(*args, *((k_scale.astype(jnp.float32),) if has_scale else ()),
          *((lg,) if sparse else ()))
  return out.reshape(bsz, runs * pages * page)[:, :max_blocks * page]

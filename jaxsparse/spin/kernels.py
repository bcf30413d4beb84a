"""Dispatch of SPIN's selection and update to its Pallas kernels (`pallas_kernels.spin`):
the same blocks and the same state as the functions of `jaxsparse.spin.algorithm`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsparse.spin.algorithm import (_budget, _priorities, block_scores, compact_blocks, key_words,
                                      request_seeds, select_blocks_batched)
from jaxsparse.spin.config import NEG_INF, SpinConfig

__all__ = [
    "select_compact_batched", "update_batched", "update_batched_tpu"
]


def _score_bits(config: SpinConfig) -> int:
  """Bits that rank block scores exactly: 16 when each is a bfloat16 state value (bfloat16
  EMAs pooled by max, or A2's block states), else 32."""
  exact = config.state_dtype == "bfloat16" and (config.reduction == "A2"
                                                or config.pooling == "max")
  return 16 if exact else 32


def select_compact_batched(state, pos, lengths, config: SpinConfig, key, width: int, *,
                           kernel: bool = False, interpret: bool = False, block_table=None,
                           num_pages: int = 0, advance_step: bool = False,
                           select_warps: int = 8, kind: str = "gpu", priorities=None):
  """Block selection and compaction for B requests -> (masks [B, nb] bool, sel [B, width]
  int32 selected ids ascending, -1 padded, counts [B] int32 ids in sel, selected [B] int32
  blocks selected, uncut [, pages [B, width] int32, length rows [B, 32] int32] [, next step
  [B] int32]): `select_blocks_batched` then `compact_blocks`, the same blocks for the same
  key. kernel=True (A1/A2; GPU, or its
  interpreter with interpret=True): one Pallas program per request computes its budget, ranks,
  picks and compacts (`pallas_kernels.spin`), random exploration keys are made in it from the
  key's words, and A1's max-pooled block scores come from one more kernel; XLA computes only
  other policies' priorities or pooling. block_table [B, nb] with num_pages (kernel=True
  only) adds the selected blocks' pages, clipped to [0, num_pages), in sel's order, and the
  lengths repeated over rows of 32 (the inputs of the Mosaic block-sparse scoring kernel).
  advance_step adds state["step"] + 1 last (the kernel writes it in place of the step).
  select_warps: the selection kernel's warps per program.
  kind="tpu" (with kernel=True; A1/A2): the TPU selection kernel
  (`pallas_kernels.spin.tpu.select_compact_tpu`) ranks, picks and compacts, and A1's
  max-pooled block scores come from `block_scores_max_tpu`; other poolings and the
  priorities from XLA; no pages or step outputs.
  pos None: lengths - 1 (computed in the kernels where they read it). priorities: [B, nb]
  float32 exploration priorities that replace the policy's own (explore="query")."""
  kpos = pos
  if pos is None:
    pos = lengths - 1
  if kernel and kind == "tpu" and config.reduction != "A0":
    from pallas_kernels.spin.tpu import block_scores_max_tpu, select_compact_tpu
    if config.reduction == "A1" and config.pooling == "max" and config.block_size <= 128:
      s = block_scores_max_tpu(state["VM"], state["V"], state["D"], lengths,
                               page=config.block_size, interpret=interpret)
    else:
      s = jax.vmap(block_scores, in_axes=(0, 0, 0, None))(state, pos, lengths, config)
    if priorities is None:
      seeds = request_seeds(key, pos.shape[0])
      prio = jax.vmap(_priorities, in_axes=(0, 0, 0, None, 0))(state, pos, lengths, config,
                                                                seeds)
    else:
      prio = priorities
    n_exploit, n_explore = _budget(-(-lengths // config.block_size), config)
    masks, sel, total = select_compact_tpu(s, prio, lengths, state["warm"], width, n_exploit,
                                           n_explore, block=config.block_size,
                                           interpret=interpret)
    return masks, sel, jnp.minimum(total, width), total
  if not kernel or config.reduction == "A0":
    masks = select_blocks_batched(state, pos, lengths, config, key, priorities)
    out = (masks, *compact_blocks(masks, width), masks.sum(1).astype(jnp.int32))
    if num_pages:
      from pallas_kernels.spin.gpu import LENGTH_ROW
      sel = out[1]
      pages = jnp.take_along_axis(block_table, jnp.maximum(sel, 0), axis=1)
      out += (jnp.where(sel >= 0, jnp.clip(pages, 0, num_pages - 1), 0),
              jnp.broadcast_to(lengths.astype(jnp.int32)[:, None],
                               (lengths.shape[0], LENGTH_ROW)))
    return out + (state["step"] + 1,) if advance_step else out
  from pallas_kernels._util import next_pow2, pad_axis
  from pallas_kernels.spin import block_scores_max_gpu, select_compact_gpu
  nb = state["VB"].shape[-1]
  if config.reduction == "A1" and config.pooling == "max":
    s = block_scores_max_gpu(state["VM"], state["V"], state["D"], kpos, lengths,
                             page=config.block_size, interpret=interpret)
  else:
    s = jax.vmap(block_scores, in_axes=(0, 0, 0, None))(state, pos, lengths, config)
  if priorities is not None:
    prio = priorities
  elif config.explore == "random":
    prio = key_words(key)
  else:
    seeds = request_seeds(key, pos.shape[0])
    prio = jax.vmap(_priorities, in_axes=(0, 0, 0, None, 0))(state, pos, lengths, config, seeds)
  lp = next_pow2(max(nb, 16))
  out = select_compact_gpu(
      pad_axis(s, 1, lp, value=NEG_INF), prio if prio.ndim == 1 else pad_axis(prio, 1, lp),
      lengths, state["warm"], width, budget=lambda n: _budget(n, config),
      block=config.block_size, score_bits=_score_bits(config), block_table=block_table,
      num_pages=num_pages, step=state["step"] if advance_step else None,
      num_warps=select_warps, interpret=interpret)
  masks, sel, total = out[:3]
  return (masks[:, :nb], sel, jnp.minimum(total, width), total, *out[3:])


def update_batched(state, scores, sel, pos, lengths, config: SpinConfig, *, group: int = 0,
                   interpret: bool = False, blocks_per_program: int | None = None,
                   stepped: bool = False, num_warps: int | None = None):
  """The step's EMA update by the GPU kernel, in place: only the selected blocks' states (and,
  except under A2, their slots' V and D) are read or written. Equals `update_blocks` per
  request (A0/A1) or `update_block_states` (A2). scores [B, W * b] of the selected blocks
  sel [B, W], pos/lengths [B] (pos None: lengths - 1, computed in the kernel). -> (new state,
  [B, W * b / group] group maxima of the scores for the top-K when group > 0, else None).
  blocks_per_program, num_warps: the kernel's tile; None takes `pallas_kernels.spin.config`'s
  defaults for the reduction. stepped: state["step"] is already the
  next step (the selection kernel advanced it)."""
  from pallas_kernels.spin import update_states_gpu
  from pallas_kernels.spin.config import SpinKernelConfig
  bpp, warps = SpinKernelConfig().update_tile(config.reduction != "A2")
  blocks_per_program = blocks_per_program or bpp
  num_warps = num_warps or warps
  upd, gm = update_states_gpu(state, scores, sel, pos, lengths, decay=config.ema_decay,
                              page=config.block_size, slots=config.reduction != "A2",
                              group=group, blocks_per_program=blocks_per_program,
                              stepped=stepped, num_warps=num_warps, interpret=interpret)
  return {**state, **upd}, gm  # the kernel wrote step and warm


def update_batched_tpu(state, scores, sel, pos, lengths, config: SpinConfig, *,
                       interpret: bool = False):
  """The step's EMA update on TPU: A0/A1's slot states V, D and VM by the TPU kernel
  (`pallas_kernels.spin.tpu.update_slots_tpu`: the selected blocks' scores placed on their
  slots in VMEM, V and D updated, D through an in-kernel flip onto offsets), the [nb]-sized
  block states (VB, DB, ages, step, warm) in XLA; A2 updates block states only (XLA).
  scores [B, W * b] of the selected blocks sel [B, W], pos/lengths [B] -> the new state."""
  from jaxsparse.spin.algorithm import _selected_block_states, update_block_states
  from pallas_kernels.spin.tpu import update_slots_tpu
  if config.reduction == "A2" or config.block_size > 128:
    if config.reduction == "A2":
      return update_block_states(state, scores, sel, pos, lengths, config)
    from jaxsparse.spin.algorithm import update_blocks
    return jax.vmap(update_blocks, in_axes=(0, 0, 0, 0, 0, None))(state, scores, sel, pos,
                                                                   lengths, config)
  b = config.block_size
  bsz, width = sel.shape
  v, d, vm = update_slots_tpu(state["V"], state["D"], scores, sel, lengths, page=b,
                              decay=config.ema_decay, interpret=interpret)
  slot = sel[:, :, None] * b + jnp.arange(b)
  obs = (sel[:, :, None] >= 0) & (slot < lengths[:, None, None])
  blk_w = jnp.where(obs, scores.reshape(bsz, width, b).astype(jnp.float32), NEG_INF).max(-1)
  return {"V": v, "D": d, "VM": vm,
          **_selected_block_states(state, sel, blk_w, pos, lengths, config)}

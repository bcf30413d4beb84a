"""SPIN's batched serving step over a paged cache: select, score the selected blocks, top-K,
update; and the speculative (multi-row) step with its deferred commit."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse.indexer import sanitize_paged
from jaxsparse import _checks
from jaxsparse.spin.algorithm import (check_key, check_state, compact_blocks, query_priorities,
                                      realized_sparsity, select_rows, update_block_states,
                                      update_blocks)
from jaxsparse.spin.config import NEG_INF, SpinConfig
from jaxsparse.spin.kernels import select_compact_batched, update_batched, update_batched_tpu

__all__ = [
    "decode_step", "decode_step_rows", "commit", "max_selected_blocks", "ALIGN_BLOCKS"
]


def max_selected_blocks(num_blocks: int, config: SpinConfig) -> int:
  """Static bound on blocks selected per request once warm (the compacted kernel width)."""
  if config.reduction == "A0":
    return num_blocks
  m = min(num_blocks, max(config.min_blocks, math.ceil((1 - config.sparsity) * num_blocks)))
  return min(num_blocks, max(m, 2))


# 32 blocks of 64 slots = 2048 scores: the top-K's chunk (its tuning table's) and the scoring
# kernel's 32-page runs (at 64 x 128K, 40%, the 1229 selected blocks pad to 1248).
ALIGN_BLOCKS = 32


def _aligned_width(width: int, num_blocks: int) -> int:
  """Round the compacted width up to whole ALIGN_BLOCKS-block runs (capped at num_blocks): the
  block-sparse kernel's output then needs no slicing, the top-K no padding and the update
  kernel no padding, i.e. no copies of the [B, width * b] scores (padding blocks are -1 and
  cost an early exit)."""
  return min(num_blocks, -(-width // ALIGN_BLOCKS) * ALIGN_BLOCKS)


def _validate_step(state, q, k_cache, block_table, lengths, w, k_scale, config):
  from jaxsparse.indexer import _validate_paged
  check_state(state, config)
  _validate_paged(q, k_cache, block_table, lengths, w, k_scale)
  if config.explore == "query":
    want = (*state["V"].shape[:-1], block_table.shape[1], k_cache.shape[-1])
    if "KM" not in state or tuple(state["KM"].shape) != want:
      raise ValueError(f"explore='query' needs the blocks' mean keys in the state: "
                       f"init_state(capacity, config, batch, head_dim={k_cache.shape[-1]}) "
                       f"(KM {want})")
  if k_cache.shape[1] != config.block_size:
    raise ValueError(f"config.block_size={config.block_size} must equal the cache page size "
                     f"k_cache.shape[1]={k_cache.shape[1]}")
  cap = block_table.shape[1] * config.block_size
  if state["V"].shape[-1] != cap:
    raise ValueError(f"state capacity {state['V'].shape[-1]} must equal block_table.shape[1] * "
                     f"block_size = {cap}")
  if state["V"].shape[0] != q.shape[0]:
    raise ValueError(f"state batch {state['V'].shape[0]} must equal q.shape[0]={q.shape[0]}")


@_checks.array_args("q", "k_cache", "block_table", "lengths", "w", optional=("k_scale",))
def decode_step(state, q, k_cache, block_table, lengths, w, config: SpinConfig, key, *,
                k_scale=None, implementation=None, decode_config=None, topk_config=None,
                warm=None, sorted=True, checked=False):  # noqa: A002
  """One SPIN decode step for B requests (one query row each), jit-friendly.

  state: `init_state(capacity, config, (B,))`; q [B, H, D]; k_cache [num_blocks, 64, D];
  block_table [B, max_blocks]; lengths [B] (the query sits at slot lengths - 1); w [B, H].
  Returns (values [B, K], slot indices [B, K] (-1 tail), new state, info) where info has the
  block masks [B, num_blocks] and realized sparsity [B] of the blocks actually scored. Cold
  requests (first step after a reset) make the whole batch score densely that step (sec.
  3.2): every request's info then shows all its blocks and realized sparsity 0.

  warm: None decides dense vs sparse on the device from `state["warm"]` (a `lax.cond`; on GPU
  XLA reads its predicate on the host, a sync of the step). A serving loop knows when it reset a
  request, so it can pass warm=False for the first step after a reset (dense, static) and
  warm=True otherwise (sparse, static, no sync). warm=True with a cold request in the batch is
  wrong (a cold request selects every block, more than the compiled width): don't.

  sorted: as in `jaxsparse.topk`; False returns the top-K as a set in ascending slot order (on
  GPU without the final sort of the candidates).

  Inputs are checked as in `jaxsparse.paged_indexer_scores` (fp8 keys need k_scale; concrete
  out-of-range lengths or pages raise ValueError); traced ones follow
  `jaxsparse.indexer.sanitize_paged` (a void request selects nothing and returns -1s), with
  checkify checks when checked=True.

  In a serving loop, jit the step with the state donated (`jax.jit(..., donate_argnums=...)`)
  and pass each step's new state to the next: on GPU the update kernel then writes the state in
  place. Without donation XLA copies the [B, N] V / D states every step.
  """
  _validate_step(state, q, k_cache, block_table, lengths, w, k_scale, config)
  check_key(key)
  lengths = sanitize_paged(block_table, lengths, k_cache.shape[0], config.block_size,
                           checked=checked)
  _checks.check_bool("warm", warm, none=True)
  _checks.check_bool("checked", checked)
  if not isinstance(sorted, bool):
    raise ValueError(f"sorted={sorted!r} must be a bool")
  return _decode_step(state, q, k_cache, block_table, lengths, w, key, k_scale, config,
                      implementation, decode_config, topk_config, warm, sorted)


def _sparse_scores(q, k_cache, block_table, lengths, w, sel, counts, k_scale, impl,
                   decode_config, block, pages=None):
  """Block-sparse scores of the selected blocks: q [B, R, H, D] -> (z [B, R, M * b], slots
  [B, M * b] (-1: padding)), through the Pallas kernel or the XLA reference. pages: the
  selected blocks' (cache pages, length rows) when the selection kernel wrote them (Pallas
  only)."""
  from jaxsparse import backend
  from jaxsparse.indexer import paged_indexer_scores_xla, row_lengths
  if impl == "pallas":
    from pallas_kernels import indexer_decode
    return indexer_decode.block_sparse_scores(
        q, k_cache, block_table, lengths, w, sel, counts, k_scale=k_scale, config=decode_config,
        platform=backend.kernel_platform(), pages=pages)
  bsz, width = sel.shape
  table = jnp.take_along_axis(block_table, jnp.maximum(sel, 0), axis=1)
  z = paged_indexer_scores_xla(q, k_cache, table, jnp.full_like(lengths, width * block), w,
                               k_scale)
  slots = (sel[:, :, None] * block + jnp.arange(block)).reshape(bsz, -1)
  slots = jnp.where(jnp.repeat(sel, block, axis=1) >= 0, slots, -1)
  lrows = row_lengths(lengths, q.shape[1])
  z = jnp.where((slots[:, None] >= 0) & (slots[:, None] < lrows[:, :, None]), z, NEG_INF)
  return z, slots


def _key_means(k_cache, block_table, lengths, k_scale, blocks, block: int):
  """Mean visible key of the given blocks: blocks [B, S] int32 block ids (past the table:
  skipped) -> [B, S, D] float32 (0 for a block with no visible slot). Reads S pages a request."""
  nb = block_table.shape[1]
  pages = jnp.take_along_axis(block_table, jnp.clip(blocks, 0, nb - 1), axis=1)
  pages = jnp.clip(pages, 0, k_cache.shape[0] - 1)  # void requests see no slot below
  keys = k_cache[pages].astype(jnp.float32)  # [B, S, b, D]
  if k_scale is not None:
    keys = keys * k_scale[pages].astype(jnp.float32)[..., None]
  slot = blocks[:, :, None] * block + jnp.arange(block)
  vis = (slot < lengths[:, None, None]) & (blocks[:, :, None] < nb)
  total = jnp.where(vis[..., None], keys, 0.0).sum(2)
  return total / jnp.maximum(vis.sum(2), 1)[..., None].astype(jnp.float32)


def _refresh_key_means(km, k_cache, block_table, lengths, k_scale, block: int, span: int):
  """KM [B, nb, D] with the `span` blocks ending at each request's newest recomputed (the
  blocks its new slots can have touched since the last step)."""
  newest = (jnp.maximum(lengths, 1) - 1) // block
  blocks = newest[:, None] - jnp.arange(span - 1, -1, -1)  # [B, span]; negative: skipped
  means = _key_means(k_cache, block_table, lengths, k_scale, jnp.maximum(blocks, 0), block)
  rows = jnp.broadcast_to(jnp.arange(km.shape[0])[:, None], blocks.shape)
  cols = jnp.where(blocks >= 0, blocks, km.shape[1])  # out of range: dropped
  return km.at[rows, cols].set(means, mode="drop")


def _all_key_means(k_cache, block_table, lengths, k_scale, block: int):
  bsz, nb = block_table.shape
  blocks = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (bsz, nb))
  return _key_means(k_cache, block_table, lengths, k_scale, blocks, block)


def _decode_step_impl(state, q, k_cache, block_table, lengths, w, key, k_scale, config,
                      implementation, decode_config, topk_config, warm=None, ordered=True):
  from jaxsparse import backend, selection
  from jaxsparse.indexer import paged_indexer_scores, paged_indexer_scores_xla
  from pallas_kernels import topk as ktopk
  bsz = q.shape[0]
  nb = block_table.shape[1]
  b = config.block_size
  lengths = lengths.astype(jnp.int32)
  pos = lengths - 1
  impl = backend.resolve(implementation)
  plat = backend.kernel_platform()
  kernels = impl == "pallas" and plat.kind == "gpu"  # the SPIN kernels (compiled or interpreted)
  width = _aligned_width(max_selected_blocks(nb, config), nb)
  # the selection kernel also gathers the selected blocks' pages for the scoring kernel
  # and advances the step counters in place (the update kernel then reads the new ones)
  tpu_kernels = impl == "pallas" and plat.kind == "tpu"  # the TPU selection kernel
  prio = km = None
  if config.explore == "query":  # the current query on the blocks' mean keys
    state = dict(state)
    km = _refresh_key_means(state.pop("KM"), k_cache, block_table, lengths, k_scale, b, 2)
    prio = jax.vmap(query_priorities)(q, w, km)
  masks, sel_w, counts_w, picked, *extra = select_compact_batched(
      state, None if kernels else pos, lengths, config, key, width,
      kernel=kernels or tpu_kernels, kind=plat.kind,
      interpret=plat.interpret, block_table=block_table if kernels else None,
      num_pages=k_cache.shape[0] if kernels else 0, advance_step=kernels, priorities=prio)
  pages = extra[:2]
  if kernels:
    state = {**state, "step": extra[2]}
  upd = jax.vmap(update_blocks, in_axes=(0, 0, 0, 0, 0, None))

  def finish(z, sel):
    gm = None
    # the top-K's groups, when the update kernel emits their maxima: ones that tile a block
    tcfg = ktopk.fused_groups(topk_config or ktopk.TopkConfig(), b)
    if kernels:  # in place, only the scored blocks; the same read of z emits the top-K's maxima
      new, gm = update_batched(state, z, sel, None, lengths, config,
                               group=_fused_group(*z.shape, config, tcfg),
                               interpret=plat.interpret, stepped=True)
    elif tpu_kernels:
      new = update_batched_tpu(state, z, sel, pos, lengths, config, interpret=plat.interpret)
    elif config.reduction == "A2":  # block states only: V and D are never read under A2
      new = update_block_states(state, z, sel, pos, lengths, config)
    else:
      new = upd(state, z, sel, pos, lengths, config)
    # top-K over the scored slots only (the compacted width, not N), then map to slots
    if gm is None:
      vals, idx = selection.topk(z, config.topk, implementation=implementation,
                                 config=topk_config, sorted=ordered)
      top = ktopk.block_slots(sel, idx, b)
    else:  # the same mapping, done by the top-K's last kernel
      # row lengths: the requests' own. Column c of z holds a slot >= c (the selected blocks
      # ascend), so columns at or past the length hold -inf anyway and the cut is exact; an
      # array already on the device, where a constant row of widths costs XLA a kernel
      vals, top = ktopk.topk_rows(z, lengths, config.topk,
                                  tcfg, plat, gm, ordered=ordered,
                                  block_map=(sel, b))
    return vals, top, new

  def sparse(_):
    z, _ = _sparse_scores(q[:, None], k_cache, block_table, lengths, w[:, None], sel_w,
                          counts_w, k_scale, impl, decode_config, b,
                          tuple(pages) if pages else None)
    vals, top, new = finish(z[:, 0], sel_w)
    return vals, top, new if km is None else {**new, "KM": km}, masks, picked

  def dense(_):  # the first step after a reset scores every block
    if impl == "pallas":
      z = paged_indexer_scores(q, k_cache, block_table, lengths, w, k_scale=k_scale,
                               implementation="pallas", config=decode_config)
    else:
      z = paged_indexer_scores_xla(q[:, None], k_cache, block_table, lengths, w[:, None],
                                   k_scale)[:, 0]
    vals, top, new = finish(z, jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (bsz, nb)))
    if km is not None:
      new = {**new, "KM": _all_key_means(k_cache, block_table, lengths, k_scale, b)}
    # every request, warm or not, was scored on all its blocks: that is what info reports
    return vals, top, new, jnp.arange(nb)[None, :] < n_blocks[:, None], n_blocks

  n_blocks = -(-lengths // b)
  if warm is None:
    vals, top_slots, new_state, scored, count = jax.lax.cond(jnp.all(state["warm"]), sparse,
                                                             dense, None)
  else:
    vals, top_slots, new_state, scored, count = (sparse if warm else dense)(None)
  # the blocks actually scored (a dense step: all of each request's), and realized sparsity
  # from their count
  info = {"block_masks": scored,
          "realized_sparsity": 1.0 - count / jnp.maximum(n_blocks, 1)}
  return vals, top_slots, new_state, info


def _fused_group(rows: int, n: int, config: SpinConfig, topk_config) -> int:
  """Group size of the top-K's first pass over n scored slots when the update kernel can
  emit it (a power of two dividing the block), else 0 (the top-K computes its own)."""
  from pallas_kernels import topk as ktopk
  if n <= config.topk:
    return 0
  g = ktopk.group_size(n, config.topk, topk_config or ktopk.TopkConfig(), "gpu", rows=rows)
  return g if g and config.block_size % g == 0 else 0


_decode_step = jax.jit(_decode_step_impl, static_argnums=(8, 9, 10, 11, 12, 13))


@_checks.array_args("q", "k_cache", "block_table", "lengths", "w", optional=("k_scale",))
def decode_step_rows(state, q, k_cache, block_table, lengths, w, config: SpinConfig, key, *,
                     k_scale=None, implementation=None, decode_config=None, topk_config=None,
                     warm=None, checked=False):
  """One SPIN verification step for B requests with R verifier rows (sec. 3.2.2).

  q [B, R, H, D], w [B, R, H]; lengths [B] counts the slots the last row sees (row r sits at
  slot lengths - R + r). Each row predicts its own mask; the shared mask is their union
  (config.mask_policy="union") or row 0's ("row0", plus every row's newest block). All rows are
  scored on the shared mask. The state is NOT updated: pass the returned `pending` to
  `commit(state, pending, accepted, config)` once the number of accepted drafts is known.
  Returns (values [B, R, K], slots [B, R, K], pending, info); info's block masks are the
  blocks scored (the shared masks). Inputs as in `decode_step`.

  A cold request (first step after a reset) selects every block and is scored on all of them
  (the others keep their sparse masks): the scored width is then every block. warm: None
  decides from `state["warm"]` on the host when it is concrete, and takes the full width when
  it is traced (under an outer jit); True (no request cold: the compacted width) or False
  (the full width) fixes it statically. warm=True with a cold request in the batch raises
  ValueError when `state["warm"]` is concrete.
  """
  if q.ndim != 4 or w.shape != q.shape[:3]:
    raise ValueError(f"q.shape={tuple(q.shape)} / w.shape={tuple(w.shape)} must be "
                     "[B, R, H, D] / [B, R, H]")
  _validate_step(state, q, k_cache, block_table, lengths, w, k_scale, config)
  check_key(key)
  _checks.check_bool("warm", warm, none=True)
  _checks.check_bool("checked", checked)
  known = None if isinstance(state["warm"], jax.core.Tracer) else bool(
      np.asarray(state["warm"]).all())
  if warm is True and known is False:
    raise ValueError("warm=True but state['warm'] has a cold request (first step after a "
                     "reset): pass warm=None or False")
  full_width = not (warm if warm is not None else bool(known))
  lengths = sanitize_paged(block_table, lengths, k_cache.shape[0], config.block_size,
                           checked=checked)
  return _decode_rows(state, q, k_cache, block_table, lengths, w, key, k_scale, config,
                      implementation, decode_config, topk_config, full_width)


def _decode_rows_impl(state, q, k_cache, block_table, lengths, w, key, k_scale, config,
                      implementation, decode_config, topk_config, full_width=False):
  from jaxsparse import backend, selection
  from jaxsparse.indexer import row_lengths
  bsz, r = q.shape[:2]
  nb = block_table.shape[1]
  b = config.block_size
  lrows = row_lengths(lengths, r)  # [B, R]
  keys = jax.random.split(key, bsz)
  if config.explore == "query":  # every row's query on the blocks' mean keys
    state = dict(state)
    km = state.pop("KM")
    km = jax.lax.cond(  # a cold request: every block's mean (the whole batch, as its scoring)
        jnp.all(state["warm"]),
        lambda: _refresh_key_means(km, k_cache, block_table, lengths, k_scale, b,
                                   2 + -(-r // b)),
        lambda: _all_key_means(k_cache, block_table, lengths, k_scale, b))
    prio = jax.vmap(jax.vmap(query_priorities, in_axes=(0, 0, None)))(q, w, km)
    shared, row_masks = jax.vmap(select_rows, in_axes=(0, 0, None, 0, 0))(state, lrows, config,
                                                                          keys, prio)
  else:
    shared, row_masks = jax.vmap(select_rows, in_axes=(0, 0, None, 0))(state, lrows, config,
                                                                        keys)
  per_row = max_selected_blocks(nb, config)
  width = _aligned_width(per_row * r if config.mask_policy == "union" else per_row + r, nb)
  # a cold request selects every block: scored on all of them (the full width)
  sel, counts = compact_blocks(shared, nb if full_width else width)
  z, slots = _sparse_scores(q, k_cache, block_table, lengths, w, sel, counts, k_scale,
                            backend.resolve(implementation), decode_config, b)
  vals, idx = selection.topk(z, config.topk, implementation=implementation, config=topk_config)
  top = jnp.where(idx >= 0, jnp.take_along_axis(
      jnp.broadcast_to(slots[:, None], z.shape), jnp.maximum(idx, 0), axis=2), -1)
  pending = {"scores": z, "sel": sel, "lrows": lrows}
  if config.explore == "query":
    pending["KM"] = km
  info = {"block_masks": shared, "row_masks": row_masks,
          "realized_sparsity": jax.vmap(lambda m, l: realized_sparsity(m, l[-1], b))(shared,
                                                                                     lrows)}
  return vals, top, pending, info


_decode_rows = jax.jit(_decode_rows_impl, static_argnums=(8, 9, 10, 11, 12))


@_checks.array_args("accepted")
def commit(state, pending, accepted, config: SpinConfig):
  """Deferred EMA update after verification: rows 0..accepted[b] in order
  (update_policy="prefix") or row 0 only ("row0"). accepted: [B] int drafts accepted, each in
  [0, R - 1]; concrete values outside it, fractional ones or a non-integer dtype raise
  ValueError; traced ones are clipped to [0, R - 1] (README "Input rules")."""
  check_state(state, config)
  if not isinstance(pending, dict) or not hasattr(pending.get("scores"), "shape") \
      or "sel" not in pending or getattr(pending["scores"], "ndim", 0) < 2:
    raise ValueError("pending must be the dict decode_step_rows returns (its 'scores' "
                     "[B, R, ...] and 'sel')")
  rows = pending["scores"].shape[1]
  bsz = pending["scores"].shape[0]
  a = accepted if isinstance(accepted, jax.core.Tracer) else np.asarray(accepted)
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise ValueError(f"accepted.dtype={a.dtype} must be an integer type")
  if a.shape != (bsz,):
    raise ValueError(f"accepted.shape={a.shape} must be ({bsz},)")
  if not isinstance(a, jax.core.Tracer) and ((a < 0).any() or (a > rows - 1).any()):
    raise ValueError(f"accepted must lie in [0, {rows - 1}] (R - 1 drafts); got min={a.min()} "
                     f"max={a.max()}")
  acc = jnp.clip(jnp.asarray(a), 0, rows - 1).astype(jnp.int32)
  if "KM" not in pending:
    return _commit(state, pending, acc, config)
  rest = {k: v for k, v in state.items() if k != "KM"}
  new = _commit(rest, {k: v for k, v in pending.items() if k != "KM"}, acc, config)
  return {**new, "KM": pending["KM"]}  # the means the step read, its drafts' blocks included


def _commit_impl(state, pending, accepted, config):
  def one(st, z, sel, lrows, a):
    def body(i, s):
      use = (i <= a) if config.update_policy == "prefix" else (i == 0)
      new = update_blocks(s, z[i], sel, lrows[i] - 1, lrows[i], config)
      return jax.tree.map(lambda n, o: jnp.where(use, n, o), new, s)
    return jax.lax.fori_loop(0, z.shape[0], body, st)
  return jax.vmap(one)(state, pending["scores"], pending["sel"], pending["lrows"], accepted)


_commit = jax.jit(_commit_impl, static_argnums=(3,))

"""SPIN: shadow predictive indexer for decode (shared/papers/spin-shadow-predictive-indexer.txt).

Pure functions over a state pytree. Per request and layer SPIN keeps
  V [N_cap]  an EMA of observed indexer scores by absolute slot     (vertical pattern, sec. 3.2)
  D [N_cap]  an EMA of observed scores by relative offset q_t - i   (diagonal pattern)
  VM [B_cap] the max of V over each block (kept by every update; read by A1's GPU block scores)
  age [B_cap] the step at which each block was last scored            (block-age exploration)
and predicts slot scores `max(V[i], D[q_t - i])`, pools them per block, and scores only the
m_t best blocks (Algorithm 1), plus the sink block, the newest block and a few explored blocks
(sec. 3.2.1). Speculative decoding (sec. 3.2.2): one mask per verifier row, union or row-0
sharing; EMA updates deferred until acceptance is known, then replayed for rows 0..a (prefix)
or row 0 only.

Everything is jit-compiled for a fixed capacity (`N_cap` slots): lengths are data, so a growing
context never recompiles.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._util import counter_hash, words_seed

NEG_INF = float("-inf")
POOLINGS = ("max", "top4", "mean")
REDUCTIONS = ("A0", "A1", "A2")
EXPLORES = ("random", "staleness", "block-age", "none")
MASK_POLICIES = ("union", "row0")
UPDATE_POLICIES = ("prefix", "row0")
STATE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class SpinConfig:
  """SPIN's knobs (paper defaults: b=64, max pooling, alpha=0.5, A1, random 5% exploration).

  block_size: slots per KV block (must match the paged cache's page size).
  topk: K of the post-indexer top-K.
  sparsity: target block sparsity rho in [0, 1).
  ema_decay: alpha in [0, 1).
  explore_fraction: gamma, the part of the block budget m_t reserved for exploration.
  explore: "random" | "staleness" | "block-age" | "none".
  pooling: "max" | "top4" | "mean" (how predicted slot scores become a block score).
  reduction: "A0" (slot top-K, then expand to blocks) | "A1" (pool predicted slot scores) |
    "A2" (block-level EMA states; `decode_step` then updates only those, not V and D).
  mask_policy, update_policy: speculative decoding (R > 1 verifier rows).
  state_dtype: "bfloat16" (default) or "float32" for the V, D, VB, DB EMAs (updates are
    computed in float32 and rounded once). bfloat16 halves the state bytes read and written
    per step: on the H200 at B=64 x 128K prediction + update take 62.7 us instead of 78.7
    (benchmarks/results/session3/spin_parts_*.json) with the same misses on the shipped trace
    (benchmarks/results/spin_state_dtype.json).
  """
  block_size: int = 64
  topk: int = 2048
  sparsity: float = 0.4
  ema_decay: float = 0.5
  explore_fraction: float = 0.05
  explore: str = "random"
  pooling: str = "max"
  reduction: str = "A1"
  mask_policy: str = "union"
  update_policy: str = "prefix"
  state_dtype: str = "bfloat16"

  def __post_init__(self):
    b = self.block_size
    if not isinstance(b, int) or b < 1 or b & (b - 1):
      raise ValueError(f"block_size={b!r} must be a power of two")
    if not isinstance(self.topk, int) or self.topk < 1:
      raise ValueError(f"topk={self.topk!r} must be a positive int")
    if not 0.0 <= self.sparsity < 1.0:
      raise ValueError(f"sparsity={self.sparsity!r} must lie in [0, 1)")
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"ema_decay={self.ema_decay!r} must lie in [0, 1)")
    if not 0.0 <= self.explore_fraction <= 0.5:
      raise ValueError(f"explore_fraction={self.explore_fraction!r} must lie in [0, 0.5]: "
                       "exploration may take at most half of the block budget")
    for name, allowed in (("explore", EXPLORES), ("pooling", POOLINGS),
                          ("reduction", REDUCTIONS), ("mask_policy", MASK_POLICIES),
                          ("update_policy", UPDATE_POLICIES),
                          ("state_dtype", STATE_DTYPES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")

  @property
  def min_blocks(self) -> int:
    return -(-self.topk // self.block_size)


# ------------------------------------------------------------------------------------ state


def init_state(capacity: int, config: SpinConfig, batch: tuple = ()):
  """Fresh (reset) state for `capacity` slots; `batch` adds leading request dims.

  The first step after a reset scores every block (`warm` is False until then). Keys: V, D
  [..., capacity] and VB, DB, VM [..., capacity / block_size] in the state dtype, age
  [..., capacity / block_size] uint32, step int32 and warm bool [...]. VM is V's maximum over
  each block; every update keeps it so (a state built by hand must set it to
  `V.reshape(..., -1, block_size).max(-1)`). age is uint32, not int32, so that a jitted step
  that donates its state never finds it the same shape and dtype as the int32 top-K indices
  [B, K]: at K = capacity / block_size (2048 at 128K slots) jax would alias the donated age to
  those indices and XLA would copy age every step (~1.5 us of kernel time at 64 x 128K on the
  H200: `memcpy32_post` 2.85 -> 1.34 us, benchmarks/results/session12/spin_A1_s12{a,b}.json).
  An int32 age built by hand works as well.
  """
  if capacity % config.block_size:
    raise ValueError(f"capacity={capacity} must be a multiple of block_size={config.block_size}")
  nb = capacity // config.block_size
  z = lambda n: jnp.zeros(batch + (n,), jnp.dtype(config.state_dtype))
  return {"V": z(capacity), "D": z(capacity), "VM": z(nb), "VB": z(nb), "DB": z(nb),
          "age": jnp.zeros(batch + (nb,), jnp.uint32), "step": jnp.zeros(batch, jnp.int32),
          "warm": jnp.zeros(batch, bool)}


def reset(state):
  """Reset after prefill or at the start of a turn (sec. 3.2)."""
  return jax.tree.map(jnp.zeros_like, state)


# ------------------------------------------------------------------------------- prediction


def num_blocks_budget(n_blocks, config: SpinConfig):
  """m_t = min(B_t, max(ceil(K / b), ceil((1 - rho) B_t))) (Algorithm 1, line 4)."""
  # the 1e-3 absorbs float32 rounding of (1 - rho) * B (0.6 * 100 must give 60, not 61)
  n_blocks = jnp.asarray(n_blocks, jnp.int32)
  keep = jnp.ceil((1.0 - config.sparsity) * n_blocks.astype(jnp.float32) - 1e-3).astype(jnp.int32)
  return jnp.minimum(n_blocks, jnp.maximum(config.min_blocks, keep))


def _pool(x, config):
  """x [nb, b] predicted slot scores (-inf outside the context) -> [nb] block scores."""
  if config.pooling == "max":
    return x.max(-1)
  valid = x > NEG_INF
  if config.pooling == "mean":
    cnt = valid.sum(-1)
    return jnp.where(cnt > 0, jnp.where(valid, x, 0.0).sum(-1) / jnp.maximum(cnt, 1), NEG_INF)
  top = jax.lax.top_k(x, min(4, x.shape[-1]))[0]
  tv = top > NEG_INF
  cnt = tv.sum(-1)
  return jnp.where(cnt > 0, jnp.where(tv, top, 0.0).sum(-1) / jnp.maximum(cnt, 1), NEG_INF)


def by_offset(x, pos, fill=0):
  """y[i] = x[pos - i] for 0 <= pos - i < len(x), else `fill`: a flip and a dynamic slice
  (contiguous, no gather), so slot- and offset-indexed arrays line up. x: [n]."""
  n = x.shape[-1]
  xf = jnp.concatenate([jnp.flip(x, -1), jnp.full((n,), fill, x.dtype)])
  return jax.lax.dynamic_slice_in_dim(xf, n - 1 - pos, n)


def predicted_slot_scores(state, pos, length):
  """zhat[i] = max(V[i], D[pos - i]) for i < length, else -inf (eq. 1)."""
  cap = state["V"].shape[-1]
  i = jnp.arange(cap)
  zhat = jnp.maximum(state["V"], by_offset(state["D"], pos)).astype(jnp.float32)
  return jnp.where(i < length, zhat, NEG_INF)


def block_scores(state, pos, length, config: SpinConfig):
  """Predicted block scores S_t [num_blocks] (-inf for blocks past the context)."""
  b = config.block_size
  nb = state["VB"].shape[-1]
  jb = jnp.arange(nb)
  n_blocks = -(-length // b)
  if config.reduction == "A2":
    d = by_offset(state["DB"], pos // b)
    return jnp.where(jb < n_blocks, jnp.maximum(state["VB"], d).astype(jnp.float32), NEG_INF)
  if config.pooling == "max":
    return _max_pooled_block_scores(state, pos, length, b)
  z = predicted_slot_scores(state, pos, length).reshape(nb, b)
  return _pool(z, config)


def _max_pooled_block_scores(state, pos, length, b: int):
  """Max pooling of eq. 1's predictions without flipping D onto slots: block j's score
  max_i max(V[i], D[pos - i]) is max(the max of V over the block's valid slots, the max of D
  over the block's offsets). Those offsets, pos - jb - b + 1 ... pos - jb, start at phase
  r = (pos + 1) % b within D's own blocks, so they are the lanes >= r of D-block c - 1 - j plus
  the lanes < r of D-block c - j (c = (pos + 1) // b; r = 0: D-block c - 1 - j alone).
  Both partial maxima come from one aligned pass over D; only [num_blocks] vectors are
  flipped. Negative offsets (slots past the query) and blocks past the context give -inf.
  Equal to `_pool(predicted_slot_scores(...))` with pooling="max"."""
  cap = state["V"].shape[-1]
  nb = cap // b
  slot = jnp.arange(cap)
  v = jnp.where(slot < length, state["V"].astype(jnp.float32), NEG_INF).reshape(nb, b).max(-1)
  d = state["D"].astype(jnp.float32).reshape(nb, b)
  r = (pos + 1) % b
  c = (pos + 1) // b
  lane = jnp.arange(b)
  suffix = jnp.where(lane >= r, d, NEG_INF).max(-1)  # [nb] over D-blocks
  prefix = jnp.where(lane < r, d, NEG_INF).max(-1)
  # c = nb only when pos = cap - 1, where r = 0 and `prefix` is all -inf, so by_offset's
  # clamped start there changes nothing
  window = jnp.maximum(by_offset(suffix, c - 1, NEG_INF), by_offset(prefix, c, NEG_INF))
  return jnp.maximum(v, window)


def _rank_desc(score, eligible):
  """Rank (0 = best) of each eligible entry by score, ties to the lower index; others n.

  Callers only take ranks below the number of eligible entries, and eligible scores are
  finite, so pushing ineligible entries to -inf in a stable sort is enough.
  """
  n = score.shape[-1]
  key = jnp.where(eligible, score, NEG_INF)
  order = jnp.argsort(-key, stable=True)
  rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32),
                                                 unique_indices=True)
  return jnp.where(eligible, rank, n)


def top_mask(score, eligible, n):
  """Mask of the n best eligible entries of `score` [L], ties to the lower index (n <= the
  eligible count). On a GPU this is one Pallas kernel per row (an exact bitwise search for the
  n-th largest key, no sort); elsewhere a stable argsort."""
  from jaxsparse import backend
  plat = backend.kernel_platform()
  if plat.kind == "gpu" and not plat.interpret:
    from pallas_kernels._util import next_pow2, pad_axis
    from pallas_kernels.topk import gpu as kg
    length = score.shape[-1]
    lp = next_pow2(max(length, 16))
    m = kg.select_mask(pad_axis(score[None].astype(jnp.float32), 1, lp),
                       pad_axis(eligible[None], 1, lp, value=False),
                       jnp.reshape(n, (1,)).astype(jnp.int32))
    return m[0, :length]
  return _rank_desc(score, eligible) < n


def _budget(n_blocks, config: SpinConfig):
  """(n_exploit, n_explore) for a request with n_blocks blocks: m_t minus the forced blocks
  (sink and newest: min(n_blocks, 2)), of which floor(gamma * m_t) explore (sec. 3.2.1)."""
  m = num_blocks_budget(n_blocks, config)
  cap = jnp.maximum(m - jnp.minimum(n_blocks, 2), 0)
  n_explore = jnp.minimum(jnp.floor(config.explore_fraction * m).astype(jnp.int32), cap)
  if config.explore == "none":
    n_explore = jnp.zeros_like(n_explore)
  return cap - n_explore, n_explore


def key_seed(key):
  """A uint32 seed from a PRNG key (raw uint32 or typed): its key data hashed together."""
  words = key_words(key)
  return words_seed(lambda i: words[i], words.shape[0])


def key_words(key):
  """A PRNG key's data as a flat uint32 array (no computation for a raw uint32 key)."""
  return jax.random.key_data(key).reshape(-1).astype(jnp.uint32)


def request_seeds(key, n: int):
  """[n] uint32 seeds, one per request (or verifier row), from one key: counter hashes, not
  key splits, so they cost no extra kernel in a jitted step."""
  return counter_hash(key_seed(key), jnp.arange(n, dtype=jnp.uint32))


def random_keys16(seed, nb: int):
  """[nb] uint32 random 16-bit keys of blocks 0..nb-1 under a uint32 seed (the random
  exploration order). The GPU selection kernel computes the same keys in registers."""
  return counter_hash(seed, jnp.arange(nb, dtype=jnp.uint32)) >> 16


def _uniform16(seed, nb: int):
  """[nb] float32 in [0, 1) on a grid of 2**-16 (exact in float32), from `random_keys16`."""
  return random_keys16(seed, nb).astype(jnp.float32) * (1.0 / 65536)


def _staleness(state):
  """Steps since each block was last observed: step - age, float32 [..., nb]."""
  return (state["step"].astype(jnp.int32) - state["age"].astype(jnp.int32)).astype(jnp.float32)


def _priorities(state, pos, length, config: SpinConfig, seed):
  """Exploration priorities [nb] float32 of the configured policy (higher: explored first).
  seed: uint32 (`request_seeds`). Random priorities take 2**16 values: two blocks tie with
  probability 2**-16 and a tie goes to the lower block, so a ranking needs 16 bits, not 32."""
  nb = state["VB"].shape[-1]
  if config.explore == "random":
    return _uniform16(seed, nb)
  if config.explore == "block-age":
    return _staleness(state) + 1e-3 * _uniform16(seed, nb)
  if config.explore == "staleness":
    s = block_scores(state, pos, length, dataclasses.replace(config, reduction="A1")
                     if config.reduction == "A0" else config)
    valid = jnp.arange(nb) < -(-length // config.block_size)
    stale = _staleness(state)
    lo = jnp.min(jnp.where(valid, s, jnp.inf))
    return stale * (jnp.where(valid, s, lo) - lo + 1e-6)
  return jnp.zeros((nb,))


def select_blocks(state, pos, length, config: SpinConfig, key):
  """Block mask [num_blocks] bool for one query at slot `pos` seeing `length` slots.

  Cold state (first step after a reset): every block. Otherwise the forced blocks (sink and
  newest), the best predicted blocks, and floor(gamma * m_t) explored blocks, m_t in total
  (sec. 3.2.1). A0 instead keeps every block holding one of the top-K predicted slots.
  key: a PRNG key (exploration).
  """
  return _select_blocks(state, pos, length, config, key_seed(key))


def _select_blocks(state, pos, length, config: SpinConfig, seed):
  """`select_blocks` with a uint32 seed instead of a key."""
  b = config.block_size
  nb = state["VB"].shape[-1]
  jb = jnp.arange(nb)
  n_blocks = -(-length // b)
  valid = jb < n_blocks
  forced = valid & ((jb == 0) | (jb == n_blocks - 1))
  n_exploit, n_explore = _budget(n_blocks, config)
  if config.reduction == "A0":
    z = predicted_slot_scores(state, pos, length)
    from jaxsparse.selection import topk
    _, idx = topk(z, config.topk)  # the project's top-K (Pallas on GPU/TPU, sort on CPU)
    hit = jnp.zeros(nb, bool).at[jnp.where(idx >= 0, idx // b, nb)].set(True, mode="drop") & valid
    exploit = hit & ~forced
  else:
    exploit = top_mask(block_scores(state, pos, length, config), valid & ~forced, n_exploit)
  rest = valid & ~forced & ~exploit
  explore = top_mask(_priorities(state, pos, length, config, seed), rest, n_explore)
  mask = forced | exploit | explore
  return jnp.where(state["warm"], mask, valid)


def select_blocks_batched(state, pos, lengths, config: SpinConfig, key):
  """`select_blocks` for B requests: state with a leading batch axis, pos/lengths [B], one key
  (request b explores with `request_seeds(key, B)[b]`) -> masks [B, num_blocks] bool (the
  step and the benchmarks share this)."""
  seeds = request_seeds(key, pos.shape[0])
  return jax.vmap(_select_blocks, in_axes=(0, 0, 0, None, 0))(state, pos, lengths, config,
                                                              seeds)


def _score_bits(config: SpinConfig) -> int:
  """Bits that rank block scores exactly: 16 when each is a bfloat16 state value (bfloat16
  EMAs pooled by max, or A2's block states), else 32."""
  exact = config.state_dtype == "bfloat16" and (config.reduction == "A2"
                                                or config.pooling == "max")
  return 16 if exact else 32


def select_compact_batched(state, pos, lengths, config: SpinConfig, key, width: int, *,
                           kernel: bool = False, interpret: bool = False, block_table=None,
                           num_pages: int = 0, advance_step: bool = False,
                           select_warps: int = 8):
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
  pos None: lengths - 1 (computed in the kernels where they read it)."""
  kpos = pos
  if pos is None:
    pos = lengths - 1
  if not kernel or config.reduction == "A0":
    masks = select_blocks_batched(state, pos, lengths, config, key)
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
  if config.explore == "random":
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


# ---------------------------------------------------------------------------------- update


def _ema(old, new, a):
  """a * old + (1 - a) * new in float32, stored back in the state's dtype."""
  return (a * old.astype(jnp.float32) + (1 - a) * new).astype(old.dtype)


def update_dense(state, z, obs, pos, length, config: SpinConfig):
  """EMA update from observed scores only (Algorithm 1 lines 8-10), all elementwise.

  z [N_cap] float32 scores by slot, obs [N_cap] bool (which slots were scored), for the query
  at slot `pos` seeing `length` slots. D is indexed by offset pos - i, so the slot-indexed
  arrays are flipped onto offsets with `by_offset` instead of scattered.
  """
  a = config.ema_decay
  b = config.block_size
  cap = state["V"].shape[-1]
  nb = cap // b
  obs = obs & (jnp.arange(cap) < length)
  z = jnp.where(obs, z, 0.0)
  v = jnp.where(obs, _ema(state["V"], z, a), state["V"])
  z_off, obs_off = by_offset(z, pos), by_offset(obs, pos, False)
  d = jnp.where(obs_off, _ema(state["D"], z_off, a), state["D"])
  seen = obs.reshape(nb, b).any(-1)
  blk = jnp.where(obs, z, NEG_INF).reshape(nb, b).max(-1)  # A2: pooled observation per block
  return {"V": v, "D": d, "VM": v.reshape(nb, b).max(-1),
          **_block_state_update(state, seen, blk, pos, config)}


def _block_state_update(state, seen, blk, pos, config: SpinConfig):
  """The per-block part of the update (A2's VB, DB, block ages, step, warm): seen [nb] bool,
  blk [nb] the max observed score of each block."""
  a = config.ema_decay
  b = config.block_size
  vb = jnp.where(seen, _ema(state["VB"], blk, a), state["VB"])
  blk_off, seen_off = by_offset(jnp.where(seen, blk, 0.0), pos // b), by_offset(seen, pos // b,
                                                                             False)
  db = jnp.where(seen_off, _ema(state["DB"], blk_off, a), state["DB"])
  age = jnp.where(seen, state["step"].astype(state["age"].dtype), state["age"])
  return {"VB": vb, "DB": db, "age": age, "step": state["step"] + 1,
          "warm": jnp.ones_like(state["warm"])}


def update_batched(state, scores, sel, pos, lengths, config: SpinConfig, *, group: int = 0,
                   interpret: bool = False, blocks_per_program: int | None = None,
                   stepped: bool = False, num_warps: int | None = None):
  """The step's EMA update by the GPU kernel, in place: only the selected blocks' states (and,
  except under A2, their slots' V and D) are read or written. Equals `update_blocks` per
  request (A0/A1) or `update_block_states` (A2). scores [B, W * b] of the selected blocks
  sel [B, W], pos/lengths [B] (pos None: lengths - 1, computed in the kernel). -> (new state,
  [B, W * b / group] group maxima of the scores for the top-K when group > 0, else None).
  blocks_per_program, num_warps: the kernel's tile; None picks the fastest at B=64 x 128K on
  the H200 in kernel time: 16 blocks at 2 warps under A2 (8.9 us; 9.7 at 4 warps), 8 blocks at
  1 warp otherwise (19.5 us; 22.3 at 4 warps, 20.0 for 4 blocks at 1 warp): the kernel is
  bound by memory latency per program, so small programs, more of them resident per SM, win
  (benchmarks/results/session12/spin_tiles_s12d.json). stepped: state["step"] is already the
  next step (the selection kernel advanced it)."""
  from pallas_kernels.spin import update_states_gpu
  if blocks_per_program is None:
    blocks_per_program = 16 if config.reduction == "A2" else 8
  if num_warps is None:
    num_warps = 2 if config.reduction == "A2" else 1
  upd, gm = update_states_gpu(state, scores, sel, pos, lengths, decay=config.ema_decay,
                              page=config.block_size, slots=config.reduction != "A2",
                              group=group, blocks_per_program=blocks_per_program,
                              stepped=stepped, num_warps=num_warps, interpret=interpret)
  return {**state, **upd}, gm  # the kernel wrote step and warm


def _selected_block_states(state, sel, blk_w, pos, lengths, config: SpinConfig):
  """The per-block update for a batch from the selected blocks: sel [B, W] block ids (-1:
  padding), blk_w [B, W] each one's max observed score -> new VB, DB, age, step, warm."""
  b = config.block_size
  bsz = sel.shape[0]
  nb = state["VB"].shape[-1]
  seen_w = (sel >= 0) & (sel * b < lengths[:, None])
  rows = jnp.broadcast_to(jnp.arange(bsz)[:, None], sel.shape)
  idx = jnp.where(sel >= 0, sel, nb)
  seen = jnp.zeros((bsz, nb), bool).at[rows, idx].set(seen_w, mode="drop")
  blk = jnp.full((bsz, nb), NEG_INF, jnp.float32).at[rows, idx].set(blk_w, mode="drop")
  return jax.vmap(_block_state_update, in_axes=(0, 0, 0, 0, None))(state, seen, blk, pos, config)


def update_block_states(state, scores, sel, pos, lengths, config: SpinConfig):
  """A2's EMA update for a batch: only the per-block states (VB, DB, ages); the slot states V
  and D, which only A0 and A1 read, are passed through untouched, so the step neither reads
  nor writes them. scores [B, W * b] of the selected blocks sel [B, W], pos/lengths [B]."""
  b = config.block_size
  bsz, width = sel.shape
  slot = sel[:, :, None] * b + jnp.arange(b)
  obs = (sel[:, :, None] >= 0) & (slot < lengths[:, None, None])
  blk_w = jnp.where(obs, scores.reshape(bsz, width, b).astype(jnp.float32), NEG_INF).max(-1)
  return {"V": state["V"], "D": state["D"], "VM": state["VM"],
          **_selected_block_states(state, sel, blk_w, pos, lengths, config)}


def update(state, scores, slots, pos, length, config: SpinConfig):
  """EMA update from scores [M] observed at slots [M] (-1: not observed); any M."""
  cap = state["V"].shape[-1]
  sl = jnp.where((slots >= 0) & (slots < cap), slots, cap)
  z = jnp.zeros((cap,), jnp.float32).at[sl].set(scores, mode="drop")
  obs = jnp.zeros((cap,), bool).at[sl].set(True, mode="drop")
  return update_dense(state, z, obs, pos, length, config)


def update_blocks(state, scores, sel, pos, length, config: SpinConfig):
  """EMA update from the block-sparse kernel's output: scores [M * b] for blocks sel [M]
  (-1: padding). Whole-block rows are scattered, never single slots."""
  b = config.block_size
  cap = state["V"].shape[-1]
  nb = cap // b
  rows = jnp.where(sel >= 0, sel, nb)
  z = jnp.zeros((nb, b), jnp.float32).at[rows].set(scores.reshape(-1, b), mode="drop")
  obs = jnp.zeros((nb, b), bool).at[rows].set(True, mode="drop")
  return update_dense(state, z.reshape(cap), obs.reshape(cap), pos, length, config)


def realized_sparsity(mask, length, block_size):
  n_blocks = -(-length // block_size)
  return 1.0 - mask.sum() / jnp.maximum(n_blocks, 1)


def slot_mask(mask, block_size):
  return jnp.repeat(mask, block_size, axis=-1)


# ---------------------------------------------------------------------- speculative decoding


def select_rows(state, lengths_rows, config: SpinConfig, key):
  """Per-row masks for R verifier rows (row r at slot lengths_rows[r] - 1), combined.

  Returns (shared mask [num_blocks], per-row masks [R, num_blocks]).
  """
  r = lengths_rows.shape[0]
  seeds = request_seeds(key, r)
  rows = jax.vmap(lambda l, s: _select_blocks(state, l - 1, l, config, s))(lengths_rows, seeds)
  shared = rows.any(0) if config.mask_policy == "union" else rows[0] | _newest(rows, lengths_rows,
                                                                             config)
  return shared, rows


def _newest(rows, lengths_rows, config):
  """Row-0 sharing still needs each row's newest block (its own query lives there)."""
  nb = rows.shape[-1]
  last = (lengths_rows - 1) // config.block_size
  return (jnp.arange(nb)[None, :] == last[:, None]).any(0)


def update_rows(state, scores_rows, mask, lengths_rows, accepted, config: SpinConfig):
  """Deferred update once `accepted` drafts are known: rows 0..a in order ("prefix") or row 0.

  scores_rows [R, N_cap]; mask [num_blocks] (the shared mask every row was scored on).
  """
  r, cap = scores_rows.shape
  obs = slot_mask(mask, config.block_size)

  def body(i, st):
    use = (i <= accepted) if config.update_policy == "prefix" else (i == 0)
    new = update_dense(st, scores_rows[i], obs, lengths_rows[i] - 1, lengths_rows[i], config)
    return jax.tree.map(lambda n, o: jnp.where(use, n, o), new, st)

  return jax.lax.fori_loop(0, r, body, state)


# ------------------------------------------------------------------------------- trace replay


def _full_topk_sets(z, lengths_rows, k):
  """Ground-truth top-K slot masks per step and row from full scores z [S, R, N]."""
  from jaxsparse.selection import topk
  s, r, n = z.shape
  lens = lengths_rows.reshape(s * r).astype(jnp.int32)
  _, idx = topk(z.reshape(s * r, n), k, lengths=lens)
  rows = jnp.broadcast_to(jnp.arange(s * r)[:, None], idx.shape)
  hit = jnp.zeros((s * r, n), bool).at[rows, jnp.where(idx >= 0, idx, n)].set(True, mode="drop")
  return hit.reshape(s, r, n)


def replay(q, w, k, lengths, config: SpinConfig, *, seed: int = 0, accepted=None,
           scores=None):
  """Replay a decode trace through SPIN (the evaluation API).

  Args:
    q: [S, H, D] (or [S, R, H, D] verifier rows) float queries; w: [S, H] (or [S, R, H]).
    k: [N, D] keys by slot; lengths: [S] non-decreasing; at step s keys 0..lengths[s]-1 are
      visible and the (last row's) query sits at slot lengths[s] - 1; row r of R sits at slot
      lengths[s] - R + r.
    config: SpinConfig; seed: exploration RNG seed.
    accepted: [S] int drafts accepted per step (multi-row traces; default all).
    scores: optional precomputed full scores [S, (R,) N] (else computed with the reference).

  Returns a dict of numpy arrays: block_masks [S, num_blocks] bool (the shared mask),
  miss_rate [S, R] (fraction of the full top-K outside the scored slots), realized_sparsity
  [S], row_masks [S, R, num_blocks], and floats mean_miss, p99_miss, mean_sparsity (over steps
  after the first, which scores everything by design).
  """
  q, w = jnp.asarray(q), jnp.asarray(w)
  if q.ndim == 3:
    q, w = q[:, None], w[:, None]
  if q.ndim != 4 or w.shape != q.shape[:3]:
    raise ValueError(f"q.shape={tuple(q.shape)} / w.shape={tuple(w.shape)} must be "
                     "[S, H, D] / [S, H] or [S, R, H, D] / [S, R, H]")
  lengths = np.asarray(lengths)
  s, r = q.shape[:2]
  if lengths.shape != (s,):
    raise ValueError(f"lengths.shape={lengths.shape} must be ({s},)")
  if (np.diff(lengths) < 0).any():
    raise ValueError("lengths must be non-decreasing")
  if lengths.min() < r or lengths.max() > k.shape[0]:
    raise ValueError(f"lengths must lie in [{r}, {k.shape[0]}] (R={r}, N={k.shape[0]})")
  b = config.block_size
  cap = -(-k.shape[0] // b) * b
  lrows = jnp.asarray(lengths[:, None] - (r - 1) + np.arange(r)[None, :], jnp.int32)  # [S, R]
  if scores is None:
    from jaxsparse.indexer import indexer_scores_xla
    kf = jnp.asarray(k, jnp.float32)
    scores = jax.vmap(lambda qq, ww, ll: indexer_scores_xla(
        qq.astype(jnp.float32), kf, ww.astype(jnp.float32), None, ll - 1))(q, w, lrows)
  z = jnp.asarray(scores, jnp.float32).reshape(s, r, -1)
  z = jnp.pad(z, ((0, 0), (0, 0), (0, cap - z.shape[-1])), constant_values=NEG_INF)
  acc = jnp.full((s,), r - 1, jnp.int32) if accepted is None else jnp.asarray(accepted, jnp.int32)
  out = _replay_scan(z, lrows, acc, config, seed)
  masks, rows, miss, spars = [np.asarray(x) for x in out]
  tail_miss = miss[1:].reshape(-1) if s > 1 else miss.reshape(-1)
  return {"block_masks": masks, "row_masks": rows, "miss_rate": miss,
          "realized_sparsity": spars,
          "mean_miss": float(tail_miss.mean()), "p99_miss": float(np.percentile(tail_miss, 99)),
          "mean_sparsity": float(spars[1:].mean() if s > 1 else spars.mean())}


def _replay_scan_impl(z, lrows, acc, config, seed):
  s, r, cap = z.shape
  truth = _full_topk_sets(z, lrows, config.topk)
  state = init_state(cap, config)

  def step(carry, xs):
    st, key = carry
    zs, ls, a, tr = xs
    key, sub = jax.random.split(key)
    mask, rows = select_rows(st, ls, config, sub)
    slots = slot_mask(mask, config.block_size)
    observed = jnp.where(slots[None, :], zs, NEG_INF)
    st = update_rows(st, observed, mask, ls, a, config)
    kept = (tr & slots[None, :]).sum(-1)
    miss = 1.0 - kept / jnp.maximum(tr.sum(-1), 1)
    return (st, key), (mask, rows, miss, realized_sparsity(mask, ls[-1], config.block_size))

  _, out = jax.lax.scan(step, (state, jax.random.PRNGKey(seed)), (z, lrows, acc, truth))
  return out


_replay_scan = jax.jit(_replay_scan_impl, static_argnums=(3, 4))


def predictor_study(z_layers, lengths, k: int, *, offset_shift: int = 1, best_of: int = 5):
  """The paper's Table 1 on a trace: how well simple signals predict the current scores.

  z_layers: [L, S, N] full scores per layer (row 0), lengths [S]. Predictors of step s, layer l:
  random; prev-layer (layer l-1, same step); prev-layer best-of-5 (best of layers l-1..l-5,
  an oracle); prev-iter (same layer, step s-1); prev-iter offset 1 (step s-1 shifted by one
  slot, the diagonal). Returns {name: (mean Pearson r, mean top-k recall)} over the steps and
  layers where the predictor exists.
  """
  z = np.asarray(z_layers, np.float64)
  nl, s, n = z.shape
  rng = np.random.default_rng(0)
  res = {name: ([], []) for name in ("random", "prev-layer", "prev-layer best-of-5",
                                     "prev-iter", "prev-iter offset 1")}

  def score(pred, cur, length):
    a, b = pred[:length], cur[:length]
    ok = np.isfinite(a) & np.isfinite(b)
    r = np.corrcoef(a[ok], b[ok])[0, 1] if ok.sum() > 2 and a[ok].std() > 0 else 0.0
    kk = min(k, length)
    top_pred = np.argsort(-np.where(np.isfinite(a), a, -np.inf), kind="stable")[:kk]
    top_cur = np.argsort(-np.where(np.isfinite(b), b, -np.inf), kind="stable")[:kk]
    return r, np.isin(top_cur, top_pred).mean()

  for l in range(nl):
    for t in range(1, s):
      n_t = int(lengths[t])
      cur = z[l, t]
      res["random"][0].append(0.0)
      res["random"][1].append(score(rng.standard_normal(n), cur, n_t)[1])
      prev = z[l, t - 1].copy()
      prev[int(lengths[t - 1]):] = np.nan
      prev = np.where(np.isnan(prev), np.nanmin(prev[:int(lengths[t - 1])]), prev)
      for name, pred in (("prev-iter", prev),
                         ("prev-iter offset 1", np.concatenate([np.full(offset_shift, prev.min()),
                                                                prev[:-offset_shift]]))):
        rr, rc = score(pred, cur, n_t)
        res[name][0].append(rr)
        res[name][1].append(rc)
      if l >= 1:
        rr, rc = score(z[l - 1, t], cur, n_t)
        res["prev-layer"][0].append(rr)
        res["prev-layer"][1].append(rc)
        cands = [score(z[j, t], cur, n_t) for j in range(max(0, l - best_of), l)]
        best = max(cands, key=lambda x: x[1])
        res["prev-layer best-of-5"][0].append(best[0])
        res["prev-layer best-of-5"][1].append(best[1])
  return {name: (float(np.mean(v[0])) if v[0] else math.nan,
                 float(np.mean(v[1])) if v[1] else math.nan) for name, v in res.items()}


# -------------------------------------------------------------------- batched serving step


def max_selected_blocks(num_blocks: int, config: SpinConfig) -> int:
  """Static bound on blocks selected per request once warm (the compacted kernel width)."""
  if config.reduction == "A0":
    return num_blocks
  m = min(num_blocks, max(config.min_blocks, math.ceil((1 - config.sparsity) * num_blocks)))
  return min(num_blocks, max(m, 2))


# 32 blocks of 64 slots = 2048 scores: the top-K's chunk (TopkConfig.chunk) and the scoring
# kernel's 32-page runs. (It was 64 while the chunk was 4096; at 64 x 128K, 40%, 64 padded the
# 1229 selected blocks to 1280, 32 pads them to 1248.)
ALIGN_BLOCKS = 32


def _aligned_width(width: int, num_blocks: int) -> int:
  """Round the compacted width up to whole ALIGN_BLOCKS-block runs (capped at num_blocks): the
  block-sparse kernel's output then needs no slicing, the top-K no padding and the update
  kernel no padding, i.e. no copies of the [B, width * b] scores (padding blocks are -1 and
  cost an early exit)."""
  return min(num_blocks, -(-width // ALIGN_BLOCKS) * ALIGN_BLOCKS)


def _validate_step(state, q, k_cache, block_table, lengths, config):
  if k_cache.shape[1] != config.block_size:
    raise ValueError(f"config.block_size={config.block_size} must equal the cache page size "
                     f"k_cache.shape[1]={k_cache.shape[1]}")
  cap = block_table.shape[1] * config.block_size
  if state["V"].shape[-1] != cap:
    raise ValueError(f"state capacity {state['V'].shape[-1]} must equal block_table.shape[1] * "
                     f"block_size = {cap}")
  if state["V"].shape[0] != q.shape[0]:
    raise ValueError(f"state batch {state['V'].shape[0]} must equal q.shape[0]={q.shape[0]}")


def decode_step(state, q, k_cache, block_table, lengths, w, config: SpinConfig, key, *,
                k_scale=None, implementation=None, decode_config=None, topk_config=None,
                warm=None, sorted=True):  # noqa: A002
  """One SPIN decode step for B requests (one query row each), jit-friendly.

  state: `init_state(capacity, config, (B,))`; q [B, H, D]; k_cache [num_blocks, 64, D];
  block_table [B, max_blocks]; lengths [B] (the query sits at slot lengths - 1); w [B, H].
  Returns (values [B, K], slot indices [B, K] (-1 tail), new state, info) where info has the
  block masks [B, num_blocks] and realized sparsity [B]. Cold requests (first step after a
  reset) make the whole batch score densely that step (sec. 3.2).

  warm: None decides dense vs sparse on the device from `state["warm"]` (a `lax.cond`; on GPU
  XLA reads its predicate on the host, a sync of the step). A serving loop knows when it reset a
  request, so it can pass warm=False for the first step after a reset (dense, static) and
  warm=True otherwise (sparse, static, no sync). warm=True with a cold request in the batch is
  wrong (a cold request selects every block, more than the compiled width): don't.

  sorted: as in `jaxsparse.topk`; False returns the top-K as a set in ascending slot order (on
  GPU without the final sort of the candidates).

  In a serving loop, jit the step with the state donated (`jax.jit(..., donate_argnums=...)`)
  and pass each step's new state to the next: on GPU the update kernel then writes the state in
  place. Without donation XLA copies the [B, N] V / D states every step (a 17-18 us memcpy at
  B=64 x 128K on the H200, benchmarks/results/session9/spin_A*_128k*.json).
  """
  _validate_step(state, q, k_cache, block_table, lengths, config)
  if warm not in (None, True, False):
    raise ValueError(f"warm={warm!r} must be None, True or False")
  if not isinstance(sorted, bool):
    raise ValueError(f"sorted={sorted!r} must be a bool")
  return _decode_step(state, q, k_cache, block_table, lengths, w, key, k_scale, config,
                      implementation, decode_config, topk_config, warm, sorted)


def compact_blocks(mask, width: int):
  """Selected block ids in ascending order, -1 padded: mask [B, nb] -> (sel [B, width], counts
  [B]). A cumulative sum places each selected block (no sort)."""
  bsz, nb = mask.shape
  pos = jnp.where(mask, jnp.cumsum(mask, axis=1) - 1, width)
  rows = jnp.broadcast_to(jnp.arange(bsz)[:, None], mask.shape)
  ids = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), mask.shape)
  sel = jnp.full((bsz, width), -1, jnp.int32).at[rows, pos].set(ids, mode="drop")
  return sel, jnp.minimum(mask.sum(1), width).astype(jnp.int32)


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
  masks, sel_w, counts_w, picked, *extra = select_compact_batched(
      state, None if kernels else pos, lengths, config, key, width, kernel=kernels,
      interpret=plat.interpret, block_table=block_table if kernels else None,
      num_pages=k_cache.shape[0] if kernels else 0, advance_step=kernels)
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
    return finish(z[:, 0], sel_w)

  def dense(_):  # the first step after a reset scores every block
    if impl == "pallas":
      z = paged_indexer_scores(q, k_cache, block_table, lengths, w, k_scale=k_scale,
                               implementation="pallas", config=decode_config)
    else:
      z = paged_indexer_scores_xla(q[:, None], k_cache, block_table, lengths, w[:, None],
                                   k_scale)[:, 0]
    return finish(z, jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (bsz, nb)))

  if warm is None:
    vals, top_slots, new_state = jax.lax.cond(jnp.all(state["warm"]), sparse, dense, None)
  else:
    vals, top_slots, new_state = (sparse if warm else dense)(None)
  n_blocks = -(-lengths // b)  # realized sparsity from the selection's own count of blocks
  info = {"block_masks": masks,
          "realized_sparsity": 1.0 - picked / jnp.maximum(n_blocks, 1)}
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


# ----------------------------------------------------------- serving: speculative decoding


def decode_step_rows(state, q, k_cache, block_table, lengths, w, config: SpinConfig, key, *,
                     k_scale=None, implementation=None, decode_config=None, topk_config=None):
  """One SPIN verification step for B requests with R verifier rows (sec. 3.2.2).

  q [B, R, H, D], w [B, R, H]; lengths [B] counts the slots the last row sees (row r sits at
  slot lengths - R + r). Each row predicts its own mask; the shared mask is their union
  (config.mask_policy="union") or row 0's ("row0", plus every row's newest block). All rows are
  scored on the shared mask. The state is NOT updated: pass the returned `pending` to
  `commit(state, pending, accepted, config)` once the number of accepted drafts is known.
  Returns (values [B, R, K], slots [B, R, K], pending, info).
  """
  _validate_step(state, q, k_cache, block_table, lengths, config)
  if q.ndim != 4 or w.shape != q.shape[:3]:
    raise ValueError(f"q.shape={tuple(q.shape)} / w.shape={tuple(w.shape)} must be "
                     "[B, R, H, D] / [B, R, H]")
  return _decode_rows(state, q, k_cache, block_table, lengths, w, key, k_scale, config,
                      implementation, decode_config, topk_config)


def _decode_rows_impl(state, q, k_cache, block_table, lengths, w, key, k_scale, config,
                      implementation, decode_config, topk_config):
  from jaxsparse import backend, selection
  from jaxsparse.indexer import row_lengths
  bsz, r = q.shape[:2]
  nb = block_table.shape[1]
  b = config.block_size
  lrows = row_lengths(lengths, r)  # [B, R]
  keys = jax.random.split(key, bsz)
  shared, row_masks = jax.vmap(select_rows, in_axes=(0, 0, None, 0))(state, lrows, config, keys)
  per_row = max_selected_blocks(nb, config)
  width = _aligned_width(per_row * r if config.mask_policy == "union" else per_row + r, nb)
  sel, counts = compact_blocks(shared, width)
  z, slots = _sparse_scores(q, k_cache, block_table, lengths, w, sel, counts, k_scale,
                            backend.resolve(implementation), decode_config, b)
  vals, idx = selection.topk(z, config.topk, implementation=implementation, config=topk_config)
  top = jnp.where(idx >= 0, jnp.take_along_axis(
      jnp.broadcast_to(slots[:, None], z.shape), jnp.maximum(idx, 0), axis=2), -1)
  pending = {"scores": z, "sel": sel, "lrows": lrows}
  info = {"block_masks": shared, "row_masks": row_masks,
          "realized_sparsity": jax.vmap(lambda m, l: realized_sparsity(m, l[-1], b))(shared,
                                                                                     lrows)}
  return vals, top, pending, info


_decode_rows = jax.jit(_decode_rows_impl, static_argnums=(8, 9, 10, 11))


def commit(state, pending, accepted, config: SpinConfig):
  """Deferred EMA update after verification: rows 0..accepted[b] in order
  (update_policy="prefix") or row 0 only ("row0"). accepted: [B] int drafts accepted."""
  return _commit(state, pending, jnp.asarray(accepted, jnp.int32), config)


def _commit_impl(state, pending, accepted, config):
  def one(st, z, sel, lrows, a):
    def body(i, s):
      use = (i <= a) if config.update_policy == "prefix" else (i == 0)
      new = update_blocks(s, z[i], sel, lrows[i] - 1, lrows[i], config)
      return jax.tree.map(lambda n, o: jnp.where(use, n, o), new, s)
    return jax.lax.fori_loop(0, z.shape[0], body, st)
  return jax.vmap(one)(state, pending["scores"], pending["sel"], pending["lrows"], accepted)


_commit = jax.jit(_commit_impl, static_argnums=(3,))

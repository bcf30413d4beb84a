"""SPIN's algorithm (Algorithm 1 and sec. 3.2 of shared/papers/spin-shadow-predictive-indexer.txt)
as pure functions over a state pytree: prediction, block selection, EMA update, verifier rows."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _checks
from jaxsparse.spin.config import NEG_INF, SpinConfig
from pallas_kernels._util import counter_hash, flush_zero, words_seed

# block-age exploration ranks staleness up to this many steps; staler blocks tie, and their
# random keys order them (staleness * 2**16 + key stays below 2**24: exact in float32)
STALENESS_CAP = 255

__all__ = [
    "STALENESS_CAP", "check_key", "init_state", "reset", "num_blocks_budget",
    "predicted_slot_scores", "block_scores", "by_offset", "rank_key", "top_mask", "request_seeds",
    "random_keys16", "query_priorities",
    "select_blocks", "select_blocks_batched", "update_dense", "update", "update_blocks", "update_block_states",
    "realized_sparsity", "slot_mask", "compact_blocks", "select_rows", "update_rows"
]


def init_state(capacity: int, config: SpinConfig, batch: tuple = (), *,
               head_dim: int | None = None):
  """Fresh (reset) state for `capacity` slots; `batch` adds leading request dims.

  head_dim: the indexer key dim D; with it the state also holds KM [..., capacity /
  block_size, D] float32, each block's mean key, which the serving steps keep for
  explore="query" (they require it then; a first step after a reset fills every block).

  The first step after a reset scores every block (`warm` is False until then). Keys: V, D
  [..., capacity] and VB, DB, VM [..., capacity / block_size] in the state dtype, age
  [..., capacity / block_size] uint32, step int32 and warm bool [...]. VM is V's maximum over
  each block; every update keeps it so (a state built by hand must set it to
  `V.reshape(..., -1, block_size).max(-1)`). age is uint32, not int32, so that a jitted step
  that donates its state never finds it the same shape and dtype as the int32 top-K indices
  [B, K]: at K = capacity / block_size (2048 at 128K slots) jax would alias the donated age to
  those indices and XLA would copy age every step. An int32 age built by hand works as well.
  """
  from jaxsparse._checks import check_instance, check_int
  check_instance("config", config, SpinConfig)
  check_int("capacity", capacity, 1)
  if capacity % config.block_size:
    raise ValueError(f"capacity={capacity} must be a multiple of block_size={config.block_size}")
  if not isinstance(batch, (tuple, list)):
    raise ValueError(f"batch={batch!r} must be a tuple of ints (leading request dims)")
  for b in batch:
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)) or b < 0:
      raise ValueError(f"batch={batch!r} must be a tuple of non-negative ints")
  batch = tuple(int(b) for b in batch)
  nb = capacity // config.block_size
  z = lambda n: jnp.zeros(batch + (n,), jnp.dtype(config.state_dtype))
  state = {"V": z(capacity), "D": z(capacity), "VM": z(nb), "VB": z(nb), "DB": z(nb),
           "age": jnp.zeros(batch + (nb,), jnp.uint32), "step": jnp.zeros(batch, jnp.int32),
           "warm": jnp.zeros(batch, bool)}
  if head_dim is not None:
    check_int("head_dim", head_dim, 1)
    state["KM"] = jnp.zeros(batch + (nb, int(head_dim)), jnp.float32)
  return state


def reset(state):
  """Reset after prefill or at the start of a turn (sec. 3.2)."""
  return jax.tree.map(jnp.zeros_like, state)


def num_blocks_budget(n_blocks, config: SpinConfig):
  """m_t = min(B_t, max(ceil(K / b), ceil((1 - rho) B_t))) (Algorithm 1, line 4)."""
  # the 1e-3 absorbs float32 rounding of (1 - rho) * B (0.6 * 100 must give 60, not 61)
  n_blocks = jnp.asarray(n_blocks, jnp.int32)
  keep = jnp.ceil((1.0 - config.sparsity) * n_blocks.astype(jnp.float32) - 1e-3).astype(jnp.int32)
  return jnp.minimum(n_blocks, jnp.maximum(config.min_blocks, keep))


def _pool(x, config):
  """x [nb, b] predicted slot scores (-inf outside the context) -> [nb] block scores. A NaN
  prediction makes its block's score NaN under every pooling (as max propagates it); -inf
  predictions are left out of the top-4 and mean poolings (a block of them scores -inf)."""
  if config.pooling == "max":
    return x.max(-1)
  nan = jnp.isnan(x).any(-1)
  x = jnp.where(jnp.isnan(x), NEG_INF, x)
  if config.pooling == "top4":
    x = jax.lax.top_k(x, min(4, x.shape[-1]))[0]
  valid = x > NEG_INF
  cnt = valid.sum(-1)
  pooled = jnp.where(cnt > 0, jnp.where(valid, x, 0.0).sum(-1) / jnp.maximum(cnt, 1), NEG_INF)
  return jnp.where(nan, jnp.nan, pooled)


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


def rank_key(score):
  """Block scores or priorities as SPIN ranks them (README "Input rules"): float32 with NaN as
  -inf, and -0.0 and subnormals as 0 (as the top-K ranks scores). NaN and -inf are the lowest
  values: they rank after every other one, in block order among themselves, and still fill a
  budget (how many blocks a ranking takes never depends on the values)."""
  x = flush_zero(jnp.asarray(score, jnp.float32))
  return jnp.where(jnp.isnan(x), NEG_INF, x)


def _rank_desc(score, eligible):
  """Rank (0 = best) of each eligible entry by `rank_key(score)`, ties (NaN and -inf among
  them) to the lower index; ineligible entries get n. One stable lexicographic sort on
  (ineligible, -key, index)."""
  n = score.shape[-1]
  neg = 0.0 - jnp.where(eligible, rank_key(score), NEG_INF)  # 0 - x: no -0.0
  idx = jnp.arange(n, dtype=jnp.int32)
  *_, order = jax.lax.sort(((~eligible).astype(jnp.int32), neg, idx), num_keys=3)
  rank = jnp.zeros(n, jnp.int32).at[order].set(idx, unique_indices=True)
  return jnp.where(eligible, rank, n)


def top_mask(score, eligible, n):
  """Mask of the n best eligible entries of `score` [L], ties to the lower index (n <= the
  eligible count), ranked by `rank_key`: NaN and -inf last but counted, so exactly n entries
  are taken. On a GPU this is one Pallas kernel per row (an exact bitwise search for the n-th
  largest key, no sort); elsewhere a sort."""
  from jaxsparse import backend
  plat = backend.kernel_platform()
  if plat.kind == "gpu" and not plat.interpret:
    from pallas_kernels._util import next_pow2, pad_axis
    from pallas_kernels.topk import gpu as kg
    length = score.shape[-1]
    lp = next_pow2(max(length, 16))
    m = kg.select_mask(pad_axis(rank_key(score)[None], 1, lp),
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


STATE_KEYS = ("V", "D", "VM", "VB", "DB", "age", "step", "warm")


def check_state(state, config, name: str = "state") -> None:
  """`state` is what `init_state` returns (a dict of its arrays) and `config` a SpinConfig;
  ValueError naming the argument otherwise."""
  from jaxsparse._checks import check_instance
  check_instance("config", config, SpinConfig)
  if not isinstance(state, dict):
    raise ValueError(f"{name} must be the dict spin.init_state returns; got "
                     f"{type(state).__name__}")
  missing = [k for k in STATE_KEYS if k not in state]
  if missing:
    raise ValueError(f"{name} lacks {', '.join(missing)}: build it with spin.init_state")
  bad = [k for k in STATE_KEYS if not hasattr(state[k], "shape")]
  if bad:
    raise ValueError(f"{name}[{bad[0]!r}] must be an array; got {type(state[bad[0]]).__name__}")


def check_key(key, name: str = "key") -> None:
  """Refuse anything but one PRNG key: a typed key (`jax.random.key`, shape ()) or a raw
  uint32 key (`jax.random.PRNGKey`, shape [2] for the default implementation)."""
  dt = getattr(key, "dtype", None)
  shape = tuple(getattr(key, "shape", ()))
  if dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
    if shape == ():
      return
  elif dt is not None and np.dtype(dt) == np.uint32 and len(shape) == 1:
    want = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
    if shape == tuple(want):
      return
  raise ValueError(f"{name} must be one PRNG key (jax.random.key(seed) or "
                   f"jax.random.PRNGKey(seed)); got {type(key).__name__}"
                   + (f" of dtype {dt} and shape {shape}" if dt is not None else f" {key!r}"))


def key_words(key):
  """A PRNG key's data as a flat uint32 array (no computation for a raw uint32 key)."""
  check_key(key)
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
  seed: uint32 (`request_seeds`). block-age: the steps since a block was last scored (capped at
  STALENESS_CAP), ties broken by the block's random key; every priority is an integer below
  2**24, exact in float32. Random priorities take 2**16 values: two blocks tie with
  probability 2**-16 and a tie goes to the lower block, so a ranking needs 16 bits, not 32."""
  nb = state["VB"].shape[-1]
  if config.explore == "random":
    return _uniform16(seed, nb)
  if config.explore == "block-age":  # staleness first, the random key breaks its ties exactly
    stale = jnp.clip(_staleness(state), 0, STALENESS_CAP)
    return stale * 65536.0 + random_keys16(seed, nb).astype(jnp.float32)
  if config.explore == "staleness":
    s = block_scores(state, pos, length, dataclasses.replace(config, reduction="A1")
                     if config.reduction == "A0" else config)
    # scores above the lowest valid one; NaN and -inf block scores count as that lowest one
    ok = (jnp.arange(nb) < -(-length // config.block_size)) & (rank_key(s) > NEG_INF)
    stale = _staleness(state)
    lo = jnp.min(jnp.where(ok, s, jnp.inf))
    lo = jnp.where(ok.any(), lo, 0.0)
    return stale * (jnp.where(ok, s, lo) - lo + 1e-6)
  return jnp.zeros((nb,))


def query_priorities(q, w, key_means):
  """Exploration priorities of explore="query": the indexer score of the current query on each
  block's mean key, sum_h w[h] * relu(q[h] . key_means[j]).

  q [H, D], w [H] float; key_means [num_blocks, D] float, block j's mean over its visible keys
  (the caller keeps them causal: a block not yet complete is the forced newest one or not
  visible, so its value is never used). Returns [num_blocks] float32.
  """
  s = jnp.einsum("hd,jd->hj", q.astype(jnp.float32), key_means.astype(jnp.float32))
  p = jnp.einsum("h,hj->j", w.astype(jnp.float32), jnp.maximum(s, 0.0))
  return jnp.where(jnp.isnan(p), -jnp.inf, p)  # a NaN priority ranks last (README "Input rules")


def select_blocks(state, pos, length, config: SpinConfig, key):
  """Block mask [num_blocks] bool for one query at slot `pos` seeing `length` slots.

  Cold state (first step after a reset): every block. Otherwise the forced blocks (sink and
  newest), the best predicted blocks, and floor(gamma * m_t) explored blocks, m_t in total
  (sec. 3.2.1). A0 instead keeps every block holding one of the top-K predicted slots.
  key: a PRNG key (exploration).
  """
  return _select_blocks(state, pos, length, config, key_seed(key))


def _select_blocks(state, pos, length, config: SpinConfig, seed, prio=None):
  """`select_blocks` with a uint32 seed instead of a key; prio [num_blocks]: the exploration
  priorities of explore="query" (`query_priorities`)."""
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
  if config.explore == "query":
    if prio is None:
      raise ValueError("explore='query' needs the current query's block priorities "
                       "(select_rows(..., priorities=query_priorities(q, w, key_means)))")
  else:
    prio = _priorities(state, pos, length, config, seed)
  explore = top_mask(prio, rest, n_explore)
  mask = forced | exploit | explore
  return jnp.where(state["warm"], mask, valid)


@_checks.array_args("pos", "lengths", optional=("priorities",))
def select_blocks_batched(state, pos, lengths, config: SpinConfig, key, priorities=None):
  """`select_blocks` for B requests: state with a leading batch axis, pos/lengths [B], one key
  (request b explores with `request_seeds(key, B)[b]`) -> masks [B, num_blocks] bool (the
  step and the benchmarks share this). priorities: [B, num_blocks] explore="query"'s."""
  _checks.check_instance("config", config, SpinConfig)
  seeds = request_seeds(key, pos.shape[0])
  if priorities is None:
    return jax.vmap(_select_blocks, in_axes=(0, 0, 0, None, 0))(state, pos, lengths, config,
                                                                seeds)
  return jax.vmap(_select_blocks, in_axes=(0, 0, 0, None, 0, 0))(state, pos, lengths, config,
                                                                 seeds, priorities)


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


def compact_blocks(mask, width: int):
  """Selected block ids in ascending order, -1 padded: mask [B, nb] -> (sel [B, width], counts
  [B]). A cumulative sum places each selected block (no sort)."""
  bsz, nb = mask.shape
  pos = jnp.where(mask, jnp.cumsum(mask, axis=1) - 1, width)
  rows = jnp.broadcast_to(jnp.arange(bsz)[:, None], mask.shape)
  ids = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), mask.shape)
  sel = jnp.full((bsz, width), -1, jnp.int32).at[rows, pos].set(ids, mode="drop")
  return sel, jnp.minimum(mask.sum(1), width).astype(jnp.int32)


def select_rows(state, lengths_rows, config: SpinConfig, key, priorities=None):
  """Per-row masks for R verifier rows (row r at slot lengths_rows[r] - 1), combined.

  priorities: [R, num_blocks] float, explore="query"'s (`query_priorities` of each row's query).
  Returns (shared mask [num_blocks], per-row masks [R, num_blocks]).
  """
  r = lengths_rows.shape[0]
  seeds = request_seeds(key, r)
  if priorities is None:
    rows = jax.vmap(lambda l, s: _select_blocks(state, l - 1, l, config, s))(lengths_rows, seeds)
  else:
    rows = jax.vmap(lambda l, s, p: _select_blocks(state, l - 1, l, config, s, p))(
        lengths_rows, seeds, priorities)
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

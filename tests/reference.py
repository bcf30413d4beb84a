"""float64 numpy references and random-input builders used by the tests."""
from __future__ import annotations

import math
import types

import jax.numpy as jnp
import numpy as np

from jaxsparse.prep import quantize_fp8


def _f64(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def dense(q, k, w, k_scale=None, positions=None):
  """z[t, i] = sum_h w relu(q.k) (* scale), -inf where i > positions[t].

  Keys are first rounded to the query dtype: that is the contract (the dot runs in q's dtype).
  """
  s = np.einsum("thd,nd->thn", _f64(q), _f64(jnp.asarray(k).astype(q.dtype)))
  z = np.einsum("thn,th->tn", np.maximum(s, 0), _f64(w))
  if k_scale is not None:
    z = z * _f64(k_scale)[None]
  if positions is not None:
    z = np.where(np.arange(k.shape[0])[None] <= np.asarray(positions)[:, None], z, -np.inf)
  return z


def paged(q, k_cache, table, lens, w, k_scale=None):
  """q [B, R, H, D] -> [B, R, max_blocks * 64]; row r sees lens - (R - 1 - r) slots."""
  q, kc, w = _f64(q), _f64(jnp.asarray(k_cache).astype(q.dtype)), _f64(w)
  table, lens = np.asarray(table), np.asarray(lens)
  bsz, rows = q.shape[:2]
  nb, page, d = kc.shape
  slots = table.shape[1] * page
  out = np.full((bsz, rows, slots), -np.inf)
  for b in range(bsz):
    keys = kc[np.clip(table[b], 0, nb - 1)].reshape(slots, d)
    sc = None if k_scale is None else _f64(k_scale)[np.clip(table[b], 0, nb - 1)].reshape(slots)
    for r in range(rows):
      n = max(int(lens[b]) - (rows - 1 - r), 0)
      z = np.maximum(q[b, r] @ keys[:n].T, 0).T @ w[b, r]
      if sc is not None:
        z = z * sc[:n]
      out[b, r, :n] = z
  return out


np_indexer = types.SimpleNamespace(dense=dense, paged=paged)


def rule_scores(q, k, w, positions=None):
  """float64 scores under the README's input rules: z[t, i] = sum_h w relu(q . k) in IEEE
  arithmetic (NaN and +-inf propagate through the ReLU and the head sum), except that a head
  of weight 0 adds exactly 0; -inf where i > positions[t]. q [T, H, D], k [N, D], w [T, H]."""
  q, k, w = (np.asarray(a, np.float64) for a in (q, k, w))
  with np.errstate(invalid="ignore", over="ignore"):
    s = np.einsum("thd,nd->thn", q, k)  # exact for the small integers the tests draw
    r = np.where(w[:, :, None] != 0, np.where(np.isnan(s), np.nan, np.maximum(s, 0)), 0.0)
    z = np.einsum("thn,th->tn", r, w)
  if positions is not None:
    z = np.where(np.arange(k.shape[0])[None] <= np.asarray(positions)[:, None], z, -np.inf)
  return z


def np_topk(x, k, lengths=None):
  """Exact top-k with ties to the lower index; invalid/NaN/-inf never chosen; tail -1/-inf;
  subnormal scores are 0 (README "Input rules")."""
  x = np.asarray(x, np.float32)
  lead, n = x.shape[:-1], x.shape[-1]
  xf = x.reshape(-1, n)
  lens = np.full(xf.shape[0], n) if lengths is None else np.asarray(lengths).reshape(-1)
  vals = np.full((xf.shape[0], k), -np.inf, np.float32)
  idx = np.full((xf.shape[0], k), -1, np.int32)
  for r in range(xf.shape[0]):
    row = xf[r, : max(int(lens[r]), 0)]
    row = np.where(np.abs(row) < np.finfo(np.float32).tiny, np.float32(0), row)
    ok = np.nonzero(~np.isnan(row) & (row > -np.inf))[0]
    order = ok[np.lexsort((ok, -row[ok]))][:k]
    vals[r, : len(order)] = row[order]
    idx[r, : len(order)] = order
  return vals.reshape(*lead, k), idx.reshape(*lead, k)


def index_ordered(v, i):
  """Sorted top-k rows (np_topk's output) -> the same entries in ascending index order, the
  -1 tail last: what topk(..., sorted=False) returns."""
  v, i = np.asarray(v), np.asarray(i)
  o = np.argsort(np.where(i < 0, np.iinfo(np.int32).max, i), axis=-1, kind="stable")
  return np.take_along_axis(v, o, -1), np.take_along_axis(i, o, -1)


def random_paged(rng, bsz, rows, heads, d, max_len, num_blocks, key_dtype="bfloat16"):
  """Random paged decode inputs with ragged lengths and a shuffled block table."""
  max_blocks = -(-max_len // 64)
  if num_blocks < max_blocks:
    raise ValueError(f"{num_blocks=} must cover {max_blocks=}")
  q = jnp.asarray(rng.standard_normal((bsz, rows, heads, d)), jnp.bfloat16)
  kc = jnp.asarray(rng.standard_normal((num_blocks, 64, d)), jnp.bfloat16)
  ks = None
  if key_dtype == "float8_e4m3fn":
    kc, ks = quantize_fp8(kc)
  elif key_dtype == "float32":
    kc = kc.astype(jnp.float32)
  w = jnp.asarray(rng.standard_normal((bsz, rows, heads)), jnp.float32)
  table = np.stack([rng.permutation(num_blocks)[:max_blocks] for _ in range(bsz)])
  lens = rng.integers(rows, max_len + 1, bsz)
  lens[0] = max_len
  # entries past a request's length may be garbage: poison them
  for b in range(bsz):
    table[b, -(-int(lens[b]) // 64):] = -7
  return q, kc, jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32), w, ks


def prefill_case(rng, t, h, d, n, *, fp8=False, max_pos=None):
  """A causal prefill case: q [T, H, D] bf16, k [N, D] bf16, w [T, H] f32, sorted positions in
  [-1, max_pos) (some queries see nothing), k_scale None; with fp8=True q and k are quantised
  (q's scale folded into w) and k_scale [N] is set."""
  q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  pos = jnp.asarray(np.sort(rng.integers(-1, n if max_pos is None else max_pos, t)), jnp.int32)
  ks = None
  if fp8:
    (q, qs), (k, ks) = quantize_fp8(q), quantize_fp8(k)
    w = w * qs
  return q, k, w, pos, ks


def with_block_max(state, block_size: int):
  """The state with VM set to V's maximum over each block (what every SPIN update keeps), for
  tests that write V by hand."""
  v = state["V"]
  return {**state, "VM": v.reshape(*v.shape[:-1], -1, block_size).max(-1)}


def spin_state_case(rng, config, bsz, nb, lengths, *, warm=None):
  """A warm-looking SPIN state for B requests of nb blocks: V, D, VB, DB drawn on a coarse grid
  (ties, negatives, -0.0), block ages up to step 9, and the given lengths [B] (int32 array)."""
  from jaxsparse import spin
  cap = nb * config.block_size
  st = spin.init_state(cap, config, (bsz,))
  dt = st["V"].dtype

  def grid(n):
    x = np.round(rng.standard_normal((bsz, n)) * 4) / 4
    x[x == 0] = -0.0
    return jnp.asarray(x, dt)

  warm = np.ones(bsz, bool) if warm is None else np.asarray(warm)
  v = grid(cap)
  return {**st, "V": v, "D": grid(cap), "VM": v.reshape(bsz, nb, -1).max(-1),
          "VB": grid(nb), "DB": grid(nb),
          "age": jnp.asarray(rng.integers(0, 10, (bsz, nb)), jnp.int32),
          "step": jnp.full((bsz,), 10, jnp.int32), "warm": jnp.asarray(warm)}


def spin_selection_case(rng, bsz, nb, b, width):
  """Ascending selected block ids sel [B, width] (-1 padded) of requests with ragged lengths
  [B] (the first full, one ending inside its first block) and scores z [B, width * b] float32
  with some -inf (as the block-sparse kernel leaves past a length)."""
  lengths = np.array([nb * b] + list(rng.integers(1, nb * b, bsz - 2)) + [b // 2], np.int32)
  sel = np.full((bsz, width), -1, np.int32)
  for i in range(bsz):
    nblk = -(-int(lengths[i]) // b)
    pick = np.sort(rng.choice(nblk, min(width, max(1, nblk * 3 // 5)), replace=False))
    sel[i, :len(pick)] = pick
  z = rng.standard_normal((bsz, width * b)).astype(np.float32)
  z[rng.random(z.shape) < 0.05] = -np.inf
  return jnp.asarray(sel), jnp.asarray(z), jnp.asarray(lengths)


# ------------------------------------------------------------------ SPIN, float64 numpy
# Algorithm 1 and sec. 3.2 of shared/papers/spin-shadow-predictive-indexer.txt, written from
# the paper and jaxsparse.spin's documented contract (budget, forced blocks, tie order, seeds),
# without any of jaxsparse.spin's code. States are dicts of numpy arrays for one request.

_M32 = 0xFFFFFFFF


def np_mix32(x):
  """The documented uint32 avalanche hash, in uint64 arithmetic masked to 32 bits."""
  x = np.asarray(x, np.uint64) & _M32
  x ^= x >> 16
  x = (x * 0x7FEB352D) & _M32
  x ^= x >> 15
  x = (x * 0x846CA68B) & _M32
  return x ^ (x >> 16)


def np_request_seed(key, row: int) -> int:
  """Request (or verifier row) `row`'s exploration seed: the key's words folded into a seed
  (mix after xor, from 0x243F6A88), then counter-hashed with the row."""
  import jax
  words = np.asarray(jax.random.key_data(key)).reshape(-1).astype(np.uint64)
  s = np.uint64(0x243F6A88)
  for wd in words:
    s = np_mix32(s ^ wd)
  return int(np_mix32((int(s) + row * 0x9E3779B9) & _M32))


def np_random_keys16(seed: int, nb: int):
  """16-bit random keys of blocks 0..nb-1: counter hashes of the seed, top 16 bits."""
  return (np_mix32((seed + np.arange(nb, dtype=np.uint64) * 0x9E3779B9) & _M32) >> 16).astype(
      np.int64)


def np_spin_state(state, i=None):
  """A jaxsparse.spin state (request i of a batch) as float64 / int numpy arrays."""
  pick = (lambda x: np.asarray(x)) if i is None else (lambda x: np.asarray(x)[i])
  out = {k: pick(state[k]).astype(np.float64) for k in ("V", "D", "VB", "DB")}
  out.update(age=pick(state["age"]).astype(np.int64), step=int(pick(state["step"])),
             warm=bool(pick(state["warm"])))
  return out


def np_rank_value(x):
  """SPIN's ranking value (README "Input rules"): NaN as -inf, -0.0 and subnormal float32
  values as 0."""
  x = np.asarray(x, np.float64)
  x = np.where(np.abs(x) < np.finfo(np.float32).tiny, 0.0, x)
  return np.where(np.isnan(x), -np.inf, x)


def _best(score, eligible, n):
  """Mask of the n highest eligible scores, ties to the lower index; NaN and -inf rank after
  every other value (in index order) and still count, so min(n, eligible) entries are taken."""
  idx = np.nonzero(eligible)[0]
  v = np_rank_value(score)[idx]
  low = v == -np.inf
  order = idx[np.lexsort((idx, -np.where(low, 0.0, v), low))][:max(int(n), 0)]
  m = np.zeros(len(score), bool)
  m[order] = True
  return m


def np_spin_slot_predictions(st, pos, length):
  """zhat[i] = max(V[i], D[pos - i]) for i < length, else -inf (eq. 1)."""
  cap = len(st["V"])
  z = np.full(cap, -np.inf)
  for i in range(min(length, cap)):
    z[i] = np.maximum(st["V"][i], st["D"][pos - i])  # NaN propagates
  return z


def np_spin_block_scores(st, pos, length, cfg):
  """Predicted block scores: A2 max(VB[j], DB[pos // b - j]); else the pooling of the slot
  predictions over the block's visible slots (max, mean of the top 4, or mean; -inf
  predictions left out, none left: -inf); NaN where a prediction is NaN; -inf for blocks past
  the context."""
  b = cfg.block_size
  nb = len(st["VB"])
  n_blocks = -(-length // b)
  out = np.full(nb, -np.inf)
  if cfg.reduction == "A2":
    for j in range(n_blocks):
      out[j] = np.maximum(st["VB"][j], st["DB"][pos // b - j])
    return out
  z = np_spin_slot_predictions(st, pos, length)
  for j in range(n_blocks):
    x = z[j * b:(j + 1) * b]
    if np.isnan(x).any():
      out[j] = np.nan
      continue
    x = x[x > -np.inf]
    if not len(x):
      continue
    if cfg.pooling == "max":
      out[j] = x.max()
    elif cfg.pooling == "mean":
      out[j] = x.mean()
    else:
      out[j] = np.sort(x)[::-1][:4].mean()
  return out


def np_spin_budget(n_blocks, cfg):
  """(m_t, n_exploit, n_explore): m_t = min(B_t, max(ceil(K / b), ceil((1 - rho) B_t))); the
  forced blocks (sink and newest) come out of it; floor(gamma m_t) of the rest explore."""
  from fractions import Fraction
  keep = math.ceil((1 - Fraction(str(cfg.sparsity))) * n_blocks)
  m = min(n_blocks, max(-(-cfg.topk // cfg.block_size), keep))
  cap = max(m - min(n_blocks, 2), 0)
  n_explore = 0 if cfg.explore == "none" else min(math.floor(Fraction(str(cfg.explore_fraction))
                                                             * m), cap)
  return m, cap - n_explore, n_explore


def np_spin_select(st, pos, length, cfg, seed, prio=None):
  """Block mask of one query at slot pos seeing `length` slots (sec. 3.2.1): every visible
  block when cold; else sink + newest, the best predicted blocks (A0: the blocks of the top-K
  predicted slots), and the best of the rest by the exploration priority (explore="query":
  `prio` [nb], the current query's scores of the block mean keys)."""
  b = cfg.block_size
  nb = len(st["VB"])
  n_blocks = -(-length // b)
  jb = np.arange(nb)
  valid = jb < n_blocks
  if not st["warm"]:
    return valid
  forced = valid & ((jb == 0) | (jb == n_blocks - 1))
  _, n_exploit, n_explore = np_spin_budget(n_blocks, cfg)
  if cfg.reduction == "A0":
    z = np_spin_slot_predictions(st, pos, length)
    top = _best(z, z > -np.inf, min(cfg.topk, length))
    exploit = np.zeros(nb, bool)
    exploit[np.nonzero(top)[0] // b] = True
    exploit &= valid & ~forced
  else:
    exploit = _best(np_spin_block_scores(st, pos, length, cfg), valid & ~forced, n_exploit)
  rest = valid & ~forced & ~exploit
  keys = np_random_keys16(seed, nb).astype(np.float64)
  stale = (st["step"] - st["age"]).astype(np.float64)
  if cfg.explore == "random":
    prio = keys
  elif cfg.explore == "block-age":  # staleness (capped at 255), then the random key
    prio = np.clip(stale, 0, 255) * 65536 + keys
  elif cfg.explore == "query":  # the caller's current-query block priorities
    prio = np.asarray(prio, np.float64)
  elif cfg.explore == "staleness":
    import dataclasses
    s = np_spin_block_scores(st, pos, length, dataclasses.replace(cfg, reduction="A1")
                             if cfg.reduction == "A0" else cfg)
    ok = valid & (np_rank_value(s) > -np.inf)  # NaN / -inf scores count as the lowest valid
    lo = s[ok].min() if ok.any() else 0.0
    prio = stale * (np.where(ok, s, lo) - lo + 1e-6)
  else:
    prio = np.zeros(nb)
  return forced | exploit | _best(prio, rest, n_explore)


def _round_state(x, dtype):
  return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def np_spin_update(st, z, observed, pos, length, cfg):
  """EMA update from the observed scores (Algorithm 1 lines 8-10): z [cap] scores by slot,
  observed [cap] bool. V[i] and D[pos - i] move to a * old + (1 - a) * z[i] for every observed
  visible slot; VB[j] and DB[pos // b - j] to the same mix with the block's max observed
  score; a scored block's age becomes the step; step + 1; warm. Stored in cfg.state_dtype."""
  a, b = cfg.ema_decay, cfg.block_size
  st = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in st.items()}
  cap = len(st["V"])
  obs = np.asarray(observed, bool) & (np.arange(cap) < length)
  for i in np.nonzero(obs)[0]:
    st["V"][i] = a * st["V"][i] + (1 - a) * z[i]
    st["D"][pos - i] = a * st["D"][pos - i] + (1 - a) * z[i]
  for j in range(cap // b):
    o = obs[j * b:(j + 1) * b]
    if o.any():
      blk = z[j * b:(j + 1) * b][o].max()
      st["VB"][j] = a * st["VB"][j] + (1 - a) * blk
      st["DB"][pos // b - j] = a * st["DB"][pos // b - j] + (1 - a) * blk
      st["age"][j] = st["step"]
  for k in ("V", "D", "VB", "DB"):
    st[k] = _round_state(st[k], cfg.state_dtype)
  st["VM"] = st["V"].reshape(-1, b).max(-1)
  st["step"] += 1
  st["warm"] = True
  return st


def np_spin_rows(st, lrows, cfg, seeds, prios=None):
  """Verifier rows (sec. 3.2.2): each row r at slot lrows[r] - 1 selects its own mask; the
  shared mask is their union, or row 0's plus every row's newest block. prios: [R, nb] each
  row's explore="query" priorities."""
  prios = [None] * len(lrows) if prios is None else prios
  rows = np.stack([np_spin_select(st, int(l) - 1, int(l), cfg, s, p)
                   for l, s, p in zip(lrows, seeds, prios)])
  if cfg.mask_policy == "union":
    return rows.any(0), rows
  shared = rows[0].copy()
  shared[(np.asarray(lrows) - 1) // cfg.block_size] = True
  return shared, rows


def np_spin_commit(st, z_rows, shared, lrows, accepted, cfg):
  """Deferred update: rows 0..accepted in order ("prefix"), or row 0, on the shared mask."""
  obs = np.repeat(shared, cfg.block_size)
  for r in range(len(lrows)):
    if (r <= accepted) if cfg.update_policy == "prefix" else (r == 0):
      st = np_spin_update(st, z_rows[r], obs, int(lrows[r]) - 1, int(lrows[r]), cfg)
  return st


def clustered_prefill_trace(rng, n, h, d, layers):
  """A prefill trace of keys drawn around 8 centers (the same keys in every layer), Gaussian
  queries and uniform weights: q [L, n, h, d], w [L, n, h], k [L, n, d] float32."""
  from jaxsparse import traces
  k = rng.standard_normal((8, d))[rng.integers(0, 8, n)] + 0.3 * rng.standard_normal((n, d))
  nl = len(layers)
  return traces.PrefillTrace(q=rng.standard_normal((nl, n, h, d)).astype(np.float32),
                             w=rng.uniform(0, 1, (nl, n, h)).astype(np.float32),
                             k=np.stack([k] * nl).astype(np.float32),
                             layers=np.asarray(layers, np.int32), meta={})


def saved_prefill_traces(directory, rng, lengths, held: int = 640, h: int = 2, d: int = 16,
                         layers=(3, 7)):
  """Training traces of the given lengths and one held-out trace (`clustered_prefill_trace`,
  the same rng in that order) saved under `directory`: (training paths, held-out path)."""
  from jaxsparse import traces
  paths = []
  for i, n in enumerate(lengths):
    paths.append(str(directory / f"t{i}.npz"))
    traces.save(paths[-1], clustered_prefill_trace(rng, n, h, d, list(layers)))
  path = str(directory / "held.npz")
  traces.save(path, clustered_prefill_trace(rng, held, h, d, list(layers)))
  return paths, path


def np_block_key_means(kc, table, length, block=64):
  """[nb, D] float64 mean of each block's visible keys (slots < length; 0 with none) for one
  request of a paged cache kc [P, block, D] with block table row `table` [nb]."""
  kc = np.asarray(jnp.asarray(kc, jnp.float32), np.float64)
  out = np.zeros((len(table), kc.shape[-1]))
  for j in range(min(len(table), -(-int(length) // block))):
    n = min(block, int(length) - j * block)
    out[j] = kc[int(table[j]), :n].mean(0)
  return out


def np_query_priorities(q, w, key_means):
  """explore="query" priorities [nb]: sum_h w[h] relu(q[h] . key_means[j]) in float64."""
  q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
  w = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
  return np.maximum(q @ key_means.T, 0.0).T @ w

"""float64 numpy references and random-input builders used by the tests."""
from __future__ import annotations

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


def np_topk(x, k, lengths=None):
  """Exact top-k with ties to the lower index; invalid/NaN/-inf never chosen; tail -1/-inf."""
  x = np.asarray(x, np.float32)
  lead, n = x.shape[:-1], x.shape[-1]
  xf = x.reshape(-1, n)
  lens = np.full(xf.shape[0], n) if lengths is None else np.asarray(lengths).reshape(-1)
  vals = np.full((xf.shape[0], k), -np.inf, np.float32)
  idx = np.full((xf.shape[0], k), -1, np.int32)
  for r in range(xf.shape[0]):
    row = xf[r, : lens[r]]
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

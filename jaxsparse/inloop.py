"""The real DSA model with a selection method in its loop: each layer attends only to the keys
the method picks, so perplexity and retrieval measure the method by the model's own output.

Methods (`parse_methods("dense,dsa,spin:0.4,ivf,hisa,recent")`):
  dense     full causal attention (no indexer);
  dsa       every query keeps the exact top-K of its layer's lightning-indexer scores;
  spin:S    positions < decode_from are prefill (exact DSA); from decode_from on each position
            is a decode step whose indexer scores only the 64-slot blocks SPIN selects at block
            sparsity S, the state (vertical and diagonal EMAs) carried step to step per layer,
            reset at decode_from; the top-K comes from the scored blocks;
  spin:S:EXPLORE:GAMMA  the same with another exploration policy and fraction (`SpinConfig`;
            "query" explores the blocks whose mean key the current query scores highest);
  ivf       every query's top-K from AttentionIndex's candidates at `budget`, the index built
            over the growing prefix exactly as `ivf.prefill_topk` builds it;
  ivf-metric  the same under SmolLM2's shipped grouping metric (`ivf.metric.SHIPPED`, the
            layer's own);
  hisa      the same with HiSA's contiguous blocks;
  recent    the K newest keys (no indexer: the floor).
A query with at most K visible keys keeps all of them under every method.

Layer by layer this is exact: a layer's selection at position t depends only on that layer's
indexer inputs at positions <= t (SPIN's state at step t only on steps before it, the index
only on versions whose keys all precede t), and those only on tokens <= t, so running the whole
window one layer at a time gives every position the output a token-by-token decode would
(`tests/test_inloop.py` checks it against a step-by-step run). Queries go in chunks, so 8,192
tokens need a few GB.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["METHOD_KINDS", "INDEX_KINDS", "Method", "parse_methods", "LoopSettings", "ivf_config", "run",
           "measure", "compare", "study", "plot"]

METHOD_KINDS = ("dense", "dsa", "spin", "ivf", "ivf-metric", "hisa", "recent")
INDEX_KINDS = ("ivf", "ivf-metric", "hisa")  # the methods that build an index (take a budget)


@dataclasses.dataclass(frozen=True)
class Method:
  """One selection method: kind in METHOD_KINDS; for spin its sparsity in (0, 1), exploration
  policy (`SpinConfig.explore`) and exploration fraction (gamma, in [0, 0.5])."""
  kind: str
  sparsity: float | None = None
  explore: str = "random"
  explore_fraction: float = 0.05

  def __post_init__(self):
    if self.kind not in METHOD_KINDS:
      raise ValueError(f"method kind={self.kind!r} must be one of {', '.join(METHOD_KINDS)}")
    if self.kind == "spin":
      s = self.sparsity
      if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 < s < 1.0:
        raise ValueError(f"spin sparsity={s!r} must lie in (0, 1)")
      self.spin_config(64, 64)  # the explore policy and fraction, checked by SpinConfig
    elif self.sparsity is not None or (self.explore, self.explore_fraction) != ("random", 0.05):
      raise ValueError(f"sparsity and exploration apply to spin only, not to {self.kind!r}")

  def spin_config(self, block_size: int, k: int):
    from jaxsparse.spin import SpinConfig
    return SpinConfig(block_size=block_size, topk=k, sparsity=float(self.sparsity),
                      explore=self.explore, explore_fraction=float(self.explore_fraction))

  @property
  def name(self) -> str:
    if self.kind != "spin":
      return self.kind
    if (self.explore, self.explore_fraction) == ("random", 0.05):
      return f"spin:{self.sparsity:g}"
    return f"spin:{self.sparsity:g}:{self.explore}:{self.explore_fraction:g}"


def parse_methods(spec: str) -> tuple[Method, ...]:
  """'dense,dsa,spin:0.2,spin:0.4,ivf,hisa,recent' -> Methods (each once, in order).

  spin:S[:EXPLORE[:GAMMA]] picks SPIN's exploration (default random, gamma 0.05, the paper's):
  e.g. spin:0.4:query:0.1.
  Raises ValueError naming the bad entry: an unknown name, a spin sparsity outside (0, 1) or
  missing, an empty entry, a duplicate."""
  out = []
  for part in str(spec).split(","):
    part = part.strip()
    if not part:
      raise ValueError(f"empty method in {spec!r}")
    kind, _, arg = part.partition(":")
    if kind == "spin":
      sp, _, rest = arg.partition(":")
      explore, _, gamma = rest.partition(":")
      try:
        s = float(sp)
      except ValueError:
        raise ValueError(f"{part!r}: spin needs a sparsity, e.g. spin:0.4") from None
      if not 0.0 < s < 1.0 or not math.isfinite(s):
        raise ValueError(f"{part!r}: spin sparsity {sp} must lie in (0, 1)")
      try:
        g = float(gamma) if gamma else 0.05
        m = Method("spin", s, explore or "random", g)
      except ValueError as e:
        raise ValueError(f"{part!r}: {e} (spin:S[:EXPLORE[:GAMMA]])") from None
    elif arg:
      raise ValueError(f"{part!r}: only spin takes an argument")
    elif kind not in METHOD_KINDS:
      raise ValueError(f"unknown method {kind!r}; known: {', '.join(METHOD_KINDS)} "
                       "(spin as spin:S)")
    else:
      m = Method(kind)
    if m in out:
      raise ValueError(f"method {m.name!r} given twice in {spec!r}")
    out.append(m)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class LoopSettings:
  """What every method in the loop shares.

  k: keys each query keeps. decode_from: SPIN's first decode position (the prefix before it is
  prefill). budget: AttentionIndex / HiSA candidate slots per query. block_size: SPIN's block.
  seal_window, cluster_size, refit_interval: the index's (see `ivf.IVFConfig`). seed: SPIN's
  exploration seed. chunk: queries per attention chunk.
  """
  k: int
  decode_from: int
  budget: int
  seal_window: int
  cluster_size: int
  refit_interval: int
  block_size: int = 64
  seed: int = 0
  chunk: int = 512

  @classmethod
  def for_window(cls, tokens: int, k: int, *, decode_from: int | None = None,
                 budget: int | None = None, **kw) -> "LoopSettings":
    """Defaults scaled to a window of `tokens`: decode over the second half, budget 1/8 of the
    context, seal windows of tokens / 32 keys in groups of 8 (the paper's W 1,024 and groups
    of 128 scaled to 8K: 256 and 32), a refit every quarter."""
    w = kw.pop("seal_window", max(tokens // 32, 16))
    return cls(k=k, decode_from=tokens // 2 if decode_from is None else decode_from,
               budget=tokens // 8 if budget is None else budget, seal_window=w,
               cluster_size=kw.pop("cluster_size", max(w // 8, 1)),
               refit_interval=kw.pop("refit_interval", (tokens // 4) // w * w), **kw)

  def check(self, tokens: int, index: bool = True) -> None:
    """ValueError naming the setting that does not fit a window of `tokens` (index: also the
    AttentionIndex / HiSA settings, which only the methods in INDEX_KINDS use)."""
    if not 1 <= self.k < tokens:
      raise ValueError(f"k={self.k} must lie in [1, tokens={tokens})")
    if not 1 <= self.decode_from < tokens:
      raise ValueError(f"decode_from={self.decode_from} must lie in [1, tokens={tokens})")
    if index:
      ivf_config(self)


def ivf_config(s: LoopSettings):
  """The `ivf.IVFConfig` the ivf / hisa methods run (raises ValueError for a budget not above
  the fixed slots, sinks + seal_window)."""
  from jaxsparse.ivf import IVFConfig
  return IVFConfig(topk=s.k, budget=s.budget, seal_window=s.seal_window,
                   cluster_size=s.cluster_size, refit_interval=s.refit_interval,
                   sink=min(16, s.seal_window - 1))


# ------------------------------------------------------------------------------ selections
# Every selection maps one sequence's indexer inputs (q [T, H, D], k [T, D], w [T, H] float32)
# to kept key ids [T, K] int32 (-1 where fewer keys are visible) and the number of visible
# keys whose indexer score was computed [T] int32.

def _causal_scores(q, k, w, rows):
  """z [len(rows), T] float32: indexer scores of queries at `rows`, -inf past each row."""
  s = jnp.einsum("chd,nd->chn", q[rows], k)
  z = jnp.einsum("chn,ch->cn", jnp.maximum(s, 0.0), w[rows])
  return jnp.where(jnp.arange(k.shape[0])[None, :] <= rows[:, None], z, -jnp.inf)


def _chunks(t: int, chunk: int):
  n = -(-t // chunk)
  return n, jnp.minimum(jnp.arange(n * chunk).reshape(n, chunk), t - 1)


def _exact(q, w, k, *, kk: int, chunk: int):
  from jaxsparse.selection import topk_xla
  t = k.shape[0]
  n, rows = _chunks(t, chunk)
  idx = jax.lax.map(lambda r: topk_xla(_causal_scores(q, k, w, r), kk)[1], rows)
  return idx.reshape(n * chunk, kk)[:t], jnp.arange(1, t + 1, dtype=jnp.int32)


def _recent(t: int, kk: int):
  idx = jnp.arange(t, dtype=jnp.int32)[:, None] - jnp.arange(kk, dtype=jnp.int32)[None, :]
  return jnp.where(idx >= 0, idx, -1), jnp.zeros((t,), jnp.int32)


def _spin(q, w, k, *, kk: int, start: int, config, seed, chunk: int):
  """Rows < start: exact DSA. Rows start..T-1: SPIN decode steps (state reset at start)."""
  from jaxsparse.selection import topk_xla
  from jaxsparse.spin import algorithm
  t = k.shape[0]
  b = config.block_size
  cap = -(-t // b) * b
  n_dec = t - start
  head_idx, head_num = _exact(q[:start], w[:start], k[:start], kk=kk, chunk=chunk)
  rows = jnp.arange(start, t, dtype=jnp.int32)
  n, rchunks = _chunks(n_dec, chunk)
  z = jax.lax.map(lambda r: _causal_scores(q, k, w, start + r), rchunks)
  z = jnp.pad(z.reshape(n * chunk, t)[:n_dec], ((0, 0), (0, cap - t)), constant_values=-jnp.inf)

  km = jnp.pad(k, ((0, cap - t), (0, 0))).reshape(cap // b, b, -1).mean(1)  # block mean keys

  def step(carry, xs):
    st, key = carry
    zs, length, qq, ww = xs
    key, sub = jax.random.split(key)
    prio = algorithm.query_priorities(qq, ww, km)[None] if config.explore == "query" else None
    mask, _ = algorithm.select_rows(st, length[None], config, sub, priorities=prio)
    slots = algorithm.slot_mask(mask, b)
    seen = jnp.where(slots, zs, -jnp.inf)
    st = algorithm.update_rows(st, seen[None], mask, length[None], 0, config)
    return (st, key), (seen[:t], jnp.sum(slots[:t] & (jnp.arange(t) < length)))

  st0 = algorithm.init_state(cap, config)
  _, (seen, num) = jax.lax.scan(step, (st0, jax.random.PRNGKey(seed)),
                                (z, rows + 1, q[start:], w[start:]))
  _, dchunks = _chunks(n_dec, chunk)
  dec = jax.lax.map(lambda r: topk_xla(seen[r], kk)[1], dchunks).reshape(-1, kk)[:n_dec]
  idx = jnp.concatenate([head_idx, dec], 0)
  return idx, jnp.concatenate([head_num, num.astype(jnp.int32)])


@functools.partial(jax.jit, static_argnames=("kind", "kk", "start", "config", "chunk"))
def _select(q, w, k, seed, *, kind, kk, start, config, chunk):
  t = k.shape[0]
  if kind == "dsa":
    return _exact(q, w, k, kk=kk, chunk=chunk)
  if kind == "recent":
    return _recent(t, kk)
  return _spin(q, w, k, kk=kk, start=start, config=config, seed=seed, chunk=chunk)


@functools.partial(jax.jit, static_argnames=("kind", "kk", "start", "config", "chunk"))
def _select_batched(q, w, k, seeds, **static):
  return jax.vmap(lambda a, b, c, d: _select(a, b, c, d, **static))(q, w, k, seeds)


def _select_batch(method: Method, iq, ik, iw, s: LoopSettings, layer: int):
  """Kept ids [B, T, K] int32 and scored keys [B, T] int32 for a batch of sequences."""
  kk = s.k
  if method.kind in ("ivf", "ivf-metric", "hisa"):
    from jaxsparse import ivf
    cfg = ivf_config(s)
    kw = dict(metric=ivf.metric.SHIPPED, layer=layer) if method.kind == "ivf-metric" else {}
    out = [ivf.prefill_topk(q=iq[i], w=iw[i], k=ik[i], config=cfg,
                            method="hisa" if method.kind == "hisa" else "ivf", **kw)
           for i in range(iq.shape[0])]
    return jnp.stack([o[0] for o in out]), jnp.stack([o[1] for o in out])
  spin_cfg = method.spin_config(s.block_size, kk) if method.kind == "spin" else None
  seeds = jnp.asarray([s.seed * 1000003 + layer * 131 + i for i in range(iq.shape[0])],
                      jnp.uint32)
  return _select_batched(iq, iw, ik, seeds, kind=method.kind, kk=kk, start=s.decode_from,
                         config=spin_cfg, chunk=s.chunk)


# ----------------------------------------------------------------------------- the model

def _layer_in(cfg, icfg, w, ip, x):
  """x [T, width] -> attention q [T, nh, hd], k, v [T, nkv, hd]; indexer q, k, w."""
  from jaxsparse.model import lightning
  from jaxsparse.model.llama import rms_norm, rope_pairs
  t = x.shape[0]
  pos = jnp.arange(t)
  h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
  q = rope_pairs((h @ w["q"].T).reshape(t, cfg.heads, cfg.head_dim), pos, cfg.rope_base)
  k = rope_pairs((h @ w["k"].T).reshape(t, cfg.kv_heads, cfg.head_dim), pos, cfg.rope_base)
  v = (h @ w["v"].T).reshape(t, cfg.kv_heads, cfg.head_dim)
  iq, ik, iw = lightning.project(icfg, ip, h) if icfg is not None else (None, None, None)
  return q, k, v, iq, ik, iw


def _mask_of(idx, t):
  """Kept ids [C, K] (-1 unused) -> bool [C, T]."""
  c = idx.shape[0]
  rows = jnp.broadcast_to(jnp.arange(c)[:, None], idx.shape)
  return jnp.zeros((c, t + 1), bool).at[rows, jnp.where(idx >= 0, idx, t)].set(True)[:, :t]


def _layer_out(cfg, chunk, w, x, q, k, v, idx, ref, source):
  """Attention restricted to the kept ids (idx [T, K], or None: dense), then the MLP.

  ref: exact DSA's ids [T, K] (or None) -> also per row the number of kept ids in it [T].
  source [T] bool: key positions whose share of attention (head mean) and of the kept keys is
  returned per row ([T] float32 each; a task's needle or copied span)."""
  from jaxsparse.model.llama import _gqa_scores, rms_norm
  t = x.shape[0]
  nh, hd = cfg.heads, cfg.head_dim
  n, rows = _chunks(t, chunk)
  pos = jnp.arange(t)

  def one(r):
    vis = pos[None, :] <= r[:, None]
    mask = vis if idx is None else vis & _mask_of(idx[r], t)
    s = _gqa_scores(cfg, q[r], k)
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    o = jnp.einsum("ngct,tnd->cngd", p, v).reshape(r.shape[0], nh * hd)
    hit = (mask & _mask_of(ref[r], t)).sum(-1) if ref is not None else jnp.zeros(r.shape, int)
    on = (vis & source[None, :])
    mass = jnp.where(on, p.sum((0, 1)), 0.0).sum(-1) / nh
    kept = (mask & on).sum(-1) / jnp.maximum(on.sum(-1), 1)
    return o, (hit, mass, kept)

  o, (hit, mass, kept) = jax.lax.map(one, rows)
  x = x + o.reshape(n * chunk, nh * hd)[:t] @ w["o"].T
  h2 = rms_norm(x, w["ffn_norm"], cfg.norm_eps)
  x = x + (jax.nn.silu(h2 @ w["gate"].T) * (h2 @ w["up"].T)) @ w["down"].T
  return x, (hit.reshape(-1)[:t], mass.reshape(-1)[:t], kept.reshape(-1)[:t])


def _head(chunk, x, final_norm, embed, tokens, eps):
  """Next-token NLL [T-1] and greedy prediction [T] (chunked over positions)."""
  from jaxsparse.model.llama import rms_norm
  t = x.shape[0]
  n, rows = _chunks(t, chunk)
  xn = rms_norm(x, final_norm, eps)
  nxt = jnp.concatenate([tokens[1:], tokens[:1]])

  def one(r):
    lp = jax.nn.log_softmax(xn[r] @ embed.T, axis=-1)
    return -jnp.take_along_axis(lp, nxt[r][:, None], axis=-1)[:, 0], lp.argmax(-1)

  nll, pred = jax.lax.map(one, rows)
  return nll.reshape(-1)[:t - 1], pred.reshape(-1)[:t].astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer_in_batch(cfg, icfg, w, ip, x):
  return jax.vmap(lambda xx: _layer_in(cfg, icfg, w, ip, xx))(x)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer_out_batch(cfg, chunk, w, x, q, k, v, idx, ref, source):
  def one(xx, qq, kk, vv, ii, rr, ss):
    return _layer_out(cfg, chunk, w, xx, qq, kk, vv, ii, rr, ss)
  return jax.vmap(one, in_axes=(0, 0, 0, 0, None if idx is None else 0,
                                None if ref is None else 0, 0))(x, q, k, v, idx, ref, source)


@functools.partial(jax.jit, static_argnums=(0,))
def _head_batch(chunk, x, final_norm, embed, tokens, eps):
  return jax.vmap(lambda xx, tt: _head(chunk, xx, final_norm, embed, tt, eps))(x, tokens)


def run(model, indexers, tokens, method: Method, settings: LoopSettings, *, focus=None) -> dict:
  """One forward of the model with `method` selecting every layer's keys.

  model: `llama.Llama`; indexers: `lightning.LightningIndexers` (unused by dense and recent);
  tokens [B, T] int (B windows of T tokens, run together). Returns numpy arrays:
    nll [B, T-1] float32 (predicting token t+1 at t), pred [B, T] int32 (greedy);
    per layer [L] float64: recall (mean over decided rows of the share of exact DSA's top-K
    the method keeps; NaN for dense), unscored (share of visible keys on decided rows whose
    indexer score was never computed; NaN for dense), where decided rows are those with more
    than K visible keys (and at or past decode_from for spin).
  focus: optional (rows [B, T] bool, source [B, T] bool): then also [L, B] float64
    source_mass (head-mean attention on the source keys) and source_kept (share of the source
    keys the selection keeps), each sequence's mean over its focus rows (NaN without any):
    where a task's answer looks back, layer by layer.
  """
  from jaxsparse.model.llama import var_value
  tokens = np.asarray(tokens)
  if tokens.ndim == 1:
    tokens = tokens[None]
  b, t = tokens.shape
  settings.check(t)
  cfg = model.cfg
  layers = var_value(model.layers)
  embed = var_value(model.embed)
  use_idx = method.kind != "dense"
  if use_idx and indexers is None:
    raise ValueError(f"method {method.name!r} needs indexers")
  icfg = indexers.cfg if use_idx else None
  ip = indexers.params_tree() if use_idx else None
  tok = jnp.asarray(tokens, jnp.int32)
  x = embed[tok]
  kk = settings.k
  decided = np.arange(t) + 1 > kk
  if method.kind == "spin":
    decided &= np.arange(t) >= settings.decode_from
  recall, unscored, smass, skept = [], [], [], []
  frows, fsrc = (np.zeros((b, t), bool), np.zeros((b, t), bool)) if focus is None else (
      np.asarray(focus[0], bool), np.asarray(focus[1], bool))
  for l in range(cfg.layers):
    w_l = jax.tree.map(lambda a: a[l], layers)
    ip_l = jax.tree.map(lambda a: a[l], ip) if use_idx else None
    q, k, v, iq, ik, iw = _layer_in_batch(cfg, icfg, w_l, ip_l, x)
    if use_idx:
      idx, scored = _select_batch(method, iq, ik, iw, settings, l)
      ref = idx if method.kind == "dsa" else _select_batch(Method("dsa"), iq, ik, iw,
                                                           settings, l)[0]
    else:
      idx = ref = None
    x, (hit, mass, kept) = _layer_out_batch(cfg, settings.chunk, w_l, x, q, k, v, idx, ref,
                                            jnp.asarray(fsrc))
    if frows.any():  # per sequence: the mean over its focus rows (NaN where it has none)
      cnt = frows.sum(1)
      with np.errstate(invalid="ignore"):
        smass.append(np.where(frows, np.asarray(mass), 0.0).sum(1) / cnt)
        skept.append(np.where(frows, np.asarray(kept), 0.0).sum(1) / cnt)
    if use_idx:
      hit = np.asarray(hit, np.float64)[:, decided]
      recall.append(float(hit.mean() / kk) if hit.size else math.nan)
      vis = (np.arange(t) + 1)[decided]
      sc = np.asarray(scored, np.float64)[:, decided]
      unscored.append(float(1.0 - sc.sum() / (vis.sum() * b)) if sc.size else math.nan)
    else:
      recall.append(math.nan)
      unscored.append(math.nan)
  nll, pred = _head_batch(settings.chunk, x, var_value(model.final_norm), embed, tok,
                          cfg.norm_eps)
  out = {"nll": np.asarray(nll), "pred": np.asarray(pred),
         "recall": np.asarray(recall), "unscored": np.asarray(unscored)}
  if frows.any():
    out.update(source_mass=np.asarray(smass), source_kept=np.asarray(skept))
  return out


def _nan_none(a) -> list:
  return [None if not np.isfinite(x) else float(x) for x in np.asarray(a, np.float64)]


def measure(model, indexers, windows, methods, settings: LoopSettings, *, tasks=None,
            progress=None) -> dict:
  """Every method on the same windows: perplexity, recall, unscored keys, task scores.

  windows [B, T] int token ids (held-out text); tasks: optional {name: `tasks.Task`} built on
  windows of the same length (copy, passkey), scored from the model's own logits; each method
  runs the text windows and every task's windows as one batch (recall and unscored pool them).
  Returns a dict keyed by method name, each with perplexity (whole window) and second_half
  (predictions at positions >= T // 2) and per-window values for standard errors, per-layer
  recall and unscored, and per task its score dict (`tasks.score`).
  """
  from jaxsparse import tasks as _tasks
  say = progress or (lambda m: None)
  windows = np.asarray(windows)
  t = windows.shape[1]
  half = t // 2
  out = {}
  tasks = dict(tasks or {})
  batch = np.concatenate([windows] + [tk.tokens for tk in tasks.values()], 0)
  none = np.zeros(windows.shape, bool)
  rows = np.concatenate([none] + [np.pad(tk.scored, ((0, 0), (0, 1))) for tk in tasks.values()])
  focus = (rows, np.concatenate([none] + [tk.source for tk in tasks.values()])) if tasks else None
  for m in methods:
    say(f"{m.name}: {len(batch)} sequence(s) of {t:,} tokens")
    r = run(model, indexers, batch, m, settings, focus=focus)  # text and task windows together
    nll = r["nll"][:len(windows)].astype(np.float64)
    res = {"perplexity": float(np.exp(nll.mean())),
           "second_half": float(np.exp(nll[:, half:].mean())),
           "window_nll": nll.mean(1).tolist(), "window_nll_second_half":
           nll[:, half:].mean(1).tolist(),
           "recall": _nan_none(r["recall"]), "unscored": _nan_none(r["unscored"])}
    at = len(windows)
    for name, task in tasks.items():
      n = len(task.tokens)
      res[name] = _tasks.score(task, r["nll"][at:at + n], r["pred"][at:at + n])
      for key in ("source_mass", "source_kept"):  # per layer, at the answer positions
        res[name][key] = _nan_none(r[key][:, at:at + n].mean(1))
      at += n

    out[m.name] = res
  return out


def _se(v) -> float:
  v = np.asarray(v, np.float64)
  return float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0


def compare(res: dict) -> dict:
  """Summary figures of one (tokens, K) cell of `study`: for each method its perplexity and
  second-half perplexity against dense and exact DSA (ratios - 1, with the standard error of
  the per-window log-ratio), mean / worst-layer recall, mean unscored share and task scores."""
  out = {}
  base = {name: res[name] for name in ("dense", "dsa") if name in res}
  arr = lambda v: np.asarray([math.nan if x is None else x for x in v], np.float64)
  for name, r in res.items():
    rec, uns = arr(r["recall"]), arr(r["unscored"])
    row = {"perplexity": r["perplexity"], "second_half": r["second_half"]}
    if np.isfinite(rec).any():
      worst = int(np.nanargmin(rec))
      row.update(recall_mean=float(np.nanmean(rec)), recall_worst=float(rec[worst]),
                 recall_worst_layer=worst, unscored_mean=float(np.nanmean(uns)))
    for bname, b in base.items():
      for key, wkey in (("perplexity", "window_nll"), ("second_half", "window_nll_second_half")):
        d = np.asarray(r[wkey]) - np.asarray(b[wkey])
        row[f"{key}_vs_{bname}"] = r[key] / b[key] - 1.0
        row[f"{key}_vs_{bname}_se"] = _se(d)
    for task in [k for k, v in r.items() if isinstance(v, dict) and "accuracy" in v]:
      row[f"{task}_accuracy"] = r[task]["accuracy"]
      row[f"{task}_accuracy_se"] = r[task]["accuracy_se"]
      row[f"{task}_logprob"] = r[task]["logprob"]
      for bname, b in base.items():
        if task in b:
          d = np.asarray(r[task]["window_accuracy"]) - np.asarray(b[task]["window_accuracy"])
          row[f"{task}_accuracy_vs_{bname}"] = float(d.mean())
          row[f"{task}_accuracy_vs_{bname}_se"] = _se(d)
    out[name] = row
  return out


def study(model, indexers, ids, tokenizer, *, tokens, ks, methods, tasks=(), windows: int = 8,
          decode_from: int | None = None, budget: int | None = None, seed: int = 0,
          chunk: int = 512, progress=None, on_cell=None) -> dict:
  """`measure` over window lengths and K: the in-loop table.

  ids [M] int token ids of a held-out text; tokens: window lengths; ks: K values; methods:
  Methods (dense runs once a length, shared by every K); tasks: names in `tasks.TASKS`, built
  on the same windows. decode_from / budget: None scales them to each length
  (`LoopSettings.for_window`). Every window starts where the previous ended: windows x
  max(tokens) tokens of text are needed. `on_cell(results)` is told after each cell (to save
  partial results). Returns {"cells": {"T/K": {"settings", "methods", "summary"}}}.
  """
  from jaxsparse import tasks as _tasks
  say = progress or (lambda m: None)
  ids = np.asarray(ids, np.int32)
  out = {"cells": {}}
  for t in tokens:
    if len(ids) < windows * t:
      raise ValueError(f"the text has {len(ids):,} tokens; {windows} windows of {t:,} need "
                       f"{windows * t:,}")
    wins = ids[:windows * t].reshape(windows, t)
    built = {name: _tasks.build(name, ids, tokenizer, windows=windows, tokens=t, seed=seed)
             for name in tasks}
    dense = None
    for kk in ks:
      s = LoopSettings.for_window(t, kk, decode_from=decode_from, budget=budget, seed=seed,
                                  chunk=min(chunk, t))
      s.check(t, index=any(m.kind in INDEX_KINDS for m in methods))
      res = {}
      for m in methods:
        if m.kind == "dense" and dense is not None:
          res["dense"] = dense
          continue
        say(f"{t:,} tokens, K {kk}: {m.name}")
        res.update(measure(model, indexers, wins, [m], s, tasks=built, progress=say))
        if m.kind == "dense":
          dense = res["dense"]
      out["cells"][f"{t}/{kk}"] = {"tokens": t, "k": kk, "settings": dataclasses.asdict(s),
                                   "methods": res, "summary": compare(res)}
      if on_cell is not None:
        on_cell(out)
  return out


def plot(result: dict, path: str) -> None:
  """One panel per figure (second-half perplexity against exact DSA, task accuracies, mean
  recall, unscored keys) against context length, a line per method and K."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cells = list(result["cells"].values())
  figs = [("second_half_vs_dsa", "2nd-half perplexity vs DSA"), ("copy_accuracy", "copy accuracy"),
          ("passkey_accuracy", "passkey accuracy"), ("recall_mean", "recall vs DSA (mean)"),
          ("unscored_mean", "keys not scored")]
  figs = [f for f in figs if any(f[0] in row for c in cells for row in c["summary"].values())]
  fig, axes = plt.subplots(1, len(figs), figsize=(4.2 * len(figs), 3.6), squeeze=False)
  names = sorted({n for c in cells for n in c["summary"]}, key=lambda n: list(
      next(c for c in cells if n in c["summary"])["summary"]).index(n))
  for ax, (key, title) in zip(axes[0], figs):
    for kk in sorted({c["k"] for c in cells}):
      for n in names:
        pts = sorted((c["tokens"], c["summary"][n].get(key, math.nan)) for c in cells
                     if c["k"] == kk and n in c["summary"])
        if pts and any(np.isfinite(v) for _, v in pts):
          ax.plot(*zip(*pts), marker="o", linestyle="-" if kk == max(c["k"] for c in cells)
                  else "--", label=f"{n}, K {kk}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)

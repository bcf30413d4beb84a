"""Flax NNX Llama forward for SmolLM2 (GQA, RMSNorm, adjacent-pair RoPE), with DSA hooks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse.model.gguf_weights import LlamaConfig

__all__ = [
    "LAYER_KEYS", "rms_norm", "rope_pairs", "Llama", "var_value", "topk_mask", "spin_visible",
    "perplexity", "load_model", "run_chunked"
]


LAYER_KEYS = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")


def rms_norm(x, w, eps):
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w


def rope_pairs(x, positions, base):
  """RoPE on adjacent pairs (x[..., 0::2], x[..., 1::2]): the GGUF converter permutes Q/K so
  that this, not the half-split form, matches the original model. x: [T, heads, hd]."""
  hd = x.shape[-1]
  inv = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
  ang = positions.astype(jnp.float32)[:, None, None] * jnp.asarray(inv, jnp.float32)
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  a, b = x[..., 0::2], x[..., 1::2]
  return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)


class Llama(nnx.Module):
  """SmolLM2 as an NNX module. Weights are frozen `nnx.Variable`s stacked over layers.

  `__call__(tokens [T] int32, keep=None, collect=False)` returns logits [T, vocab] float32 and,
  with collect=True, a dict with `hidden [L, T, width]` (each layer's normalised attention
  input, the indexer's input) and `attn [L, T, T]` (attention probabilities summed over heads
  and L1-normalised: the DSA warm-up target). `keep [L, T, T]` bool restricts each layer's
  attention to the kept keys (DSA inference); the causal mask always applies.
  """

  def __init__(self, cfg: LlamaConfig, weights: dict):
    self.cfg = cfg
    self.embed = nnx.Variable(jnp.asarray(weights["embed"]))
    self.final_norm = nnx.Variable(jnp.asarray(weights["final_norm"]))
    self.layers = nnx.Variable({k: jnp.asarray(np.stack([weights[f"{i}.{k}"]
                                                         for i in range(cfg.layers)]))
                                for k in LAYER_KEYS})

  def __call__(self, tokens, keep=None, collect: bool = False, dsa=None, spin=None):
    """dsa: optional (IndexerConfig, stacked indexer params, k): DSA inference, where each layer
    attends only to the top-k keys of its own lightning indexer (queries with <= k visible keys
    stay dense).

    spin: optional (SpinConfig, decode_from): with dsa, queries at positions >= decode_from
    are decode steps whose indexer sees only the blocks SPIN selects (state reset at
    decode_from, per layer), so the top-k comes from SPIN's scored blocks: DSA with SPIN.
    """
    icfg, iparams, k = dsa if dsa is not None else (None, None, 0)
    scfg, start = spin if spin is not None else (None, 0)
    return _forward(self.cfg, var_value(self.embed), var_value(self.final_norm),
                    var_value(self.layers), tokens, keep, collect, icfg, iparams, k, scfg, start)


def var_value(v):
  """An nnx.Variable's value across flax versions (`.value` is deprecated from 0.12)."""
  return v.get_value() if hasattr(v, "get_value") else v.value


def topk_mask(scores, k: int):
  """[T, T] causal indexer scores -> bool keep mask of each row's top-k (exact, ties by index)."""
  from jaxsparse.selection import topk_xla
  _, idx = topk_xla(scores, k)
  t = scores.shape[0]
  rows = jnp.broadcast_to(jnp.arange(t)[:, None], idx.shape)
  return jnp.zeros((t, t), bool).at[rows, jnp.where(idx >= 0, idx, t)].set(True, mode="drop")


def spin_visible(z, start: int, config):
  """SPIN's scored slots for decode queries start..T-1 of causal scores z [T, T] -> bool [T, T]
  (rows before `start` see everything: prefill)."""
  from jaxsparse import spin as _spin
  t = z.shape[0]
  b = config.block_size
  cap = -(-t // b) * b
  zz = jnp.pad(z[start:], ((0, 0), (0, cap - t)), constant_values=-jnp.inf)[:, None]
  lrows = jnp.arange(start + 1, t + 1, dtype=jnp.int32)[:, None]
  masks = _spin.studies._replay_scan_impl(zz, lrows, jnp.zeros((t - start,), jnp.int32), config, 0)[0]
  vis = jnp.repeat(masks, b, axis=1)[:, :t]
  return jnp.concatenate([jnp.ones((start, t), bool), vis], axis=0)


def _forward(cfg, embed, final_norm, layers, tokens, keep, collect, icfg=None, iparams=None,
             k_sel=0, spin_cfg=None, decode_from=0):
  t = tokens.shape[0]
  hd, nh, nkv = cfg.head_dim, cfg.heads, cfg.kv_heads
  pos = jnp.arange(t)
  causal = pos[None, :] <= pos[:, None]
  x = embed[tokens]

  def layer(x, xs):
    w, kp, ip = xs
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
    if ip is not None:
      from jaxsparse.model import lightning
      z = lightning.score_layer(icfg, ip, h)
      if spin_cfg is not None:
        z = jnp.where(spin_visible(z, decode_from, spin_cfg), z, -jnp.inf)
      sel = topk_mask(z, k_sel)
      kp = sel if kp is None else kp & sel
    q = rope_pairs((h @ w["q"].T).reshape(t, nh, hd), pos, cfg.rope_base)
    k = rope_pairs((h @ w["k"].T).reshape(t, nkv, hd), pos, cfg.rope_base)
    v = (h @ w["v"].T).reshape(t, nkv, hd)
    k = jnp.repeat(k, nh // nkv, axis=1)
    v = jnp.repeat(v, nh // nkv, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    mask = causal if kp is None else causal & kp
    s = jnp.where(mask[None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("hqk,khd->qhd", p, v).reshape(t, nh * hd)
    x = x + o @ w["o"].T
    h2 = rms_norm(x, w["ffn_norm"], cfg.norm_eps)
    x = x + (jax.nn.silu(h2 @ w["gate"].T) * (h2 @ w["up"].T)) @ w["down"].T
    out = None
    if collect:
      a = p.sum(axis=0)
      out = (h, a / a.sum(axis=-1, keepdims=True))
    return x, out

  x, coll = jax.lax.scan(layer, x, (layers, keep, iparams))
  logits = rms_norm(x, final_norm, cfg.norm_eps) @ embed.T
  if collect:
    return logits, {"hidden": coll[0], "attn": coll[1]}
  return logits


_forward = jax.jit(_forward, static_argnums=(0, 6, 7, 9, 10, 11))


def perplexity(logits, tokens, start: int = 0) -> float:
  """exp(mean next-token NLL) of logits [T, vocab] on tokens [T], over predictions made at
  positions >= start (start > 0: score only the decode part of a sequence)."""
  lp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(lp, tokens[1:, None], axis=-1)[:, 0]
  return float(jnp.exp(nll[start:].mean()))


def load_model(layers: int | None = None) -> Llama:
  """SmolLM2-135M-Instruct from the packaged GGUF (first `layers` layers if given)."""
  from jaxsparse.model import gguf_weights
  cfg, w = gguf_weights.load(layers=layers)
  return Llama(cfg, w)


def _gqa_scores(cfg, qc, k):
  """qc [C, nh, hd], k [T, nkv, hd] -> logits [nkv, g, C, T] (head n*g + i reads kv head n)."""
  c, nh, hd = qc.shape
  g = nh // cfg.kv_heads
  return jnp.einsum("cngd,tnd->ngct", qc.reshape(c, cfg.kv_heads, g, hd), k) / np.sqrt(hd)


def _topk_keep(z, k: int):
  """bool [C, T]: each row's k best finite entries of z (ties to the lower index)."""
  _, idx = jax.lax.top_k(z, k)
  rows = jnp.arange(z.shape[0])[:, None]
  keep = jnp.zeros(z.shape, bool).at[rows, idx].set(True)
  return keep & jnp.isfinite(z)


def _chunked_forward(cfg, icfg, chunk, stat_ks, k_sel, want_hidden, embed, final_norm, layers,
                     iparams, tokens, oracle=False):
  t = tokens.shape[0]
  nc = -(-t // chunk)
  tp = nc * chunk
  pos = jnp.arange(t)
  hd, nh = cfg.head_dim, cfg.heads
  x = embed[tokens]

  def layer(x, xs):
    w, ip = xs
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
    q = rope_pairs((h @ w["q"].T).reshape(t, nh, hd), pos, cfg.rope_base)
    k = rope_pairs((h @ w["k"].T).reshape(t, cfg.kv_heads, hd), pos, cfg.rope_base)
    v = (h @ w["v"].T).reshape(t, cfg.kv_heads, hd)
    qp = jnp.pad(q, ((0, tp - t), (0, 0), (0, 0)))
    if ip is not None:
      from jaxsparse.model import lightning
      iq, ik, iw = lightning.project(icfg, ip, h)
      iq = jnp.pad(iq, ((0, tp - t), (0, 0), (0, 0)))
      iw = jnp.pad(iw, ((0, tp - t), (0, 0)))

    def one(c):
      start = c * chunk
      qpos = start + jnp.arange(chunk)
      vis = pos[None, :] <= qpos[:, None]  # [C, T]
      mask = vis
      stats = {}
      if ip is not None:
        s_i = jnp.einsum("chd,nd->chn", jax.lax.dynamic_slice_in_dim(iq, start, chunk), ik)
        z = jnp.einsum("chn,ch->cn", jnp.maximum(s_i, 0.0),
                       jax.lax.dynamic_slice_in_dim(iw, start, chunk))
        z = jnp.where(vis, z, -jnp.inf)
        if k_sel:
          mask = mask & _topk_keep(z, k_sel)
      s = _gqa_scores(cfg, jax.lax.dynamic_slice_in_dim(qp, start, chunk), k)
      if oracle:  # the attention's own top-k_sel keys (head-summed): the selection ceiling
        a = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), axis=-1).sum((0, 1))
        mask = vis & _topk_keep(jnp.where(vis, a, -jnp.inf), k_sel)
      p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
      o = jnp.einsum("ngct,tnd->cngd", p, v).reshape(chunk, nh * hd)
      if ip is not None and stat_ks:
        a = p.sum((0, 1)) / nh  # [C, T] head-summed attention, rows sum to 1
        live = qpos < t
        for kk in stat_ks:
          sel = live & (qpos + 1 > kk)  # rows where a top-kk selection drops keys
          got = jnp.sum(jnp.where(_topk_keep(z, kk), a, 0.0), -1)
          best = jax.lax.top_k(a, kk)[0].sum(-1)
          stats[f"idx{kk}"] = jnp.sum(jnp.where(sel, got, 0.0))
          stats[f"true{kk}"] = jnp.sum(jnp.where(sel, best, 0.0))
          stats[f"rows{kk}"] = jnp.sum(sel)
        stats["zero"] = jnp.sum(vis & (z == 0) & live[:, None])
        stats["visible"] = jnp.sum(vis & live[:, None])
      return o, stats

    o, st = jax.lax.map(one, jnp.arange(nc))
    st = {name: v.sum() for name, v in st.items()}
    x = x + o.reshape(tp, nh * hd)[:t] @ w["o"].T
    h2 = rms_norm(x, w["ffn_norm"], cfg.norm_eps)
    x = x + (jax.nn.silu(h2 @ w["gate"].T) * (h2 @ w["up"].T)) @ w["down"].T
    return x, (h if want_hidden else None, st)

  x, (hidden, stats) = jax.lax.scan(layer, x, (layers, iparams))
  xn = jnp.pad(rms_norm(x, final_norm, cfg.norm_eps), ((0, tp - t), (0, 0)))
  nxt = jnp.pad(tokens[1:], (0, tp - t + 1))

  def head(c):
    lg = jax.lax.dynamic_slice_in_dim(xn, c * chunk, chunk) @ embed.T
    lp = jax.nn.log_softmax(lg, axis=-1)
    tgt = jax.lax.dynamic_slice_in_dim(nxt, c * chunk, chunk)
    return -jnp.take_along_axis(lp, tgt[:, None], axis=-1)[:, 0], lg.argmax(-1)

  nll, pred = jax.lax.map(head, jnp.arange(nc))
  return nll.reshape(tp)[: t - 1], pred.reshape(tp)[:t].astype(jnp.int32), hidden, stats


_chunked_forward = jax.jit(_chunked_forward, static_argnums=(0, 1, 2, 3, 4, 5, 11))


def run_chunked(model: Llama, tokens, *, indexers=None, k_sel: int = 0, stat_ks=(),
                chunk: int = 512, hidden: bool = False, oracle: bool = False,
                depth: int | None = None):
  """Forward over queries in chunks of `chunk`: memory O(chunk x T), never the [T, T] matrix.

  tokens [T] int32. indexers: a `LightningIndexers` (needed for k_sel or stat_ks).
  k_sel > 0: DSA inference, every layer attends only to its indexer's top-k_sel keys; with
  oracle=True to the top-k_sel keys of its own head-summed attention instead (no indexer
  needed): the best any k_sel-key selection shared by the heads can do.
  stat_ks: with k_sel = 0, per layer and k, the attention mass (head-summed, rows sum to 1)
  captured by the indexer's top-k and by the true top-k, summed over rows with more than k
  visible keys, and the count of exactly-zero indexer scores among visible entries.
  depth: run only the first `depth` layers (for their hidden states; nll and pred then come
  from the truncated model and mean nothing).
  Returns (nll [T-1] float32 of predicting token t+1 at t, greedy pred [T] int32,
  hidden [L, T, width] or None, stats dict of [L] arrays; L = depth when given).
  """
  n_layers = model.cfg.layers
  if depth is not None and not 1 <= depth <= n_layers:
    raise ValueError(f"depth={depth} must be in 1..{n_layers}")
  if oracle and not k_sel:
    raise ValueError("oracle=True needs k_sel > 0")
  if ((k_sel and not oracle) or stat_ks) and indexers is None:
    raise ValueError("indexers are needed for k_sel or stat_ks")
  if k_sel and stat_ks:
    raise ValueError("stat_ks are measured on the dense forward (k_sel=0)")
  use = indexers is not None and not oracle
  icfg = indexers.cfg if use else None
  ip = indexers.params_tree() if use else None
  layers = var_value(model.layers)
  if depth is not None:
    layers, ip = jax.tree.map(lambda v: v[:depth], (layers, ip))
  return _chunked_forward(model.cfg, icfg, int(chunk), tuple(int(k) for k in stat_ks),
                          int(k_sel), bool(hidden), var_value(model.embed),
                          var_value(model.final_norm), layers, ip,
                          jnp.asarray(tokens, jnp.int32), bool(oracle))

"""Flax NNX Llama forward for SmolLM2 (GQA, RMSNorm, adjacent-pair RoPE), with DSA hooks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse.model.gguf_weights import LlamaConfig

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
  masks = _spin._replay_scan_impl(zz, lrows, jnp.zeros((t - start,), jnp.int32), config, 0)[0]
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

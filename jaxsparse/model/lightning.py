"""Lightning indexers for every layer of the base model (DeepSeek-V3.2's DSA indexer design).

Per layer l, from the layer's normalised attention input h [T, width]:
  q = h Wq -> [T, H, D] (RoPE on the first `rope_dims` dims), k = LayerNorm(h Wk) -> [T, D]
  (one key per token, shared by heads, RoPE likewise), w = h Ww * H^-0.5 * D^-0.5 -> [T, H].
Scores are `jaxsparse.indexer_scores` of those, causal.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse import indexer as _indexer
from jaxsparse import prep
from jaxsparse._io import save_npz_atomic


__all__ = [
    "IndexerConfig", "LightningIndexers", "project", "score_layer", "train_scores", "FILE_FORMAT",
    "quantize_int8", "dequantize_int8",
    "PARAM_NAMES", "param_shapes", "save_indexers", "IndexerFileError", "load_indexers",
    "default_indexers_path", "score_all", "kl_loss", "topk_recall", "recent_recall"
]


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
  layers: int
  width: int
  heads: int = 8
  head_dim: int = 32
  rope_dims: int = 16
  rope_base: float = 10000.0

  def __post_init__(self):
    for name in ("layers", "width", "heads", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be positive")
    if self.rope_dims % 2 or not 0 <= self.rope_dims <= self.head_dim:
      raise ValueError(f"rope_dims={self.rope_dims} must be even and <= head_dim={self.head_dim}")


class LightningIndexers(nnx.Module):
  """All layers' indexers as stacked parameters ([L, ...]) so one vmap scores every layer."""

  def __init__(self, cfg: IndexerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.lecun_normal()
    l, wd, h, d = cfg.layers, cfg.width, cfg.heads, cfg.head_dim
    self.wq = nnx.Param(init(rngs.params(), (l, wd, h * d)))
    self.wk = nnx.Param(init(rngs.params(), (l, wd, d)))
    self.ww = nnx.Param(init(rngs.params(), (l, wd, h)))
    self.k_scale = nnx.Param(jnp.ones((l, d)))
    self.k_bias = nnx.Param(jnp.zeros((l, d)))

  def params_tree(self):
    from jaxsparse.model.llama import var_value
    return {name: var_value(getattr(self, name)) for name in ("wq", "wk", "ww", "k_scale",
                                                              "k_bias")}

  def __call__(self, hidden):
    """hidden [L, T, width] -> causal scores [L, T, T] float32."""
    return score_all(self.cfg, self.params_tree(), hidden)


def project(cfg: IndexerConfig, p: dict, h):
  """One layer: p holds that layer's arrays; h [T, width] -> (q [T,H,D], k [T,D], w [T,H])."""
  t = h.shape[0]
  pos = jnp.arange(t)
  q = (h @ p["wq"]).reshape(t, cfg.heads, cfg.head_dim)
  k = h @ p["wk"]
  mu = k.mean(-1, keepdims=True)
  var = ((k - mu) ** 2).mean(-1, keepdims=True)
  k = (k - mu) * jax.lax.rsqrt(var + 1e-6) * p["k_scale"] + p["k_bias"]
  if cfg.rope_dims:
    q = prep.apply_rope(q, pos, rope_dims=cfg.rope_dims, base=cfg.rope_base)
    k = prep.apply_rope(k, pos, rope_dims=cfg.rope_dims, base=cfg.rope_base)
  w = (h @ p["ww"]) * (cfg.heads ** -0.5) * (cfg.head_dim ** -0.5)
  return q, k, w


def score_layer(cfg, p, h):
  q, k, w = project(cfg, p, h)
  pos = jnp.arange(h.shape[0], dtype=jnp.int32)
  return _indexer.indexer_scores_xla(q, k, w, None, pos)


@jax.custom_jvp
def _relu_leaky_grad(x, leak):
  return jnp.maximum(x, 0.0)


@_relu_leaky_grad.defjvp
def _relu_leaky_grad_jvp(primals, tangents):
  x, leak = primals
  dx, _ = tangents
  return jnp.maximum(x, 0.0), dx * jnp.where(x > 0, 1.0, leak)


def train_scores(cfg, p, h, leak: float):
  """Causal indexer scores [T, T] of one layer for training.

  The forward value is exactly `score_layer`'s; the gradient of each ReLU is `leak` (not 0)
  below zero, so a head whose dot products all went negative still receives gradient and
  recovers instead of scoring 0 for every key (a dead indexer).
  """
  q, k, w = project(cfg, p, h)
  t = h.shape[0]
  s = jnp.einsum("thd,nd->thn", q, k, preferred_element_type=jnp.float32)
  z = jnp.einsum("thn,th->tn", _relu_leaky_grad(s, jnp.float32(leak)), w)
  visible = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
  return jnp.where(visible, z, -jnp.inf)


FILE_FORMAT = 2  # 1: float16 weights; 2: int8 codes with per-column scales
PARAM_NAMES = ("wq", "wk", "ww", "k_scale", "k_bias")


def param_shapes(cfg: IndexerConfig) -> dict:
  l, wd, h, d = cfg.layers, cfg.width, cfg.heads, cfg.head_dim
  return {"wq": (l, wd, h * d), "wk": (l, wd, d), "ww": (l, wd, h), "k_scale": (l, d),
          "k_bias": (l, d)}


def quantize_int8(a) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric int8 codes of a float array [L, A, ...], one scale per layer and trailing column.

  The scale is max |a| over axis 1 (the input width of a [L, width, out] weight, the head dim
  of a [L, D] vector) over 127; returns (codes int8, same shape; scales float32 with axis 1
  kept as 1). `dequantize_int8` gives the float16 weights the file stands for.
  """
  a = np.asarray(a, np.float32)
  s = np.abs(a).max(axis=1, keepdims=True) / np.float32(127)
  s = np.where(s == 0, np.float32(1), s).astype(np.float32)
  return np.clip(np.round(a / s), -127, 127).astype(np.int8), s


def dequantize_int8(codes, scales) -> np.ndarray:
  """float16 weights from `quantize_int8`'s codes and scales (computed in float32)."""
  return (codes.astype(np.float32) * scales).astype(np.float16)


def save_indexers(path: str, cfg: IndexerConfig, params: dict, meta: dict | None = None) -> None:
  """Write trained indexers as a versioned npz, atomically.

  Format 2: each parameter as int8 codes (`name`) and float32 scales (`name_int8_scale`) from
  `quantize_int8`, a JSON config and JSON meta. Rounding to 8 bits per column moved the
  16-head indexers' held-out perplexity by at most 0.06% (benchmarks/NOTES.md).
  """
  import json
  shapes = param_shapes(cfg)
  arrays = {"format": np.int64(FILE_FORMAT),
            "config": np.str_(json.dumps(dataclasses.asdict(cfg))),
            "meta": np.str_(json.dumps(meta or {}))}
  for name in PARAM_NAMES:
    a = np.asarray(params[name], np.float32)
    if a.shape != shapes[name]:
      raise ValueError(f"params[{name!r}].shape={a.shape} must be {shapes[name]}")
    arrays[name], arrays[f"{name}_int8_scale"] = quantize_int8(a)
  save_npz_atomic(path, arrays, compressed=True)


class IndexerFileError(ValueError):
  """An indexer file that cannot be used; the message says what is wrong."""


def load_indexers(path: str | None = None, *, layers: int | None = None,
                  width: int | None = None):
  """Trained indexers from a file written by `save_indexers` (default: the shipped ones).

  layers / width: the base model's, when known: a file made for another model is refused.
  Returns a `LightningIndexers` with float32 parameters.
  """
  import json
  import os
  path = path or default_indexers_path()
  if not os.path.isfile(path):
    raise FileNotFoundError(f"indexer file {path!r} does not exist")
  from jaxsparse._io import open_npz
  with open_npz(path, IndexerFileError, "indexer file") as z:
    fmt = int(z["format"]) if "format" in z.files and z["format"].shape == () else None
    if fmt not in (1, FILE_FORMAT):
      raise IndexerFileError(f"{path!r}: not an indexer file of format 1 or {FILE_FORMAT}")
    try:
      cfg = IndexerConfig(**json.loads(str(z["config"])))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
      raise IndexerFileError(f"{path!r}: config is not a valid IndexerConfig: {e}") from e
    if layers is not None and cfg.layers != layers:
      raise IndexerFileError(f"{path!r} holds {cfg.layers} layers; the model has {layers}")
    if width is not None and cfg.width != width:
      raise IndexerFileError(f"{path!r} is for width {cfg.width}; the model's is {width}")
    shapes = param_shapes(cfg)
    params = {}
    for name in PARAM_NAMES:
      if name not in z.files:
        raise IndexerFileError(f"{path!r}: missing array {name!r}")
      a = z[name]
      if a.shape != shapes[name]:
        raise IndexerFileError(f"{path!r}: {name}.shape={a.shape}, config says {shapes[name]}")
      if fmt >= 2:
        scale_shape = shapes[name][:1] + (1,) + shapes[name][2:]
        if a.dtype != np.int8 or f"{name}_int8_scale" not in z.files:
          raise IndexerFileError(f"{path!r}: format 2 needs int8 {name} and {name}_int8_scale")
        s = z[f"{name}_int8_scale"]
        if s.shape != scale_shape or s.dtype != np.float32:
          raise IndexerFileError(f"{path!r}: {name}_int8_scale must be float32 {scale_shape}, "
                                 f"got {s.dtype} {s.shape}")
        a = dequantize_int8(a, s)
      if not np.isfinite(a).all():
        raise IndexerFileError(f"{path!r}: {name} holds non-finite values")
      params[name] = a.astype(np.float32)
  model = LightningIndexers(cfg, rngs=nnx.Rngs(0))
  for name in PARAM_NAMES:
    getattr(model, name).set_value(jnp.asarray(params[name])) if hasattr(
        getattr(model, name), "set_value") else setattr(getattr(model, name), "value",
                                                        jnp.asarray(params[name]))
  return model


def default_indexers_path() -> str:
  """The indexers shipped inside the package (trained at up to 8,192 tokens)."""
  import importlib.resources
  import os
  return os.fspath(importlib.resources.files("jaxsparse") / "data" / "smollm2_indexers.npz")


def score_all(cfg, params, hidden):
  return jax.vmap(lambda p, h: score_layer(cfg, p, h))(params, hidden)


def kl_loss(scores, target):
  """mean_t KL(target_t || softmax(scores_t)) over the causal prefix; scores -inf when hidden.

  scores, target: [..., T, T]. target rows sum to 1 over visible keys.
  """
  logq = jax.nn.log_softmax(scores, axis=-1)
  logq = jnp.where(jnp.isfinite(scores), logq, 0.0)
  tp = jnp.where(target > 0, target * jnp.log(jnp.where(target > 0, target, 1.0)), 0.0)
  return jnp.mean(jnp.sum(tp - target * logq, axis=-1))


def topk_recall(scores, target, k: int):
  """Attention mass the indexer's top-k keys capture: [..., T, T] -> [...] mean over queries."""
  from jaxsparse.selection import topk_xla
  _, idx = topk_xla(scores, k)
  mass = jnp.take_along_axis(target, jnp.maximum(idx, 0), axis=-1) * (idx >= 0)
  return mass.sum(-1).mean(-1)


def recent_recall(target, k: int):
  """Baseline: attention mass of the k most recent keys (a sliding window)."""
  t = target.shape[-1]
  qi, ki = np.arange(t)[:, None], np.arange(t)[None, :]
  window = (ki <= qi) & (ki > qi - k)
  return (target * window).sum(-1).mean(-1)

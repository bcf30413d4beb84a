"""The learned representative correction (paper: "Why learn the representatives?").

A group's mean key is a poor representative for the indexer score: ReLU per head, then a
weighted head sum, so averaging before the ReLU hides good keys. One small network per layer
reads a group's member summaries -- the mean key, log of the group size, and every member key
through a learned transform, mean- and max-pooled -- and outputs a bounded correction
(`scale * tanh(.)`, last layer zero-initialised) added to the mean: an untrained network is
plain IVF. It runs when a seal or refit creates groups; queries score representatives as usual.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse._io import save_npz_atomic

__all__ = ["CorrectorConfig", "Corrector", "group_features", "save", "load", "file_meta",
           "CorrectorFileError", "SHIPPED"]

# SmolLM2-135M's correctors, trained by `python -m train.corrector` (see the README)
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                       "smollm2_correctors.npz")

FILE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class CorrectorConfig:
  """dim: key dim D. member_features: width of the per-member transform. hidden: MLP width.
  scale: bound on each coordinate of the correction (keys are LayerNorm'd: O(1) entries)."""
  dim: int
  member_features: int = 64
  hidden: int = 128
  scale: float = 0.5

  def __post_init__(self):
    for name in ("dim", "member_features", "hidden"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be positive")
    if not self.scale > 0:
      raise ValueError(f"scale={self.scale} must be positive")


class Corrector(nnx.Module):
  """One layer's network: (member keys by group) -> correction [G, D] float32."""

  def __init__(self, cfg: CorrectorConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, f, h = cfg.dim, cfg.member_features, cfg.hidden
    self.member = nnx.Linear(d, f, rngs=rngs)
    self.hidden = nnx.Linear(d + 1 + 2 * f, h, rngs=rngs)
    self.out = nnx.Linear(h, d, kernel_init=nnx.initializers.zeros, rngs=rngs)

  def __call__(self, keys, assign, num_groups: int):
    """keys [N, D], assign [N] int32 (-1: not grouped) -> (mean [G, D], correction [G, D])."""
    mean, logsize, fmean, fmax = group_features(keys, assign, num_groups,
                                                lambda x: jax.nn.gelu(self.member(x)))
    hdn = jax.nn.gelu(self.hidden(jnp.concatenate([mean, logsize[:, None], fmean, fmax], -1)))
    return mean, self.cfg.scale * jnp.tanh(self.out(hdn))


def group_features(keys, assign, num_groups: int, transform):
  """Per-group summaries: mean key [G, D], log size [G], and `transform`(member key) mean- and
  max-pooled ([G, F] each; zeros for empty groups)."""
  valid = assign >= 0
  seg = jnp.where(valid, assign, num_groups)
  kf = keys.astype(jnp.float32)
  cnt = jax.ops.segment_sum(valid.astype(jnp.float32), seg, num_groups + 1)[:num_groups]
  mean = jax.ops.segment_sum(jnp.where(valid[:, None], kf, 0.0), seg,
                             num_groups + 1)[:num_groups] / jnp.maximum(cnt, 1)[:, None]
  phi = transform(kf)
  fmean = jax.ops.segment_sum(jnp.where(valid[:, None], phi, 0.0), seg,
                              num_groups + 1)[:num_groups] / jnp.maximum(cnt, 1)[:, None]
  fmax = jax.ops.segment_max(jnp.where(valid[:, None], phi, -jnp.inf), seg,
                             num_groups + 1)[:num_groups]
  fmax = jnp.where(cnt[:, None] > 0, fmax, 0.0)
  return mean, jnp.log(jnp.maximum(cnt, 1.0)), fmean, fmax


class CorrectorFileError(ValueError):
  """A corrector file that cannot be used; the message says what is wrong."""


def save(path: str, models: dict[int, Corrector], meta: dict | None = None) -> None:
  """Write one network per model layer ({layer: Corrector}) as a versioned npz, atomically."""
  arrays = {"format": np.int64(FILE_FORMAT)}
  cfgs = {}
  for layer, m in models.items():
    cfgs[str(layer)] = dataclasses.asdict(m.cfg)
    for name, leaf in nnx.to_flat_state(nnx.state(m, nnx.Param)):
      arrays[f"{layer}/{'/'.join(map(str, name))}"] = np.asarray(
          leaf.get_value() if hasattr(leaf, "get_value") else leaf.value, np.float32)
  arrays["config"] = np.str_(json.dumps({"layers": cfgs, "meta": meta or {}}))
  save_npz_atomic(path, arrays)


def load(path: str) -> dict[int, Corrector]:
  """{layer: Corrector} from a file written by `save` (validated). Cached by the file's path,
  modification time and size: a file rewritten in place is read again."""
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"path={path!r} must be a file path")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"corrector file {path!r} does not exist")
  st = os.stat(path)
  return dict(_load(os.path.abspath(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> dict[int, Corrector]:
  del mtime_ns, size  # cache keys only
  from jaxsparse._io import open_npz
  with open_npz(path, CorrectorFileError, "corrector file") as z:
    if "format" not in z.files or int(z["format"]) != FILE_FORMAT:
      raise CorrectorFileError(f"{path!r}: not a corrector file of format {FILE_FORMAT}")
    try:
      info = json.loads(str(z["config"]))
      layers = info["layers"]
      if not isinstance(layers, dict):
        raise TypeError(f"layers is a {type(layers).__name__}, not a mapping")
      cfgs = {int(layer): CorrectorConfig(**c) for layer, c in layers.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise CorrectorFileError(f"{path!r}: its config is not a corrector file's ({e})") \
          from None
    out = {}
    for (layer, c), cfg in zip(layers.items(), cfgs.values()):
      m = Corrector(cfg, rngs=nnx.Rngs(0))
      st = nnx.state(m, nnx.Param)
      flat = []
      for name, leaf in nnx.to_flat_state(st):
        key = f"{layer}/{'/'.join(map(str, name))}"
        if key not in z.files:
          raise CorrectorFileError(f"{path!r}: missing array {key!r}")
        a = z[key]
        if a.shape != leaf.shape:
          raise CorrectorFileError(f"{path!r}: {key}.shape={a.shape}, expected {leaf.shape}")
        if a.dtype.kind != "f" or not np.isfinite(a).all():
          raise CorrectorFileError(f"{path!r}: {key} must hold finite real floats "
                                   f"(dtype {a.dtype.name})")
        flat.append((name, jnp.asarray(a)))
      nnx.update(m, nnx.from_flat_state(flat))
      out[int(layer)] = m
    return out


def file_meta(path: str) -> dict:
  """The metadata a corrector file was saved with (IVF settings, traces, and "plain_layers":
  layers whose correction did not pay on validation text, so they use plain means)."""
  load(path)  # validated
  with np.load(path, allow_pickle=False) as z:
    return json.loads(str(z["config"])).get("meta", {})


def as_ivf_corrector(model: Corrector):
  """The `corrector(state, keys, mean)` callable `ivf.evaluate` takes."""
  def fn(state, keys, mean):
    g = state["sizes"].shape[0]
    _, corr = model(jnp.asarray(keys), state["assign"], g)
    return jnp.where(state["sizes"][:, None] > 0, corr, 0.0)
  return fn

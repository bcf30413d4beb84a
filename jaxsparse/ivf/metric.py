"""A query-aware grouping metric for AttentionIndex.

Plain k-means groups keys that are close in Euclidean distance, but a query sees a key only
through its indexer score z(k) = sum_h w_h relu(q_h . k), and a group ranks well when its
members score alike for the queries that arrive. Near a group's mean c a member's score moves
by g . (k - c), with g = dz/dk = sum_h w_h [q_h . k > 0] q_h the score's gradient; its mean
square over queries and keys is (k - c)^T S (k - c), S = E[g g^T]. Clustering with that
distance, i.e. k-means on keys mapped by A = S^(1/2), groups keys that the queries cannot tell
apart instead of keys that are merely near.

A metric is a linear change of basis used by the index alone: keys enter it as k @ A, and
queries rank its groups as q @ A^-1 (so q . k, and every representative's score, is unchanged);
candidates are scored with the original keys and queries. A (per layer, [D, D] float32,
symmetric positive definite) is fitted offline on training traces, S averaged over causal
(query, key) pairs (`sample_pairs`: evenly spaced queries, keys drawn at random from each
query's prefix):

    S' = D * S / trace(S) + eps * I,   A = S'^(1/2)     (eps keeps A well conditioned)

`fit` does one layer, `fit_traces` every layer of prefill traces; `save` / `load` keep them
as a validated npz ({layer: A}); `SHIPPED` holds SmolLM2-135M's, fitted on three training
texts (`jaxsparse fit-metric`).
"""
from __future__ import annotations

import functools
import json
import os

import numpy as np

from jaxsparse._io import save_npz_atomic

__all__ = ["fit", "fit_traces", "sample_pairs", "save", "load", "file_meta", "resolve", "check",
           "MetricFileError", "SHIPPED", "FILE_FORMAT"]

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                       "smollm2_metric.npz")
FILE_FORMAT = 1


class MetricFileError(ValueError):
  """A metric file that cannot be used; the message says what is wrong."""


def sample_pairs(n: int, queries: int = 256, keys: int = 256, seed: int = 0):
  """The causal (query, key) pairs a metric averages over on an n-token trace: positions [Q]
  int64 (`queries` evenly spaced in [n // 16, n - 1], without repeats) and key ids [Q, keys]
  int64, drawn uniformly from 0..position (numpy's PCG64 with `seed`)."""
  if n < 2 or queries < 1 or keys < 1:
    raise ValueError(f"need n >= 2, queries >= 1 and keys >= 1; got n={n}, queries={queries}, "
                     f"keys={keys}")
  pos = np.unique(np.linspace(n // 16, n - 1, queries).astype(np.int64))
  rng = np.random.default_rng(seed)
  ids = np.floor(rng.random((len(pos), keys)) * (pos[:, None] + 1)).astype(np.int64)
  return pos, np.minimum(ids, pos[:, None])


def _moment(q, w, k, queries, keys, seed):
  """sum over `sample_pairs` of g g^T [D, D] float64, g = sum_h w_h [q_h . k > 0] q_h."""
  if (len(q.shape) != 3 or tuple(w.shape) != tuple(q.shape[:2])
      or tuple(k.shape) != (q.shape[0], q.shape[2])):
    raise ValueError(f"q {tuple(q.shape)}, w {tuple(w.shape)}, k {tuple(k.shape)} must be "
                     f"[N, H, D], [N, H], [N, D]")
  pos, ids = sample_pairs(k.shape[0], queries, keys, seed)
  # only the sampled rows are read (and converted): q may be a device array of many GB
  q = np.asarray(q[pos], np.float64)
  w = np.asarray(w[pos], np.float64)
  kk = np.asarray(k[np.unique(ids)], np.float64)
  ids = np.searchsorted(np.unique(ids), ids)
  if not (np.isfinite(q).all() and np.isfinite(w).all() and np.isfinite(kk).all()):
    raise ValueError("q, w and k must be finite")
  s = np.zeros((q.shape[2], q.shape[2]))
  for i, row in enumerate(ids):
    gate = (np.einsum("hd,sd->sh", q[i], kk[row]) > 0) * w[i]  # [keys, H]
    g = gate @ q[i]  # [keys, D]
    s += g.T @ g
  return s


def _root(s, eps):
  d = s.shape[0]
  tr = np.trace(s)
  if not tr > 0:
    raise ValueError("the score gradients are all zero: no metric can be fitted")
  s = d * s / tr + eps * np.eye(d)
  e, v = np.linalg.eigh((s + s.T) / 2)
  return ((v * np.sqrt(np.maximum(e, 0.0))) @ v.T).astype(np.float32)


def _check_fit(eps, queries, keys):
  from jaxsparse import _checks
  _checks.check_real("eps", eps)
  if not eps > 0:
    raise ValueError(f"eps={eps} must be positive")
  for name, v in (("queries", queries), ("keys", keys)):
    _checks.check_int(name, v, 1)


def fit(q, k, w, *, eps: float = 0.01, queries: int = 256, keys: int = 256,
        seed: int = 0) -> np.ndarray:
  """The metric of one layer from a training trace's q [N, H, D], k [N, D], w [N, H] (any
  float; query n sees keys 0..n).

  Returns A [D, D] float32, symmetric positive definite: (D S / trace S + eps I)^(1/2), S the
  mean of g g^T over `sample_pairs(N, queries, keys, seed)`.
  """
  _check_fit(eps, queries, keys)
  from jaxsparse import _checks
  q, k, w = (_checks.as_array(n, x) for n, x in (("q", q), ("k", k), ("w", w)))
  for name, x in (("q", q), ("k", k), ("w", w)):
    _checks.check_real_dtype(name, x)
  _checks.check_kw_order(np.asarray(q), np.asarray(k), np.asarray(w))
  return _root(_moment(q, w, k, queries, keys, seed), eps)


def fit_traces(traces, *, eps: float = 0.01, queries: int = 256, keys: int = 256,
               seed: int = 0) -> dict[int, np.ndarray]:
  """{model layer: A} from prefill traces (`jaxsparse.traces.PrefillTrace` objects with the
  same layers), pooling every trace's pairs of a layer."""
  _check_fit(eps, queries, keys)
  traces = list(traces)
  if not traces:
    raise ValueError("traces must hold at least one prefill trace")
  layers = [int(x) for x in traces[0].layers]
  for t in traces[1:]:
    if [int(x) for x in t.layers] != layers:
      raise ValueError(f"every trace must hold the same layers; got {layers} and "
                       f"{[int(x) for x in t.layers]}")
  out = {}
  for i, layer in enumerate(layers):
    s = sum(_moment(t.q[i], t.w[i], t.k[i], queries, keys, seed) for t in traces)
    out[layer] = _root(s, eps)
  return out


def check(a, dim: int | None = None, name: str = "metric") -> np.ndarray:
  """a as a [D, D] float32 symmetric positive definite matrix, else ValueError naming `name`."""
  a = np.asarray(a)
  if a.dtype.kind not in "fiu":
    raise ValueError(f"{name}.dtype={a.dtype.name} must be a real type")
  if a.ndim != 2 or a.shape[0] != a.shape[1] or (dim is not None and a.shape[0] != dim):
    want = f"[{dim}, {dim}]" if dim is not None else "[D, D]"
    raise ValueError(f"{name} must be a {want} matrix; got shape {a.shape}")
  a = a.astype(np.float64)
  if not np.isfinite(a).all():
    raise ValueError(f"{name} must be finite")
  if not np.allclose(a, a.T, rtol=1e-5, atol=1e-6 * np.abs(a).max()):
    raise ValueError(f"{name} must be symmetric")
  e = np.linalg.eigvalsh(a)
  if not e.min() > 1e-6 * e.max():
    raise ValueError(f"{name} must be positive definite (smallest eigenvalue {e.min():.3g})")
  return a.astype(np.float32)


def save(path: str, metrics: dict[int, np.ndarray], meta: dict | None = None) -> None:
  """Write {layer: A} as a versioned npz, atomically."""
  if not metrics:
    raise ValueError("metrics must hold at least one layer")
  arrays = {"format": np.int64(FILE_FORMAT),
            "config": np.str_(json.dumps({"layers": sorted(int(x) for x in metrics),
                                          "meta": meta or {}}))}
  for layer, a in metrics.items():
    arrays[f"layer_{int(layer)}"] = check(a, name=f"metrics[{layer}]")
  save_npz_atomic(path, arrays)


def _load_fresh(path: str):
  """_load keyed by the file's modification time and size: a rewritten file is read again."""
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"path={path!r} must be a file path")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"metric file {path!r} does not exist")
  st = os.stat(path)
  return _load(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int):
  del mtime_ns, size  # cache keys only
  from jaxsparse._io import open_npz
  try:
    with open_npz(path, MetricFileError, "metric file") as z:
      if "format" not in z.files or int(z["format"]) != FILE_FORMAT:
        raise MetricFileError(f"{path!r}: not a metric file of format {FILE_FORMAT}")
      info = json.loads(str(z["config"]))
      out = {}
      layers = info.get("layers") if isinstance(info, dict) else None
      if not isinstance(layers, list) or not all(
          isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise MetricFileError(f"{path!r}: config's layers must be a list of ints; got "
                              f"{layers!r}")
      for layer in layers:
        key = f"layer_{int(layer)}"
        if key not in z.files:
          raise MetricFileError(f"{path!r}: missing array {key!r}")
        try:
          out[int(layer)] = check(z[key], name=f"{path!r} layer {layer}")
        except ValueError as e:
          raise MetricFileError(str(e)) from e
      return out, info.get("meta", {})
  except MetricFileError:
    raise
  except (ValueError, KeyError, TypeError) as e:  # a config of the wrong shape
    raise MetricFileError(f"{path!r} is not a readable metric file: {e}") from None


def load(path: str) -> dict[int, np.ndarray]:
  """{layer: A [D, D] float32} from a file written by `save` (validated)."""
  return dict(_load_fresh(path)[0])


def file_meta(path: str) -> dict:
  """The metadata a metric file was saved with (traces, eps)."""
  return dict(_load_fresh(path)[1])


def resolve(metric, layer: int | None, dim: int) -> np.ndarray | None:
  """A metric argument as A [dim, dim] float32 (or None): an array, or a path to a metric file
  with `layer`, the model layer the trace layer is."""
  if metric is None:
    return None
  if isinstance(metric, (str, os.PathLike)):
    metrics = load(str(metric))
    if layer is None or int(layer) not in metrics:
      raise ValueError(f"layer={layer} must name a layer the metric file holds: "
                       f"{sorted(metrics)}")
    metric = metrics[int(layer)]
  return check(metric, dim)

"""Indexer traces: a documented, versioned npz format for decode and prefill, validated on load.

Format (schema_version 1), one `.npz` (numpy, no pickled objects: load with allow_pickle=False):

  schema_version  int64 scalar, = 1
  kind            str scalar, "decode" or "prefill"
  meta            str scalar, JSON: model, source text, tokens, extrapolated (bool: any position
                  past the model's trained context), and anything else the producer adds
  layers          [L] int32, which model layers the trace holds
  decode:
    q             [L, S, R, H, D] float32  indexer queries; R verifier rows (R = 1: plain decode)
    w             [L, S, R, H]    float32  head weights
    k             [L, N, D]       float32  indexer keys by slot (N = lengths[-1])
    lengths       [S] int32, non-decreasing: at step s row r sits at slot lengths[s] - R + r
                  and sees slots [0, lengths[s] - R + r]
    accepted      [S] int32 in [0, R - 1]: draft tokens accepted at step s (0 when R = 1)
  prefill:
    q [L, T, H, D] float32, w [L, T, H] float32, k [L, T, D] float32; query t sees keys <= t.
  q, w and k may be stored as float16 (`save(..., half=True)`, half the bytes); `load` always
  returns float32.

Importing from another engine: dump per layer the indexer's post-RoPE (and post-Hadamard) q,
the head weights after all scaling (q-scale folded in), and dequantised keys in slot order; for
a paged cache, gather the pages in block-table order first. `save` validates before writing.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxsparse._io import save_npz_atomic

__all__ = [
    "SCHEMA_VERSION", "DecodeTrace", "PrefillTrace", "TraceError", "validate", "save", "load",
    "default_trace_path", "tile_prefill"
]


SCHEMA_VERSION = 1


@dataclasses.dataclass
class DecodeTrace:
  q: np.ndarray
  w: np.ndarray
  k: np.ndarray
  lengths: np.ndarray
  accepted: np.ndarray
  layers: np.ndarray
  meta: dict

  kind = "decode"

  @property
  def rows(self) -> int:
    return self.q.shape[2]

  def layer(self, i: int):
    """(q [S, R, H, D], k [N, D], w [S, R, H]) of the i-th stored layer, in the order
    `indexer_scores(q, k, w)` takes them."""
    return self.q[i], self.k[i], self.w[i]


@dataclasses.dataclass
class PrefillTrace:
  q: np.ndarray
  w: np.ndarray
  k: np.ndarray
  layers: np.ndarray
  meta: dict

  kind = "prefill"


class TraceError(ValueError):
  """A trace file that does not follow the schema; the message names the field."""


def _need(cond, msg):
  if not cond:
    raise TraceError(msg)


def validate(tr) -> None:
  """Check shapes, dtypes, ranges and finiteness; raises TraceError naming the field."""
  _need(isinstance(tr, (DecodeTrace, PrefillTrace)),
        f"a trace must be a DecodeTrace or PrefillTrace; got {type(tr).__name__}")
  fields = ("layers", "q", "w", "k") + (("lengths", "accepted") if tr.kind == "decode" else ())
  for name in fields:
    a = getattr(tr, name)
    _need(isinstance(a, np.ndarray), f"{name} must be a numpy array; got {type(a).__name__}")
  _need(isinstance(tr.meta, dict), "meta must be a dict")
  try:
    json.dumps(tr.meta)
  except (TypeError, ValueError) as e:
    raise TraceError(f"meta must be JSON-serialisable: {e}") from None
  _need(tr.layers.ndim == 1 and tr.layers.dtype.kind == "i", "layers must be [L] int")
  _need(len(set(tr.layers.tolist())) == tr.layers.shape[0], "layers must be distinct")
  nl = tr.layers.shape[0]
  for name in ("q", "w", "k"):
    a = getattr(tr, name)
    _need(a.dtype == np.float32, f"{name}.dtype={a.dtype} must be float32")
    _need(a.ndim >= 1, f"{name} must be an array with a layer axis; got a 0-d value")
    _need(a.shape[0] == nl, f"{name}.shape[0]={a.shape[0]} must equal len(layers)={nl}")
    _need(np.isfinite(a).all(), f"{name} holds non-finite values")
  if tr.kind == "decode":
    _need(tr.q.ndim == 5, f"q must be [L, S, R, H, D]; got shape {tr.q.shape}")
    _, s, r, h, d = tr.q.shape
    _need(tr.w.shape == (nl, s, r, h), f"w.shape={tr.w.shape} must be {(nl, s, r, h)}")
    _need(tr.k.ndim == 3 and tr.k.shape[2] == d, f"k.shape={tr.k.shape} must be [L, N, {d}]")
    _need(tr.lengths.shape == (s,) and tr.lengths.dtype.kind == "i",
          f"lengths must be [{s}] int; got {tr.lengths.shape} {tr.lengths.dtype}")
    _need(tr.accepted.shape == (s,) and tr.accepted.dtype.kind == "i",
          f"accepted must be [{s}] int; got {tr.accepted.shape} {tr.accepted.dtype}")
    if s:
      _need((np.diff(tr.lengths) >= 0).all(), "lengths must be non-decreasing")
      _need(tr.lengths.min() >= r, f"lengths must be >= R={r} (every row needs a slot)")
      _need(tr.lengths.max() <= tr.k.shape[1],
            f"lengths max {tr.lengths.max()} exceeds the {tr.k.shape[1]} key slots")
      _need(((tr.accepted >= 0) & (tr.accepted <= r - 1)).all(),
            f"accepted must lie in [0, {r - 1}]")
  else:
    _need(tr.q.ndim == 4, f"q must be [L, T, H, D]; got shape {tr.q.shape}")
    _, t, h, d = tr.q.shape
    _need(tr.w.shape == (nl, t, h), f"w.shape={tr.w.shape} must be {(nl, t, h)}")
    _need(tr.k.shape == (nl, t, d), f"k.shape={tr.k.shape} must be {(nl, t, d)}")


def save(path: str, tr, *, half: bool = False) -> None:
  """Validate, then write atomically (a crash never leaves a half-written trace).

  half: store q, w and k as float16 (values beyond float16's range are refused).
  """
  validate(tr)
  qwk = {"q": tr.q, "w": tr.w, "k": tr.k}
  if half:
    for name, a in qwk.items():
      _need(np.abs(a).max(initial=0) < np.finfo(np.float16).max,
            f"{name} exceeds float16's range: save it with half=False")
    qwk = {name: a.astype(np.float16) for name, a in qwk.items()}
  arrays = {"schema_version": np.int64(SCHEMA_VERSION), "kind": np.str_(tr.kind),
            "meta": np.str_(json.dumps(tr.meta)), "layers": tr.layers, **qwk}
  if tr.kind == "decode":
    arrays.update(lengths=tr.lengths, accepted=tr.accepted)
  save_npz_atomic(path, arrays, compressed=True)


def load(path: str):
  """Read and validate a trace; never unpickles. Returns DecodeTrace or PrefillTrace."""
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"path={path!r} must be a file path")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"trace file {path!r} does not exist")
  from jaxsparse._io import open_npz
  with open_npz(path, TraceError, "npz trace") as z:
    keys = set(z.files)
    _need("schema_version" in keys, f"{path!r}: missing field schema_version")
    sv = z["schema_version"]
    _need(sv.shape == () and np.issubdtype(sv.dtype, np.integer),
          f"{path!r}: schema_version must be an integer scalar; got {sv.dtype.name} {sv.shape}")
    ver = int(sv)
    _need(ver == SCHEMA_VERSION, f"{path!r}: schema_version={ver}, this jaxsparse reads "
                                 f"{SCHEMA_VERSION}")
    kind = str(z["kind"]) if "kind" in keys else None
    _need(kind in ("decode", "prefill"), f"{path!r}: kind={kind!r} must be decode or prefill")
    need = {"meta", "layers", "q", "w", "k"} | ({"lengths", "accepted"} if kind == "decode"
                                                 else set())
    missing = sorted(need - keys)
    _need(not missing, f"{path!r}: missing field(s) {missing}")
    try:
      meta = json.loads(str(z["meta"]))
    except json.JSONDecodeError as e:
      raise TraceError(f"{path!r}: meta is not JSON: {e}") from e
    qwk = {name: z[name] for name in ("q", "w", "k")}
    qwk = {name: a.astype(np.float32) if a.dtype == np.float16 else a for name, a in qwk.items()}
    common = dict(layers=z["layers"], meta=meta, **qwk)
    tr = (DecodeTrace(lengths=z["lengths"], accepted=z["accepted"], **common)
          if kind == "decode" else PrefillTrace(**common))
  try:
    validate(tr)
  except TraceError as e:  # the file's name beside the field's
    raise TraceError(f"{path!r}: {e}") from None
  return tr


def default_trace_path() -> str:
  """The small real decode trace shipped inside the package (the main job's input)."""
  import importlib.resources
  return os.fspath(importlib.resources.files("jaxsparse") / "data" / "smollm2_decode.npz")


def _fixing(u, rng):
  """A random d x d orthogonal matrix that maps the unit vector u to itself (a Haar rotation
  followed by the Householder reflection that brings u's image back to u)."""
  d = u.shape[0]
  g, r = np.linalg.qr(rng.standard_normal((d, d)))
  g = g * np.sign(np.diag(r))
  v = g @ u - u
  if np.linalg.norm(v) > 1e-12:
    v = v / np.linalg.norm(v)
    g = g - 2.0 * np.outer(v, v @ g)
  return g


def tile_prefill(q, k, w, n: int, *, heads: int | None = None, dim: int | None = None,
                 seed: int = 0, dtype=np.float32):
  """One layer's real prefill trace laid end to end as independent documents, to n tokens,
  optionally widened to larger indexer shapes: keys and queries with the trace's statistics at
  a context the model never reached.

  q [T, h, d], k [T, d], w [T, h] (one layer of a PrefillTrace). Copy c of the trace is rotated
  by its own random orthogonal matrix that keeps the direction of the trace's mean key, applied
  to its queries and keys alike: inside a copy every score equals the trace's, while a copy's
  content directions differ from the others' (unrelated documents sharing the model's common
  key direction). heads (a multiple of h) repeats each head heads / h times with its weight
  divided as much, and dim (>= d) embeds q and k isometrically in dim dimensions, so the
  indexer scores are unchanged at the wider shape. Returns jax arrays (q [n, heads, dim] and
  k [n, dim] in dtype, w [n, heads] float32), built on the default device.
  """
  import jax.numpy as jnp
  q, k, w = (np.asarray(a, np.float64) for a in (q, k, w))
  from jaxsparse import _checks
  _checks.check_kw_order(q, k, w)
  if q.ndim != 3 or w.shape != q.shape[:2] or k.shape != (q.shape[0], q.shape[2]):
    raise ValueError(f"q {q.shape}, k {k.shape}, w {w.shape} must be [T, h, d], [T, d], [T, h]")
  t, h, d = q.shape
  heads, dim = heads or h, dim or d
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"n={n!r} must be a positive int")
  if heads % h:
    raise ValueError(f"heads={heads} must be a multiple of the trace's {h} heads")
  if dim < d:
    raise ValueError(f"dim={dim} must be at least the trace's {d} dimensions")
  rng = np.random.default_rng(seed)
  m = k.mean(0)
  u = m / max(np.linalg.norm(m), 1e-30)
  embed = np.linalg.qr(rng.standard_normal((dim, d)))[0]  # [dim, d], orthonormal columns
  qs, ks = [], []
  for c in range(-(-n // t)):
    rot = embed @ _fixing(u, rng)  # [dim, d]: x -> embed (R x), an isometry
    rows = min(t, n - c * t)
    qs.append(jnp.repeat(jnp.asarray(q[:rows] @ rot.T, dtype), heads // h, axis=1))
    ks.append(jnp.asarray(k[:rows] @ rot.T, dtype))
  ww = np.repeat(w, heads // h, axis=1).astype(np.float32) / np.float32(heads // h)
  ww = np.tile(ww, (-(-n // t), 1))[:n]
  return jnp.concatenate(qs), jnp.concatenate(ks), jnp.asarray(ww)

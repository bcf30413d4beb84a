"""Input validation shared by the public entry points (ValueError names the argument)."""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._util import clip_positions, widen_int  # noqa: F401  (shared with the kernels)

KEY_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn)
QUERY_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn)
IMPLEMENTATIONS = (None, "xla", "pallas")


def check_int(name: str, value, minimum=None) -> None:
  """A Python or numpy integer (never a bool or a float), at least `minimum` when given."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{name}={value!r} must be an int")
  if minimum is not None and value < minimum:
    raise ValueError(f"{name}={value!r} must be >= {minimum}")


def check_real(name: str, value) -> None:
  """A finite real number (int or float, never a bool, a complex or NaN / inf)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                    np.floating)):
    raise ValueError(f"{name}={value!r} must be a real number")
  if not np.isfinite(value):
    raise ValueError(f"{name}={value!r} must be finite")


def as_array(name: str, x):
  """`x` as an array: jax and numpy arrays (and tracers) pass unchanged; lists, tuples and
  numbers become numpy arrays; None, strings, objects and ragged lists raise ValueError naming
  `name`."""
  if isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer)):
    return x
  if x is None or isinstance(x, (str, bytes, dict)):
    raise ValueError(f"{name} must be an array; got {type(x).__name__}")
  try:
    a = np.asarray(x)
  except (ValueError, TypeError):
    raise ValueError(f"{name} must be an array; got a ragged or mixed {type(x).__name__}") \
        from None
  if a.dtype == object or a.dtype.kind in "SUV":
    raise ValueError(f"{name} must be a numeric array; got {type(x).__name__} of "
                     f"{a.dtype.name}")
  return a


def array_args(*names: str, optional: tuple = ()):
  """Decorator for public functions: the arguments `names` (and `optional` ones unless None)
  go through `as_array` first, so a list is taken as an array and None, a string or a ragged
  list is a ValueError naming the argument, not an AttributeError deep inside; float64 arrays
  are taken as float32 (what jax does without x64, on every path alike)."""
  def wrap(fn):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
      bound = sig.bind_partial(*args, **kwargs)
      x64 = jax.config.jax_enable_x64
      for name in names + tuple(optional):
        if name in bound.arguments and not (name in optional and bound.arguments[name] is None):
          x = as_array(name, bound.arguments[name])
          if name in names and x.ndim == 0:
            raise ValueError(f"{name} must be an array with at least one axis; got a 0-d "
                             "value")
          if np.dtype(x.dtype) == np.float64:  # computed in float32, as jax does without x64
            x = x.astype(np.float32)
          bound.arguments[name] = _to_int32_range(x) if x64 else x
      if x64:  # the library computes in 32 bits (its kernels index with int32)
        with jax.enable_x64(False):
          return fn(*bound.args, **bound.kwargs)
      return fn(*bound.args, **bound.kwargs)
    return checked
  return wrap


def _to_int32_range(x):
  """Under jax_enable_x64: a 64-bit integer array clipped to int32's range (in 64 bits, before
  the library's 32-bit code sees it), so a position or length past 2^31 clips as documented
  instead of wrapping; anything else unchanged."""
  dt = np.dtype(x.dtype)
  if dt.kind not in "iu" or dt.itemsize < 8:
    return x
  lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
  xp = np if isinstance(x, np.ndarray) else jnp
  if dt.kind == "u":
    return xp.minimum(x, xp.asarray(hi, dt)).astype(np.int32)
  return xp.clip(x, lo, hi).astype(np.int32)


def check_bool(name: str, value, *, none: bool = False) -> None:
  """A bool (None too when `none`), never 1, "yes" or a numpy bool array."""
  if not (isinstance(value, (bool, np.bool_)) or (none and value is None)):
    raise ValueError(f"{name}={value!r} must be {'None, ' if none else ''}True or False")


def check_instance(name: str, value, cls) -> None:
  """`value` is a `cls` (a config object, a Mesh), else ValueError naming `name`."""
  if not isinstance(value, cls):
    raise ValueError(f"{name} must be a {cls.__name__}; got {type(value).__name__}")


def check_real_dtype(name: str, x) -> None:
  """Reject complex (and other non-real) arrays before any conversion drops a part."""
  dt = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
  if not (np.issubdtype(dt, np.floating) or np.issubdtype(dt, np.integer)
          or dt == jnp.bfloat16 or dt.name.startswith("float8")):
    raise ValueError(f"{name}.dtype={dt.name} must be a real (float or integer) type")


def check_positions(name: str, x) -> None:
  """query_positions: an integer dtype; concrete values must fit int32 (positions past 2^31
  would wrap and hide every key). Traced values are clipped by the kernels."""
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name}.dtype={x.dtype} must be an integer type")
  v = concrete_values(x)
  if v is not None and v.size and (v.max() > np.iinfo(np.int32).max
                                   or v.min() < np.iinfo(np.int32).min):
    raise ValueError(f"{name} must fit int32; got min={v.min()} max={v.max()}")


def check_implementation(implementation):
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")


def check_dtype(name: str, x, allowed) -> None:
  if x.dtype not in [jnp.dtype(a) for a in allowed]:
    names = ", ".join(jnp.dtype(a).name for a in allowed)
    raise ValueError(f"{name}.dtype={x.dtype.name} must be one of: {names}")


def check_ndim(name: str, x, ndims, what: str) -> None:
  if x.ndim not in ndims:
    raise ValueError(f"{name} must be {what}; got shape {tuple(x.shape)}")


def check_nonempty(name: str, x) -> None:
  if x.size == 0:
    raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")


def check_key_scale(k, k_scale, expected_shape) -> None:
  """fp8 keys need float32 per-slot scales of `expected_shape`; other dtypes may take them."""
  if k.dtype == jnp.float8_e4m3fn and k_scale is None:
    raise ValueError("k_scale is required when the keys are float8_e4m3fn (one float32 per slot)")
  if k_scale is None:
    return
  if tuple(k_scale.shape) != tuple(expected_shape):
    raise ValueError(f"k_scale.shape={tuple(k_scale.shape)} must be {tuple(expected_shape)}")
  check_dtype("k_scale", k_scale, (jnp.float32,))


def check_fp8_pairing(q, k, k_name: str) -> None:
  """fp8 queries run an fp8 x fp8 dot: the keys must be fp8 too."""
  if q.dtype == jnp.float8_e4m3fn and k.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"q.dtype=float8_e4m3fn needs {k_name}.dtype=float8_e4m3fn too; "
                     f"got {k_name}.dtype={k.dtype.name}")


def compute_dtype(q_dtype):
  """The dtype both dot operands take: q's, except fp8 (exact in bfloat16) for XLA and TPU."""
  return jnp.bfloat16 if q_dtype == jnp.float8_e4m3fn else q_dtype


def is_concrete(x) -> bool:
  """True when `x` holds values we can inspect now (not a tracer under jit)."""
  return not isinstance(x, jax.core.Tracer)


def concrete_values(x):
  """numpy view of a concrete array, or None under tracing."""
  if not is_concrete(x):
    return None
  return np.asarray(x)


def check_kw_order(q, k, w) -> None:
  """Public functions take (q, k, w) as `indexer_scores` does: q [..., H, D], k [..., D],
  w [..., H]. A call in the old (q, w, k) order (k [..., H] and w [..., D], H != D) raises one
  ValueError that says so; with H == D the shapes cannot tell the two apart."""
  if q.ndim < 2 or not k.ndim or not w.ndim:
    return
  h, d = q.shape[-2], q.shape[-1]
  if h != d and k.shape[-1] == h and w.shape[-1] == d:
    raise ValueError(f"k {tuple(k.shape)} and w {tuple(w.shape)} look swapped: the arguments "
                     f"are (q, k, w) as in indexer_scores, k [..., D={d}] and w [..., H={h}]")


def clip_lengths(lengths, n: int):
  """Row lengths -> int32 in [0, n], clipped before the cast (README "Input rules"): a length
  of n or more means the whole row, also a uint32 or int64 one past 2^31, which a plain cast
  would wrap to a small or negative length. Concrete lengths are clipped in numpy (int64 stays
  exact), traced ones in their own dtype."""
  if isinstance(lengths, jax.core.Tracer):
    lengths = widen_int(lengths)
    if jnp.issubdtype(lengths.dtype, jnp.unsignedinteger):
      return jnp.minimum(lengths, jnp.asarray(n, lengths.dtype)).astype(jnp.int32)
    return jnp.clip(lengths, 0, n).astype(jnp.int32)
  v = np.asarray(lengths)
  if v.dtype.kind in "iub" and v.dtype != np.uint64:
    v = v.astype(np.int64)  # widened first: int8 lengths clipped to n = 1000 must not wrap
  return jnp.asarray(np.clip(v, 0, n).astype(np.int32))

"""Timing and result-file helpers shared by the benchmark scripts."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

COPY_TBPS = 4.3  # H200 device-to-device copy, bytes read + written (shared/anchors.md)
MATMUL_TFLOPS = 711.0  # H200 bf16 8192^3 jnp.dot (shared/anchors.md)


def time_calls(fn, arg_sets, *, reps: int = 5, calls: int = 30, warmup: int = 3) -> float:
  """Median seconds per call: `calls` back-to-back async dispatches, one sync, `reps` times.

  arg_sets: list of argument tuples rotated through so repeated calls do not hit in L2.
  """
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for i in range(calls):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / calls)
  return statistics.median(samples)


def time_in_graph(fn, args, *, calls: int = 20, reps: int = 5) -> float:
  """Median device seconds per call, without host dispatch: `fn` runs `calls` times inside one
  jitted loop (an optimization barrier ties each call's inputs to the previous result, so XLA
  can neither hoist nor overlap them), minus a 1-call loop, over calls - 1."""
  import jax.numpy as jnp
  from jax import lax

  def looped(n):
    def loop(a0):
      def body(i, acc):
        a, acc = lax.optimization_barrier((a0, acc))
        leaf = jax.tree.leaves(fn(*a))[0]
        return acc + leaf.reshape(-1)[0].astype(jnp.float32)
      return lax.fori_loop(0, n, body, jnp.float32(0))
    return jax.jit(loop)

  one, many = looped(1), looped(calls)
  jax.block_until_ready(one(args))
  jax.block_until_ready(many(args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(one(args))
    t1 = time.perf_counter()
    jax.block_until_ready(many(args))
    t2 = time.perf_counter()
    samples.append(((t2 - t1) - (t1 - t0)) / (calls - 1))
  return statistics.median(samples)


def environment() -> dict:
  dev = jax.devices()[0]
  info = {
      "device": getattr(dev, "device_kind", str(dev)),
      "platform": dev.platform,
      "jax": jax.__version__,
      "python": platform.python_version(),
      "numpy": np.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv),
      "timing": ("in-graph (JAXSPARSE_IN_GRAPH=1)" if os.environ.get("JAXSPARSE_IN_GRAPH") == "1"
                 else "host loop: back-to-back calls, one sync"),
  }
  try:
    import jaxlib
    info["jaxlib"] = jaxlib.__version__
  except ImportError:
    pass
  try:
    info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, check=False).stdout.strip()
  except OSError:
    pass
  return info


def write_json(path: str, payload: dict) -> None:
  """Atomic write: a crash never leaves a half-written result file."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=1, default=float)
  os.replace(tmp, path)


def print_table(rows: list[dict], cols: list[str]) -> None:
  from rich.console import Console
  from rich.table import Table
  t = Table()
  for c in cols:
    t.add_column(c)
  for r in rows:
    t.add_row(*[(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, ""))) for c in cols])
  Console(width=200).print(t)

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


def time_calls(fn, arg_sets, *, reps: int = 5, calls: int = 30, warmup: int = 3,
               carry: tuple[int, int | None] | None = None) -> float:
  """Median seconds per call: `calls` back-to-back async dispatches, one sync, `reps` times.

  arg_sets: list of argument tuples rotated through so repeated calls do not hit in L2.
  carry=(i, j): one argument set whose argument i is output j (None: the whole output) of the
    previous call, as a decode loop threads its state. With `fn` jitted with donate_argnums=(i,)
    the state is updated in place, as a serving loop runs it, and the caller's args[i] is
    consumed.
  """
  if carry is not None and len(arg_sets) != 1:
    raise ValueError(f"carry={carry} needs exactly one argument set, got {len(arg_sets)}")
  args = list(arg_sets[0])

  def call(i):
    if carry is None:
      return fn(*arg_sets[i % len(arg_sets)])
    out = fn(*args)
    args[carry[0]] = out if carry[1] is None else out[carry[1]]
    return out

  for i in range(warmup):
    jax.block_until_ready(call(i))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for i in range(calls):
      out = call(i)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / calls)
  return statistics.median(samples)


def in_graph_mode() -> str:
  """$JAXSPARSE_IN_GRAPH: "" (host loop), "1" or "loop" (fori_loop in one jit) or "unrolled"."""
  mode = os.environ.get("JAXSPARSE_IN_GRAPH", "")
  if mode not in ("", "1", "loop", "unrolled"):
    raise ValueError(f"JAXSPARSE_IN_GRAPH={mode!r} must be unset, '1', 'loop' or 'unrolled'")
  return {"1": "loop"}.get(mode, mode)


def time_in_graph(fn, args, *, calls: int = 20, reps: int = 5, unrolled: bool | None = None,
                  carry: tuple[int, int] | None = None) -> float:
  """Median device seconds per call, without host dispatch: `fn` runs `calls` times inside one
  jitted program (an optimization barrier ties each call's inputs to the previous result, so XLA
  can neither hoist nor overlap them), minus a 1-call program, over calls - 1. One element of
  every output leaf feeds the result; XLA may then compute only that element of an output made
  by elementwise ops (an EMA update, say), so pass such outputs on with `carry`.

  unrolled=False: the calls are a `fori_loop`. XLA on GPU reads a while loop's predicate on the
    host every iteration, which adds a fixed ~9 us per call (H200, benchmarks/NOTES.md).
  unrolled=True: the calls are straight-line code (what a CUDA-graph-captured serving step
    sees); `calls` is capped at 10 to bound compile time. Default: $JAXSPARSE_IN_GRAPH.
  carry=(i, j): argument i of each call is output j (j=None: the whole output) of the previous
    call (a decode loop threading its state), instead of the same input every time.
  """
  import jax.numpy as jnp
  from jax import lax

  if unrolled is None:
    unrolled = in_graph_mode() == "unrolled"
  if unrolled:
    calls = min(calls, 10)

  def one_call(a0, acc):
    a, acc = lax.optimization_barrier((a0, acc))
    out = fn(*a)
    for leaf in jax.tree.leaves(out):
      acc = acc + leaf.reshape(-1)[0].astype(jnp.float32)
    if carry is not None:
      new = out if carry[1] is None else out[carry[1]]
      a = tuple(new if n == carry[0] else x for n, x in enumerate(a))
    return a, acc

  def looped(n):
    def loop(a0):
      state = (tuple(a0), jnp.float32(0))
      if unrolled:
        for _ in range(n):
          state = one_call(*state)
        return state[1]
      return lax.fori_loop(0, n, lambda i, st: one_call(*st), state)[1]
    return jax.jit(loop)

  one, many = looped(1), looped(calls)
  if unrolled and _ops(many, args) < 0.5 * calls * _ops(one, args):
    # XLA merged the repeated calls (it can drop the barrier and CSE them, as XLA:CPU does):
    # the unrolled program would under-count, so time the loop instead
    print("time_in_graph: unrolled calls were merged by XLA; using the fori_loop timing",
          file=sys.stderr)
    return time_in_graph(fn, args, calls=calls, reps=reps, unrolled=False, carry=carry)
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


def kernel_time(fn, args, *, calls: int = 20, warmup: int = 2,
                carry: tuple[int, int] | None = None) -> tuple[float, dict]:
  """GPU kernel seconds per call from the profiler's device trace (CUPTI), and seconds per call
  of each kernel name: what the GPU spent executing `fn`'s kernels, without the host dispatch,
  launch gaps and clock reads that wall-clock timers add (a ~10 us spread on 40-80 us decode
  calls in benchmarks/NOTES.md). `calls` back-to-back calls of `fn(*args)` run under
  `jax.profiler.trace`; events on the device planes' stream lines are summed.
  carry=(i, j): as in `time_in_graph`, argument i of each call is output j (None: the whole
  output) of the previous one, as a decode loop threads its state; with `fn` jitted with
  donate_argnums=(i,) the state is updated in place (no defensive copy of buffers a kernel
  aliases), and the caller's args[i] is consumed.
  Raises RuntimeError when the trace holds no GPU kernels (a CPU run, a profiler failure).
  """
  import glob
  import tempfile

  from jax.profiler import ProfileData

  args = list(args)

  def call():
    out = fn(*args)
    if carry is not None:
      args[carry[0]] = out if carry[1] is None else out[carry[1]]
    return out

  for _ in range(warmup):
    jax.block_until_ready(call())
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      out = None
      for _ in range(calls):
        out = call()
      jax.block_until_ready(out)
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
      raise RuntimeError(f"kernel_time: the profiler wrote no trace under {d}")
    per_kernel = stream_kernel_ns(ProfileData.from_file(paths[0]))
  if not per_kernel:
    raise RuntimeError("kernel_time: no GPU kernel events in the trace (no /device:GPU plane "
                       "with stream lines)")
  per_call = {name: ns * 1e-9 / calls for name, ns in per_kernel.items()}
  return sum(per_call.values()), per_call


def stream_kernel_ns(profile) -> dict[str, float]:
  """Total nanoseconds per event name on the stream lines ("Stream #...") of a profile's
  /device:GPU planes (the kernels and copies CUPTI recorded; the derived "XLA Ops" /
  "XLA Modules" lines repeat the same time and are skipped)."""
  totals: dict[str, float] = {}
  for plane in profile.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      for ev in line.events:
        totals[ev.name] = totals.get(ev.name, 0.0) + float(ev.duration_ns)
  return totals


def _ops(jitted, args) -> int:
  """Instructions in the compiled entry computation (to see whether repeated calls survived)."""
  text = jitted.lower(args).compile().as_text()
  entry = text[text.rindex("ENTRY"):]
  return max(1, entry.count(" = "))


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
      "timing": {"loop": "in-graph, fori_loop (JAXSPARSE_IN_GRAPH=1)",
                 "unrolled": "in-graph, unrolled (JAXSPARSE_IN_GRAPH=unrolled)",
                 "": "host loop: back-to-back calls, one sync"}[in_graph_mode()],
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  try:
    import jaxlib
    info["jaxlib"] = jaxlib.__version__
  except ImportError:
    pass
  info["git"] = _GIT
  return info


def _git() -> str:
  """$JAXSPARSE_GIT (where the checkout's .git is absent or stale: a copied tree), else HEAD."""
  if os.environ.get("JAXSPARSE_GIT"):
    return os.environ["JAXSPARSE_GIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  except OSError:
    return ""


_GIT = _git()  # read when the run starts: a commit made while it runs is not the code it ran


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

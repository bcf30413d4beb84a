"""Shared fixtures: GPU marker handling, tolerance, lowering and top-K option helpers."""
from __future__ import annotations

import importlib.util
import os


def _xla_knows(flag: str) -> bool:
  """Whether the installed jaxlib has an XLA flag (XLA aborts on an unknown one in XLA_FLAGS):
  its name is a string in the library."""
  import mmap
  spec = importlib.util.find_spec("jaxlib")
  lib = os.path.join(os.path.dirname(spec.origin), "libjax_common.so") if spec else ""
  try:
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      return m.find(flag.encode()) >= 0
  except (OSError, ValueError):
    return False


# Without a GPU plugin every test compiles for the CPU, where most of the suite's time is XLA
# compiling interpret-mode kernels: LLVM's optimisation passes cost more than they save there,
# and the CPU's newer (MLIR) fusion emitters compile the interpret-mode kernels' loops 3-4x
# slower than the classic elemental emitters (the same HLO). The flags must precede
# the backend's start. This process compiles at optimisation level 0 through
# jax_disable_most_optimizations, so that a test that mostly runs large XLA programs can ask for
# optimised code (`xla_optimized`); subprocesses that tests start get level 0 from XLA_FLAGS.
CPU_ONLY = not any(importlib.util.find_spec(p)
                   for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
if CPU_ONLY:
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [
      os.environ.get("XLA_FLAGS", ""),
      *(["--xla_cpu_use_fusion_emitters=false"]
        if _xla_knows("xla_cpu_use_fusion_emitters") else [])]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _level0_per_compile() -> bool:
  """Level-0 compiles through jax_disable_most_optimizations (False: this jax lacks it)."""
  try:
    jax.config.update("jax_disable_most_optimizations", True)
    return True
  except (AttributeError, KeyError):
    return False


if CPU_ONLY:
  per_compile = _level0_per_compile()
  if not per_compile:  # then every compile of this process too, through its XLA flags
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
  try:
    jax.devices()  # the backend reads XLA_FLAGS once, here: the level-0 flag below is not seen
  except RuntimeError:
    pass
  if per_compile:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"  # for subprocesses


@pytest.fixture
def xla_optimized():
  """XLA's optimised CPU code for this test's compiles: for a test that mostly runs large XLA
  programs (the main job's replay of the shipped trace: about 40% less time) rather than
  compiling interpret-mode kernels."""
  try:
    old = jax.config.read("jax_disable_most_optimizations")
  except (AttributeError, KeyError):
    yield
    return
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


def has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  part = os.environ.get("JAXSPARSE_TEST_PART", "")
  if part:  # "i/n": every n-th test from the i-th (1-based), to split a run over device calls
    try:
      i, n = (int(v) for v in part.split("/"))
      assert 1 <= i <= n
    except (ValueError, AssertionError):
      raise pytest.UsageError(f"JAXSPARSE_TEST_PART={part!r} must be i/n with 1 <= i <= n")
    keep = [it for j, it in enumerate(items) if j % n == i - 1]
    config.hook.pytest_deselected(items=[it for it in items if it not in keep])
    items[:] = keep
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if item.get_closest_marker("gpu") is not None:
      item.add_marker(skip)


def assert_scores_close(out, ref, *, dtype_tol=None, reduction=1):
  """-inf pattern must match exactly; finite values within a norm-relative tolerance.

  Default tolerance from the arithmetic: products of bf16 or fp8 inputs are exact in float32,
  so the only error is float32 accumulation over `reduction` terms (at most ~2^-24 x
  sqrt(reduction) relative for random signs), times a margin of 16. A kernel that is 1% off
  fails by orders of magnitude. `dtype_tol` overrides it (for example TF32 dots on a GPU).
  """
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert not np.isnan(out).any(), "NaN in output"
  fin = np.isfinite(ref)
  np.testing.assert_array_equal(np.isfinite(out), fin)
  np.testing.assert_array_equal(out[~fin], ref[~fin])
  tol = dtype_tol if dtype_tol is not None else 16 * 2.0 ** -24 * np.sqrt(reduction) + 1e-6
  if fin.any():
    err = np.linalg.norm(out[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), 1e-30)
    assert err < tol, f"relative error {err} >= {tol}"


def export_for(fn, platform: str, *shapes):
  """jax.export `fn` for "cuda" or "tpu" from this machine (no such device needed).

  jax >= 0.11 asks which GPU the Triton kernels are lowered for when none is attached: there
  the cuda lowering runs under an abstract mesh naming an H200 (jax 0.10 needs no device).
  """
  import contextlib
  import inspect
  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  ctx = contextlib.nullcontext()
  abstract = getattr(jax.sharding, "AbstractDevice", None)
  if (platform == "cuda" and not has_gpu() and abstract is not None
      and "platform" in inspect.signature(abstract).parameters):
    dev = abstract(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    ctx = jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("d",), abstract_device=dev))
  with ctx, (_verified_triton() if platform == "cuda" else contextlib.nullcontext()):
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*shapes)


def _verified_triton():
  """Context in which every Pallas Triton module lowered is also run through the MLIR
  verifier, so that a kernel the GPU's Triton parser would reject fails here on the CPU
  (for example a select whose cases differ in type, which once failed only on the GPU). A jax
  without that lowering entry point gets no extra check."""
  import contextlib
  try:
    from jax._src.pallas.triton import lowering
  except ImportError:
    return contextlib.nullcontext()
  orig = getattr(lowering, "lower_jaxpr_to_triton_module", None)
  if orig is None:
    return contextlib.nullcontext()

  def checked(*args, **kwargs):
    result = orig(*args, **kwargs)
    result.module.operation.verify()  # raises with the failing operation
    return result

  @contextlib.contextmanager
  def patched():
    lowering.lower_jaxpr_to_triton_module = checked
    try:
      yield
    finally:
      lowering.lower_jaxpr_to_triton_module = orig
  return patched()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drop each test module's compiled programs when it ends: a worker runs hundreds of
  interpret-mode kernels, and their executables otherwise pile up for the whole run."""
  yield
  import gc
  jax.clear_caches()
  gc.collect()


def topk_options(**fields):
  """(TopkConfig, Tuning) from fields of either: the user's choices go to the config, the
  measured table's entries replace the defaults' (`pallas_kernels.topk._tuning`), so a test
  can reach every kernel path at small sizes."""
  import dataclasses
  from pallas_kernels.topk import TopkConfig
  from pallas_kernels.topk._tuning import TUNING
  user = {f.name for f in dataclasses.fields(TopkConfig)}
  return (TopkConfig(**{k: v for k, v in fields.items() if k in user}),
          dataclasses.replace(TUNING, **{k: v for k, v in fields.items() if k not in user}))

"""Helpers shared by the Mosaic GPU (Hopper) kernels, across jax 0.10 and 0.11."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_BYTES = 227 * 1024  # per-block shared memory on the H100 / H200


def is_hopper_or_newer() -> bool:
  """Whether the default device is an NVIDIA GPU of compute capability >= 9.0 (wgmma, TMA)."""
  try:
    return float(getattr(jax.devices()[0], "compute_capability", "0")) >= 9.0
  except (RuntimeError, ValueError):
    return False


def mma_transforms(dtype):
  """Shared-memory layout of wgmma operands: 128-byte swizzled rows (64 bf16 / 128 fp8)."""
  return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(128))


def load(ref, layout, interpret: bool = False):
  """Read a whole ref into registers with `layout`. jax 0.10's plgpu.load needs the index
  argument that jax >= 0.11 deprecates; the Mosaic GPU interpreter has no rule for plgpu.load
  (and no layouts), so there it is a plain read."""
  if interpret:
    return ref[...]
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def interpret_params(interpret: bool):
  """The `interpret=` value for plgpu.kernel: None, or the Mosaic GPU interpreter's parameters
  (it runs TMA copies, barriers and wgmma on the CPU)."""
  if not interpret:
    return None
  cls = getattr(plgpu, "InterpretGPUParams", None) or getattr(plgpu, "InterpretParams", None)
  if cls is None:
    try:
      from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    except ImportError as e:
      raise NotImplementedError("this jax has no Mosaic GPU interpreter") from e
  return cls()


def iota(shape, dim: int, layout, interpret: bool = False):
  """int32 iota along `dim` in `layout` (a plain iota in the interpreter, which has no
  layouts)."""
  if interpret:
    return lax.broadcasted_iota(jnp.int32, shape, dim)
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)


def scores_nt(a, b_ref, interpret: bool = False):
  """S = a @ b^T in float32 on the tensor cores: a is a [M, D] shared-memory ref or a register
  array (the wgmma A operand), b_ref a [N, D] shared-memory ref read K-major (transposed view).
  The interpreter cannot read transposed refs, so there it is a plain float32 dot of the same
  operands (the kernel's indexing, pipelining and epilogue still run as compiled)."""
  if interpret:
    return jnp.dot(a[...].astype(jnp.float32), b_ref[...].astype(jnp.float32).T,
                   preferred_element_type=jnp.float32)

  def mm(acc_ref):
    plgpu.wgmma(acc_ref, a, b_ref.transpose((1, 0)))
    return acc_ref[...]
  m, n = a.shape[0], b_ref.shape[0]
  return pl.run_scoped(mm, plgpu.ACC((m, n), jnp.float32))

"""Mosaic GPU prefill scoring kernel (TMA + wgmma) on the H200: check it against the reference,
then time it per tiling next to the Triton kernel.

  python benchmarks/prefill_mgpu.py --keys 65536,262144 --configs 4:64:2,8:64:2
"""
from __future__ import annotations

import argparse
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import indexer
from jaxsparse._bench import cases as bench
from jaxsparse._bench.timing import MATMUL_TFLOPS, environment, print_table, write_json
from jaxsparse.prep import quantize_fp8
from pallas_kernels.indexer_prefill import PrefillConfig
from pallas_kernels.indexer_prefill.mgpu import prefill_scores_mgpu


def check(bt, bn, stages, fp8=False):
  """Max relative error against the float32 reference on a small causal case."""
  rng = np.random.default_rng(0)
  t, h, d, n = 64, 64, 128, 4096
  q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
  pos = jnp.asarray(np.sort(rng.integers(-1, n, t)), jnp.int32)
  ks = None
  if fp8:
    (q, qs), (k, ks) = quantize_fp8(q), quantize_fp8(k)
    w = w * qs
  got = np.asarray(jax.jit(lambda *a: prefill_scores_mgpu(
      *a, block_t=bt, block_n=bn, max_concurrent_steps=stages))(q, k, w, pos, ks))
  ref = np.asarray(indexer.indexer_scores_xla(q, k, w, k_scale=ks, query_positions=pos))
  fin = np.isfinite(ref)
  if not np.array_equal(np.isfinite(got), fin):
    return float("inf")
  scale = np.abs(ref[fin]).max()
  return float(np.abs(got[fin] - ref[fin]).max() / scale)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--keys", default="65536,262144")
  p.add_argument("--configs", default="4:64:2,8:64:2,4:64:4,2:64:4,4:128:2,8:128:2,4:128:3",
                 help="block_t:block_n:max_concurrent_steps, comma-separated")
  p.add_argument("--fp8-configs", default="",
                 help="tilings to also time with fp8 q and k (fp8 wgmma), comma-separated")
  p.add_argument("--out", default="benchmarks/results/prefill_mgpu_h200.json")
  a = p.parse_args(argv)
  rows = []
  rng = np.random.default_rng(1)
  dev = bench._Rand(1)
  h, d, chunk = 64, 128, 2048
  for n in (int(x) for x in a.keys.split(",")):
    t = chunk
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    pos = jnp.arange(n - t, n, dtype=jnp.int32)
    k = dev.normal((n, d))
    flops = 2.0 * h * d * (float(t) * n - t * (t - 1) / 2)
    triton = jax.jit(lambda q, k, w, p: indexer.indexer_scores(
        q, k, w, query_positions=p, implementation="pallas", config=PrefillConfig(kernel="triton")))
    variants = [("triton", "default", triton, (q, k, w, pos), None)]  # forced Triton kernel
    for spec in a.configs.split(","):
      bt, bn, st = (int(x) for x in spec.split(":"))
      f = jax.jit(lambda q, k, w, p, ks=None, bt=bt, bn=bn, st=st: prefill_scores_mgpu(
          q, k, w, p, ks, block_t=bt, block_n=bn, max_concurrent_steps=st))
      variants.append(("mosaic", spec, f, (q, k, w, pos), False))
      if spec in a.fp8_configs.split(","):
        q8 = quantize_fp8(q)[0]
        k8 = (k * 16).astype(jnp.float8_e4m3fn)  # values do not change the speed
        variants.append(("mosaic fp8 q+k", spec, f,
                         (q8, k8, w, pos, jnp.full((n,), 1 / 16, jnp.float32)), True))
    for impl, spec, f, args, fp8 in variants:
      err = ""
      rel = float("nan")
      if impl.startswith("mosaic"):
        try:
          bt, bn, st = (int(x) for x in spec.split(":"))
          rel = check(bt, bn, st, fp8=bool(fp8))
        except Exception as e:  # noqa: BLE001 - report, keep sweeping
          traceback.print_exc()
          err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      sec = float("nan")
      if not err:
        sec, err = bench._timed(f, [args], reps=3, calls=5)
      row = dict(op="prefill_mgpu", T=t, N=n, impl=impl, config=spec, ms=sec * 1e3,
                 tflops=flops / sec / 1e12, roofline=flops / sec / 1e12 / MATMUL_TFLOPS,
                 max_rel_err=rel, error=err)
      bench._emit(rows, row)
  print_table(rows, ["N", "impl", "config", "ms", "tflops", "roofline", "max_rel_err", "error"])
  write_json(a.out, dict(environment=environment(), rows=rows))


if __name__ == "__main__":
  main()

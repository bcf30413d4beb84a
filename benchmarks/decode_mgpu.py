"""Mosaic GPU paged decode scoring kernel (TMA page gathers + wgmma) on the H200: check it
against the reference (bf16, fp8 q+k and bf16 q with fp8 keys, per-slot scales, ragged
lengths), then time it per
tiling next to the Triton kernel (bf16 keys, fp8 keys with bf16 q).

  python benchmarks/decode_mgpu.py --shapes 64x131072,8x1048576 --configs 32:4,32:8
  python benchmarks/decode_mgpu.py --shapes 64x131072 --configs 32:4 --sparse-controls
  ncu ... python benchmarks/decode_mgpu.py --shapes 8x131072 --configs 32:4 --profile 1

At 64x131072 it also times SPIN's block-sparse mode (60% of the pages; with --sparse-controls
also a contiguous selection and dense scoring with 60% lengths, the same bytes).
"""
from __future__ import annotations

import argparse
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import indexer
from jaxsparse._bench import cases as bench
from jaxsparse._bench.timing import COPY_TBPS, environment, print_table, write_json
from jaxsparse.prep import quantize_fp8
from pallas_kernels.indexer_decode.mgpu import decode_scores_mgpu


def check(pages, steps):
  """Max |error| / max |ref| for bf16 and fp8 q+k on a ragged case; -inf patterns must match."""
  q, kc, table, lens, w = bench.ragged_paged_case(np.random.default_rng(0))
  q8, qs = quantize_fp8(q)
  k8, ks = quantize_fp8(kc)
  errs = []
  for args in ((q, kc, table, lens, w, None), (q8, k8, table, lens, w * qs, ks),
               (q, k8, table, lens, w, ks)):
    got = np.asarray(jax.jit(lambda *a: decode_scores_mgpu(*a, pages=pages, steps=steps))(*args))
    ref = np.asarray(indexer.paged_indexer_scores(*args[:5], k_scale=args[5],
                                                  implementation="xla"))
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), fin):
      return float("inf")
    errs.append(float(np.abs(got[fin] - ref[fin]).max() / np.abs(ref[fin]).max()))
  return max(errs)


def _sparse_variants(configs, bsz, n, inputs, d, *, controls):
  """Block-sparse rows (60% of the pages) per tiling; with `controls`, the same page count as
  a contiguous selection (blocks 0..0.6 n) and as dense scoring with lengths 0.6 n."""
  from jaxsparse.backend import kernel_platform
  from pallas_kernels import indexer_decode
  q, kc, table, lens, w = inputs
  nbk = n // 64
  keep = int(0.6 * nbk)
  srng = np.random.default_rng(2)
  sel = np.full((bsz, nbk), -1, np.int32)
  for i in range(bsz):
    sel[i, :keep] = np.sort(srng.choice(nbk, keep, replace=False))
  contiguous = np.where(np.arange(nbk)[None] < keep, np.arange(nbk)[None], -1).repeat(bsz, 0)
  per_slot = (2 * d + 4) * keep / nbk
  counts = jnp.full((bsz,), keep, jnp.int32)
  plat = kernel_platform()
  out = [("triton sparse 60%", "bf16", "default",
          lambda q, kc, t, l, w, s: indexer_decode.block_sparse_scores(
              q[:, None], kc, t, l, w[:, None], s, counts, platform=plat)[0],
          (q, kc, table, lens, w, jnp.asarray(sel)), per_slot)]
  sels = [("random", sel)] + ([("contiguous", contiguous)] if controls else [])
  for spec in configs:
    pg, st = (int(x) for x in spec.split(":"))
    for name, sl in sels:
      sl = jnp.asarray(sl)
      phys = jnp.take_along_axis(table, jnp.maximum(sl, 0), axis=1)
      out.append((f"mosaic sparse 60% {name}", "bf16", spec,
                  lambda q, kc, t, l, w, s, pg=pg, st=st: decode_scores_mgpu(
                      q, kc, t, l, w, None, logical=s, pages=pg, steps=st),
                  (q, kc, phys, lens, w, sl), per_slot))
    if controls:
      out.append(("mosaic dense 60% lengths", "bf16", spec,
                  lambda q, kc, t, l, w, ks, pg=pg, st=st: decode_scores_mgpu(
                      q, kc, t, l, w, None, pages=pg, steps=st),
                  (q, kc, table, jnp.full_like(lens, keep * 64), w, None), per_slot))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--shapes", default="64x131072,8x1048576,1x1048576")
  p.add_argument("--configs", default="32:4,32:8",
                 help="pages:steps (pages per CTA, page gathers in flight), comma-separated")
  p.add_argument("--out", default="benchmarks/results/decode_mgpu_h200.json")
  p.add_argument("--dtypes", default="bf16,fp8 q+k,fp8 keys",
                 help="which key dtypes to time (bf16, fp8 q+k, fp8 keys), comma-separated")
  p.add_argument("--profile", type=int, default=0,
                 help="instead of timing, call each variant this many times (for ncu)")
  p.add_argument("--no-triton", action="store_true", help="skip the Triton rows")
  p.add_argument("--sparse-controls", action="store_true",
                 help="at 64x131072 also time the same 60%% of the pages as a contiguous "
                      "selection and as a dense call with 60%% lengths (where the block-sparse "
                      "kernel's time goes)")
  a = p.parse_args(argv)
  h, d = 64, 128
  checked = {}
  for spec in a.configs.split(","):
    pg, st = (int(x) for x in spec.split(":"))
    try:
      checked[spec] = (check(pg, st), "")
    except Exception as e:  # noqa: BLE001 - report, keep sweeping
      traceback.print_exc()
      checked[spec] = (float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    print(spec, checked[spec], flush=True)
  rows = []
  for shape in a.shapes.split(","):
    bsz, n = (int(x) for x in shape.split("x"))
    (_, _, (q, w, lens, table, kc)), = bench._paged_cases((bsz,), (n,), h, d, 0)
    k8 = (kc * 16).astype(jnp.float8_e4m3fn)  # values do not change the speed
    ks = jnp.full(k8.shape[:2], 1 / 16, jnp.float32)
    del kc
    kc = k8.astype(jnp.bfloat16)
    q8 = quantize_fp8(q)[0]
    slots = bsz * n
    variants = [
        ("triton", "bf16", "default", lambda q, kc, t, l, w, ks: indexer.paged_indexer_scores(
            q, kc, t, l, w, implementation="pallas"), (q, kc, table, lens, w, None), 2 * d + 4),
        ("triton", "fp8 keys", "default", lambda q, kc, t, l, w, ks: indexer.paged_indexer_scores(
            q, kc, t, l, w, k_scale=ks, implementation="pallas"), (q, k8, table, lens, w, ks),
         d + 8),
    ]
    for spec in a.configs.split(","):
      pg, st = (int(x) for x in spec.split(":"))
      f = (lambda q, kc, t, l, w, ks, pg=pg, st=st: decode_scores_mgpu(q, kc, t, l, w, ks,
                                                                        pages=pg, steps=st))
      variants += [("mosaic", "bf16", spec, f, (q, kc, table, lens, w, None), 2 * d + 4),
                   ("mosaic", "fp8 q+k", spec, f, (q8, k8, table, lens, w, ks), d + 8),
                   ("mosaic", "fp8 keys", spec, f, (q, k8, table, lens, w, ks), d + 8)]
    if bsz * n == 64 * 131072:  # SPIN's block-sparse scoring: 60% of the blocks, ascending
      variants += _sparse_variants(a.configs.split(","), bsz, n, (q, kc, table, lens, w), d,
                                   controls=a.sparse_controls)
    keep = set(a.dtypes.split(","))
    variants = [v for v in variants if v[1] in keep and not (a.no_triton and "triton" in v[0])]
    for impl, kd, spec, f, args, per_slot in variants:
      err = checked.get(spec, (float("nan"), ""))[1] if impl.startswith("mosaic") else ""
      sec = float("nan")
      if a.profile and not err:
        for _ in range(a.profile):
          jax.block_until_ready(jax.jit(f)(*args))
        print("profiled", impl, kd, spec, flush=True)
        continue
      kus = float("nan")
      if not err:
        sec, err = bench._timed(jax.jit(f), [args], reps=5, calls=10)
        kus = bench._kernel_us(jax.jit(f), args)
      tbps = slots * per_slot / sec / 1e12
      bench._emit(rows, dict(op="decode_mgpu", B=bsz, N=n, keys=kd, impl=impl, config=spec,
                             us=sec * 1e6, tbps=tbps, roofline=tbps / COPY_TBPS, kernel_us=kus,
                             kernel_tbps=slots * per_slot / kus / 1e6,
                             max_rel_err=checked.get(spec, (float("nan"),))[0]
                             if impl == "mosaic" else float("nan"), error=err))
    del kc, k8
  print_table(rows, ["B", "N", "keys", "impl", "config", "us", "tbps", "roofline", "kernel_us",
                     "kernel_tbps", "max_rel_err", "error"])
  write_json(a.out, dict(environment=environment(), rows=rows))


if __name__ == "__main__":
  main()

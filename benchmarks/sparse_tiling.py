"""Block-sparse decode scoring (SPIN) against dense scoring, per kernel tiling, on the H200.

Dense scoring of B x N slots and block-sparse scoring of a (1 - rho) fraction of the blocks,
picked at random per request (ascending, as SPIN compacts them), for several `DecodeConfig`
tilings. Reports time and effective TB/s (key
bytes read + scores written) so that the sparse kernel's efficiency can be compared with the
dense kernel's.

  python benchmarks/sparse_tiling.py --batch 64 --slots 131072 --sparsity 0.4
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import bench, spin
from jaxsparse.backend import kernel_platform
from jaxsparse.benchtools import environment, print_table, write_json
from pallas_kernels import indexer_decode


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--slots", type=int, default=131072)
  p.add_argument("--sparsity", type=float, default=0.4)
  p.add_argument("--configs", default="2:8,1:16,4:4,2:16,4:8,2:8:4:4,2:8:4:8",
                 help="pages_per_step:steps_per_program[:num_warps:num_stages], comma-separated")
  p.add_argument("--out", default="benchmarks/results/sparse_tiling_h200.json")
  a = p.parse_args(argv)
  bsz, n = a.batch, a.slots
  (_, _, (q, w, lens, table, kc)), = bench._paged_cases((bsz,), (n,), 64, 128, 0)
  nb = n // 64
  keep = int(np.ceil((1 - a.sparsity) * nb))
  width = spin._aligned_width(keep, nb)
  rng = np.random.default_rng(1)
  sel = np.full((bsz, width), -1, np.int32)
  for b in range(bsz):
    sel[b, :keep] = np.sort(rng.choice(nb, keep, replace=False))
  sel, counts = jnp.asarray(sel), jnp.full((bsz,), keep, jnp.int32)
  plat = kernel_platform()
  rows = []
  for spec in a.configs.split(","):
    parts = [int(x) for x in spec.split(":")]
    cfg = indexer_decode.DecodeConfig(*parts[:2], *(parts[2:3] or [4]),
                                      num_stages=parts[3] if len(parts) > 3 else None)
    dense = jax.jit(lambda q, kc, t, l, w, cfg=cfg: indexer_decode.decode_scores(
        q[:, None], kc, t, l, w[:, None], config=cfg, platform=plat))
    sparse = jax.jit(lambda q, kc, t, l, w, s, c, cfg=cfg: indexer_decode.block_sparse_scores(
        q[:, None], kc, t, l, w[:, None], s, c, config=cfg, platform=plat)[0])

    for name, f, args, carry, slots in (
        ("dense", dense, (q, kc, table, lens, w), None, bsz * n),
        ("sparse", sparse, (q, kc, table, lens, w, sel, counts), None, bsz * keep * 64)):
      sec, err = bench._timed(f, [args], reps=5, calls=10, carry=carry)
      tbps = slots * (128 * 2 + 4) / sec / 1e12
      row = dict(op="sparse_tiling", B=bsz, N=n, sparsity=a.sparsity, config=spec, kernel=name,
                 us=sec * 1e6, tbps=tbps, error=err)
      bench._emit(rows, row)
  print_table(rows, ["B", "N", "config", "kernel", "us", "tbps", "error"])
  write_json(a.out, dict(environment=environment(), rows=rows))


if __name__ == "__main__":
  main()

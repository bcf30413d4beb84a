"""SPIN's in-place update kernel: selected blocks per program (blocks_per_program) under A1
(block states + V, D) and A2 (block states only), with the top-K group maxima emitted as the
step does, at B requests x N slots, 40% target sparsity (selection of a warmed random state).

  python benchmarks/spin_update_bpp.py --out benchmarks/results/spin_update_bpp.json
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxsparse import spin
from jaxsparse.bench import _timed
from jaxsparse.benchtools import environment, print_table, write_json


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", default="benchmarks/results/spin_update_bpp.json")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--slots", type=int, default=131072)
  p.add_argument("--bpp", default="4,8,16,32")
  a = p.parse_args(argv)
  key = jax.random.PRNGKey(0)
  nb = a.slots // 64
  lens = jnp.full((a.batch,), a.slots, jnp.int32)
  rows = []
  for reduction in ("A2", "A1"):
    cfg = spin.SpinConfig(block_size=64, topk=2048, sparsity=0.4, reduction=reduction)
    st = spin.init_state(a.slots, cfg, (a.batch,))
    st = {**st, "VB": jax.random.normal(key, st["VB"].shape, st["VB"].dtype),
          "warm": jnp.ones_like(st["warm"])}
    width = spin._aligned_width(spin.max_selected_blocks(nb, cfg), nb)
    masks, sel, _, _ = spin.select_compact_batched(st, lens - 1, lens, cfg, key, width)
    z = jnp.where(jnp.repeat(sel, 64, axis=1) >= 0,
                  jax.random.normal(key, (a.batch, width * 64), jnp.float32), -jnp.inf)
    group = spin._fused_group(width * 64, cfg, None)
    for bpp in (int(v) for v in a.bpp.split(",")):
      f = jax.jit(lambda st, z, s, l, cfg=cfg, bpp=bpp: spin.update_batched(
          st, z, s, l - 1, l, cfg, group=group, blocks_per_program=bpp,
          interpret=jax.default_backend() == "cpu")[0])
      sec, err = _timed(f, [(st, z, sel, lens)], carry=(0, None))
      rows.append(dict(op="spin_update", B=a.batch, N=a.slots, reduction=reduction, bpp=bpp,
                       group=group, us=sec * 1e6, error=err))
  print_table(rows, ["B", "N", "reduction", "bpp", "group", "us", "error"])
  write_json(a.out, dict(environment=environment(), rows=rows))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

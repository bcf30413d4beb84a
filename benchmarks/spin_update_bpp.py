"""SPIN's kernel tiles: the in-place update kernel's selected blocks per program
(blocks_per_program) under A1 (block states + V, D) and A2 (block states only), with the top-K
group maxima emitted as the step does, at B requests x N slots, 40% target sparsity (selection
of a warmed random state), per blocks_per_program[:num_warps] (--kernel-time: in kernel time,
the state donated); with --score-tiles, also A1's block-score kernel per
blocks_per_program:num_warps, and with --select-warps the selection kernel per num_warps, in
kernel time (device trace; GPU only).

  python benchmarks/spin_update_bpp.py --out benchmarks/results/spin_update_bpp.json
  python benchmarks/spin_update_bpp.py --kernel-time --bpp 8:4,8:2 --score-tiles 64:4,64:2 \
      --select-warps 4,8,16
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxsparse import spin
from jaxsparse.bench import _timed
from jaxsparse.benchtools import environment, kernel_time, print_table, write_json


def _kernel_seconds(f, args, **kw):
  """(seconds per call from the device trace, "") or (nan, the error's first line): a tile
  that does not compile is a row, not a stop."""
  try:
    return kernel_time(f, args, **kw)[0], ""
  except Exception as e:  # noqa: BLE001
    return float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", default="benchmarks/results/spin_update_bpp.json")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--slots", type=int, default=131072)
  p.add_argument("--bpp", default="4,8,16,32",
                 help="update tiles: blocks per program, or blocks_per_program:num_warps")
  p.add_argument("--select-warps", default="",
                 help="comma list of num_warps for the selection kernel (A1, kernel time)")
  p.add_argument("--score-tiles", default="",
                 help="comma list of blocks_per_program:num_warps for A1's block-score kernel")
  p.add_argument("--skip-update", action="store_true", help="only the block-score tiles")
  p.add_argument("--kernel-time", action="store_true",
                 help="time the update tiles by the device trace (default: in-graph)")
  a = p.parse_args(argv)
  key = jax.random.PRNGKey(0)
  nb = a.slots // 64
  lens = jnp.full((a.batch,), a.slots, jnp.int32)
  rows = []
  for reduction in () if a.skip_update else ("A2", "A1"):
    cfg = spin.SpinConfig(block_size=64, topk=2048, sparsity=0.4, reduction=reduction)
    st = spin.init_state(a.slots, cfg, (a.batch,))
    st = {**st, "VB": jax.random.normal(key, st["VB"].shape, st["VB"].dtype),
          "warm": jnp.ones_like(st["warm"])}
    width = spin._aligned_width(spin.max_selected_blocks(nb, cfg), nb)
    masks, sel, _, _ = spin.select_compact_batched(st, lens - 1, lens, cfg, key, width)
    z = jnp.where(jnp.repeat(sel, 64, axis=1) >= 0,
                  jax.random.normal(key, (a.batch, width * 64), jnp.float32), -jnp.inf)
    group = spin._fused_group(width * 64, cfg, None)
    for tile in a.bpp.split(","):
      bpp, warps = (int(t) for t in (tile + ":4").split(":")[:2])
      f = jax.jit(lambda st, z, s, l, cfg=cfg, bpp=bpp, warps=warps: spin.update_batched(
          st, z, s, l - 1, l, cfg, group=group, blocks_per_program=bpp, num_warps=warps,
          interpret=jax.default_backend() == "cpu")[0])
      if a.kernel_time:  # the device trace, the state donated and threaded (in place)
        sec, err = _kernel_seconds(jax.jit(f, donate_argnums=0),
                                   (jax.tree.map(jnp.copy, st), z, sel, lens), carry=(0, None))
      else:
        sec, err = _timed(f, [(st, z, sel, lens)], carry=(0, None))
      rows.append(dict(op="spin_update", B=a.batch, N=a.slots, reduction=reduction, bpp=bpp,
                       num_warps=warps, group=group, us=sec * 1e6, error=err,
                       timing="kernel" if a.kernel_time else "in-graph"))
  if a.select_warps:
    cfg = spin.SpinConfig(block_size=64, topk=2048, sparsity=0.4)
    st = spin.init_state(a.slots, cfg, (a.batch,))
    st = {**st, "VM": jax.random.normal(key, st["VM"].shape, st["VM"].dtype),
          "warm": jnp.ones_like(st["warm"])}
    width = spin._aligned_width(spin.max_selected_blocks(nb, cfg), nb)
    table = jnp.tile(jnp.arange(nb, dtype=jnp.int32), (a.batch, 1))
    for warps in (int(v) for v in a.select_warps.split(",")):
      def sel_fn(st, l, t, warps=warps):  # the step's own call (A1 block scores included)
        return spin.select_compact_batched(st, None, l, cfg, key, width, kernel=True,
                                           block_table=t, num_pages=nb, advance_step=True,
                                           select_warps=warps)

      sec, err = _kernel_seconds(jax.jit(sel_fn), (st, lens, table))
      rows.append(dict(op="spin_select", B=a.batch, N=a.slots, reduction="A1", num_warps=warps,
                       us=sec * 1e6, error=err, timing="kernel"))
  if a.score_tiles:
    from pallas_kernels.spin import block_scores_max_gpu
    v, d = (jax.random.normal(jax.random.PRNGKey(i), (a.batch, a.slots), jnp.bfloat16)
            for i in (1, 2))
    vm = v.reshape(a.batch, -1, 64).max(-1)
    lens = jnp.asarray(jax.random.randint(key, (a.batch,), a.slots // 2, a.slots + 1), jnp.int32)
    for tile in a.score_tiles.split(","):
      bpp, warps = (int(t) for t in tile.split(":"))
      f = jax.jit(lambda vm, v, d, l, bpp=bpp, warps=warps: block_scores_max_gpu(
          vm, v, d, l - 1, l, page=64, blocks_per_program=bpp, num_warps=warps))
      sec, err = _kernel_seconds(f, (vm, v, d, lens))
      # bytes: D (bf16) and VM; V's newest block only
      rows.append(dict(op="spin_block_scores", B=a.batch, N=a.slots, reduction="A1", bpp=bpp,
                       num_warps=warps, us=sec * 1e6,
                       gbps=(2 * a.batch * a.slots + a.batch * a.slots // 32) / sec / 1e9,
                       error=err))
  print_table(rows, ["op", "B", "N", "reduction", "bpp", "num_warps", "group", "timing", "us",
                     "error"])
  write_json(a.out, dict(environment=environment(), rows=rows))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

"""Run one indexer kernel a few times (for `ncu`): decode bf16 / fp8 / fp8 q+k, or prefill;
or a whole top-K call (sorted / set) or SPIN step, to list every kernel they launch.

  ncu --clock-control none -k regex:jaxsparse --launch-skip 2 --launch-count 1 \\
      python benchmarks/profile_one.py decode-fp8
  ncu --clock-control none --metrics gpu__time_duration.sum python benchmarks/profile_one.py topk
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import indexer
from jaxsparse.prep import quantize_fp8


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("what", choices=("decode-bf16", "decode-fp8", "decode-fp8qk", "prefill",
                                  "topk", "topk-set", "spin"))
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--slots", type=int, default=131072)
  p.add_argument("--calls", type=int, default=4)
  p.add_argument("--compact", default="scan", choices=("scan", "lane"),
                 help="topk: TopkConfig.compact")
  p.add_argument("--reduction", default="A1", choices=("A0", "A1", "A2"), help="SPIN's (spin)")
  p.add_argument("--hlo", default="",
                 help="spin: also write the compiled (optimised) HLO of the step to this file")
  a = p.parse_args(argv)
  key = jax.random.PRNGKey(0)
  h, d = 64, 128
  if a.what in ("topk", "topk-set"):
    from jaxsparse import selection
    from pallas_kernels.topk import TopkConfig
    x = jax.random.normal(key, (a.batch, a.slots), jnp.float32)
    cfg = TopkConfig(compact=a.compact)
    f = jax.jit(lambda x: selection.topk(x, 2048, sorted=a.what == "topk", config=cfg))
    args = (x,)
  elif a.what == "spin":
    from jaxsparse import spin
    b, n = a.batch, a.slots
    pages = n // 64
    q = jax.random.normal(key, (b, h, d), jnp.bfloat16)
    w = jnp.ones((b, h), jnp.float32)
    kc = jax.random.normal(key, (b * pages, 64, d), jnp.bfloat16)
    rng = np.random.default_rng(0)
    table = jnp.asarray(np.stack([rng.permutation(pages) + i * pages for i in range(b)]), jnp.int32)
    lens = jnp.full((b,), n, jnp.int32)
    cfg = spin.SpinConfig(topk=2048, sparsity=0.4, reduction=a.reduction)
    st = spin.init_state(n, cfg, (b,))
    st = spin.decode_step(st, q, kc, table, lens, w, cfg, key, warm=False)[2]
    # the arrays are arguments, not constants captured by the trace (2 GB of cache)
    step = jax.jit(lambda st, *xs: spin.decode_step(st, *xs, cfg, key, warm=True)[2],
                   donate_argnums=0)
    xs = (q, kc, table, lens, w)
    if a.hlo:
      with open(a.hlo, "w") as fh:
        fh.write(step.lower(st, *xs).compile().as_text())
    for _ in range(a.calls):
      st = jax.block_until_ready(step(st, *xs))
    print("done", a.what)
    return
  elif a.what == "prefill":
    t, n = 2048, a.slots
    q = jax.random.normal(key, (t, h, d), jnp.bfloat16)
    k = jax.random.normal(key, (n, d), jnp.bfloat16)
    w = jnp.ones((t, h), jnp.float32)
    pos = jnp.arange(n - t, n, dtype=jnp.int32)
    f = jax.jit(lambda q, k, w, p: indexer.indexer_scores(q, k, w, query_positions=p))
    args = (q, k, w, pos)
  else:
    b, n = a.batch, a.slots
    pages = n // 64
    q = jax.random.normal(key, (b, h, d), jnp.bfloat16)
    w = jnp.ones((b, h), jnp.float32)
    kc = jax.random.normal(key, (b * pages, 64, d), jnp.bfloat16)
    ks = None
    if a.what != "decode-bf16":
      kc, ks = (kc * 16).astype(jnp.float8_e4m3fn), jnp.full((b * pages, 64), 1 / 16, jnp.float32)
    if a.what == "decode-fp8qk":
      q = quantize_fp8(q)[0]
    rng = np.random.default_rng(0)
    table = jnp.asarray(np.stack([rng.permutation(pages) + i * pages for i in range(b)]), jnp.int32)
    lens = jnp.full((b,), n, jnp.int32)
    f = jax.jit(lambda q, kc, t, l, w, ks: indexer.paged_indexer_scores(q, kc, t, l, w, k_scale=ks))
    args = (q, kc, table, lens, w, ks)
  for _ in range(a.calls):
    jax.block_until_ready(f(*args))
  print("done", a.what)


if __name__ == "__main__":
  main()

"""`jaxsparse.prefill_topk` (kernel path) against the scoring kernel alone and against scoring
followed by `jaxsparse.topk` on the materialised [T, N] matrix: kernel time (device trace),
extra device memory (the compiled program's temporaries) and agreement, at T queries (the last
T positions of an N-token context) and N keys. DeepSeek-V3.2 shapes by default: H 64, D 128,
bf16 q and k, top-2048. Writes JSON.

  python benchmarks/bench_prefill_topk.py --keys 65536,262144,1048576 --out r.json
  python benchmarks/bench_prefill_topk.py --quick --out r.json      (CPU check: wall clock)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jaxsparse  # noqa: E402
from jaxsparse._bench.timing import environment, kernel_time, print_table, write_json  # noqa: E402


def case(t, n, h, d, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((t, h, d), np.float32), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((n, d), np.float32), jnp.bfloat16)
  w = jnp.asarray(rng.uniform(0, 1, (t, h)), jnp.float32)
  pos = jnp.arange(n - t, n, dtype=jnp.int32)
  return q, k, w, pos


def temp_bytes(fn, args) -> int:
  """Bytes of temporaries XLA allocates for `fn(*args)` besides its arguments and outputs."""
  mem = fn.lower(*args).compile().memory_analysis()
  return int(mem.temp_size_in_bytes)


def seconds(fn, args, quick: bool) -> float:
  if quick:  # no device trace on the CPU: wall clock of one call after a warm-up
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0
  return kernel_time(fn, args, calls=5, warmup=1)[0]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--queries", type=int, default=2048)
  p.add_argument("--keys", default="65536,262144,1048576")
  p.add_argument("--heads", type=int, default=64)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--topk", type=int, default=2048)
  p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU check")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  if a.quick:
    a.queries, a.keys, a.heads, a.dim, a.topk = 64, "2048,4096", 4, 32, 64
  impl = "xla" if a.quick else None  # the CPU check runs the plain-JAX path
  k_ = a.topk
  fused = jax.jit(lambda q, k, w, p: jaxsparse.prefill_topk(q, k, w, k_, query_positions=p,
                                                            implementation=impl))
  scores = jax.jit(lambda q, k, w, p: jaxsparse.indexer_scores(q, k, w, query_positions=p,
                                                               implementation=impl))
  two_pass = jax.jit(lambda q, k, w, p: jaxsparse.topk(
      jaxsparse.indexer_scores(q, k, w, query_positions=p, implementation=impl), k_,
      implementation=impl))
  rows = []
  for n in (int(v) for v in a.keys.split(",")):
    args = case(a.queries, n, a.heads, a.dim, seed=n)
    dense = a.queries * n * 4
    flops = 2 * a.queries * n * a.heads * a.dim
    row = dict(T=a.queries, N=n, scores_bytes=dense)
    for name, fn in (("fused", fused), ("scores", scores), ("two_pass", two_pass)):
      row[f"{name}_temp_bytes"] = temp_bytes(fn, args)
      row[f"{name}_ms"] = seconds(fn, args, a.quick) * 1e3
    _, i_f = fused(*args)
    _, i_t = two_pass(*args)
    row["same_indices"] = float(np.mean(np.asarray(i_f) == np.asarray(i_t)))
    row["fused_temp_frac"] = row["fused_temp_bytes"] / dense
    row["fused_time_vs_scores"] = row["fused_ms"] / row["scores_ms"]
    row["fused_time_vs_two_pass"] = row["fused_ms"] / row["two_pass_ms"]
    row["scores_tflops"] = flops / row["scores_ms"] * 1e-9
    rows.append(row)
    print(f"N={n}: fused {row['fused_ms']:.2f} ms ({row['fused_time_vs_scores']:.2f}x scoring, "
          f"{row['fused_time_vs_two_pass']:.2f}x two-pass), temp {row['fused_temp_frac']:.3f} of "
          f"T x N x 4, same indices {row['same_indices']:.4f}", flush=True)
  print_table(rows, ["N", "fused_ms", "scores_ms", "two_pass_ms", "fused_time_vs_scores",
                     "fused_time_vs_two_pass", "fused_temp_frac", "same_indices"])
  timing = "wall clock, one call (CPU)" if a.quick else "kernel time (device trace), 5 calls"
  write_json(a.out, {"environment": {**environment(), "command": " ".join(sys.argv),
                                     "timing": timing},
                     "config": vars(a), "rows": rows})


if __name__ == "__main__":
  main()

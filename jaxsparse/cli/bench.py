"""`jaxsparse bench`: kernel timings at small shapes, or sharded prefill throughput."""
from __future__ import annotations

import os

from ._common import (FORMATTER, PLOT_FORMATS, CliError, check_out, check_plot,
                      check_power_of_two, check_topk, fill_defaults, int_list, positive,
                      reject_given, str_list)

__all__ = ["HELP", "add_parser", "run"]

HELP = """\
Time the indexer kernels at small shapes: paged decode scoring (bf16 and fp8 keys), causal
prefill scoring and exact top-K, each against plain jnp / lax.top_k in the same run. On a
machine without a GPU or TPU the Pallas kernels run in interpret mode: the figures there check
the plumbing, not the speed.

examples:
  jaxsparse bench
  jaxsparse bench --slots 65536 --k 2048 --out bench.json      (on a GPU)
  jaxsparse bench prefill --devices 8 --tokens 65536,262144 --out prefill.json
      (also draws prefill.png: tokens / s against devices; --plot names another file)
"""

KERNELS = {"slots": 8192, "chunk": 256, "implementation": "pallas"}
PREFILL = {"devices": 1, "tokens": [4096, 8192], "strategies": ["allgather", "ring"], "reps": 2,
           "dtype": "bfloat16", "plot": ""}


def add_parser(sub) -> None:
  """Register the command on the top-level parser's subparsers."""
  b = sub.add_parser("bench", help="time the indexer kernels at small shapes",
                     description=HELP, formatter_class=FORMATTER)
  b.add_argument("what", nargs="?", choices=("kernels", "prefill"), default="kernels",
                 help="kernels (default): the kernel timings; prefill: sharded indexer "
                 "prefill throughput against context and device count, beside one device's "
                 "prefill_topk over all keys (unsharded) and causal_prefill_topk")
  b.add_argument("--devices", type=positive("--devices"), default=None,
                 help="prefill: up to this many devices (1, 2, 4, ...; default 1)")
  b.add_argument("--tokens", type=int_list("--tokens"), default=None,
                 help="prefill: context lengths, comma list (default 4096,8192)")
  b.add_argument("--strategies", type=str_list("--strategies"), default=None,
                 help="prefill: key exchanges, comma list (default allgather,ring)")
  b.add_argument("--reps", type=positive("--reps"), default=None,
                 help="prefill: timed runs per row (default 2)")
  b.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                 help="prefill: q and k dtype (default bfloat16)")
  b.add_argument("--slots", type=positive("--slots"), default=None,
                 help="kernels: decode context slots (default 8192)")
  b.add_argument("--chunk", type=positive("--chunk"), default=None,
                 help="kernels: prefill queries (default 256)")
  b.add_argument("--heads", type=positive("--heads"), default=16,
                 help="indexer heads (default 16)")
  b.add_argument("--head-dim", type=positive("--head-dim"), default=64,
                 help="indexer head dim (default 64)")
  b.add_argument("--k", type=positive("--k"), default=256, help="top-K size (default 256)")
  b.add_argument("--implementation", choices=("auto", "pallas", "xla"), default=None,
                 help="kernels: kernel path to time against plain jnp (default pallas)")
  b.add_argument("--out", default="", help="also write the rows as JSON here, a .json file "
                 "(default none)")
  b.add_argument("--plot", default=None, help="prefill: draw tokens / s against devices here "
                 f"({', '.join(PLOT_FORMATS)}; default: with --out, its name with .png)")
  b.set_defaults(func=run)


def run(args) -> int:
  mine, other = (PREFILL, KERNELS) if args.what == "prefill" else (KERNELS, PREFILL)
  reject_given(args, other, f"to `bench {args.what}`")
  fill_defaults(args, mine)
  check_out("--out", args.out, (".json",))
  if args.what == "prefill":
    if args.out and not args.plot:
      args.plot = os.path.splitext(args.out)[0] + ".png"
    check_plot("--plot", args.plot)
    return _run_prefill(args)
  check_power_of_two("--head-dim", args.head_dim, 16, 256)
  check_power_of_two("--heads", args.heads, 1, 128)
  if args.slots % 64:
    raise CliError(f"--slots={args.slots} must be a multiple of the 64-slot page")
  check_topk(args.k, args.slots, f"--slots={args.slots}")
  if args.chunk > args.slots // 4:
    raise CliError(f"--chunk={args.chunk} must not exceed the prefill's --slots / 4 = "
                   f"{args.slots // 4} keys")
  from jaxsparse._bench import cases as bench
  from jaxsparse._bench.timing import environment, print_table, write_json
  impl = None if args.implementation == "auto" else args.implementation
  from rich.console import Console
  status = Console(stderr=True).status("timing")
  with bench.rows_not_echoed(), status:
    print(f"decode scoring: B = 1, 2 rows x {args.slots} slots, {args.heads} heads x "
          f"{args.head_dim} dims; time per call (us), tbps = bytes read / time")
    status.update("timing decode scoring")
    rows = bench.bench_decode((1, 2), (args.slots,), heads=args.heads, head_dim=args.head_dim,
                              key_dtypes=("bfloat16", "float8_e4m3fn"), implementation=impl,
                              reps=2, calls=3)
    print_table(rows, ["B", "N", "keys", "impl", "us", "tbps", "speedup_vs_jnp"])
    print(f"prefill scoring: {args.chunk} causal queries x {args.slots // 4} keys")
    status.update("timing prefill scoring")
    pre = bench.bench_prefill((args.slots // 4,), chunk=args.chunk, heads=args.heads,
                              head_dim=args.head_dim, implementation=impl, reps=2, calls=2)
    print_table(pre, ["T", "N", "keys", "impl", "ms", "tflops", "speedup_vs_jnp"])
    print(f"exact top-K: 2 rows x {args.slots}, K = {args.k}")
    status.update("timing exact top-K")
    top = bench.bench_topk((2,), (args.slots,), (args.k,), approx=False, torch_topk=False,
                           reps=2, calls=3)
    print_table(top, ["B", "N", "K", "impl", "us", "speedup_vs_lax_top_k"])
  print("speedup_vs_jnp / speedup_vs_lax_top_k: the plain-JAX path's time / this row's, in the "
        "same run (> 1: faster)")
  if args.out:
    write_json(args.out, dict(environment=environment(), rows=rows + pre + top))
    print(f"wrote {args.out}")
  return 0


def _run_prefill(args) -> int:
  check_topk(args.k, min(args.tokens), f"the smallest --tokens ({min(args.tokens)})")
  from jaxsparse.distributed import STRATEGIES
  bad = [s for s in args.strategies if s not in STRATEGIES]
  if bad or not args.strategies:
    raise CliError(f"--strategies {bad or args.strategies} must be taken from {STRATEGIES}")
  import jax
  avail = len(jax.devices())
  if args.devices > avail:
    raise CliError(f"--devices={args.devices} but {avail} device(s) are visible (on a CPU, "
                   f"emulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N)")
  import time

  import numpy as np
  from jaxsparse._bench.timing import environment, print_table, write_json
  from jaxsparse.distributed import sharded_prefill_topk
  import jax.numpy as jnp

  import jaxsparse
  counts = [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= args.devices]
  rows = []
  dt = jnp.dtype(args.dtype)
  from rich.console import Console
  with Console(stderr=True).status("timing sharded prefill") as st:
    for n in args.tokens:
      kq, kw, kk = jax.random.split(jax.random.key(n), 3)  # drawn on the device
      q = jax.random.normal(kq, (n, args.heads, args.head_dim), dt)
      w = jax.random.uniform(kw, (n, args.heads), jnp.float32)
      k = jax.random.normal(kk, (n, args.head_dim), dt)
      def timed(devices, strategy, fn):
        fn()  # compile
        t0 = time.perf_counter()
        for _ in range(args.reps):
          fn()
        sec = (time.perf_counter() - t0) / args.reps
        rows.append({"tokens": n, "devices": devices, "strategy": strategy, "s": sec,
                     "tokens_per_s": n / sec})

      st.update(f"timing {n:,} tokens unsharded")
      timed(1, "unsharded", lambda: jax.block_until_ready(jaxsparse.prefill_topk(
          q, k, w, args.k, query_positions=jnp.arange(n, dtype=jnp.int32))))
      st.update(f"timing {n:,} tokens unsharded, causal segments")
      timed(1, "causal_segments",
            lambda: jax.block_until_ready(jaxsparse.causal_prefill_topk(q, k, w, args.k)))
      for p in counts:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), ("x",))
        for strategy in args.strategies:
          st.update(f"timing {n:,} tokens on {p} device(s), {strategy}")
          timed(p, strategy, lambda: jax.block_until_ready(sharded_prefill_topk(
              q, k, w, args.k, mesh=mesh, strategy=strategy)))  # noqa: B023
  for r in rows:
    one = next(x for x in rows if x["tokens"] == r["tokens"] and x["devices"] == 1
               and x["strategy"] == r["strategy"])
    base = next(x for x in rows if x["tokens"] == r["tokens"] and x["strategy"] == "unsharded")
    r["speedup"] = one["s"] / r["s"]
    r["efficiency"] = r["speedup"] / r["devices"]
    r["speedup_vs_unsharded"] = base["s"] / r["s"]  # < 1 at 1 device: the sharding overhead
  print_table([{**r, "s": f"{r['s']:.3f}", "tokens_per_s": f"{r['tokens_per_s']:,.0f}",
                "speedup": f"{r['speedup']:.2f}", "efficiency": f"{r['efficiency']:.0%}",
                "speedup_vs_unsharded": f"{r['speedup_vs_unsharded']:.2f}"}
               for r in rows],
              ["tokens", "devices", "strategy", "s", "tokens_per_s", "speedup", "efficiency",
               "speedup_vs_unsharded"])
  print(f"indexer prefill (scores + exact top-{args.k} for every query), host wall clock "
        f"on {jax.devices()[0].platform}; speedup: time on one device / time here (> 1: faster); "
        f"efficiency = speedup / devices; speedup_vs_unsharded: the unsharded row's time / "
        f"time here (> 1: faster)")
  if args.out:
    write_json(args.out, dict(environment=environment(), rows=rows, k=args.k,
                              heads=args.heads, head_dim=args.head_dim, dtype=args.dtype))
    print(f"wrote {args.out}")
  if args.plot:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in args.tokens:
      for strategy in args.strategies:  # the unsharded row is one point: the table has it
        rr = [r for r in rows if r["tokens"] == n and r["strategy"] == strategy]
        ax.plot([r["devices"] for r in rr], [r["tokens_per_s"] for r in rr], marker="o",
                label=f"{n:,} tokens, {strategy}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens / s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")
  return 0

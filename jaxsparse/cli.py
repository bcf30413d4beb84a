"""The `jaxsparse` command line: one entry point, one subcommand per capability."""
from __future__ import annotations

import argparse
import sys

MAIN_JOB_HELP = """\
Run the indexer benchmark at small shapes: paged decode scoring (bf16 and fp8 keys), causal
prefill scoring and exact top-K, each against plain jnp / lax.top_k in the same run.
On a CPU-only machine the Pallas kernels run in interpret mode (slow but exact), so the
figures there check the plumbing, not the speed; on a GPU or TPU they are real timings.
"""


def _bench(args) -> int:
  from jaxsparse import bench
  from jaxsparse.benchtools import environment, print_table, write_json
  impl = None if args.implementation == "auto" else args.implementation
  rows = bench.bench_decode((1, 2), (args.slots,), heads=args.heads, head_dim=args.head_dim,
                            key_dtypes=("bfloat16", "float8_e4m3fn"), implementation=impl,
                            reps=2, calls=3)
  print_table(rows, ["B", "N", "keys", "impl", "us", "tbps", "vs_jnp"])
  pre = bench.bench_prefill((args.slots // 4,), chunk=args.chunk, heads=args.heads,
                            head_dim=args.head_dim, implementation=impl, reps=2, calls=2)
  print_table(pre, ["T", "N", "keys", "impl", "ms", "tflops", "vs_jnp"])
  top = bench.bench_topk((2,), (args.slots,), (args.k,), approx=False, torch_topk=False,
                         reps=2, calls=3)
  print_table(top, ["B", "N", "K", "impl", "us", "vs_lax_top_k"])
  if args.out:
    write_json(args.out, dict(environment=environment(), rows=rows + pre + top))
    print(f"wrote {args.out}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jaxsparse",
      description="DeepSeek Sparse Attention indexer tools: benchmarks (more subcommands come "
                  "with each capability: eval, trace, spin).")
  sub = p.add_subparsers(dest="command", required=True)
  b = sub.add_parser("bench", help="small indexer + top-K benchmark (the main job)",
                     description=MAIN_JOB_HELP, formatter_class=argparse.RawTextHelpFormatter)
  b.add_argument("--slots", type=int, default=8192, help="decode context slots (default 8192)")
  b.add_argument("--chunk", type=int, default=256, help="prefill queries (default 256)")
  b.add_argument("--heads", type=int, default=16, help="indexer heads (default 16)")
  b.add_argument("--head-dim", type=int, default=64, help="indexer head dim (default 64)")
  b.add_argument("--k", type=int, default=256, help="top-K size (default 256)")
  b.add_argument("--implementation", choices=("auto", "pallas", "xla"), default="pallas",
                 help="kernel path to time against plain jnp (default pallas)")
  b.add_argument("--out", default="", help="also write the rows as JSON here")
  b.set_defaults(func=_bench)
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  for name in ("slots", "chunk", "heads", "head_dim", "k"):
    v = getattr(args, name, None)
    if v is not None and v < 1:
      print(f"error: --{name.replace('_', '-')}={v} must be positive", file=sys.stderr)
      return 2
  if getattr(args, "slots", 64) % 64:
    print(f"error: --slots={args.slots} must be a multiple of the 64-slot page", file=sys.stderr)
    return 2
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())

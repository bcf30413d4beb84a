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


def _eval(args) -> int:
  from jaxsparse import evaluate, traces
  from jaxsparse.benchtools import print_table, write_json
  path = args.trace or traces.default_trace_path()
  tr = traces.load(path)
  if tr.kind != "decode":
    print(f"error: --trace {path} is a {tr.kind} trace; eval replays decode traces",
          file=sys.stderr)
    return 2
  impl = None if args.implementation == "auto" else args.implementation
  from jaxsparse import spin
  try:
    rhos = [float(v) for v in args.sparsities.split(",") if v.strip()]
    spins = [(f"SPIN {int(round(100 * rho))}% (b={args.block_size})",
              spin.SpinConfig(block_size=args.block_size, topk=args.k, sparsity=rho,
                              explore=args.explore, reduction=args.reduction,
                              pooling=args.pooling)) for rho in rhos]
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  rows = evaluate.decode_baselines(tr, args.k, implementation=impl, spin_configs=spins)
  print(f"trace {path}: layers {tr.layers.tolist()}, {tr.q.shape[1]} steps, R={tr.rows}, "
        f"slots {int(tr.lengths[0])}..{int(tr.lengths[-1])}"
        + (" (extrapolated past the trained context)" if tr.meta.get("extrapolated") else ""))
  print_table(rows, ["method", "recall", "mean_miss", "p99_miss", "sparsity", "us_per_step"])
  if args.out:
    from jaxsparse.benchtools import environment
    write_json(args.out, dict(environment=environment(), trace=path, meta=tr.meta, k=args.k,
                              rows=rows))
  return 0


def _trace(args) -> int:
  from jaxsparse import traces
  from jaxsparse.model import gguf_weights, llama, record
  from train.indexer import load_indexers
  with open(args.text, encoding="utf-8") as f:
    ids = gguf_weights.tokenizer().encode(f.read()).ids
  base = llama.load_model()
  idx = load_indexers(args.indexers)
  layers = [int(v) for v in args.layers.split(",")] if args.layers else None
  if args.kind == "decode":
    tr = record.record_decode(base, idx, ids, prompt_len=args.prompt_len, steps=args.steps,
                              rows=args.rows, layers=layers, source=args.text)
  else:
    tr = record.record_prefill(base, idx, ids[: args.tokens], layers=layers, source=args.text)
  traces.save(args.out, tr)
  print(f"wrote {args.out} ({tr.kind}, layers {tr.layers.tolist()}, q {tr.q.shape}"
        + (", extrapolated" if tr.meta["extrapolated"] else "") + ")")
  return 0


def _train_indexer(args) -> int:
  from train import indexer
  return indexer.main(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jaxsparse",
      description="DeepSeek Sparse Attention indexer tools: kernels benchmark (bench), the real "
                  "model's indexers (train-indexer), traces (trace) and their replay (eval).")
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

  e = sub.add_parser("eval", help="replay a decode trace through full DSA and the selection "
                     "methods; print recall, miss, sparsity and speed")
  e.add_argument("--trace", default="", help="decode trace .npz (default: the shipped one)")
  e.add_argument("--k", type=int, default=64, help="top-K size (default 64)")
  e.add_argument("--block-size", type=int, default=16,
                 help="SPIN block size for the replay (default 16: the shipped trace has ~1K "
                      "slots, so 16-slot blocks give SPIN as many blocks as 64-slot blocks do "
                      "at 4K)")
  e.add_argument("--sparsities", default="0.2,0.4",
                 help="SPIN target block sparsities to replay (comma list, default 0.2,0.4)")
  e.add_argument("--explore", default="random", help="SPIN exploration policy (random, "
                 "staleness, block-age, none)")
  e.add_argument("--reduction", default="A1", help="SPIN block reduction (A0, A1, A2)")
  e.add_argument("--pooling", default="max", help="SPIN block pooling (max, top4, mean)")
  e.add_argument("--implementation", choices=("auto", "pallas", "xla"), default="auto")
  e.add_argument("--out", default="", help="also write the table as JSON here")
  e.set_defaults(func=_eval)

  t = sub.add_parser("trace", help="record a decode or prefill trace from a text file with the "
                     "real model (SmolLM2-135M) and trained indexers")
  t.add_argument("kind", choices=("decode", "prefill"))
  t.add_argument("--text", required=True, help="UTF-8 text file")
  t.add_argument("--indexers", required=True, help="output folder of `jaxsparse train-indexer`")
  t.add_argument("--out", required=True, help="trace .npz to write")
  t.add_argument("--layers", default="", help="comma list of layers (default: all)")
  t.add_argument("--prompt-len", type=int, default=1024, help="decode: slots before step 0")
  t.add_argument("--steps", type=int, default=256, help="decode: steps")
  t.add_argument("--rows", type=int, default=1, help="decode: verifier rows (R = drafts + 1)")
  t.add_argument("--tokens", type=int, default=4096, help="prefill: tokens")
  t.set_defaults(func=_trace)

  r = sub.add_parser("train-indexer", help="train the lightning indexers (dense warm-up); "
                     "options as `python -m train.indexer --help`", add_help=False)
  r.add_argument("rest", nargs=argparse.REMAINDER)
  r.set_defaults(func=_train_indexer)
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  for name in ("slots", "chunk", "heads", "head_dim", "k", "steps", "rows", "prompt_len",
               "tokens"):
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

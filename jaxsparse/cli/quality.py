"""`jaxsparse quality`: dense vs DSA perplexity and per-layer attention recall on a text."""
from __future__ import annotations

from ._common import (FORMATTER, MODEL_CONTEXT, CliError, check_text, check_writable,
                      indexers_path, int_list, load_indexers, positive)

__all__ = ["HELP", "add_parser", "run"]

HELP = """\
Measure the real DSA model on any text: perplexity with dense attention against attention
restricted to each layer's indexer top-K (whole window and second half), and per layer the
attention mass the indexer's top-K keeps beside the true top-K's (the ceiling). Runs in query
chunks: 8,192 tokens fit in a few GB of CPU memory (about 4 minutes on 2 cores for k = 64,256).

examples:
  jaxsparse quality --text book.txt --tokens 4096
  jaxsparse quality --text book.txt --tokens 8192 --k 64,256 --out q.json
"""


def add_parser(sub) -> None:
  """Register the command on the top-level parser's subparsers."""
  q = sub.add_parser("quality", help="dense vs DSA perplexity and per-layer recall on a text",
                     description=HELP, formatter_class=FORMATTER)
  q.add_argument("--text", required=True, help="UTF-8 text file")
  q.add_argument("--tokens", type=positive("--tokens"), required=True,
                 help=f"window length in tokens (at most {MODEL_CONTEXT})")
  q.add_argument("--k", type=int_list("--k"), default=[64, 256],
                 help="top-K sizes, comma list (default 64,256)")
  q.add_argument("--windows", type=positive("--windows"), default=1,
                 help="consecutive windows to pool (default 1)")
  q.add_argument("--indexers", default="", help="indexers.npz (default: the shipped ones)")
  q.add_argument("--chunk", type=positive("--chunk"), default=512,
                 help="queries per chunk (memory ~ chunk x tokens; default 512)")
  q.add_argument("--oracle", action="store_true", help="also run attention restricted to its "
                 "own true top-K per layer (the ceiling of any K-key selection)")
  q.add_argument("--out", default="", help="also write the figures as JSON here")
  q.set_defaults(func=run)


def run(args) -> int:
  if args.tokens > MODEL_CONTEXT:
    raise CliError(f"--tokens={args.tokens} exceeds the model's {MODEL_CONTEXT}-token context")
  if max(args.k) >= args.tokens:
    raise CliError(f"--k={max(args.k)} must be below --tokens={args.tokens}")
  s = check_text("--text", args.text)
  ipath = indexers_path("--indexers", args.indexers)
  check_writable("--out", args.out)
  idx = load_indexers("--indexers", ipath)
  from jaxsparse.model import gguf_weights
  ids = gguf_weights.tokenizer().encode(s).ids
  need = args.tokens * args.windows
  if len(ids) < need:
    raise CliError(f"--text={args.text!r} has {len(ids):,} tokens; --tokens x --windows needs "
                   f"{need:,}")
  from jaxsparse import quality
  from jaxsparse._bench.timing import environment, write_json
  from jaxsparse.model import llama
  base = llama.load_model()
  wins = [ids[i * args.tokens:(i + 1) * args.tokens] for i in range(args.windows)]
  from rich.console import Console
  con = Console(stderr=True)
  with con.status("measuring") as st:
    q = quality.measure(base, idx, wins, ks=tuple(args.k), chunk=args.chunk,
                        progress=lambda m: st.update(m), oracle=args.oracle)
  _print(q)
  if args.out:
    write_json(args.out, dict(environment=environment(), text=args.text,
                              indexers=ipath, **q))
    print(f"wrote {args.out}")
  return 0


def _print(q):
  from jaxsparse._bench.timing import print_table
  ks = q["ks"]
  print(f"{q['windows']} window(s) of {q['tokens']:,} tokens")
  rows = []
  for name in q["perplexity"]:
    d0, h0 = q["perplexity"]["dense"], q["second_half"]["dense"]
    p, h = q["perplexity"][name], q["second_half"][name]
    label = ("dense" if name == "dense" else f"DSA top-{name[7:]}" if name.startswith("dsa")
             else f"true top-{name[10:]}")
    rows.append({"attention": label,
                 "perplexity": f"{p:.3f}", "vs dense": f"{p / d0 - 1:+.1%}",
                 "2nd half": f"{h:.3f}", "2nd half vs dense": f"{h / h0 - 1:+.1%}"})
  print_table(rows, ["attention", "perplexity", "vs dense", "2nd half", "2nd half vs dense"])
  layer_rows = []
  for i in range(len(q["zero_share"])):
    r = {"layer": i}
    for k in ks:
      r[f"indexer top-{k}"] = f"{q[f'recall_top{k}'][i]:.3f}"
      r[f"true top-{k}"] = f"{q[f'true_top{k}'][i]:.3f}"
    r["zero scores"] = f"{q['zero_share'][i]:.2%}"
    layer_rows.append(r)
  cols = ["layer"] + [c for k in ks for c in (f"indexer top-{k}", f"true top-{k}")] + \
      ["zero scores"]
  print_table(layer_rows, cols)
  print("indexer/true top-k: attention mass (summed over heads, rows sum to 1) on the "
        "indexer's / the attention's own k best keys, mean over queries with more than k "
        "visible keys; zero scores: share of visible indexer scores exactly 0 (a dead layer "
        "scores everything 0)")
  k = max(ks)
  rec = q[f"recall_top{k}"]
  worst = min(range(len(rec)), key=rec.__getitem__)
  print(f"summary  DSA top-{k} perplexity {q['perplexity'][f'dsa_top{k}']:.2f} vs dense "
        f"{q['perplexity']['dense']:.2f} "
        f"({q['perplexity'][f'dsa_top{k}'] / q['perplexity']['dense'] - 1:+.1%}); indexer "
        f"top-{k} keeps {sum(rec) / len(rec):.1%} of the attention mass on average, "
        f"{rec[worst]:.1%} on layer {worst} (true top-{k}: {q[f'true_top{k}'][worst]:.1%}).")

"""`jaxsparse quality`: dense vs DSA perplexity and per-layer attention recall on a text, and
every selection method in the model's loop (perplexity, recall, skipped keys, copy, passkey)."""
from __future__ import annotations

import re

from ._common import (FORMATTER, MODEL_CONTEXT, PLOT_FORMATS, CliError, check_budget,
                      check_out, check_plot, check_text, check_topk, indexers_path, int_list,
                      integer, load_indexers, option_names, positive)

__all__ = ["HELP", "add_parser", "run"]

HELP = """\
Measure the real DSA model on any text: perplexity with dense attention against attention
restricted to each layer's indexer top-K (whole window and second half), and per layer the
attention mass the indexer's top-K keeps beside the true top-K's (the ceiling). Runs in query
chunks: 8,192 tokens fit in a few GB of CPU memory (about 4 minutes on 2 cores for k = 64,256).

With --methods (or --task) every layer attends only to the keys a method picks, the method
running causally inside the forward (`jaxsparse.inloop`): dense, dsa (exact indexer top-K),
spin:S[:EXPLORE[:GAMMA]] (decode steps from --decode-from on score only the blocks SPIN
selects at sparsity S; exploration policy and fraction as in SpinConfig, default random 0.05),
ivf / ivf-metric / hisa (AttentionIndex, plain or under the shipped grouping metric, / HiSA
candidates at --budget), recent (the K newest keys). Reports
per method and K whole-window and second-half perplexity against dense and exact DSA, per-layer
recall of exact DSA's top-K, the share of keys the indexer did not score, and the tasks: copy
(a 64-token span from the first quarter repeated at the end: accuracy on its tokens after the
first) and passkey (a number stated early, asked for at the end: digits right), with standard
errors over windows.

examples:
  jaxsparse quality --text book.txt --tokens 4096
  jaxsparse quality --text book.txt --tokens 8192 --k 64,256 --out q.json
  jaxsparse quality --text book.txt --tokens 2048 --k 64 --methods dense,dsa,spin:0.4,ivf,hisa,recent --task ppl,copy,passkey
  jaxsparse quality --text book.txt --tokens 2048,8192 --windows 8 --methods dense,dsa,spin:0.4 --plot q.png --out q.json
"""

TASK_NAMES = ("ppl", "copy", "passkey")
BUDGET_KINDS = ("ivf", "ivf-metric", "hisa")  # inloop.INDEX_KINDS: the methods that take --budget
LOOP_OPTIONS = {"topk": "--k", "k": "--k", "budget": "--budget", "decode_from": "--decode-from",
                "tokens": "--tokens"}
"""The option that sets each `inloop.LoopSettings` / `ivf.IVFConfig` field it names."""


def _method_list() -> str:
  """Every method --methods takes (`inloop.METHOD_KINDS`), spin with its arguments."""
  from jaxsparse.inloop import METHOD_KINDS
  return ", ".join("spin:S[:EXPLORE[:GAMMA]]" if m == "spin" else m for m in METHOD_KINDS)


def add_parser(sub) -> None:
  """Register the command on the top-level parser's subparsers."""
  q = sub.add_parser("quality", help="dense vs DSA perplexity and per-layer recall on a text",
                     description=HELP, formatter_class=FORMATTER)
  q.add_argument("--text", required=True, help="UTF-8 text file")
  q.add_argument("--tokens", type=int_list("--tokens", low=2), required=True,
                 help=f"window length in tokens (at most {MODEL_CONTEXT}); with --methods a "
                 "comma list of lengths")
  q.add_argument("--k", type=int_list("--k"), default=[64, 256],
                 help="top-K sizes, comma list (default 64,256)")
  q.add_argument("--windows", type=positive("--windows"), default=1,
                 help="consecutive windows to pool (default 1)")
  q.add_argument("--indexers", default="", help="indexers.npz (default: the shipped ones)")
  q.add_argument("--chunk", type=positive("--chunk"), default=512,
                 help="queries per chunk (memory ~ chunk x tokens; default 512)")
  q.add_argument("--oracle", action="store_true", help="also run attention restricted to its "
                 "own true top-K per layer (the ceiling of any K-key selection)")
  q.add_argument("--methods", default="", help=f"methods in the loop, comma list of "
                 f"{_method_list()} (default without --methods: the dense vs DSA report; with "
                 "--task only: dense,dsa)")
  q.add_argument("--task", default="", help="with methods: comma list of ppl, copy, passkey "
                 "(default ppl)")
  q.add_argument("--decode-from", type=positive("--decode-from"), default=None,
                 help="spin methods: first decode position (default half of each window)")
  q.add_argument("--budget", type=positive("--budget"), default=None,
                 help=f"{' / '.join(BUDGET_KINDS)} methods: candidate slots per query (default "
                 "1/8 of each window)")
  q.add_argument("--seed", type=integer("--seed", low=0), default=0,
                 help="SPIN exploration and task placement seed (default 0)")
  q.add_argument("--plot", default="", help="with methods: each figure against context length "
                 f"({', '.join(PLOT_FORMATS)}; default none)")
  q.add_argument("--out", default="", help="also write the figures here (.json; default none)")
  q.set_defaults(func=run)


def _inloop_plan(args):
  """Parse and check every in-loop option before anything loads: (methods, tasks, lengths)."""
  from jaxsparse import inloop
  try:
    methods = inloop.parse_methods(args.methods or "dense,dsa")
  except ValueError as e:
    raise CliError(f"--methods: {e}") from None
  tasks = [t.strip() for t in (args.task or "ppl").split(",")]
  bad = [t for t in tasks if t not in TASK_NAMES]
  if bad or len(set(tasks)) != len(tasks):
    raise CliError(f"--task={args.task!r} must list distinct tasks of {', '.join(TASK_NAMES)}")
  kinds = {m.kind for m in methods}
  if args.budget is not None and not kinds & set(BUDGET_KINDS):
    raise CliError(f"--budget applies to the {', '.join(BUDGET_KINDS)} methods, and --methods "
                   f"lists none")
  if args.decode_from is not None and "spin" not in kinds:
    raise CliError("--decode-from applies to spin methods, and --methods lists none")
  if args.oracle:
    raise CliError("--oracle applies to the dense vs DSA report, not to --methods / --task")
  lengths = args.tokens
  for t in lengths:
    if t > MODEL_CONTEXT:
      raise CliError(f"--tokens={t} exceeds the model's {MODEL_CONTEXT}-token context")
    if args.decode_from is not None and args.decode_from >= t:
      raise CliError(f"--decode-from={args.decode_from} must lie inside the window "
                     f"(below --tokens={t})")
    if "copy" in tasks and t // 4 < 64:
      raise CliError(f"--task copy needs --tokens of at least 256 (a 64-token span in the "
                     f"first quarter), got {t}")
    if "passkey" in tasks and t < 128:
      raise CliError(f"--task passkey needs --tokens of at least 128, got {t}")
    if args.budget is not None and kinds & set(BUDGET_KINDS):
      check_budget(args.budget, t, f"--tokens={t}")
    for kk in args.k:
      check_topk(kk, t, f"--tokens={t}")
      s = inloop.LoopSettings.for_window(t, kk, decode_from=args.decode_from,
                                         budget=args.budget)
      try:  # what the measurement checks per window length and K, before the model loads
        s.check(t, index=bool(kinds & set(BUDGET_KINDS)))
      except ValueError as e:
        msg = option_names(str(e), LOOP_OPTIONS)
        notes = []
        if args.budget is None and "--budget" in msg:
          notes.append("--budget defaults to 1/8 of --tokens")
        if re.search(r"\b(seal_window|cluster_size|refit_interval)\b", msg):
          notes.append("the index's seal window and groups scale with --tokens")
        raise CliError(f"at --tokens={t}, --k={kk}: {msg}" +
                       (f" ({'; '.join(notes)})" if notes else "")) from None
  check_out("--out", args.out, (".json",))
  check_plot("--plot", args.plot)
  return methods, [t for t in tasks if t != "ppl"], lengths


def _run_inloop(args) -> int:
  methods, tasks, lengths = _inloop_plan(args)
  s = check_text("--text", args.text)
  ipath = indexers_path("--indexers", args.indexers)
  idx = load_indexers("--indexers", ipath)
  from jaxsparse.model import gguf_weights
  tok = gguf_weights.tokenizer()
  ids = tok.encode(s).ids
  need = max(lengths) * args.windows
  if len(ids) < need:
    raise CliError(f"--text={args.text!r} has {len(ids):,} tokens; --tokens x --windows needs "
                   f"{need:,}")
  from jaxsparse import inloop
  from jaxsparse._bench.timing import environment, write_json
  from jaxsparse.model import llama
  base = llama.load_model()
  head = dict(environment=environment(), text=args.text, indexers=ipath,
              methods=[m.name for m in methods], tasks=["ppl"] + tasks, ks=list(args.k),
              tokens=list(lengths), windows=args.windows)
  save = (lambda r: write_json(args.out, dict(head, **r))) if args.out else None
  import sys
  import time
  from rich.console import Console
  t0 = time.time()

  def progress(m, st):  # a status line on a terminal, timed log lines otherwise
    st.update(m) if sys.stderr.isatty() else print(f"[{time.time() - t0:7.1f} s] {m}",
                                                   file=sys.stderr, flush=True)

  with Console(stderr=True).status("measuring") as st:
    res = inloop.study(base, idx, ids, tok, tokens=lengths, ks=args.k, methods=methods,
                       tasks=tasks, windows=args.windows, decode_from=args.decode_from,
                       budget=args.budget, seed=args.seed, chunk=args.chunk,
                       progress=lambda m: progress(m, st), on_cell=save)
  _print_inloop(res, tasks)
  if args.out:
    print(f"wrote {args.out}")
  if args.plot:
    inloop.plot(res, args.plot)
    print(f"wrote {args.plot}")
  return 0


def _print_inloop(res, tasks):
  from jaxsparse._bench.timing import print_table
  for key, cell in res["cells"].items():
    windows = len(next(iter(cell["methods"].values()))["window_nll"])
    print(f"{cell['tokens']:,} tokens, K {cell['k']}, {windows} window(s)")

    def se(v):  # a standard error over windows: none from a single window
      return f" ±{v:.2%}" if windows > 1 and v is not None else ""

    def pct(v, err=None):
      return "" if v is None else f"{v:+.2%}" + se(err)

    rows = []
    for name, r in cell["summary"].items():
      row = {"method": name, "ppl": f"{r['perplexity']:.3f}",
             "vs DSA": pct(r.get("perplexity_vs_dsa"), r.get("perplexity_vs_dsa_se")),
             "2nd half": f"{r['second_half']:.3f}",
             "2nd vs DSA": pct(r.get("second_half_vs_dsa"), r.get("second_half_vs_dsa_se")),
             "2nd vs dense": pct(r.get("second_half_vs_dense")),
             "recall mean / worst": (f"{r['recall_mean']:.3f} / {r['recall_worst']:.3f} "
                                     f"(L{r['recall_worst_layer']})" if "recall_mean" in r
                                     else ""),
             "not scored": f"{r['unscored_mean']:.1%}" if "unscored_mean" in r else ""}
      for t in tasks:
        row[t] = f"{r[f'{t}_accuracy']:.3f}" + (f" ±{r[f'{t}_accuracy_se']:.3f}"
                                                 if windows > 1 else "")
      rows.append(row)
    print_table(rows, ["method", "ppl", "vs DSA", "2nd half", "2nd vs DSA", "2nd vs dense",
                       "recall mean / worst", "not scored"] + list(tasks))
  print("vs DSA: perplexity ratio - 1 against exact DSA with the same K (± s.e. over windows,"
        " given 2 or more); recall: share of exact DSA's top-K kept, mean over layers / worst "
        "layer; not scored: share of visible keys the indexer never scored; tasks: accuracy "
        "(± s.e. over windows)")


def run(args) -> int:
  if args.methods or args.task:
    return _run_inloop(args)
  for opt, given in (("--decode-from", args.decode_from is not None),
                     ("--budget", args.budget is not None), ("--plot", bool(args.plot)),
                     ("--seed", args.seed != 0)):
    if given:
      raise CliError(f"{opt} applies with --methods or --task only")
  if len(args.tokens) != 1:
    raise CliError(f"--tokens takes one length without --methods, got {args.tokens}")
  args.tokens = args.tokens[0]
  if args.tokens > MODEL_CONTEXT:
    raise CliError(f"--tokens={args.tokens} exceeds the model's {MODEL_CONTEXT}-token context")
  check_topk(max(args.k), args.tokens, f"--tokens={args.tokens}")
  check_out("--out", args.out, (".json",))
  s = check_text("--text", args.text)
  ipath = indexers_path("--indexers", args.indexers)
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

"""`jaxsparse eval`: replay a decode or prefill trace through exact DSA and cheaper selections."""
from __future__ import annotations

import os

from ._common import (FORMATTER, PLOT_FORMATS, CliError, check_budget, check_count, check_out,
                      check_path_given, check_plot, check_topk, fill_defaults, float_list,
                      load_trace, option_names, positive, reject_given)
from ._index import DEFAULTS, check_metric, index_options, ivf_config

__all__ = ["HELP", "LEGEND", "DECODE_DEFAULTS", "PREFILL_DEFAULTS", "add_parser", "run"]

HELP = """\
Replay a real decode trace (SmolLM2-135M with its trained lightning indexers, held-out text)
through exact DSA and the cheaper selection methods, and print how much of DSA's top-K each
keeps against how much of the context it skips.

examples:
  jaxsparse eval                                   the shipped 4K-slot trace, K = 256
  jaxsparse eval --k 128 --sparsities 0.3,0.5 --plot eval.png
  jaxsparse eval --trace my_decode.npz --out eval.json
  jaxsparse eval --trace my_prefill.npz --k 128 --budget 1024     (AttentionIndex vs HiSA)

A prefill trace (`jaxsparse trace prefill`) is evaluated with AttentionIndex, HiSA and full
DSA instead: recall of the causal full top-K at a candidate budget.
"""

DECODE_DEFAULTS = {"k": 256, "block_size": 64, "sparsities": [0.2, 0.4], "explore": "random",
                   "reduction": "A1", "pooling": "max", "implementation": "auto", "plot": ""}
PREFILL_DEFAULTS = {**DEFAULTS, "queries": 128, "plan": "", "metric": ""}
SPIN_OPTIONS = {"block_size": "--block-size", "topk": "--k", "sparsity": "--sparsities",
                "explore": "--explore", "reduction": "--reduction", "pooling": "--pooling"}
"""The option that sets each `spin.SpinConfig` field."""

LEGEND = """\
recall     share of exact DSA's top-K (every visible key scored) that the method's selection
           also holds; mean over decode steps and layers
miss       1 - recall of one step: mean, and the 99th percentile over steps and layers
skipped    share of the visible keys the method does not score (recent window and previous
           top-K score only the K keys they keep; SPIN skips whole KV blocks)"""


def add_parser(sub) -> None:
  """Register the command on the top-level parser's subparsers."""
  e = sub.add_parser("eval", help="replay a real decode trace: SPIN and baselines against "
                     "exact DSA (the main job)", description=HELP, formatter_class=FORMATTER)
  e.add_argument("--trace", default=None, help="decode or prefill trace .npz (default: the "
                 "shipped decode trace)")
  e.add_argument("--k", type=positive("--k"), default=None,
                 help=f"top-K size (default {DECODE_DEFAULTS['k']} on a decode trace, "
                 f"{DEFAULTS['k']} on a prefill trace, as `jaxsparse plan`)")
  e.add_argument("--block-size", type=positive("--block-size"), default=None,
                 help="decode traces: SPIN KV block size in slots (default 64)")
  e.add_argument("--sparsities", type=float_list("--sparsities"), default=None,
                 help="decode traces: SPIN target shares of blocks skipped, comma list "
                 "(default 0.2,0.4)")
  e.add_argument("--explore", default=None, choices=("random", "staleness", "block-age", "query",
                                                    "none"),
                 help="decode traces: SPIN exploration policy (default random)")
  e.add_argument("--reduction", default=None, choices=("A0", "A1", "A2"),
                 help="decode traces: SPIN block reduction (default A1)")
  e.add_argument("--pooling", default=None, choices=("max", "top4", "mean"),
                 help="decode traces: SPIN block pooling (default max)")
  e.add_argument("--implementation", choices=("auto", "pallas", "xla"), default=None,
                 help="decode traces: exact DSA's scoring path, auto = the kernels on a GPU/TPU "
                 "(default auto)")
  index_options(e, "prefill traces: ", given_only=True)
  e.add_argument("--queries", type=positive("--queries"), default=None,
                 help="prefill traces: queries evaluated per layer (default 128)")
  e.add_argument("--plan", default=None, help="prefill traces: also a row with each layer's "
                 "partition from this plan (`jaxsparse plan`; default none)")
  e.add_argument("--metric", default=None, help="prefill traces: also a row with the grouping "
                 "metric of this file (`jaxsparse fit-metric`; default none)")
  e.add_argument("--out", default="", help="also write the table as JSON here (default none)")
  e.add_argument("--plot", default=None, help="decode traces: also draw recall vs skipped and "
                 f"miss per step here ({', '.join(PLOT_FORMATS)}; default none)")
  e.set_defaults(func=run)


def run(args) -> int:
  from jaxsparse import traces
  check_path_given("--trace", args.trace)
  path = args.trace or traces.default_trace_path()
  tr = load_trace("--trace", path)
  if tr.kind == "prefill":
    reject_given(args, [n for n in DECODE_DEFAULTS if n != "k"], "to a prefill trace")
    default_budget = args.budget is None
    fill_defaults(args, PREFILL_DEFAULTS)
    return _run_prefill(args, path, tr, default_budget)
  reject_given(args, [n for n in PREFILL_DEFAULTS if n != "k"], "to a decode trace")
  fill_defaults(args, DECODE_DEFAULTS)
  ctx = int(tr.lengths[0]) - tr.rows + 1
  check_topk(args.k, ctx, f"the trace's smallest context ({ctx} slots)")
  for rho in args.sparsities:
    if not 0 <= rho < 1:
      raise CliError(f"--sparsities: {rho} must lie in [0, 1)")
  if args.block_size * 2 > ctx:
    raise CliError(f"--block-size={args.block_size} leaves fewer than 2 blocks in the "
                   f"{ctx}-slot context")
  check_out("--out", args.out, (".json",))
  check_plot("--plot", args.plot)
  from jaxsparse import evaluate, spin
  from jaxsparse._bench.timing import print_table, write_json
  impl = None if args.implementation == "auto" else args.implementation
  try:
    spins = [(f"SPIN {int(round(100 * rho))}%",
              spin.SpinConfig(block_size=args.block_size, topk=args.k, sparsity=rho,
                              explore=args.explore, reduction=args.reduction,
                              pooling=args.pooling)) for rho in args.sparsities]
  except ValueError as e:
    raise CliError(option_names(str(e), SPIN_OPTIONS)) from None
  src = tr.meta.get("source", "")
  print(f"trace    {path}\n         {tr.meta.get('model', 'model unknown')}; text: {src}")
  print(f"         layers {','.join(map(str, tr.layers.tolist()))}; {tr.q.shape[1]} decode "
        f"steps; context {ctx:,} -> {int(tr.lengths[-1]):,} slots"
        + (" (past the model's trained context)" if tr.meta.get("extrapolated") else ""))
  print(f"select   K = {args.k} keys per step; SPIN blocks of {args.block_size} slots, "
        f"{args.reduction}, {args.pooling} pooling, {args.explore} exploration")
  res = evaluate.decode_baselines(tr, args.k, implementation=impl, spin_configs=spins)
  rows = res["rows"]
  table = [{"method": r["method"], "recall": f"{r['recall']:.4f}",
            "mean miss": f"{r['mean_miss']:.2%}", "p99 miss": f"{r['p99_miss']:.2%}",
            "skipped": f"{r['skipped']:.1%}"} for r in rows]
  print_table(table, ["method", "recall", "mean miss", "p99 miss", "skipped"])
  print(LEGEND)
  print(f"timing   exact DSA scoring + top-K: {res['us_per_step']:.0f} us per step and layer "
        f"on {res['device']} (plain host timing; see `jaxsparse bench` for kernel figures)")
  spin_rows = [r for r in rows if r["method"].startswith("SPIN")]
  if spin_rows:
    best = max(spin_rows, key=lambda r: r["skipped"])
    print(f"summary  {best['method']} skips {best['skipped']:.1%} of the context and keeps "
          f"{best['recall']:.2%} of exact DSA's top-{args.k} (p99 miss {best['p99_miss']:.1%}) "
          f"over {len(tr.layers)} layers x {tr.q.shape[1]} steps.")
  if args.out:
    from jaxsparse._bench.timing import environment
    write_json(args.out, dict(environment=environment(), trace=path, meta=tr.meta, k=args.k,
                              rows=rows, us_per_step=res["us_per_step"]))
    print(f"wrote {args.out}")
  if args.plot:
    _plot(args.plot, res, args.k)
    print(f"wrote {args.plot}")
  return 0


def _run_prefill(args, path, tr, default_budget: bool = False) -> int:
  """A prefill trace: AttentionIndex, HiSA and full DSA recall of the causal full top-K."""
  import numpy as np
  from jaxsparse import ivf
  n = tr.k.shape[1]
  cfg = ivf_config(args)
  check_topk(args.k, n, f"the trace's {n} tokens")
  if n <= args.seal_window:
    raise CliError(f"--seal-window={args.seal_window} must be below the trace's {n} tokens")
  check_budget(args.budget, n, f"the trace's {n} tokens", default=default_budget)
  check_count("--queries", args.queries, n - args.seal_window,
              f"query positions of the trace (its {n:,} tokens after the first "
              f"--seal-window={args.seal_window})")
  plan = _load_plan(args, cfg, tr) if args.plan else None
  check_out("--out", args.out, (".json",))
  pos = np.unique(np.linspace(args.seal_window, n - 1, args.queries).astype(np.int64))
  print(f"trace    {path}\n         prefill, {n:,} tokens, layers "
        f"{','.join(map(str, tr.layers.tolist()))}"
        + (" (past the model's trained context)" if tr.meta.get("extrapolated") else ""))
  print(f"select   K = {args.k} of {len(pos)} queries' full top-K; budget {args.budget} "
        f"candidates; seal every {args.seal_window} keys into groups of ~{args.cluster_size}, "
        f"refit every {args.refit_interval}")
  from jaxsparse._bench.timing import print_table, write_json
  rows = []
  methods = [("AttentionIndex (IVF)", "ivf", False), ("IVF, oracle group ranking", "ivf", True),
             ("HiSA blocks", "hisa", False), ("full DSA", "full", False)]
  if plan is not None:
    methods.insert(1, ("IVF planned (per layer)", "plan", False))
  if args.metric:
    check_metric(args, tr)
    methods.insert(1, ("IVF, query-aware metric", "metric", False))
  for name, method, oracle in methods:
    rec, cand = [], []
    for li, layer in enumerate(tr.layers.tolist()):
      m = plan["methods"][int(layer)] if method == "plan" else method
      metric_row = method == "metric" or (method == "plan" and m == "ivf" and plan.get("metric"))
      extra = dict(metric=args.metric, layer=int(layer)) if metric_row else {}
      r = ivf.evaluate(tr.q[li], tr.k[li], tr.w[li], cfg, method="ivf" if m == "metric" else m,
                       query_positions=pos, oracle=oracle, **extra)
      rec.append(float(r["recall"].mean()))
      cand.append(float(r["num_candidates"].mean()))
    rows.append({"method": name, "recall": float(np.mean(rec)), "worst layer": min(rec),
                 "candidates": float(np.mean(cand))})
  print_table([{"method": r["method"], "recall": f"{r['recall']:.4f}",
                "worst layer": f"{r['worst layer']:.4f}",
                "scored per query": f"{r['candidates']:,.0f} + groups"
                if "full" not in r["method"] else f"{r['candidates']:,.0f}"} for r in rows],
              ["method", "recall", "worst layer", "scored per query"])
  print("recall     share of the causal full top-K the method also selects (mean over queries "
        "and layers)")
  hisa = next(r for r in rows if r["method"] == "HiSA blocks")
  print(f"summary  AttentionIndex keeps {rows[0]['recall']:.2%} of the full top-{args.k} with "
        f"{rows[0]['candidates']:,.0f} candidates per query; HiSA {hisa['recall']:.2%}.")
  if args.out:
    from jaxsparse._bench.timing import environment
    write_json(args.out, dict(environment=environment(), trace=path, meta=tr.meta,
                              k=args.k, rows=rows))
    print(f"wrote {args.out}")
  return 0


def _load_plan(args, cfg, tr) -> dict:
  """The --plan file, checked against this evaluation's settings and the trace's layers."""
  from jaxsparse.ivf import plan as ivf_plan
  try:
    pl = ivf_plan.load(args.plan)
  except FileNotFoundError:
    raise CliError(f"--plan={args.plan!r} does not exist") from None
  except ivf_plan.PlanFileError as e:
    raise CliError(f"--plan: {e}") from None
  got = pl.get("config", {})
  for name, option in (("topk", "--k"), ("budget", "--budget"), ("seal_window", "--seal-window"),
                       ("cluster_size", "--cluster-size")):
    if name in got and got[name] != getattr(cfg, name):
      raise CliError(f"--plan={args.plan!r} was calibrated with {option}={got[name]}, not "
                     f"{getattr(cfg, name)}")
  missing = sorted(set(tr.layers.tolist()) - set(pl["methods"]))
  if missing:
    raise CliError(f"--plan={args.plan!r} does not cover the trace's layers {missing}")
  if pl.get("metric") and os.path.basename(args.metric) != pl["metric"]:
    raise CliError(f"--plan={args.plan!r} was calibrated with the grouping metric "
                   f"{pl['metric']!r}: give it as --metric")
  return pl


def _plot(path, res, k):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  for r in res["rows"]:
    a.scatter(r["skipped"], r["recall"], label=r["method"])
  a.set_xlabel("share of the context skipped")
  a.set_ylabel(f"recall of exact DSA top-{k}")
  a.legend(fontsize=8)
  a.grid(alpha=0.3)
  for name, miss in res["miss_by_step"].items():
    b.plot(miss, label=name)
  b.set_xlabel("decode step")
  b.set_ylabel("miss (mean over layers)")
  b.legend(fontsize=8)
  b.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)

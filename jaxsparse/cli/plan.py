"""`jaxsparse plan`: choose each layer's partition (AttentionIndex groups or HiSA blocks)."""
from __future__ import annotations

from ._common import (FORMATTER, CliError, check_budget, check_count, check_out, check_topk,
                      fill_defaults, number, path_list, positive)
from ._index import DEFAULTS, check_metric, index_options, ivf_config, prefill_traces

__all__ = ["HELP", "add_parser", "run"]

HELP = """\
Measure AttentionIndex (content groups) and HiSA (position blocks) on prefill traces of
training text, per layer, at one budget, and write the plan `ivf.plan.load` reads: a layer
keeps --prefer unless the other partition's mean recall wins by over --z standard errors of
the paired per-query difference. Several traces (texts) are pooled per layer.

  jaxsparse trace prefill --text train1.txt --tokens 8192 --out t1.npz
  jaxsparse plan --trace t1.npz,t2.npz --budget 512 --out plan.json
  jaxsparse eval --trace heldout.npz --budget 512 --plan plan.json"""


def add_parser(sub) -> None:
  """Register the command on the top-level parser's subparsers."""
  pl = sub.add_parser("plan", help="choose each layer's partition (AttentionIndex groups or "
                      "HiSA blocks) on prefill traces of training text",
                      description=HELP, formatter_class=FORMATTER)
  pl.add_argument("--trace", required=True, type=path_list("--trace"),
                  help="prefill trace(s) .npz, comma list (several texts are pooled per layer)")
  pl.add_argument("--out", required=True, help="plan JSON to write")
  pl.add_argument("--k", type=positive("--k"), default=DEFAULTS["k"],
                  help=f"top-K size (default {DEFAULTS['k']})")
  index_options(pl, given_only=True)
  pl.add_argument("--queries", type=positive("--queries"), default=256,
                  help="queries evaluated per layer and trace (default 256)")
  pl.add_argument("--z", type=number("--z", low=0), default=2.0, help="standard errors the other partition "
                  "must win by (default 2)")
  pl.add_argument("--prefer", choices=("hisa", "ivf"), default="hisa",
                  help="the partition a layer keeps on a tie (default hisa: no index)")
  pl.add_argument("--metric", default="", help="group under this grouping metric "
                  "(`jaxsparse fit-metric`); eval --plan then needs the same --metric "
                  "(default none: plain AttentionIndex)")
  pl.set_defaults(func=run)


def run(args) -> int:
  from jaxsparse.ivf import plan as ivf_plan
  default_budget = args.budget is None
  fill_defaults(args, DEFAULTS)
  cfg = ivf_config(args)
  if args.queries < 2:
    raise CliError(f"--queries={args.queries} must be at least 2")
  check_out("--out", args.out, (".json",))
  trs = prefill_traces(args.trace, "a plan")
  for path, tr in zip(args.trace, trs):
    n = tr.k.shape[1]
    if n <= args.seal_window:
      raise CliError(f"--trace={path!r} has {n} tokens: need more than "
                     f"--seal-window={args.seal_window}")
    where = f"the {n} tokens of --trace={path!r}"
    check_topk(args.k, n, where)
    check_budget(args.budget, n, where, default=default_budget)
    start = int(ivf_plan.calibration_positions(n, args.seal_window, 2)[0])
    check_count("--queries", args.queries, n - start,
                f"query positions of --trace={path!r} (its {n:,} tokens from position "
                f"{start:,}, past the first seals)")
  if args.metric:
    for tr in trs:
      check_metric(args, tr)
  from jaxsparse._bench.timing import print_table
  pl = ivf_plan.calibrate(trs, cfg, queries=args.queries, z=args.z, prefer=args.prefer,
                          metric=args.metric or None)
  print_table([{"layer": str(layer), "IVF": f"{r['ivf']:.4f}", "HiSA": f"{r['hisa']:.4f}",
                "HiSA - IVF": f"{r['difference']:+.4f}", "std. error": f"{r['std_error']:.4f}",
                "plan": pl["methods"][layer]} for layer, r in pl["recall"].items()],
              ["layer", "IVF", "HiSA", "HiSA - IVF", "std. error", "plan"])
  ivf_plan.save(args.out, pl)
  blocks = [layer for layer, m in pl["methods"].items() if m == "hisa"]
  print(f"summary  blocks for {len(blocks)} of {len(pl['methods'])} layers "
        f"({','.join(map(str, blocks)) or 'none'}); wrote {args.out}")
  return 0

"""`jaxsparse fit-metric`: fit AttentionIndex's query-aware grouping metric on prefill traces."""
from __future__ import annotations

import os

from ._common import FORMATTER, CliError, check_count, check_out, number, path_list, positive
from ._index import prefill_traces

__all__ = ["HELP", "add_parser", "run"]

HELP = """\
Fit AttentionIndex's query-aware grouping metric (`jaxsparse.ivf.metric`) on prefill traces of
training text: per layer, A = (D S / trace S + eps I)^(1/2), S the mean outer product of the
indexer score's gradient in the key over causal (query, key) pairs. The index then groups keys
that queries score alike. For example:

  jaxsparse fit-metric --trace t1.npz,t2.npz --out metric.npz
  jaxsparse eval --trace heldout.npz --metric metric.npz"""


def add_parser(sub) -> None:
  """Register the command on the top-level parser's subparsers."""
  fm = sub.add_parser("fit-metric", help="fit AttentionIndex's query-aware grouping metric on "
                      "prefill traces of training text", description=HELP,
                      formatter_class=FORMATTER)
  fm.add_argument("--trace", required=True, type=path_list("--trace"),
                  help="prefill trace(s) .npz, comma list (queries pooled per layer)")
  fm.add_argument("--out", required=True, help="metric .npz to write")
  fm.add_argument("--eps", type=number("--eps", above=0), default=0.01,
                  help="ridge added to the normalised second moment (default 0.01)")
  fm.add_argument("--queries", type=positive("--queries"), default=256,
                  help="query positions per trace (default 256)")
  fm.add_argument("--keys", type=positive("--keys"), default=256,
                  help="keys drawn from each query's prefix (default 256)")
  fm.set_defaults(func=run)


def run(args) -> int:
  from jaxsparse.ivf import metric as ivf_metric
  check_out("--out", args.out, (".npz",))
  trs = prefill_traces(args.trace, "a metric")
  for path, tr in zip(args.trace, trs):
    if tr.layers.tolist() != trs[0].layers.tolist():
      raise CliError(f"--trace={path!r} holds layers {tr.layers.tolist()}, the first trace "
                     f"{trs[0].layers.tolist()}: every trace must hold the same layers")
  for path, tr in zip(args.trace, trs):  # the pairs `ivf.metric.sample_pairs` draws
    n = tr.k.shape[1]
    check_count("--queries", args.queries, n - n // 16,
                f"query positions of --trace={path!r} (its {n:,} tokens from position "
                f"{n // 16:,})")
    check_count("--keys", args.keys, n, f"keys of --trace={path!r} (its longest prefix)")
  metrics = ivf_metric.fit_traces(trs, eps=args.eps, queries=args.queries, keys=args.keys)
  ivf_metric.save(args.out, metrics, meta={"traces": [os.path.basename(t) for t in args.trace],
                                           "eps": args.eps, "queries": args.queries,
                                           "keys": args.keys, "seed": 0})
  print(f"summary  metric for {len(metrics)} layers from {len(trs)} trace(s); wrote {args.out}")
  return 0

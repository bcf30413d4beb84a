"""AttentionIndex settings and prefill-trace checks shared by `eval`, `plan` and `fit-metric`."""
from __future__ import annotations

from ._common import CliError, integer, load_trace, option_names, positive

__all__ = ["DEFAULTS", "index_options", "ivf_config", "prefill_traces", "check_metric"]


DEFAULTS = {"k": 128, "budget": 1024, "seal_window": 256, "cluster_size": 32,
            "refit_interval": 2048}
"""AttentionIndex settings `plan` calibrates at and `eval` on a prefill trace uses when an
option is left out: a plan made with the defaults serves `eval --plan` with the defaults."""


def index_options(p, note: str = "", given_only: bool = False) -> None:
  """AttentionIndex settings shared by `eval` (prefill traces) and `plan`. given_only: the
  options default to None (`fill_defaults(args, DEFAULTS)` sets them once the mode is known)."""
  d = {name: None if given_only else v for name, v in DEFAULTS.items()}
  p.add_argument("--budget", type=positive("--budget"), default=d["budget"],
                 help=f"{note}candidate slots per query (default {DEFAULTS['budget']})")
  p.add_argument("--seal-window", type=positive("--seal-window"), default=d["seal_window"],
                 help=f"{note}keys per seal (default {DEFAULTS['seal_window']})")
  p.add_argument("--cluster-size", type=positive("--cluster-size"), default=d["cluster_size"],
                 help=f"{note}keys per group on average (default {DEFAULTS['cluster_size']})")
  p.add_argument("--refit-interval", type=integer("--refit-interval", low=0),
                 default=d["refit_interval"],
                 help=f"{note}tokens between refits, 0 = seal only (default "
                 f"{DEFAULTS['refit_interval']})")


IVF_OPTIONS = {"topk": "--k", "budget": "--budget", "seal_window": "--seal-window",
               "cluster_size": "--cluster-size", "refit_interval": "--refit-interval"}
"""The option that sets each `ivf.IVFConfig` field."""


def ivf_config(args):
  from jaxsparse import ivf
  try:
    return ivf.IVFConfig(topk=args.k, budget=args.budget, seal_window=args.seal_window,
                         cluster_size=args.cluster_size, refit_interval=args.refit_interval)
  except ValueError as e:
    raise CliError(option_names(str(e), IVF_OPTIONS)) from None


def prefill_traces(paths, what: str) -> list:
  """--trace's files, each loaded and checked to be a prefill trace (`what` needs them)."""
  trs = []
  for path in paths:
    tr = load_trace("--trace", path)
    if tr.kind != "prefill":
      raise CliError(f"--trace={path!r} is a {tr.kind} trace; {what} needs prefill traces")
    trs.append(tr)
  return trs



def check_metric(args, tr) -> None:
  """The --metric file, checked against the trace's layers and key width."""
  from jaxsparse.ivf import metric as ivf_metric
  try:
    metrics = ivf_metric.load(args.metric)
  except FileNotFoundError:
    raise CliError(f"--metric={args.metric!r} does not exist") from None
  except ValueError as e:
    raise CliError(f"--metric={args.metric!r}: {e}") from None
  missing = [int(x) for x in tr.layers.tolist() if int(x) not in metrics]
  if missing:
    raise CliError(f"--metric={args.metric!r} holds no metric for layers {missing}")
  d = tr.k.shape[-1]
  bad = [layer for layer, a in metrics.items() if a.shape != (d, d)]
  if bad:
    raise CliError(f"--metric={args.metric!r}: layers {bad} are not [{d}, {d}] (the trace's "
                   f"key width)")


"""The `jaxsparse` command line: one entry point, one subcommand per capability, one module per
command (`eval`, `bench`, `quality`, `trace`, `plan`, `metric` for fit-metric, `train`,
`model`), each with its help text, `add_parser(sub)` and `run(args)`.

Every wrong invocation ends with one `jaxsparse <command>: error: ...` line naming the option
and exit status 2, before any slow work (model loading, tracing, timing) starts.
"""
from __future__ import annotations

import argparse
import sys

from . import bench, eval, metric, model, plan, quality, trace, train
from ._common import FORMATTER, MODEL_CONTEXT, MODEL_LAYERS, CliError

__all__ = ["main", "build_parser", "CliError", "MODEL_LAYERS", "MODEL_CONTEXT"]


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jaxsparse",
      description="DeepSeek Sparse Attention indexer tools. Start with `jaxsparse eval`.",
      formatter_class=FORMATTER)
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for command in (eval, bench, quality, trace, plan, metric, train, model):
    command.add_parser(sub)
  for name, sp in sub.choices.items():  # an unknown option prints this command's usage
    if not sp.get_default("parser"):
      sp.set_defaults(parser=sp)
  return p


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  rc = train.dispatch(argv)
  if rc is not None:
    return rc
  p = build_parser()
  args, extra = p.parse_known_args(argv)
  if extra:
    args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
  from jaxsparse.model.fetch import FetchError
  try:
    return args.func(args) or 0
  except (CliError, FetchError) as e:
    print(f"jaxsparse {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"jaxsparse {args.command}: interrupted", file=sys.stderr)
    return 130

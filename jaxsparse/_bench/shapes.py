"""Benchmark and test shapes, named after the models they come from (declared once)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class IndexerShape:
  """Indexer geometry: H heads x D dims, top-k size, and the key dtype the model caches."""
  name: str
  heads: int
  head_dim: int
  topk: int


DEEPSEEK_V32 = IndexerShape("deepseek-v3.2", heads=64, head_dim=128, topk=2048)
# DeepSeek-V4-Flash's CSA compresses the indexer context 4x: 1M tokens -> 256K slots.
DEEPSEEK_V4_FLASH = IndexerShape("deepseek-v4-flash", heads=64, head_dim=128, topk=512)
GLM5 = IndexerShape("glm-5", heads=32, head_dim=128, topk=2048)
TINY = IndexerShape("tiny-test", heads=8, head_dim=64, topk=64)

K = 1024
DECODE_BATCHES = (1, 8, 64)
DECODE_SLOTS = (32 * K, 128 * K, 512 * K, 1024 * K)
PREFILL_CHUNK = 2048
PREFILL_KEYS = (64 * K, 256 * K, 1024 * K)
TOPK_BATCHES = (1, 8, 64)
TOPK_N = (32 * K, 128 * K, 512 * K, 1024 * K)
TOPK_K = (512, 2048)

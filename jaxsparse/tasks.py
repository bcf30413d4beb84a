"""Long-range retrieval the model does densely, scored from its own logits: copy and passkey.

copy     a span of `span` tokens from the window's first quarter is repeated at its end; the
         score is top-1 accuracy and mean log-probability on the repeated span's tokens after
         its first (the first cannot be known before the copy starts).
passkey  a number of `digits` digits is stated once early (at 1/8 to 1/4 of the window) in the
         text and asked for at the end ("What is the pass key? The pass key is"); the score is
         the share of its digits predicted right (teacher-forced greedy) and their mean
         log-probability.
Both are built on windows of real text, so the filler is the text itself.
"""
from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["TASKS", "Task", "copy_task", "passkey_task", "build", "score"]

TASKS = ("copy", "passkey")


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
  """tokens [B, T] int32 (B windows); scored [B, T - 1] bool: the predictions (of token p + 1
  at position p) that count."""
  name: str
  tokens: np.ndarray
  scored: np.ndarray


def _windows(ids, windows: int, tokens: int, need: int) -> np.ndarray:
  ids = np.asarray(ids, np.int32)
  if ids.ndim != 1 or len(ids) < windows * need:
    raise ValueError(f"the text has {ids.size:,} tokens; {windows} window(s) need "
                     f"{windows * need:,}")
  return ids[:windows * need].reshape(windows, need)


def copy_task(ids, *, windows: int, tokens: int, span: int = 64, seed: int = 0) -> Task:
  """Copy windows from text token ids [M]: text of tokens - span tokens, then a copy of a
  span starting in the first quarter (at a seeded random position)."""
  if span < 2 or tokens // 4 < span:
    raise ValueError(f"span={span} must be at least 2 and fit in the first quarter of "
                     f"tokens={tokens}")
  body = _windows(ids, windows, tokens, tokens - span)
  rng = np.random.default_rng(seed)
  out = np.empty((windows, tokens), np.int32)
  scored = np.zeros((windows, tokens - 1), bool)
  for i in range(windows):
    a = int(rng.integers(0, tokens // 4 - span + 1))
    out[i] = np.concatenate([body[i], body[i, a:a + span]])
    scored[i, tokens - span:] = True  # predictions of the copy's tokens 2..span
  return Task("copy", out, scored)


def passkey_task(ids, tokenizer, *, windows: int, tokens: int, digits: int = 5,
                 seed: int = 0) -> Task:
  """Passkey windows from text token ids [M]; `tokenizer` a `tokenizers.Tokenizer` (the
  model's: its digits are single tokens)."""
  if not 1 <= digits <= 12:
    raise ValueError(f"digits={digits} must lie in [1, 12]")
  rng = np.random.default_rng(seed)
  enc = lambda s: np.asarray(tokenizer.encode(s).ids, np.int32)
  out = np.empty((windows, tokens), np.int32)
  scored = np.zeros((windows, tokens - 1), bool)
  plans = []
  for _ in range(windows):
    key = "".join(str(d) for d in rng.integers(0, 10, digits))
    key = str(rng.integers(1, 10)) + key[1:]
    needle = enc(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    ask = enc(f" What is the pass key? The pass key is {key}")
    answer = enc(f" {key}")[-digits:]
    if not np.array_equal(ask[-digits:], answer) or \
        [tokenizer.decode([int(a)]) for a in answer] != list(key):
      raise ValueError("the tokenizer does not make each digit of the key one token")
    plans.append((needle, ask))
  filler = max(tokens - len(n) - len(a) for n, a in plans)
  if filler < tokens // 2:
    raise ValueError(f"tokens={tokens} is too short for the passkey task")
  body = _windows(ids, windows, tokens, filler)
  for i, (needle, ask) in enumerate(plans):
    fill = tokens - len(needle) - len(ask)
    at = int(rng.integers(tokens // 8, tokens // 4))
    out[i] = np.concatenate([body[i, :at], needle, body[i, at:fill], ask])
    scored[i, tokens - digits - 1:] = True
  return Task("passkey", out, scored)


def build(name: str, ids, tokenizer, *, windows: int, tokens: int, seed: int = 0) -> Task:
  """The task `name` (one of TASKS) on windows of `tokens` from text ids."""
  if name == "copy":
    return copy_task(ids, windows=windows, tokens=tokens, seed=seed)
  if name == "passkey":
    return passkey_task(ids, tokenizer, windows=windows, tokens=tokens, seed=seed)
  raise ValueError(f"task={name!r} must be one of {', '.join(TASKS)}")


def score(task: Task, nll, pred) -> dict:
  """Task scores from a forward over task.tokens: nll [B, T-1] (of token p + 1 at p), pred
  [B, T] greedy. Returns accuracy and logprob (means over windows of each window's mean over
  its scored predictions), their standard errors over windows (0 for one window) and the
  per-window values."""
  nll = np.asarray(nll, np.float64)
  hit = np.asarray(pred)[:, :-1] == task.tokens[:, 1:]
  m = task.scored
  acc = (hit & m).sum(1) / m.sum(1)
  lp = -(np.where(m, nll, 0.0)).sum(1) / m.sum(1)
  se = lambda v: float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0
  return {"accuracy": float(acc.mean()), "accuracy_se": se(acc),
          "logprob": float(lp.mean()), "logprob_se": se(lp),
          "window_accuracy": acc.tolist(), "window_logprob": lp.tolist()}

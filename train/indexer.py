"""Train a lightning indexer for every layer of SmolLM2 with DeepSeek-V3.2's dense warm-up.

The base model is frozen. For each query t the target is the layer's attention distribution
summed over heads and L1-normalised; the loss is KL(target_t || softmax(indexer_t)) over the
causal prefix; the indexer's input (the layer's normalised attention input) carries no gradient.
One scan over the layers runs the base model and, per layer, the indexer's loss and gradient,
so memory holds one layer's [T, T] attention at a time, never all layers'.

A length curriculum (`--schedule 2048:300,4096:200,8192:700`: window:steps, the windows
increasing) moves to the model's full 8,192-token context. Training text is long documents
(standard-library modules, the Linux documentation; `--corpus` takes pre-tokenised ids) and
never the evaluation text (`jaxsparse.model.text.held_out_text`).

  jaxsparse train indexer --out runs/idx --schedule 2048:300,4096:200,8192:700 \\
      --max-seconds 420                   (the run of the shipped indexers, on one GPU)
  jaxsparse train indexer --out runs/tiny --window 128 --steps 10 --num-layers 2 \\
      --eval-windows 1 --eval-tokens 256 --recall-k 64          (a CPU-sized run)

`python -m train.indexer` takes the same options. Checkpoints (Orbax, atomic, the latest two
kept) hold parameters, optimizer state and step; a rerun with the same --out and options
resumes and ends with the same parameters as an uninterrupted run. Once a checkpoint exists, a
rerun that changes the run's options (--schedule or --window/--steps, which set the total
steps the learning-rate schedule spans, --heads, --seed, ...) is refused: a new --out starts
a new run.
The trained indexers are exported to OUT/indexers.npz (`lightning.save_indexers` format).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsparse.model.fetch import FetchError
from train import checkpoints

__all__ = ["TrainConfig", "ConfigError", "parse_schedule", "train", "main"]


class ConfigError(ValueError):
  """A training option that cannot work; raised before the model loads."""


def parse_schedule(schedule: str) -> tuple[tuple[int, int], ...]:
  """'2048:300,8192:100' -> ((2048, 300), (8192, 100)); ConfigError naming --schedule."""
  stages = []
  for part in schedule.split(","):
    try:
      w, s = (int(v) for v in part.split(":"))
    except ValueError:
      raise ConfigError(f"--schedule={schedule!r}: each stage is WINDOW:STEPS, "
                        f"got {part!r}") from None
    if w < 2 or s < 1:
      raise ConfigError(f"--schedule={schedule!r}: window {w} and steps {s} must be >= 2, >= 1")
    if stages and w <= stages[-1][0]:
      raise ConfigError(f"--schedule={schedule!r}: window {w} follows window {stages[-1][0]}; "
                        f"the windows of a length curriculum increase stage by stage")
    stages.append((w, s))
  return tuple(stages)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  out: str
  schedule: str = "2048:300,4096:200,8192:300"
  heads: int = 16
  head_dim: int = 64
  rope_dims: int = 16
  lr: float = 3e-3
  leak: float = 0.1
  num_layers: int = 0  # train the first N layers of the base model; 0: all of them
  corpus: str = ""  # .npy of token ids; "" reads text.training_documents()
  eval_windows: int = 2
  eval_tokens: int = 8192
  recall_k: int = 256
  save_every: int = 50
  max_seconds: float = 0.0  # > 0: checkpoint and stop after this long (rerun resumes)
  seed: int = 0

  def __post_init__(self):
    stages = parse_schedule(self.schedule)
    for name in ("heads", "head_dim", "eval_windows", "eval_tokens", "recall_k", "save_every"):
      if getattr(self, name) < 1:
        raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")
    if self.steps < 2:
      raise ConfigError(f"the schedule has {self.steps} step(s); training needs at least 2")
    if not (self.lr > 0 and math.isfinite(self.lr)):
      raise ConfigError(f"--lr={self.lr} must be a positive finite number")
    if not 0 <= self.leak < 1:
      raise ConfigError(f"--leak={self.leak} must lie in [0, 1)")
    checkpoints.check_run_limits(self.max_seconds, self.seed, ConfigError)
    from jaxsparse.cli._common import MODEL_CONTEXT, MODEL_LAYERS
    if not 0 <= self.num_layers <= MODEL_LAYERS:
      raise ConfigError(f"--num-layers={self.num_layers} must lie in [0, {MODEL_LAYERS}] (the "
                        f"model's layers; 0: all)")
    from jaxsparse.cli._common import CliError, check_power_of_two
    try:
      check_power_of_two("--head-dim", self.head_dim, 16, 256)
    except CliError as e:
      raise ConfigError(str(e)) from None
    if self.rope_dims % 2 or not 0 <= self.rope_dims <= self.head_dim:
      raise ConfigError(f"--rope-dims={self.rope_dims} must be even and <= --head-dim")
    if self.eval_tokens <= self.recall_k:
      raise ConfigError(f"--eval-tokens={self.eval_tokens} must exceed --recall-k="
                        f"{self.recall_k}")
    if self.eval_tokens > MODEL_CONTEXT:
      raise ConfigError(f"--eval-tokens={self.eval_tokens} exceeds the model's "
                        f"{MODEL_CONTEXT:,}-token context")
    if max(w for w, _ in stages) > MODEL_CONTEXT:
      raise ConfigError(f"--schedule={self.schedule!r}: windows past the model's "
                        f"{MODEL_CONTEXT:,}-token context are not training data")
    if not self.out:
      raise ConfigError("--out must name a directory for checkpoints and the report")

  @property
  def stages(self):
    return parse_schedule(self.schedule)

  @property
  def steps(self) -> int:
    return sum(s for _, s in self.stages)

  def window_at(self, step: int) -> int:
    for w, s in self.stages:
      if step < s:
        return w
      step -= s
    return self.stages[-1][0]

  def identity(self) -> dict:
    """The fields a resumed run must share with the run that wrote the checkpoints."""
    return {k: getattr(self, k) for k in ("heads", "head_dim", "rope_dims", "num_layers", "seed",
                                          "corpus", "lr", "leak", "schedule")}

  IDENTITY_OPTIONS = {"schedule": "--schedule (or --window:--steps)"}
  """The option that sets an identity field not spelled `--field-name`."""


OPTION_HELP = {
    "heads": "indexer heads", "head_dim": "indexer head dim",
    "rope_dims": "leading head dims that take rotary positions",
    "lr": "peak AdamW learning rate (warm-up, then cosine decay)",
    "leak": "negative slope of the leaky ReLU the training scores take (0 at inference)",
    "num_layers": "train the first N layers of the model; 0: all",
    "corpus": ".npy of token ids; '' reads the standard library and Linux documentation",
    "eval_windows": "held-out windows of the final recall evaluation",
    "eval_tokens": "tokens per evaluation window",
    "recall_k": "top-K of the evaluation (attention mass the indexer's top-K keeps)",
    "save_every": "steps between checkpoints",
    "max_seconds": "checkpoint and stop after this long, 0: no limit (a rerun resumes)",
    "seed": "initialisation and window sampling seed",
}


def read_ids(path: str) -> np.ndarray:
  """The token ids of a --corpus file: one .npy integer array (never unpickled); ConfigError
  naming --corpus for anything else (another format, an npz archive, pickled objects, floats,
  ids outside the model's vocabulary)."""
  from jaxsparse.cli._common import MODEL_VOCAB
  with open(path, "rb") as f:
    magic = f.read(6)
  if magic != b"\x93NUMPY" and magic[:4] != b"PK\x03\x04":
    raise ConfigError(f"--corpus={path!r} is not a .npy file (numpy.save of the token ids)")
  try:
    ids = np.load(path, allow_pickle=False)
  except (ValueError, OSError, EOFError) as e:
    why = "it holds pickled objects" if "pickle" in str(e) else f"{type(e).__name__}: {e}"
    raise ConfigError(f"--corpus={path!r} is not a .npy array of token ids: {why}") from None
  if not isinstance(ids, np.ndarray):
    ids.close()
    raise ConfigError(f"--corpus={path!r} is an npz archive; give one .npy array of token ids")
  if ids.ndim != 1:
    raise ConfigError(f"--corpus={path!r} holds an array of shape {ids.shape}; token ids are "
                      f"one 1-D array (numpy.save of the ids in order)")
  if ids.dtype.kind not in "iu":
    raise ConfigError(f"--corpus={path!r} holds {ids.dtype} values; token ids are integers")
  if ids.size and ids.min() < 0:
    raise ConfigError(f"--corpus={path!r} holds negative token ids ({ids.min()})")
  if ids.size and ids.max() >= MODEL_VOCAB:
    raise ConfigError(f"--corpus={path!r} holds token id {ids.max()}, past the model's "
                      f"vocabulary of {MODEL_VOCAB:,} (ids 0..{MODEL_VOCAB - 1})")
  return ids


def load_corpus(cfg: TrainConfig):
  """(token ids, description): the --corpus file's ids, checked, or the training documents
  tokenised; ConfigError when they hold no window of the schedule's longest."""
  if cfg.corpus:
    if not os.path.isfile(cfg.corpus):
      raise ConfigError(f"--corpus={cfg.corpus!r} does not exist")
    ids = read_ids(cfg.corpus)
    desc = f"token ids from {os.path.basename(cfg.corpus)}"
  else:
    from jaxsparse.model import gguf_weights, text
    tok = gguf_weights.tokenizer()
    ids = []
    for e in tok.encode_batch(text.training_documents()):
      ids.extend(e.ids)
      ids.append(0)  # <|endoftext|> between documents
    ids = np.asarray(ids, np.int32)
    desc = "standard-library modules + Linux Documentation/*.rst (where installed)"
  ids = np.asarray(ids).astype(np.int32).reshape(-1)
  longest = max(w for w, _ in cfg.stages)
  if len(ids) < longest + 1:
    raise ConfigError(f"the corpus has {len(ids)} tokens, fewer than the longest window "
                      f"{longest}")
  return ids, desc


def window_for(ids, cfg: TrainConfig, step: int):
  """The training window of `step`: a deterministic random slice (resume-safe)."""
  w = cfg.window_at(step)
  start = np.random.default_rng([cfg.seed, step]).integers(0, len(ids) - w + 1)
  return ids[start: start + w]


def _layer_grads(bcfg, icfg, leak, embed, layers, iparams, tokens):
  """Scan over layers: base block forward and one indexer's KL loss and gradient per layer."""
  from jaxsparse.model import lightning, llama
  t = tokens.shape[0]
  pos = jnp.arange(t)
  hd, nh = bcfg.head_dim, bcfg.heads
  causal = pos[None, :] <= pos[:, None]
  x = embed[tokens]

  def layer(x, xs):
    w, ip = xs
    h = llama.rms_norm(x, w["attn_norm"], bcfg.norm_eps)
    q = llama.rope_pairs((h @ w["q"].T).reshape(t, nh, hd), pos, bcfg.rope_base)
    k = llama.rope_pairs((h @ w["k"].T).reshape(t, bcfg.kv_heads, hd), pos, bcfg.rope_base)
    v = (h @ w["v"].T).reshape(t, bcfg.kv_heads, hd)
    s = jnp.where(causal, llama._gqa_scores(bcfg, q, k), -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    target = p.sum((0, 1)) / nh
    hs = jax.lax.stop_gradient(h)
    loss, g = jax.value_and_grad(
        lambda ip: lightning.kl_loss(lightning.train_scores(icfg, ip, hs, leak), target))(ip)
    o = jnp.einsum("ngct,tnd->cngd", p, v).reshape(t, nh * hd)
    x = x + o @ w["o"].T
    h2 = llama.rms_norm(x, w["ffn_norm"], bcfg.norm_eps)
    x = x + (jax.nn.silu(h2 @ w["gate"].T) * (h2 @ w["up"].T)) @ w["down"].T
    return x, (loss, g)

  _, (losses, grads) = jax.lax.scan(layer, x, (layers, iparams))
  return losses, grads


def _make_step(bcfg, icfg, leak, tx):
  @jax.jit
  def step(params, opt_state, embed, layers, tokens):
    losses, grads = _layer_grads(bcfg, icfg, leak, embed, layers, params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses
  return step


def evaluate(base, indexers, windows, k: int, chunk: int = 1024) -> dict:
  """Per-layer top-k recall of attention mass on held-out windows (chunked forward), beside
  the true top-k's mass (the ceiling), and each layer's share of exactly-zero scores."""
  from jaxsparse.model import llama
  acc = None
  for wnd in windows:
    _, _, _, st = llama.run_chunked(base, wnd, indexers=indexers, stat_ks=(k,),
                                    chunk=min(chunk, len(wnd)))
    st = {n: np.asarray(v, np.float64) for n, v in st.items()}
    acc = st if acc is None else {n: acc[n] + st[n] for n in acc}
  rec = acc[f"idx{k}"] / acc[f"rows{k}"]
  true = acc[f"true{k}"] / acc[f"rows{k}"]
  zero = acc["zero"] / acc["visible"]
  return {"recall_k": k, "eval_tokens": int(len(windows[0])), "eval_windows": len(windows),
          "recall_per_layer": rec.tolist(), "true_topk_per_layer": true.tolist(),
          "zero_share_per_layer": zero.tolist(), "mean_recall": float(rec.mean()),
          "min_recall": float(rec.min()), "max_zero_share": float(zero.max())}


def held_out_windows(n: int, tokens: int):
  from jaxsparse.model import gguf_weights, text
  ids = np.asarray(gguf_weights.tokenizer().encode(text.held_out_text()).ids, np.int32)
  if len(ids) < n * tokens:
    raise ConfigError(f"--eval-windows={n} x --eval-tokens={tokens} exceeds the held-out "
                      f"text's {len(ids)} tokens")
  return [ids[i * tokens:(i + 1) * tokens] for i in range(n)]


def train(cfg: TrainConfig, progress: bool = True) -> dict:
  out = os.path.abspath(cfg.out)
  # a --corpus file is checked before --out is touched; the documents are tokenised (slow)
  # only once the run's folder and identity pass
  ids, corpus_desc = load_corpus(cfg) if cfg.corpus else (None, None)
  checkpoints.prepare_out(out)
  checkpoints.check_identity(out, cfg.identity(), cfg.steps, TrainConfig.IDENTITY_OPTIONS)
  if ids is None:
    ids, corpus_desc = load_corpus(cfg)
  from flax import nnx
  from jaxsparse.model import lightning, llama
  base = llama.load_model(cfg.num_layers or None)
  icfg = lightning.IndexerConfig(layers=base.cfg.layers, width=base.cfg.width, heads=cfg.heads,
                                 head_dim=cfg.head_dim, rope_dims=cfg.rope_dims)
  model = lightning.LightningIndexers(icfg, rngs=nnx.Rngs(cfg.seed))
  params = model.params_tree()
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, max(1, min(50, cfg.steps // 5)), cfg.steps))
  opt_state = tx.init(params)
  mgr = checkpoints.Manager(os.path.join(out, "checkpoints"), save_every=cfg.save_every)
  start, restored = mgr.restore_latest({"params": params, "opt": opt_state})
  if restored is not None:
    params, opt_state = restored["params"], restored["opt"]
  checkpoints.write_identity(out, cfg.identity(), cfg.steps)
  embed = llama.var_value(base.embed)
  layers = llama.var_value(base.layers)
  step_fn = _make_step(base.cfg, icfg, cfg.leak, tx)
  losses, t0, tokens_seen, stopped = [], time.time(), 0, False
  from rich.progress import Progress
  with Progress(disable=not progress, transient=False) as bar:
    task = bar.add_task("training indexers", total=cfg.steps, completed=start)
    for s in range(start, cfg.steps):
      toks = jnp.asarray(window_for(ids, cfg, s))
      params, opt_state, ls = step_fn(params, opt_state, embed, layers, toks)
      loss = float(ls.mean())
      losses.append(loss)
      tokens_seen += toks.shape[0]
      mgr.maybe_save(s + 1, {"params": params, "opt": opt_state})
      rate = tokens_seen / max(time.time() - t0, 1e-9)
      bar.update(task, advance=1, description=f"training indexers (T={toks.shape[0]}, "
                                              f"KL {loss:.3f}, {rate:,.0f} tok/s)")
      if (s + 1) % cfg.save_every == 0 and not sys.stdout.isatty():
        print(f"step {s + 1}/{cfg.steps} T={toks.shape[0]} KL {loss:.4f} {rate:,.0f} tok/s "
              f"{time.time() - t0:.0f} s", flush=True)
      if cfg.max_seconds and time.time() - t0 > cfg.max_seconds and s + 1 < cfg.steps:
        mgr.save(s + 1, {"params": params, "opt": opt_state})
        stopped = True
        break
  last = s + 1 if losses else start
  if not stopped:
    mgr.save(cfg.steps, {"params": params, "opt": opt_state})
  mgr.close()
  for name, v in params.items():
    getattr(model, name).set_value(v) if hasattr(getattr(model, name), "set_value") else \
        setattr(getattr(model, name), "value", v)
  report = {"config": dataclasses.asdict(cfg), "indexer": dataclasses.asdict(icfg),
            "corpus": corpus_desc, "corpus_tokens": int(len(ids)), "steps_done": last,
            "steps_run": len(losses), "stopped_early": stopped,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "train_seconds": time.time() - t0}
  if not stopped:
    report.update(evaluate(base, model, held_out_windows(cfg.eval_windows, cfg.eval_tokens),
                           cfg.recall_k))
  from jaxsparse._bench.timing import environment
  report["environment"] = environment()
  lightning.save_indexers(os.path.join(out, "indexers.npz"), icfg, params,
                          meta={k: report[k] for k in ("corpus", "steps_done", "stopped_early")}
                          | {"schedule": cfg.schedule})
  _write_json(os.path.join(out, "report.json"), report)
  return report


def _write_json(path, obj):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def build_parser(prog: str = "python -m train.indexer") -> argparse.ArgumentParser:
  from jaxsparse.cli._common import Parser
  from jaxsparse.cli.train import shipped_provenance
  p = Parser(prog=prog, description=__doc__ + "\n" + shipped_provenance())
  p.add_argument("--out", required=True, help="directory for checkpoints, report, indexers.npz "
                 "(required)")
  p.add_argument("--schedule", default=None,
                 help=f"length curriculum WINDOW:STEPS,... (default {TrainConfig.schedule})")
  p.add_argument("--window", type=int, default=0,
                 help="one stage of this window (with --steps) instead of --schedule "
                 "(default: --schedule)")
  p.add_argument("--steps", type=int, default=0,
                 help="steps of the --window stage (default: --schedule)")
  for f in dataclasses.fields(TrainConfig):
    if f.name in ("out", "schedule"):
      continue
    typ = {"int": int, "float": float, "str": str}[f.type]
    p.add_argument("--" + f.name.replace("_", "-"), type=typ, default=f.default,
                   help=f"{OPTION_HELP[f.name]} (default {f.default!r})")
  return p


def config_from_args(a) -> TrainConfig:
  sched = a.schedule if a.schedule is not None else TrainConfig.schedule
  if a.window or a.steps:
    if not (a.window and a.steps):
      raise ConfigError("--window and --steps go together (one stage); or use --schedule")
    if a.schedule is not None:
      raise ConfigError("--schedule does not apply beside --window/--steps (one stage)")
    if a.window < 2 or a.steps < 1:
      raise ConfigError(f"--window={a.window} and --steps={a.steps} must be >= 2 and >= 1")
    sched = f"{a.window}:{a.steps}"
  kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)
        if f.name != "schedule"}
  return TrainConfig(schedule=sched, **kw)


def main(argv=None, prog: str = "python -m train.indexer") -> int:
  p = build_parser(prog)
  a = p.parse_args(argv)
  try:
    cfg = config_from_args(a)
    rep = train(cfg)
  except (ConfigError, checkpoints.CheckpointError, FetchError) as e:
    p.error(str(e))  # the usage, then one error line, exit status 2
  keys = ("steps_done", "stopped_early", "first_loss", "last_loss", "mean_recall",
          "min_recall", "max_zero_share")
  print(json.dumps({k: rep[k] for k in keys if k in rep}, indent=1))
  print(f"indexers written to {os.path.join(cfg.out, 'indexers.npz')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

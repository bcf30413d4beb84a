"""Train a lightning indexer for every layer of SmolLM2 with DeepSeek-V3.2's dense warm-up.

The base model is frozen; for each query t the target is its attention distribution summed over
heads and L1-normalised; the loss is KL(target_t || softmax(indexer_t)) over the causal prefix;
the indexer's inputs (each layer's normalised attention input) carry no gradient.

  python -m train.indexer --steps 300 --window 1024 --out runs/indexer   (minutes on an H200)
  jaxsparse train-indexer --help                                          (same, via the CLI)

Checkpoints (Orbax, atomic) hold the indexer parameters, the optimizer state and the step; a
rerun with the same --out resumes from the latest one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from jaxsparse.benchtools import environment
from jaxsparse.model import gguf_weights, lightning, llama, text


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  out: str
  steps: int = 300
  window: int = 1024
  layers: int | None = None  # None: all layers of the base model
  heads: int = 4
  head_dim: int = 32
  rope_dims: int = 16
  lr: float = 3e-3
  eval_windows: int = 4
  recall_k: int = 64
  save_every: int = 50
  seed: int = 0

  def __post_init__(self):
    for name in ("steps", "window", "eval_windows", "recall_k", "save_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be positive")
    if self.window < 2 * self.recall_k:
      raise ValueError(f"window={self.window} must be at least 2 * recall_k={2 * self.recall_k}")
    if not self.out:
      raise ValueError("out must name a directory for checkpoints and the report")


def token_windows(window: int):
  """Non-overlapping windows of real text: Python docs (prose) and _pydecimal.py (code).

  Returns (train [n, window] int32, eval [m, window] int32); the last windows of each source
  are held out for evaluation.
  """
  tok = gguf_weights.tokenizer()
  train, held = [], []
  for kind in ("docs", "code"):
    ids = np.asarray(tok.encode(text.corpus(kind)).ids, np.int32)
    n = len(ids) // window
    w = ids[: n * window].reshape(n, window)
    cut = max(1, n // 10)
    train.append(w[:-cut])
    held.append(w[-cut:])
  return np.concatenate(train), np.concatenate(held)


def _interleave(a):
  """Alternate docs and code windows so training sees both from the start."""
  rng = np.random.default_rng(0)
  return a[rng.permutation(len(a))]


def train(cfg: TrainConfig, progress: bool = True) -> dict:
  base = llama.load_model(cfg.layers)
  icfg = lightning.IndexerConfig(layers=base.cfg.layers, width=base.cfg.width, heads=cfg.heads,
                                 head_dim=cfg.head_dim, rope_dims=cfg.rope_dims)
  model = lightning.LightningIndexers(icfg, rngs=nnx.Rngs(cfg.seed))
  opt = nnx.Optimizer(model, optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, min(50, cfg.steps // 5 + 1), cfg.steps)), wrt=nnx.Param)
  tr, ev = token_windows(cfg.window)
  tr = _interleave(tr)
  os.makedirs(cfg.out, exist_ok=True)
  ckpt_dir = os.path.abspath(os.path.join(cfg.out, "checkpoints"))
  mgr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(
      max_to_keep=2, save_interval_steps=cfg.save_every))
  start = 0
  if mgr.latest_step() is not None:
    start = mgr.latest_step()
    restored = mgr.restore(start, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(nnx.state(model).to_pure_dict()),
        opt=ocp.args.StandardRestore(nnx.state(opt).to_pure_dict())))
    ms, os_ = nnx.state(model), nnx.state(opt)
    nnx.replace_by_pure_dict(ms, restored["model"])
    nnx.replace_by_pure_dict(os_, restored["opt"])
    nnx.update(model, ms)
    nnx.update(opt, os_)

  @nnx.jit
  def step(model, opt, hidden, attn):
    def loss_fn(m):
      return lightning.kl_loss(m(hidden), attn)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses = []
  from rich.progress import Progress
  with Progress(disable=not progress) as bar:
    task = bar.add_task("training indexers", total=cfg.steps, completed=start)
    for s in range(start, cfg.steps):
      toks = jnp.asarray(tr[s % len(tr)])
      _, coll = base(toks, collect=True)
      hidden = jax.lax.stop_gradient(coll["hidden"])
      loss = float(step(model, opt, hidden, coll["attn"]))
      losses.append(loss)
      mgr.save(s + 1, args=_save_args(model, opt))
      bar.update(task, advance=1, description=f"training indexers (KL {loss:.3f})")
  if mgr.latest_step() != cfg.steps:  # the last step falls between save intervals
    mgr.save(cfg.steps, args=_save_args(model, opt), force=True)
  mgr.wait_until_finished()
  report = evaluate(base, model, ev[: cfg.eval_windows], cfg.recall_k)
  report.update(config=dataclasses.asdict(cfg), indexer=dataclasses.asdict(icfg),
                steps_run=len(losses), first_loss=losses[0] if losses else None,
                last_loss=losses[-1] if losses else None,
                environment=environment())
  _write_json(os.path.join(cfg.out, "report.json"), report)
  return report


def _save_args(model, opt):
  """Model and optimizer as separate items, so inference can restore the model alone."""
  return ocp.args.Composite(model=ocp.args.StandardSave(nnx.state(model).to_pure_dict()),
                            opt=ocp.args.StandardSave(nnx.state(opt).to_pure_dict()))


def evaluate(base, model, windows, k: int) -> dict:
  """Per-layer top-k recall of attention mass (indexer vs a k-slot recent window) and KL."""
  rec, win, kls = [], [], []
  for wnd in windows:
    _, coll = base(jnp.asarray(wnd), collect=True)
    sc = model(coll["hidden"])
    rec.append(np.asarray(lightning.topk_recall(sc, coll["attn"], k)))
    win.append(np.asarray(lightning.recent_recall(coll["attn"], k)))
    kls.append(float(lightning.kl_loss(sc, coll["attn"])))
  rec, win = np.mean(rec, 0), np.mean(win, 0)
  return {"recall_k": k, "recall_per_layer": rec.tolist(), "recent_window_per_layer": win.tolist(),
          "mean_recall": float(rec.mean()), "mean_recent_window": float(win.mean()),
          "eval_kl": float(np.mean(kls)), "eval_windows": int(len(windows))}


def _write_json(path, obj):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def load_indexers(out: str, layers: int | None = None):
  """The trained indexers saved by `train` under `out` (latest checkpoint)."""
  with open(os.path.join(out, "report.json")) as f:
    rep = json.load(f)
  icfg = lightning.IndexerConfig(**rep["indexer"])
  if layers is not None and layers != icfg.layers:
    raise ValueError(f"{layers=} does not match the checkpoint's {icfg.layers} layers")
  model = lightning.LightningIndexers(icfg, rngs=nnx.Rngs(0))
  mgr = ocp.CheckpointManager(os.path.abspath(os.path.join(out, "checkpoints")))
  if mgr.latest_step() is None:
    raise FileNotFoundError(f"no checkpoint under {out}/checkpoints")
  restored = mgr.restore(mgr.latest_step(), args=ocp.args.Composite(
      model=ocp.args.StandardRestore(nnx.state(model).to_pure_dict())))
  st = nnx.state(model)
  nnx.replace_by_pure_dict(st, restored["model"])
  nnx.update(model, st)
  return model


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  for f in dataclasses.fields(TrainConfig):
    typ = int if f.type in ("int", "int | None") else float if f.type == "float" else str
    default = None if f.default is dataclasses.MISSING else f.default
    p.add_argument("--" + f.name.replace("_", "-"), type=typ, default=default,
                   required=f.default is dataclasses.MISSING)
  a = p.parse_args(argv)
  cfg = TrainConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)})
  rep = train(cfg)
  print(json.dumps({k: rep[k] for k in ("mean_recall", "mean_recent_window", "eval_kl",
                                         "first_loss", "last_loss")}, indent=1))


if __name__ == "__main__":
  main()

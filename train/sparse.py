"""DeepSeek-V3.2's sparse indexer stage for SmolLM2, trained from cached layer inputs.

The dense warm-up (`train.indexer`) fits each indexer's softmax to the whole attention
distribution, tail included. The sparse stage fits it where selection happens: for a query t
the indexer's own top-k keys S_t are selected, and the loss is

    KL( p_t on S_t, renormalised  ||  softmax(indexer scores of t over S_t) ),

p_t being the layer's attention summed over heads. It moves the keys that carry attention to
the top of the selection and the ones that do not out of it, which is what a small k (64) needs.

The base model is frozen, so each layer's normalised attention input h [T, width] and the
attention's log-normaliser per query and head (lse [T, heads]) are computed once per window
(`collect`, one chunked forward). From them the weight of any (query, key) pair of any layer is
exp(q . k / sqrt(d) - lse), so a step needs no forward of the model: per layer, the indexer
scores the sampled queries against every visible key (selection, no gradient), then the loss
and its gradient cost k keys per query. That fits a CPU (about 4 s a step on 2 cores at 8,192
tokens, 256 queries, 30 layers).

  python -m train.sparse collect --corpus ids.npy --windows 8 --tokens 8192 --out cache/
  python -m train.sparse train --data cache/ --out runs/sparse --steps 300

`train` starts from the shipped indexers (or `--init FILE`), keeps Orbax checkpoints (resume is
exact), reports the validation window's recall of attention mass at 64 and 256 keys before and
after, and exports OUT/indexers.npz (`lightning.save_indexers` format).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsparse._io import save_npz_atomic
from train import checkpoints

__all__ = ["SparseConfig", "ConfigError", "collect", "load_data", "layer_loss", "train", "main"]

DATA_FORMAT = 1


class ConfigError(ValueError):
  """An option or data directory that cannot work; raised before training starts."""


# ----------------------------------------------------------------------------- cached inputs

def collect(base, windows, out: str, *, chunk: int = 512, progress=print) -> list[str]:
  """One chunked forward of `base` (a `llama.Llama`) per window of token ids; writes OUT/window_XXX.npz with tokens [T] int32,
  hidden [L, T, width] float32 and lse [L, T, heads] float32. Returns the paths."""
  from jaxsparse.model import llama
  os.makedirs(out, exist_ok=True)
  paths = []
  for i, wnd in enumerate(windows):
    path = os.path.join(out, f"window_{i:03d}.npz")
    paths.append(path)
    if os.path.isfile(path):
      progress(f"{path} exists, kept")
      continue
    t0 = time.time()
    wnd = np.asarray(wnd, np.int32)
    _, _, (h, lse), _ = llama.run_chunked(base, wnd, chunk=min(chunk, len(wnd)), hidden=True,
                                          attn_lse=True)
    save_npz_atomic(path, {"format": np.int64(DATA_FORMAT), "tokens": wnd,
                           "hidden": np.asarray(h, np.float32),
                           "lse": np.asarray(lse, np.float32)})
    progress(f"{path}: {len(wnd)} tokens in {time.time() - t0:.0f} s")
  return paths


def load_data(directory: str, *, layers: int, width: int, heads: int):
  """The cached windows of `directory` as a list of (hidden, lse) numpy pairs, validated."""
  paths = sorted(glob.glob(os.path.join(directory, "window_*.npz")))
  if not paths:
    raise ConfigError(f"--data={directory!r} holds no window_*.npz (run `collect` first)")
  out = []
  for p in paths:
    try:
      with np.load(p, allow_pickle=False) as z:
        if "format" not in z.files or int(z["format"]) != DATA_FORMAT:
          raise ConfigError(f"{p}: not a sparse-stage window of format {DATA_FORMAT}")
        h, lse = z["hidden"], z["lse"]
    except (OSError, ValueError, KeyError) as e:
      if isinstance(e, ConfigError):
        raise
      raise ConfigError(f"{p} is not a readable window file: {e}") from None
    t = h.shape[1] if h.ndim == 3 else -1
    if h.shape != (layers, t, width) or lse.shape != (layers, t, heads):
      raise ConfigError(f"{p}: hidden {h.shape} / lse {lse.shape} do not fit the model "
                        f"({layers} layers, width {width}, {heads} heads)")
    out.append((h, lse))
  if len({h.shape[1] for h, _ in out}) != 1:
    raise ConfigError(f"--data={directory!r}: the windows differ in length")
  return out


# ----------------------------------------------------------------------------- the loss

def _attention_weights(bcfg, w, h, lse, rows, keys):
  """Head-averaged attention weight of query rows [Q] on keys [Q, k] (int), from h [T, width],
  lse [T, heads] and the layer's base weights: float32 [Q, k] (each row of the full
  distribution sums to 1; these are the entries at `keys`)."""
  from jaxsparse.model import llama
  nh, nkv, hd = bcfg.heads, bcfg.kv_heads, bcfg.head_dim
  g = nh // nkv
  q = llama.rope_pairs((h[rows] @ w["q"].T).reshape(-1, nh, hd), rows, bcfg.rope_base)
  kk = llama.rope_pairs((h @ w["k"].T).reshape(-1, nkv, hd), jnp.arange(h.shape[0]),
                        bcfg.rope_base)[keys]  # [Q, k, nkv, hd]
  logit = jnp.einsum("qngd,qknd->qngk", q.reshape(-1, nkv, g, hd), kk) / np.sqrt(hd)
  logit = logit.reshape(q.shape[0], nh, -1)
  return jnp.exp(logit - lse[rows][:, :, None]).mean(1)


def _selection_scores(icfg, ip, h, rows):
  from jaxsparse.model import lightning
  iq, iw = lightning.project_queries(icfg, ip, h[rows], rows)
  ik = lightning.project_keys(icfg, ip, h)
  return iq, iw, ik


def layer_loss(bcfg, icfg, leak, k, ip, w, h, lse, rows):
  """The sparse-stage loss of one layer over query rows [Q] (int, positions in the window).

  ip: the layer's indexer arrays; w: the layer's base weights ("q", "k"); h [T, width];
  lse [T, heads]. Returns (mean KL over the rows, mean attention mass the selection holds).
  """
  from jaxsparse.model import lightning
  t = h.shape[0]
  iq, iw, ik = _selection_scores(icfg, ip, h, rows)
  vis = jnp.arange(t)[None, :] <= rows[:, None]
  z_all = jnp.einsum("qhn,qh->qn", jnp.maximum(
      jnp.einsum("qhd,nd->qhn", iq, ik, preferred_element_type=jnp.float32), 0.0), iw)
  _, sel = jax.lax.top_k(jax.lax.stop_gradient(jnp.where(vis, z_all, -jnp.inf)), k)
  valid = sel <= rows[:, None]
  s = jnp.einsum("qhd,qkd->qhk", iq, ik[sel], preferred_element_type=jnp.float32)
  z = jnp.einsum("qhk,qh->qk", lightning.leaky_relu_grad(s, leak), iw)
  z = jnp.where(valid, z, -jnp.inf)
  p = jnp.where(valid, jax.lax.stop_gradient(_attention_weights(bcfg, w, h, lse, rows, sel)),
                0.0)
  held = p.sum(-1)
  target = p / held[:, None]
  logq = jax.nn.log_softmax(z, axis=-1)
  kl = jnp.sum(jnp.where(valid & (target > 0),
                         target * (jnp.log(jnp.where(target > 0, target, 1.0)) - logq), 0.0), -1)
  return kl.mean(), held.mean()


def mass_recall(bcfg, icfg, ip, w, h, lse, rows, ks):
  """Per k: mean over rows of the attention mass on the indexer's top-k and on the true top-k
  (rows with more than k visible keys only)."""
  t = h.shape[0]
  iq, iw, ik = _selection_scores(icfg, ip, h, rows)
  vis = jnp.arange(t)[None, :] <= rows[:, None]
  z = jnp.where(vis, jnp.einsum("qhn,qh->qn", jnp.maximum(
      jnp.einsum("qhd,nd->qhn", iq, ik), 0.0), iw), -jnp.inf)
  allk = jnp.broadcast_to(jnp.arange(t)[None, :], (rows.shape[0], t))
  a = jnp.where(vis, _attention_weights(bcfg, w, h, lse, rows, allk), 0.0)
  out = {}
  for k in ks:
    live = rows + 1 > k
    got = jnp.take_along_axis(a, jax.lax.top_k(z, k)[1], -1).sum(-1)
    best = jax.lax.top_k(a, k)[0].sum(-1)
    n = jnp.maximum(live.sum(), 1)
    out[k] = (jnp.where(live, got, 0).sum() / n, jnp.where(live, best, 0).sum() / n)
  return out


# ----------------------------------------------------------------------------- training

@dataclasses.dataclass(frozen=True)
class SparseConfig:
  data: str
  out: str
  init: str = ""  # "" = the shipped indexers
  steps: int = 300
  topk: int = 256
  queries: int = 256
  lr: float = 3e-4
  leak: float = 0.1
  val_windows: int = 1
  val_queries: int = 512
  save_every: int = 25
  max_seconds: float = 0.0
  seed: int = 0

  def __post_init__(self):
    for name in ("steps", "topk", "queries", "val_queries", "save_every"):
      if getattr(self, name) < 1:
        raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")
    if self.val_windows < 0:
      raise ConfigError(f"--val-windows={self.val_windows} must be >= 0")
    if not self.lr > 0:
      raise ConfigError(f"--lr={self.lr} must be positive")
    if not 0 <= self.leak < 1:
      raise ConfigError(f"--leak={self.leak} must lie in [0, 1)")
    if not os.path.isdir(self.data):
      raise ConfigError(f"--data={self.data!r} is not a directory")
    if self.init and not os.path.isfile(self.init):
      raise ConfigError(f"--init={self.init!r} does not exist")

  def identity(self) -> dict:
    return {k: getattr(self, k) for k in ("data", "init", "topk", "queries", "lr", "leak",
                                          "val_windows", "seed")}


def _rows(seed, step, t, n, low):
  """Query positions of one step: n distinct positions in [low, t), deterministic."""
  return np.sort(np.random.default_rng([seed, step]).choice(np.arange(low, t), n,
                                                             replace=False)).astype(np.int32)


def _make_step(bcfg, icfg, cfg, tx):
  def loss_all(params, layers, h, lse, rows):
    def one(_, xs):
      ip, w, hl, ll = xs
      (loss, held), g = jax.value_and_grad(
          lambda ip: layer_loss(bcfg, icfg, cfg.leak, cfg.topk, ip, w, hl, ll, rows),
          has_aux=True)(ip)
      return None, (loss, held, g)
    _, (loss, held, grads) = jax.lax.scan(one, None, (params, layers, h, lse))
    return loss, held, grads

  @jax.jit
  def step(params, opt_state, layers, h, lse, rows):
    loss, held, grads = loss_all(params, layers, h, lse, rows)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, held
  return step


def _make_eval(bcfg, icfg, ks):
  @jax.jit
  def ev(params, layers, h, lse, rows):
    def one(_, xs):
      ip, w, hl, ll = xs
      r = mass_recall(bcfg, icfg, ip, w, hl, ll, rows, ks)
      return None, jnp.stack([jnp.stack(r[k]) for k in ks])
    return jax.lax.scan(one, None, (params, layers, h, lse))[1]  # [L, len(ks), 2]
  return ev


def _validate(ev, params, layers, val, cfg, ks):
  acc = []
  for i, (h, lse) in enumerate(val):
    t = h.shape[1]
    rows = jnp.asarray(_rows(cfg.seed + 1, i, t, min(cfg.val_queries, t - min(ks)), min(ks)))
    acc.append(np.asarray(ev(params, layers, jnp.asarray(h), jnp.asarray(lse), rows)))
  r = np.mean(acc, 0)
  return {f"top{k}": {"indexer": r[:, j, 0].tolist(), "true": r[:, j, 1].tolist(),
                      "mean_indexer": float(r[:, j, 0].mean()),
                      "mean_true": float(r[:, j, 1].mean())} for j, k in enumerate(ks)}


def train(cfg: SparseConfig, progress: bool = True) -> dict:
  from jaxsparse.model import lightning, llama
  out = os.path.abspath(cfg.out)
  checkpoints.prepare_out(out)
  checkpoints.check_identity(out, cfg.identity(), cfg.steps)
  init = cfg.init or lightning.default_indexers_path()
  model = lightning.load_indexers(init)
  icfg = model.cfg
  base = llama.load_model(icfg.layers)
  bc = base.cfg
  if icfg.width != bc.width:
    raise ConfigError(f"--init={init!r} is for width {icfg.width}; the model's is {bc.width}")
  data = load_data(cfg.data, layers=bc.layers, width=bc.width, heads=bc.heads)
  if len(data) <= cfg.val_windows:
    raise ConfigError(f"--data holds {len(data)} window(s); --val-windows={cfg.val_windows} "
                      f"leaves none to train on")
  val, trn = data[:cfg.val_windows], data[cfg.val_windows:]
  t = trn[0][0].shape[1]
  if t <= cfg.topk or cfg.queries > t - cfg.topk:
    raise ConfigError(f"windows of {t} tokens leave too few queries past --topk={cfg.topk} "
                      f"for --queries={cfg.queries}")
  params = model.params_tree()
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, max(1, min(25, cfg.steps // 10)), cfg.steps), weight_decay=0.0)
  opt_state = tx.init(params)
  mgr = checkpoints.Manager(os.path.join(out, "checkpoints"), save_every=cfg.save_every)
  start, restored = mgr.restore_latest({"params": params, "opt": opt_state})
  if restored is not None:
    params, opt_state = restored["params"], restored["opt"]
  checkpoints.write_identity(out, cfg.identity(), cfg.steps)
  lw = llama.var_value(base.layers)
  layers = {"q": lw["q"], "k": lw["k"]}
  step_fn = _make_step(bc, icfg, cfg, tx)
  ks = tuple(k for k in (64, 256) if k < t)  # validation: recall of attention mass at k keys
  ev = _make_eval(bc, icfg, ks)
  report = {"config": dataclasses.asdict(cfg), "init": os.path.basename(init),
            "train_windows": len(trn), "window_tokens": int(t)}
  if val and ks and start == 0:
    report["val_before"] = _validate(ev, model.params_tree(), layers, val, cfg, ks)
  losses, helds, t0, stopped = [], [], time.time(), False
  from rich.progress import Progress
  with Progress(disable=not progress, transient=False) as bar:
    task = bar.add_task("sparse stage", total=cfg.steps, completed=start)
    for s in range(start, cfg.steps):
      h, lse = trn[s % len(trn)]
      rows = jnp.asarray(_rows(cfg.seed, s, t, cfg.queries, cfg.topk))
      params, opt_state, ls, hd = step_fn(params, opt_state, layers, jnp.asarray(h),
                                          jnp.asarray(lse), rows)
      losses.append(float(ls.mean()))
      helds.append(float(hd.mean()))
      mgr.maybe_save(s + 1, {"params": params, "opt": opt_state})
      bar.update(task, advance=1, description=f"sparse stage (KL {losses[-1]:.3f}, "
                                              f"mass held {helds[-1]:.3f})")
      if (s + 1) % cfg.save_every == 0 and not sys.stdout.isatty():
        print(f"step {s + 1}/{cfg.steps} KL {losses[-1]:.4f} held {helds[-1]:.4f} "
              f"{time.time() - t0:.0f} s", flush=True)
      if cfg.max_seconds and time.time() - t0 > cfg.max_seconds and s + 1 < cfg.steps:
        mgr.save(s + 1, {"params": params, "opt": opt_state})
        stopped = True
        break
  if not stopped:
    mgr.save(cfg.steps, {"params": params, "opt": opt_state})
  mgr.close()
  report.update({"steps_run": len(losses), "stopped_early": stopped,
                 "first_loss": losses[0] if losses else None,
                 "last_loss": losses[-1] if losses else None,
                 "first_mass_held": helds[0] if helds else None,
                 "last_mass_held": helds[-1] if helds else None,
                 "train_seconds": time.time() - t0})
  if not stopped:
    if val and ks:
      report["val_after"] = _validate(ev, params, layers, val, cfg, ks)
    lightning.save_indexers(os.path.join(out, "indexers.npz"), icfg, params,
                            meta={"stage": "sparse", "init": os.path.basename(init),
                                  "topk": cfg.topk, "steps": cfg.steps})
  from jaxsparse._bench.timing import environment
  report["environment"] = environment()
  tmp = os.path.join(out, "report.json.tmp")
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1)
  os.replace(tmp, os.path.join(out, "report.json"))
  return report


# ----------------------------------------------------------------------------- CLI

def _windows_from_corpus(path, n, tokens, seed):
  if not os.path.isfile(path):
    raise ConfigError(f"--corpus={path!r} does not exist")
  ids = np.load(path, allow_pickle=False).astype(np.int32).reshape(-1)
  if len(ids) < n * tokens:
    raise ConfigError(f"--corpus holds {len(ids)} tokens, fewer than --windows={n} x "
                      f"--tokens={tokens}")
  starts = np.sort(np.random.default_rng(seed).choice(len(ids) // tokens, n, replace=False))
  return [ids[s * tokens:(s + 1) * tokens] for s in starts]


def build_parser(prog: str = "python -m train.sparse") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  c = sub.add_parser("collect", help="cache each window's layer inputs and attention lse")
  c.add_argument("--corpus", required=True, help=".npy of training token ids (train.corpus)")
  c.add_argument("--windows", type=int, default=8)
  c.add_argument("--tokens", type=int, default=8192)
  c.add_argument("--seed", type=int, default=0)
  c.add_argument("--out", required=True)
  t = sub.add_parser("train", help="the sparse stage from cached windows")
  for f in dataclasses.fields(SparseConfig):
    typ = {"int": int, "float": float, "str": str}[f.type]
    kw = {"required": True} if f.default is dataclasses.MISSING else {"default": f.default}
    t.add_argument("--" + f.name.replace("_", "-"), type=typ, **kw)
  return p


def main(argv=None, prog: str = "python -m train.sparse") -> int:
  p = build_parser(prog)
  a = p.parse_args(argv)
  try:
    if a.cmd == "collect":
      if a.windows < 1 or not 2 <= a.tokens <= 8192:
        raise ConfigError(f"--windows={a.windows} must be >= 1 and --tokens={a.tokens} in "
                          f"[2, 8192] (the model's context)")
      wins = _windows_from_corpus(a.corpus, a.windows, a.tokens, a.seed)
      from jaxsparse.model import llama
      collect(llama.load_model(), wins, a.out)
      return 0
    cfg = SparseConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(SparseConfig)})
    rep = train(cfg)
  except (ConfigError, checkpoints.CheckpointError) as e:
    p.exit(2, f"{p.prog}: error: {e}\n")
  for key in ("val_before", "val_after"):
    if key in rep:
      print(key, {k: round(v["mean_indexer"], 4) for k, v in rep[key].items()})
  print(f"indexers written to {os.path.join(cfg.out, 'indexers.npz')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

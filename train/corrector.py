"""Train AttentionIndex's representative-correction networks, one per layer (Flax NNX + Optax).

Data come from prefill traces of the frozen model (`jaxsparse trace prefill`, training text
only): the index is replayed over the trace exactly as at inference (seals, refits, versions);
for sampled queries the full top-K is the reference, and a group's target is (reference keys
in the group) / (group size). The loss is listwise (ListNet): the cross-entropy between the
targets normalised over the query's usable groups and the softmax of the corrected
representatives' indexer scores divided by a temperature (the standard deviation of the plain
means' scores, fixed from the data). It rewards putting reference-dense groups first, over the
whole ranking at once, and is smooth in the correction; a pairwise loss would need O(G^2)
terms per query for the same information.

  python -m train.corrector --train-trace train.npz --eval-trace heldout.npz --layers 5,15 \\
      --steps 400 --out runs/corrector
  jaxsparse train corrector ...                                       (same options)

With --val-trace (a trace of training text the steps never see) a layer whose correction does
not raise recall there is exported as plain means: `ivf.evaluate` then uses the member means
for it (the file lists it in meta["plain_layers"]).

Checkpoints per layer (Orbax, atomic, the latest two kept) hold parameters, optimizer state and
step; a rerun with the same --out and options resumes and ends with the same parameters as an
uninterrupted run (once a checkpoint exists, a rerun that changes --steps, --lr, the traces, ...
is refused: a new --out starts a new run). --eval-trace and --val-trace must be other files
than the training traces. OUT/correctors.npz is the export `ivf.evaluate(..., corrector=PATH, layer=L)` loads.
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

from train import checkpoints

__all__ = ["CorrectorTrainConfig", "ConfigError", "build_snapshots", "train", "main"]


class ConfigError(ValueError):
  """A training option that cannot work; raised before any data is built."""


@dataclasses.dataclass(frozen=True)
class CorrectorTrainConfig:
  out: str
  train_trace: str  # one or more prefill traces, comma-separated (same length and layers)
  eval_trace: str
  val_trace: str = ""  # training text the steps never see: a layer whose correction does not
  #                      raise its recall there exports as plain means
  layers: str = ""  # comma list of model layer ids (of those the traces hold); "" = all
  steps: int = 300
  lr: float = 2e-3
  queries: int = 64  # per step
  topk: int = 128
  budget: int = 512
  seal_window: int = 256
  cluster_size: int = 32
  refit_interval: int = 1024
  member_features: int = 64
  hidden: int = 128
  scale: float = 0.5
  target_power: float = 1.0  # > 1 sharpens the targets toward the reference-densest groups
  eval_queries: int = 128
  eval_every: int = 100
  save_every: int = 50
  max_seconds: float = 0.0
  seed: int = 0

  def __post_init__(self):
    for name in ("steps", "queries", "topk", "budget", "eval_queries", "eval_every",
                 "save_every", "member_features", "hidden"):
      if getattr(self, name) < 1:
        raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")
    if self.steps < 2:
      raise ConfigError(f"--steps={self.steps}: training needs at least 2 steps")
    for name in ("lr", "scale", "target_power"):
      v = getattr(self, name)
      if not (v > 0 and math.isfinite(v)):
        raise ConfigError(f"--{name.replace('_', '-')}={v} must be a positive finite number")
    checkpoints.check_run_limits(self.max_seconds, self.seed, ConfigError)
    if not self.out:
      raise ConfigError("--out must name a directory")
    from jaxsparse.cli._common import comma_ints, comma_paths, option_names
    try:
      if self.layers:
        comma_ints("--layers", self.layers, low=0)
      for name in ("train_trace", "eval_trace", "val_trace"):
        option = f"--{name.replace('_', '-')}"
        paths = comma_paths(option, getattr(self, name)) if getattr(self, name) else []
        if len(paths) > 1 and name != "train_trace":
          raise ConfigError(f"{option} takes one trace, got {len(paths)}")
        for path in paths:
          if not os.path.isfile(path):
            raise ConfigError(f"{option}: {path!r} does not exist")
      self._check_held_out()
      self.ivf_config()
    except ConfigError:
      raise
    except ValueError as e:
      raise ConfigError(option_names(str(e), IVF_OPTIONS)) from None

  def _check_held_out(self) -> None:
    """--eval-trace and --val-trace must be other files than every --train-trace (and than
    each other's): recall on the training data says nothing about held-out text."""
    train = {os.path.realpath(p): p for p in self.train_trace.split(",") if p}
    seen = {}
    for name in ("eval_trace", "val_trace"):
      path = getattr(self, name)
      if not path:
        continue
      option, real = f"--{name.replace('_', '-')}", os.path.realpath(path)
      if real in train:
        raise ConfigError(f"{option}={path!r} is also a --train-trace ({train[real]!r}); give "
                          f"a trace of text the steps never see")
      if real in seen:
        raise ConfigError(f"{option}={path!r} is the same file as {seen[real]}; give two "
                          f"different texts")
      seen[real] = f"{option}={path!r}"

  def ivf_config(self):
    from jaxsparse import ivf
    return ivf.IVFConfig(topk=self.topk, budget=self.budget, seal_window=self.seal_window,
                         cluster_size=self.cluster_size, refit_interval=self.refit_interval)

  def identity(self) -> dict:
    return {k: getattr(self, k) for k in ("train_trace", "topk", "budget", "seal_window",
                                          "cluster_size", "refit_interval", "member_features",
                                          "hidden", "scale", "lr", "queries", "seed",
                                          "target_power", "steps")}


IVF_OPTIONS = {name: f"--{name.replace('_', '-')}" for name in
               ("topk", "budget", "seal_window", "cluster_size", "refit_interval")}
"""The option that sets each `ivf.IVFConfig` field (the same names)."""


OPTION_HELP = {
    "out": "directory for the per-layer checkpoints, the report and correctors.npz",
    "train_trace": "prefill trace(s) of training text, comma list (same tokens and layers)",
    "eval_trace": "held-out prefill trace: the recall printed and reported per layer",
    "val_trace": "prefill trace of training text the steps never see; a layer whose "
                 "correction does not raise recall on it is exported as plain means ('': no "
                 "gate)",
    "layers": "comma list of model layer ids to train, of those the traces hold ('': all)",
    "steps": "optimizer steps per layer",
    "lr": "AdamW learning rate",
    "queries": "training queries per step",
    "topk": "IVF top-K whose reference keys are the targets",
    "budget": "IVF candidate slots per query",
    "seal_window": "IVF keys per seal",
    "cluster_size": "IVF average keys per group",
    "refit_interval": "IVF tokens between refits (0: seal only)",
    "member_features": "width of the network's per-member transform",
    "hidden": "width of the network's hidden layer",
    "scale": "bound on each coordinate of the correction (scale * tanh)",
    "target_power": "power on the targets (> 1 sharpens them toward the reference-densest "
                    "groups)",
    "eval_queries": "query positions of the held-out (and validation) recall",
    "eval_every": "steps between held-out recall evaluations",
    "save_every": "steps between checkpoints",
    "max_seconds": "checkpoint and stop a layer after this long, 0: no limit (a rerun resumes)",
    "seed": "initialisation and query sampling seed",
}


_REF_SCORES = 1 << 30  # one chunk up to 8K tokens of 16 heads; 32K takes 16


def build_snapshots(q, k, w, cfg) -> list[dict]:
  """Replay the index over one trace layer; per version, its grouping and every query that
  uses it with its targets. Returns [{"assign" [N], "sizes" [G], "queries" [Qv], "target"
  [Qv, G] float32 (reference share per group; 0 where unusable), "usable" [Qv, G] bool}]."""
  from jaxsparse.ivf.prefill import exact_scores
  from jaxsparse.ivf import index
  n = k.shape[0]
  kj = jnp.asarray(k)
  pos_all = np.arange(cfg.seal_window, n)
  # the exact top-K in query chunks of at most _REF_SCORES scores
  rows = max(1, _REF_SCORES // (q.shape[1] * n))
  qj, wj = jnp.asarray(q), jnp.asarray(w)
  ref = np.concatenate([
      np.asarray(exact_scores(qj[pj], kj, wj[pj], pj, cfg.topk)[1])
      for pj in (jnp.asarray(pos_all[i:i + rows], jnp.int32)
                 for i in range(0, len(pos_all), rows))])
  state = index.init_state(n, k.shape[1], cfg)
  out = []
  for v in range(1, n // cfg.seal_window + 1):
    p = v * cfg.seal_window
    state = index.seal(state, kj, p, config=cfg)
    if cfg.refit_interval and p % cfg.refit_interval == 0:
      state = index.refit(state, kj, p, config=cfg)
    sel = np.nonzero((pos_all + 1) // cfg.seal_window == v)[0]
    if not len(sel):
      continue
    assign = np.asarray(state["assign"])
    sizes = np.asarray(state["sizes"])
    last = np.asarray(state["last"])
    g = len(sizes)
    r = ref[sel]
    hit = np.where(r >= 0, assign[np.maximum(r, 0)], -1)
    cnt = np.stack([np.bincount(h[h >= 0], minlength=g) for h in hit]).astype(np.float32)
    usable = np.broadcast_to((sizes > 0) & (last < p), cnt.shape)
    out.append({"assign": assign, "sizes": sizes, "queries": pos_all[sel],
                "target": np.where(usable, cnt / np.maximum(sizes, 1), 0.0).astype(np.float32),
                "usable": usable.copy()})
  return out


def _scores(q, w, reps):
  s = jnp.einsum("qhd,gd->qhg", q, reps)
  return jnp.einsum("qhg,qh->qg", jnp.maximum(s, 0.0), w)


def listnet_loss(scores, target, usable, tau, power: float = 1.0):
  """Cross-entropy of softmax(scores / tau) against the normalised targets (raised to `power`)
  over usable groups; queries whose reference keys fall in no usable group are left out."""
  logp = jax.nn.log_softmax(jnp.where(usable, scores / tau, -jnp.inf), axis=-1)
  target = target ** power
  tot = target.sum(-1, keepdims=True)
  p = target / jnp.maximum(tot, 1e-9)
  per = -jnp.sum(jnp.where(usable, p * logp, 0.0), -1)
  live = tot[:, 0] > 0
  return jnp.sum(jnp.where(live, per, 0.0)) / jnp.maximum(live.sum(), 1)


def _batch(snaps, data, cfg: CorrectorTrainConfig, step: int):
  """The step's snapshot and `queries` of its queries (with replacement), deterministic."""
  rng = np.random.default_rng([cfg.seed, step])
  sn = snaps[rng.integers(len(snaps))]
  q, w, k = data[sn["trace"]]
  pick = rng.integers(0, len(sn["queries"]), cfg.queries)
  pos = sn["queries"][pick]
  return (k, sn["assign"], q[pos], w[pos], sn["target"][pick], sn["usable"][pick])


def _train_layer(li, layer_id, trs, ev, cfg: CorrectorTrainConfig, out, progress, val=None):
  from flax import nnx
  from jaxsparse import ivf
  from jaxsparse.ivf import corrector as C
  icfg = cfg.ivf_config()
  data, snaps = [], []
  for ti, tr in enumerate(trs):
    q, w, k = (np.asarray(a, np.float32) for a in (tr.q[li], tr.w[li], tr.k[li]))
    data.append((q, w, k))
    snaps += [{**sn, "trace": ti} for sn in build_snapshots(q, k, w, icfg)]
  g = len(snaps[0]["sizes"])
  q, w, k = data[-1]
  keys = jnp.asarray(k)
  model = C.Corrector(C.CorrectorConfig(dim=k.shape[1], member_features=cfg.member_features,
                                        hidden=cfg.hidden, scale=cfg.scale),
                      rngs=nnx.Rngs(cfg.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  # the temperature: the spread of the plain means' scores over the training queries
  sn = snaps[-1]
  mean0 = C.group_features(keys, jnp.asarray(sn["assign"]), g, lambda x: x[:, :1])[0]
  s0 = np.asarray(_scores(jnp.asarray(q[sn["queries"]]), jnp.asarray(w[sn["queries"]]), mean0))
  tau = float(np.std(s0[np.asarray(sn["usable"])]) or 1.0)
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(1, cfg.steps // 10),
                                                      cfg.steps), weight_decay=1e-4)
  opt_state = tx.init(params)
  mgr = checkpoints.Manager(os.path.join(out, f"layer{layer_id}"), save_every=cfg.save_every)
  start, restored = mgr.restore_latest({"params": params, "opt": opt_state})
  if restored is not None:
    params, opt_state = restored["params"], restored["opt"]

  @jax.jit
  def step(params, opt_state, kb, assign, qb, wb, target, usable):
    def loss_fn(p):
      m = nnx.merge(graphdef, p)
      mean, corr = m(kb, assign, g)
      return listnet_loss(_scores(qb, wb, mean + corr), target, usable, tau, cfg.target_power)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    upd, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  pos_eval = np.unique(np.linspace(icfg.seal_window, ev.k.shape[1] - 1,
                                   cfg.eval_queries).astype(np.int64))
  evq, evw, evk = (np.asarray(a, np.float32) for a in (ev.q[li], ev.w[li], ev.k[li]))

  def heldout(p):
    m = nnx.merge(graphdef, p)
    return float(ivf.evaluate(evq, evk, evw, icfg, query_positions=pos_eval,
                              corrector=m)["recall"].mean())

  losses, history, t0, stopped = [], [], time.time(), False
  for s in range(start, cfg.steps):
    kb, assign, qb, wb, tg, us = _batch(snaps, data, cfg, s)
    params, opt_state, loss = step(params, opt_state, jnp.asarray(kb), jnp.asarray(assign),
                                   jnp.asarray(qb), jnp.asarray(wb), jnp.asarray(tg),
                                   jnp.asarray(us))
    losses.append(float(loss))
    mgr.maybe_save(s + 1, {"params": params, "opt": opt_state})
    if (s + 1) % cfg.eval_every == 0 or s + 1 == cfg.steps:
      rec = heldout(params)
      history.append({"step": s + 1, "loss": float(loss), "heldout_recall": rec})
      progress(f"layer {layer_id} step {s + 1}/{cfg.steps} loss {float(loss):.4f} "
               f"held-out recall {rec:.4f} ({(s + 1 - start) / (time.time() - t0):.1f} steps/s)")
    if cfg.max_seconds and time.time() - t0 > cfg.max_seconds and s + 1 < cfg.steps:
      mgr.save(s + 1, {"params": params, "opt": opt_state})
      stopped = True
      break
  if not stopped:
    mgr.save(cfg.steps, {"params": params, "opt": opt_state})
  mgr.close()
  model = nnx.merge(graphdef, params)
  result = {"layer": layer_id, "tau": tau, "steps_run": len(losses), "stopped_early": stopped,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "history": history}
  if not stopped:
    base = ivf.evaluate(evq, evk, evw, icfg, query_positions=pos_eval)
    orc = ivf.evaluate(evq, evk, evw, icfg, query_positions=pos_eval, oracle=True)
    cor = ivf.evaluate(evq, evk, evw, icfg, query_positions=pos_eval, corrector=model)
    result.update(recall_plain=float(base["recall"].mean()),
                  recall_corrected=float(cor["recall"].mean()),
                  recall_oracle=float(orc["recall"].mean()))
    if val is not None:  # the gate: kept only if it raises recall on unseen training text
      vq, vw, vk = (np.asarray(a, np.float32) for a in (val.q[li], val.w[li], val.k[li]))
      pos_val = np.unique(np.linspace(icfg.seal_window, vk.shape[0] - 1,
                                      cfg.eval_queries).astype(np.int64))
      vp = float(ivf.evaluate(vq, vk, vw, icfg, query_positions=pos_val)["recall"].mean())
      vc = float(ivf.evaluate(vq, vk, vw, icfg, query_positions=pos_val,
                              corrector=model)["recall"].mean())
      result.update(val_recall_plain=vp, val_recall_corrected=vc, kept=vc > vp,
                    recall_shipped=result["recall_corrected" if vc > vp else "recall_plain"])
  return model, result


def _load_trace(option: str, path: str):
  """`traces.load`, a damaged or foreign file raised as ConfigError naming the option."""
  from jaxsparse import traces
  try:
    return traces.load(path)
  except traces.TraceError as e:
    raise ConfigError(f"{option}: {e}") from None


def train(cfg: CorrectorTrainConfig, progress=print) -> dict:
  out = os.path.abspath(cfg.out)
  from jaxsparse.ivf import corrector as C
  trs = [_load_trace("--train-trace", p) for p in cfg.train_trace.split(",")]
  ev = _load_trace("--eval-trace", cfg.eval_trace)
  val = _load_trace("--val-trace", cfg.val_trace) if cfg.val_trace else None
  tr = trs[0]
  named = [("--train-trace", t) for t in trs] + [("--eval-trace", ev)]
  named += [("--val-trace", val)] if val is not None else []
  for name, t in named:
    if t.kind != "prefill":
      raise ConfigError(f"{name} is a {t.kind} trace; the corrector trains on prefill traces")
    if t.layers.tolist() != tr.layers.tolist():
      raise ConfigError(f"{name} holds layers {t.layers.tolist()}; the first --train-trace "
                        f"holds {tr.layers.tolist()}")
  if len({t.k.shape[1] for t in trs}) > 1:
    raise ConfigError("every --train-trace must hold the same number of tokens")
  held = tr.layers.tolist()
  from jaxsparse.cli._common import comma_ints
  ids = comma_ints("--layers", cfg.layers, low=0) if cfg.layers else held
  bad = [v for v in ids if v not in held]
  if bad:
    raise ConfigError(f"--layers {bad} are not in the traces, which hold model layers {held}")
  idx = [held.index(v) for v in ids]
  for name, t in named:
    if t.k.shape[1] <= 2 * cfg.seal_window:
      raise ConfigError(f"{name} has {t.k.shape[1]} tokens; needs more than 2 x --seal-window")
  checkpoints.prepare_out(out)  # the traces checked, before --out is touched
  checkpoints.check_identity(out, cfg.identity(), cfg.steps)
  checkpoints.write_identity(out, cfg.identity(), cfg.steps)
  models, results = {}, []
  for li in idx:
    layer_id = int(tr.layers[li])
    m, r = _train_layer(li, layer_id, trs, ev, cfg, out, progress, val)
    if r.get("kept", True):
      models[layer_id] = m
    results.append(r)
    if r["stopped_early"]:
      break
  report = {"config": dataclasses.asdict(cfg), "layers": results,
            "stopped_early": any(r["stopped_early"] for r in results)}
  from jaxsparse._bench.timing import environment
  report["environment"] = environment()
  if not report["stopped_early"]:
    plain = [r["layer"] for r in results if not r.get("kept", True)]
    C.save(os.path.join(out, "correctors.npz"), models,
           meta={"ivf": dataclasses.asdict(cfg.ivf_config()), "train_trace": cfg.train_trace,
                 "val_trace": cfg.val_trace, "plain_layers": plain})
  tmp = os.path.join(out, "report.json.tmp")
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1)
  os.replace(tmp, os.path.join(out, "report.json"))
  if not report["stopped_early"]:
    plot(report, os.path.join(out, "report.png"))
  return report


def plot(report: dict, path: str) -> None:
  """Held-out recall per layer: plain means, corrected, oracle ranking."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in report["layers"] if "recall_plain" in r]
  x = np.arange(len(rows))
  fig, ax = plt.subplots(figsize=(max(6, 0.4 * len(rows) + 2), 3.5))
  for i, (key, label) in enumerate((("recall_plain", "group mean"),
                                    ("recall_corrected", "mean + learned correction"),
                                    ("recall_oracle", "oracle ranking"))):
    ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
  ax.set_xticks(x, [r["layer"] for r in rows], fontsize=7)
  ax.set_xlabel("layer")
  ax.set_ylabel("held-out recall")
  lo = min(min(r["recall_plain"], r["recall_corrected"]) for r in rows)
  ax.set_ylim(max(0.0, lo - 0.05), 1.0)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def build_parser(prog: str = "python -m train.corrector") -> argparse.ArgumentParser:
  from jaxsparse.cli._common import Parser
  p = Parser(prog=prog, description=__doc__)
  for f in dataclasses.fields(CorrectorTrainConfig):
    typ = {"int": int, "float": float, "str": str}[f.type]
    req = f.default is dataclasses.MISSING
    p.add_argument("--" + f.name.replace("_", "-"), type=typ, required=req,
                   default=None if req else f.default,
                   help=f"{OPTION_HELP[f.name]} "
                   f"({'required' if req else f'default {f.default!r}'})")
  return p


def main(argv=None, prog: str = "python -m train.corrector") -> int:
  p = build_parser(prog)
  a = p.parse_args(argv)
  try:
    cfg = CorrectorTrainConfig(**vars(a))
    rep = train(cfg)
  except (ConfigError, checkpoints.CheckpointError) as e:
    p.error(str(e))  # the usage, then one error line, exit status 2
  for r in rep["layers"]:
    if "recall_plain" in r:
      print(f"layer {r['layer']}: held-out recall plain {r['recall_plain']:.4f} -> corrected "
            f"{r['recall_corrected']:.4f} (oracle {r['recall_oracle']:.4f})")
  if not rep["stopped_early"]:
    print(f"correctors written to {os.path.join(cfg.out, 'correctors.npz')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

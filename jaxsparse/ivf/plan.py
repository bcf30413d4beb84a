"""Per-layer partition plans: content groups (AttentionIndex) or position blocks (HiSA).

On some layers a query's reference keys come in short runs spread over the whole prefix: most
have another reference key within a few positions, few are recent. Contiguous blocks keep such
a run together while content clusters split it, so blocks recover more there, even against the
oracle ranking of the groups. `calibrate` measures both partitions on a prefill trace of text
that is not the evaluation text, at the budget a deployment uses. A layer keeps the preferred
partition unless the other wins by more than `z` standard errors of the paired per-query
difference; blocks are preferred by default, since they need no index maintenance and a layer
where the two are within noise on one text can go either way on another. The plan is
a small JSON file (`save` / `load`, validated); `method(plan, layer)` is what `evaluate` and
`prefill_topk` take for that layer, and `prefill_topk(..., plan=, layer=)` applies it.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

__all__ = ["calibrate", "calibration_positions", "choose", "method", "check_config", "save",
           "load", "shipped", "PlanFileError", "FILE_FORMAT", "SHIPPED"]

FILE_FORMAT = 1
_METHODS = ("ivf", "hisa")
_MATCHED = ("topk", "budget", "seal_window", "cluster_size")  # a plan holds at these only
# SmolLM2-135M's plans, calibrated on three training texts at each context and budget of
# `benchmarks/bench_ivf_recall.py` (made by `benchmarks/ship_plans.py` from its result files)
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "smollm2_plans.json")


class PlanFileError(ValueError):
  """A plan file that cannot be used; the message says what is wrong."""


def calibration_positions(n: int, seal_window: int, queries: int) -> np.ndarray:
  """[Q] int64 query positions spread over the trace after the first few seals."""
  start = min(4 * seal_window, n // 4)
  return np.unique(np.linspace(start, n - 1, queries).astype(np.int64))


def calibrate(trace, config, *, queries: int = 256, z: float = 2.0, prefer: str = "hisa",
              progress=None, metric=None, cache: dict | None = None) -> dict:
  """Choose each layer's partition on one or more prefill traces.

  trace: a `traces.PrefillTrace` (q [L, N, H, D], w [L, N, H], k [L, N, D], layers [L]) or a
  sequence of them (several texts; they may differ in length and layers: a layer's decision
  pools the paired per-query differences of every trace that holds it);
  config: IVFConfig (its budget is the one calibrated); queries: positions evaluated per
  layer and trace; prefer: "hisa" (position blocks) or "ivf" (content groups), the partition a
  layer keeps unless the other's mean recall exceeds it by more than z standard errors of the
  paired per-query difference. metric: a grouping metric for the content groups
  (`jaxsparse.ivf.metric`: a file path or {layer: A}); the plan records its file name
  ("metric"), and a layer planned "ivf" should then run with it. cache: a dict shared by calls
  on the same trace objects (with and without a metric, say): HiSA's per-query recalls, which
  no metric changes, are kept there by (trace, layer, config, queries) and measured once.
  Returns the plan: {"format", "methods": {layer: "ivf" | "hisa"}, "recall": {layer: {"ivf",
  "hisa", "difference" (HiSA minus IVF), "std_error", "texts", and with several texts
  "per_text": the same figures for each}}, "config": IVFConfig fields, "queries" (positions
  in the first trace), "z", "prefer", "trace": the first trace's meta, "traces": every trace's
  meta, "metric"}.
  """
  from jaxsparse.ivf.evaluation import evaluate
  if queries < 2:
    raise ValueError(f"queries={queries} must be at least 2 (the rule needs a standard error)")
  if not z >= 0:
    raise ValueError(f"z={z} must be >= 0")
  if prefer not in _METHODS:
    raise ValueError(f"prefer={prefer!r} must be one of {_METHODS}")
  texts = list(trace) if isinstance(trace, (list, tuple)) else [trace]
  if not texts:
    raise ValueError("trace: give at least one prefill trace")
  if metric is not None and not isinstance(metric, (str, os.PathLike)):
    missing = sorted({int(x) for tr in texts for x in np.asarray(tr.layers)} - set(metric))
    if missing:
      raise ValueError(f"metric holds no matrix for layers {missing}")
  per_layer: dict[int, dict[str, list]] = {}
  counts = []
  for tr in texts:
    pos = calibration_positions(tr.k.shape[1], config.seal_window, queries)
    counts.append(len(pos))
    for i, layer in enumerate(np.asarray(tr.layers).tolist()):
      q, w, k = tr.q[i], tr.w[i], tr.k[i]
      got = per_layer.setdefault(int(layer), {m: [] for m in _METHODS})
      for m in _METHODS:
        key = (id(tr), int(layer), config, len(pos))
        if m == "hisa" and cache is not None and key in cache:
          got[m].append(cache[key][1])
          continue
        extra = {}
        if m == "ivf" and metric is not None:
          extra = (dict(metric=metric, layer=int(layer)) if isinstance(metric, (str, os.PathLike))
                   else dict(metric=metric[int(layer)]))
        got[m].append(np.asarray(evaluate(q, k, w, config, method=m, query_positions=pos,
                                          **extra)["recall"], np.float64))
        if m == "hisa" and cache is not None:  # the trace held too: no other takes its id
          cache[key] = (tr, got[m][-1])
      if progress:
        progress(f"layer {layer}, text {len(got['ivf'])}: IVF {got['ivf'][-1].mean():.4f}, "
                 f"HiSA {got['hisa'][-1].mean():.4f}")
  methods, recall = {}, {}
  for layer in sorted(per_layer):
    r = {m: np.concatenate(v) for m, v in per_layer[layer].items()}
    d = r["hisa"] - r["ivf"]
    se = float(d.std(ddof=1) / np.sqrt(len(d)))
    methods[layer] = choose(d, z=z, prefer=prefer)
    recall[layer] = {"ivf": float(r["ivf"].mean()), "hisa": float(r["hisa"].mean()),
                     "difference": float(d.mean()), "std_error": se,
                     "texts": len(per_layer[layer]["ivf"])}
    if len(per_layer[layer]["ivf"]) > 1:
      recall[layer]["per_text"] = [
          {"ivf": float(a.mean()), "hisa": float(b.mean()), "difference": float((b - a).mean()),
           "std_error": float((b - a).std(ddof=1) / np.sqrt(len(a)))}
          for a, b in zip(per_layer[layer]["ivf"], per_layer[layer]["hisa"])]
  metas = [dict(getattr(tr, "meta", {}) or {}) for tr in texts]
  return {"format": FILE_FORMAT, "methods": methods, "recall": recall,
          "config": dataclasses.asdict(config), "queries": counts[0], "z": z, "prefer": prefer,
          "trace": metas[0], "traces": metas,
          "metric": os.path.basename(str(metric)) if isinstance(metric, (str, os.PathLike))
          else ("given" if metric is not None else None)}


def choose(difference, *, z: float = 2.0, prefer: str = "hisa") -> str:
  """The partition for one layer from paired per-query recall differences (HiSA minus IVF,
  [Q] float, Q >= 2): `prefer` unless the other's mean lead exceeds z standard errors."""
  if prefer not in _METHODS:
    raise ValueError(f"prefer={prefer!r} must be one of {_METHODS}")
  d = np.asarray(difference, np.float64)
  if d.ndim != 1 or len(d) < 2:
    raise ValueError(f"difference: need [Q] with Q >= 2 paired differences, got shape {d.shape}")
  se = d.std(ddof=1) / np.sqrt(len(d))
  lead = d.mean() if prefer == "ivf" else -d.mean()  # the other partition's mean lead
  other = "hisa" if prefer == "ivf" else "ivf"
  return other if lead > z * se else prefer


def method(plan: dict, layer: int) -> str:
  """The method ("ivf" or "hisa") a plan gives a model layer; ValueError naming the layer if
  the plan does not cover it."""
  m = plan["methods"].get(int(layer))
  if m is None:
    raise ValueError(f"layer={layer} is not in the plan (layers {sorted(plan['methods'])})")
  return m


def check_config(plan: dict, config) -> None:
  """ValueError naming the field where `config` (an IVFConfig) differs from the one the plan
  was calibrated with, among topk, budget, seal_window and cluster_size (a partition's lead
  depends on them)."""
  got = plan.get("config") or {}
  for name in _MATCHED:
    if name in got and got[name] != getattr(config, name):
      raise ValueError(f"the plan was calibrated with {name}={got[name]}, not config.{name}="
                       f"{getattr(config, name)}: calibrate one at these settings "
                       f"(`plan.calibrate`, `jaxsparse plan`)")


def shipped(tokens: int, budget: int, *, metric: bool = True) -> dict:
  """SmolLM2-135M's plan calibrated at `tokens` context and `budget` (with the shipped
  grouping metric for the content groups, or without); ValueError listing what is shipped
  otherwise."""
  with open(SHIPPED) as f:
    plans = json.load(f)["plans"]
  for raw in plans:
    if (raw["tokens"], raw["config"]["budget"], bool(raw.get("metric"))) == (tokens, budget,
                                                                              metric):
      plan = {**raw, "methods": {int(k): v for k, v in raw["methods"].items()}}
      _validate(plan, SHIPPED)
      return plan
  have = sorted({(p["tokens"], p["config"]["budget"]) for p in plans
                 if bool(p.get("metric")) == metric})
  raise ValueError(f"no shipped plan at tokens={tokens}, budget={budget}, metric={metric}; "
                   f"shipped (tokens, budget): {have}")


def save(path: str, plan: dict) -> None:
  """Write a plan as JSON next to `path`, then rename it into place."""
  _validate(plan, path)
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  tmp = os.path.join(d, f".{os.path.basename(path)}.tmp")
  with open(tmp, "w") as f:
    json.dump({**plan, "methods": {str(k): v for k, v in plan["methods"].items()},
               "recall": {str(k): v for k, v in plan["recall"].items()}}, f, indent=1)
  os.replace(tmp, path)


def load(path: str) -> dict:
  """A plan written by `save`, validated (layer keys back to int)."""
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"path={path!r} must be a file path")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"plan file {path!r} does not exist")
  try:
    with open(path) as f:
      raw = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise PlanFileError(f"{path!r} is not a JSON plan file: {e}") from e
  if not isinstance(raw, dict) or not isinstance(raw.get("methods"), dict):
    raise PlanFileError(f"{path!r}: no 'methods' mapping")
  if not isinstance(raw.get("recall", {}), dict):
    raise PlanFileError(f"{path!r}: 'recall' must be a mapping of layer to recall")
  try:
    plan = {**raw, "methods": {int(k): v for k, v in raw["methods"].items()},
            "recall": {int(k): v for k, v in raw.get("recall", {}).items()}}
  except ValueError as e:
    raise PlanFileError(f"{path!r}: layer keys must be integers ({e})") from e
  _validate(plan, path)
  return plan


def _validate(plan, path):
  if plan.get("format") != FILE_FORMAT:
    raise PlanFileError(f"{path!r}: format={plan.get('format')!r}, expected {FILE_FORMAT}")
  if not plan["methods"]:
    raise PlanFileError(f"{path!r}: the plan holds no layers")
  if plan.get("prefer", "hisa") not in _METHODS:
    raise PlanFileError(f"{path!r}: prefer={plan['prefer']!r} must be one of {_METHODS}")
  bad = {k: v for k, v in plan["methods"].items() if v not in _METHODS}
  if bad:
    raise PlanFileError(f"{path!r}: methods {bad} must each be one of {_METHODS}")

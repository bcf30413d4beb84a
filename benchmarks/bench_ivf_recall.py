"""AttentionIndex recall on a real prefill trace: IVF (with refits, seal only, oracle ranking)
against HiSA (and its oracle) at several candidate budgets, per layer. Writes JSON and a plot.

  python benchmarks/bench_ivf_recall.py --trace prefill_8k.npz --out benchmarks/results/ivf_recall

The trace comes from `jaxsparse trace prefill --text FILE --tokens 8192` (all 30 layers).
Default settings scale the paper's (K 2048, budget 24K, W 1024, groups of 128, refits every
16K at 128K-1M tokens) to an 8K context: K 128, budgets 384/512/1024/2048, W 256, groups of
32, refits every 2048 tokens. "IVF corrected" adds the shipped learned correction to the means
(`--corrector`); "IVF metric" groups under the shipped query-aware metric (`--metric`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxsparse import ivf, traces  # noqa: E402
from jaxsparse._bench.timing import environment, write_json  # noqa: E402
from jaxsparse.ivf import plan as ivf_plan  # noqa: E402

# name, method, refits, oracle ranking, learned correction, grouping metric
METHODS = (("IVF", "ivf", True, False, False, False),
           ("IVF seal only", "ivf", False, False, False, False),
           ("IVF corrected", "ivf", True, False, True, False),
           ("IVF metric", "ivf", True, False, False, True),
           ("IVF oracle", "ivf", True, True, False, False),
           ("HiSA", "hisa", True, False, False, False),
           ("HiSA oracle", "hisa", True, True, False, False))
PLANNED = "IVF planned"  # each layer under the partition a calibration trace chose for it
METRIC_PLANNED = "IVF metric planned"  # the same, the content groups under the metric
BARS = ("IVF", "IVF metric", "IVF oracle", "HiSA", "HiSA oracle")  # the per-layer panel's rows


def shared_name(block: int) -> str:
  return f"IVF shared {block}, 2x budget"


def run(tr, cfg, budgets, layers, queries, corrector=None, plans=None, query_block=0,
        progress=print, metric=None, metric_plans=None):
  """corrector: a file of `jaxsparse train corrector` for the "IVF corrected" rows (None:
  those rows are left out). metric: a file of `jaxsparse fit-metric` for the "IVF metric" rows
  (None: left out); metric_plans: plans calibrated with it, for "IVF metric planned". plans:
  {budget: `ivf.plan.calibrate` result} for the "IVF planned" rows (each layer's recall under
  the method its plan chose; None: left out). query_block:
  adds "IVF shared B, 2x budget" rows: blocks of B queries sharing twice the budget
  (IVFConfig.query_block; 0: left out)."""
  methods = [m for m in METHODS if (corrector or not m[4]) and (metric or not m[5])]
  pos = ivf_plan.calibration_positions(tr.k.shape[1], cfg.seal_window, queries)
  rows = []
  for li in layers:
    q, w, k = tr.q[li], tr.w[li], tr.k[li]
    for b in budgets:
      c = dataclasses.replace(cfg, budget=b)
      per_query = {}
      for name, method, refits, oracle, corrected, metric_on in methods:
        cc = c if refits else dataclasses.replace(c, refit_interval=0)
        t0 = time.perf_counter()
        extra = dict(corrector=corrector) if corrected else {}
        extra.update(dict(metric=metric) if metric_on else {})
        r = ivf.evaluate(q, k, w, cc, method=method, query_positions=pos, oracle=oracle,
                         **(dict(extra, layer=int(tr.layers[li])) if extra else {}))
        per_query[name] = np.asarray(r["recall"], np.float64)
        rows.append(dict(layer=int(tr.layers[li]), budget=b, method=name,
                         recall=float(r["recall"].mean()),
                         candidates=float(r["num_candidates"].mean()),
                         refit_compared=r["refit_compared"],
                         seconds=time.perf_counter() - t0))
      nrows = len(methods)
      if query_block:
        t0 = time.perf_counter()
        r = ivf.evaluate(q, k, w, dataclasses.replace(c, budget=2 * b, query_block=query_block),
                         query_positions=pos)
        per_query[shared_name(query_block)] = np.asarray(r["recall"], np.float64)
        rows.append(dict(layer=int(tr.layers[li]), budget=b, method=shared_name(query_block),
                         recall=float(r["recall"].mean()),
                         candidates=float(r["num_candidates"].mean()),
                         refit_compared=r["refit_compared"],
                         seconds=time.perf_counter() - t0))
        nrows += 1
      for name, pl, content in ((PLANNED, plans, "IVF"),
                                (METRIC_PLANNED, metric_plans, "IVF metric")):
        if not pl:
          continue
        chosen = ivf_plan.method(pl[b], int(tr.layers[li]))
        src = content if chosen == "ivf" else "HiSA"
        per_query[name] = per_query[src]
        rows.append({**next(r for r in rows[-nrows:] if r["method"] == src),
                     "method": name, "chosen": chosen})
        nrows += 1
      for row in rows[-nrows:]:  # paired per-query difference to HiSA, its std. error
        d = per_query[row["method"]] - per_query["HiSA"]
        row["minus_hisa"] = float(d.mean())
        row["minus_hisa_se"] = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
      progress(f"layer {int(tr.layers[li])} budget {b}: " + ", ".join(
          f"{x['method']} {x['recall']:.3f}" for x in rows[-nrows:]))
  return pos, rows


def _names(rows):
  extra = sorted({r["method"] for r in rows if r["method"].startswith("IVF shared")})
  return [m for m in [m[0] for m in METHODS] + [PLANNED, METRIC_PLANNED] + extra
          if any(r["method"] == m for r in rows)]


def summary(rows, budgets):
  """Per budget: each method's recall averaged over layers, and the layers where IVF trails
  HiSA as (layer, mean difference, its standard error over the queries)."""
  out = {}
  for b in budgets:
    out[b] = {name: float(np.mean([r["recall"] for r in rows if r["budget"] == b and
                                   r["method"] == name])) for name in _names(rows)}
    out[b]["IVF behind HiSA"] = [(r["layer"], r["minus_hisa"], r["minus_hisa_se"]) for r in rows
                                 if r["budget"] == b and r["method"] == "IVF"
                                 and r["minus_hisa"] < 0]
    if "IVF metric" in out[b]:
      out[b]["IVF metric behind HiSA"] = [
          (r["layer"], r["minus_hisa"], r["minus_hisa_se"]) for r in rows
          if r["budget"] == b and r["method"] == "IVF metric" and r["minus_hisa"] < 0]
    for name in (PLANNED, METRIC_PLANNED):
      if name in out[b]:
        out[b][f"{name} behind HiSA"] = [
            (r["layer"], r["minus_hisa"], r["minus_hisa_se"]) for r in rows
            if r["budget"] == b and r["method"] == name and r["minus_hisa"] < 0]
        out[b][f"layers {name} as blocks"] = sorted(
            r["layer"] for r in rows if r["budget"] == b and r["method"] == name
            and r.get("chosen") == "hisa")
    if PLANNED in out[b]:
      out[b]["layers planned as blocks"] = out[b].pop(f"layers {PLANNED} as blocks")
  return out


def plot(rows, budgets, main_budget, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.4))
  s = summary(rows, budgets)
  names = _names(rows)
  color = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one colour a row, both panels
  for name in names:
    a.plot(budgets, [s[x][name] for x in budgets], marker="o", label=name, color=color[name])
  a.set_xscale("log", base=2)
  a.set_xlabel("candidate budget")
  a.set_ylabel("recall of the full top-K (mean over layers)")
  a.legend(fontsize=8)
  a.grid(alpha=0.3)
  layers = sorted({r["layer"] for r in rows})
  names = [m for m in names if m in BARS]  # per layer: the main rows only
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    v = [next(r["recall"] for r in rows if r["layer"] == l and r["budget"] == main_budget
              and r["method"] == name) for l in layers]
    b.bar(np.arange(len(layers)) + (i - (len(names) - 1) / 2) * width, v, width, label=name,
          color=color[name])
  b.set_xticks(np.arange(len(layers)), layers, fontsize=7)
  b.set_xlabel(f"layer (budget {main_budget})")
  b.set_ylabel("recall")
  b.set_ylim(max(0.0, min(r["recall"] for r in rows if r["budget"] == main_budget) - 0.02), 1.0)
  b.legend(fontsize=7, ncol=len(names), loc="upper center", bbox_to_anchor=(0.5, -0.14))
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def add_index_options(p):
  """The index settings scaled to an 8K context (K, W, group size, refit interval, sinks)."""
  p.add_argument("--topk", type=int, default=128)
  p.add_argument("--seal-window", type=int, default=256)
  p.add_argument("--cluster-size", type=int, default=32)
  p.add_argument("--refit-interval", type=int, default=2048)
  p.add_argument("--sink", type=int, default=16)


def load_prefill_trace(p, path):
  tr = traces.load(path)
  if tr.kind != "prefill":
    p.error(f"--trace={path!r} is a {tr.kind} trace; this needs a prefill trace")
  return tr


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--trace", required=True, help="prefill trace .npz")
  p.add_argument("--out", default="benchmarks/results/ivf_recall", help="JSON/PNG prefix")
  p.add_argument("--budgets", default="384,512,1024,2048")
  p.add_argument("--main-budget", type=int, default=512)
  add_index_options(p)
  p.add_argument("--queries", type=int, default=256)
  p.add_argument("--layers", default="", help="comma list of stored layer indices (default all)")
  p.add_argument("--float32-index", action="store_true",
                 help="IVFConfig(compact=False): int32 / float32 index state")
  p.add_argument("--corrector", default="shipped",
                 help="corrector file for the 'IVF corrected' rows: 'shipped' (SmolLM2's, for "
                      "traces of the shipped indexers), a path, or '' to leave them out")
  p.add_argument("--metric", default="shipped",
                 help="grouping metric file for the 'IVF metric' rows: 'shipped' (SmolLM2's), a "
                      "path (`jaxsparse fit-metric`), or '' to leave them out")
  p.add_argument("--calibration-trace", default="",
                 help="prefill traces of other text (comma-separated): per budget, "
                      "`ivf.plan.calibrate` picks each layer's partition on them for the "
                      "'IVF planned' rows")
  p.add_argument("--plan-prefer", default="hisa", choices=("hisa", "ivf"),
                 help="the partition a calibrated layer keeps unless the other wins by over 2 "
                      "standard errors (`ivf.plan.calibrate(prefer=)`)")
  p.add_argument("--query-block", type=int, default=0,
                 help="add rows for blocks of this many queries sharing twice the budget")
  p.add_argument("--quick", action="store_true", help="two layers, one budget, 32 queries")
  a = p.parse_args(argv)
  tr = load_prefill_trace(p, a.trace)
  budgets = [int(v) for v in a.budgets.split(",")]
  layers = ([int(v) for v in a.layers.split(",")] if a.layers else
            list(range(tr.q.shape[0])))
  if a.quick:
    budgets, layers, a.queries = budgets[:1], layers[:2], 32
    a.main_budget = budgets[0]
  cfg = ivf.IVFConfig(topk=a.topk, budget=max(budgets), seal_window=a.seal_window,
                      cluster_size=a.cluster_size, refit_interval=a.refit_interval, sink=a.sink,
                      compact=not a.float32_index)
  from jaxsparse.ivf import corrector as ivf_corrector
  corr = ivf_corrector.SHIPPED if a.corrector == "shipped" else a.corrector or None
  from jaxsparse.ivf import metric as ivf_metric
  met = ivf_metric.SHIPPED if a.metric == "shipped" else a.metric or None
  plans = metric_plans = None
  if a.calibration_trace:
    want = [int(tr.layers[i]) for i in layers]
    cals = []
    for path in a.calibration_trace.split(","):
      cal = load_prefill_trace(p, path)
      missing = sorted(set(want) - set(np.asarray(cal.layers).tolist()))
      if missing:
        p.error(f"--calibration-trace={path!r} lacks layers {missing}")
      keep = [list(np.asarray(cal.layers)).index(l) for l in want]
      cals.append(dataclasses.replace(cal, q=cal.q[keep], w=cal.w[keep], k=cal.k[keep],
                                      layers=np.asarray(want)))
    hisa = {}  # HiSA's calibration recalls, shared by the plans with and without the metric
    plans = {b: ivf_plan.calibrate(cals, dataclasses.replace(cfg, budget=b),
                                   queries=a.queries, prefer=a.plan_prefer, progress=print,
                                   cache=hisa)
             for b in budgets}
    if met:
      metric_plans = {b: ivf_plan.calibrate(cals, dataclasses.replace(cfg, budget=b),
                                            queries=a.queries, prefer=a.plan_prefer,
                                            progress=print, metric=met, cache=hisa)
                      for b in budgets}
  if a.query_block and (a.query_block < 0 or a.seal_window % a.query_block):
    p.error(f"--query-block={a.query_block} must divide --seal-window={a.seal_window}")
  pos, rows = run(tr, cfg, budgets, layers, a.queries, corrector=corr, plans=plans,
                  query_block=a.query_block, metric=met, metric_plans=metric_plans)
  res = {"environment": environment(), "trace": os.path.basename(a.trace), "meta": tr.meta,
         "config": dataclasses.asdict(cfg),
         "corrector": os.path.basename(corr) if corr else None,
         "metric": os.path.basename(met) if met else None,
         "calibration_trace": ",".join(os.path.basename(v) for v in
                                       a.calibration_trace.split(",")) or None,
         "plans": {b: {"methods": pl["methods"], "recall": pl["recall"], "z": pl["z"],
                       "prefer": pl["prefer"]}
                   for b, pl in (plans or {}).items()},
         "metric_plans": {b: {"methods": pl["methods"], "recall": pl["recall"]}
                          for b, pl in (metric_plans or {}).items()},
         "budgets": budgets, "query_positions": pos.tolist(),
         "summary": summary(rows, budgets), "rows": rows}
  write_json(a.out + ".json", res)
  plot(rows, budgets, a.main_budget, a.out + ".png")
  for b, s in res["summary"].items():
    print(f"budget {b}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()
                                      if isinstance(v, float)))
    if PLANNED in s:
      print(f"  planned as blocks: {s['layers planned as blocks']}; IVF planned behind HiSA: "
            + (", ".join(f"({l}, {d:+.4f}, {e:.4f})" for l, d, e in
                         s["IVF planned behind HiSA"]) or "none"))
    if METRIC_PLANNED in s:
      print(f"  metric planned as blocks: {s[f'layers {METRIC_PLANNED} as blocks']}; behind "
            "HiSA: " + (", ".join(f"({l}, {d:+.4f}, {e:.4f})" for l, d, e in
                                  s[f"{METRIC_PLANNED} behind HiSA"]) or "none"))
    if "IVF metric" in s:
      print("  IVF metric behind HiSA: " + (", ".join(
          f"({l}, {d:+.4f}, {e:.4f})" for l, d, e in s["IVF metric behind HiSA"]) or "none"))
    print("  IVF behind HiSA (layer, difference, std. error): " + (", ".join(
        f"({l}, {d:+.4f}, {e:.4f})" for l, d, e in s["IVF behind HiSA"]) or "none"))
  print(f"wrote {a.out}.json and .png")


if __name__ == "__main__":
  main()

"""Write jaxsparse/data/smollm2_plans.json from the per-layer plans in the recall results.

    python benchmarks/ship_plans.py [--out jaxsparse/data/smollm2_plans.json]

Reads `results/ivf_recall.json` (8K) and `results/ivf_recall_32k.json` (32K, extrapolated past
the model's 8K context), whose "plans" / "metric_plans" hold `ivf.plan.calibrate`'s choice per
budget on three training texts; each becomes one shipped plan with its context, the recall
run's IVFConfig at that budget, and the metric file it was calibrated with.
"""
from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("ivf_recall.json", "ivf_recall_32k.json")


def plans_from(path: str) -> list[dict]:
  with open(path) as f:
    res = json.load(f)
  out = []
  for key, metric in (("plans", None), ("metric_plans", res.get("metric"))):
    for budget, plan in sorted(res.get(key, {}).items(), key=lambda kv: int(kv[0])):
      out.append({"format": 1, "tokens": int(res["meta"]["tokens"]),
                  "config": {**res["config"], "budget": int(budget)},
                  "metric": metric, "methods": plan["methods"], "z": plan.get("z", 2.0),
                  "prefer": plan.get("prefer", "hisa"),
                  "source": f"benchmarks/results/{os.path.basename(path)} ({key})",
                  "calibration": res["calibration_trace"], "git": res["environment"]["git"]})
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.path.join(HERE, "..", "jaxsparse", "data",
                                               "smollm2_plans.json"),
                 help="the plan file to write (default: the shipped one)")
  args = p.parse_args(argv)
  plans = [pl for name in SOURCES for pl in plans_from(os.path.join(HERE, "results", name))]
  tmp = args.out + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"format": 1, "plans": plans}, f, indent=1)
  os.replace(tmp, args.out)
  print(f"{len(plans)} plans -> {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

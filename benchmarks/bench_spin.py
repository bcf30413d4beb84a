"""SPIN decode step vs the full indexer step (fused scoring + exact top-K) on a GPU.

Columns: `us`, the jitted step's wall time per call with its state donated and threaded from call
to call, as a serving loop runs it; `us_undonated`, the same without donation (XLA then copies the
state every call); `kernel_us`, the donated step's kernel time from the device trace.

  python benchmarks/bench_spin.py            # B in {1, 8, 64}, 32K-512K slots, 20-50% sparsity
  python benchmarks/bench_spin.py --quick    # tiny (CPU)
"""
from __future__ import annotations

import argparse

from jaxsparse._bench import cases as bench
from jaxsparse._bench.timing import environment, print_table, write_json
from pallas_kernels.topk import TopkConfig


def _topk_config(a):
  """Both steps' TopkConfig from --topk-finish (None: the library default)."""
  kw = {"finish": a.topk_finish} if a.topk_finish else {}
  return TopkConfig(**kw) if kw else None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--out", default="benchmarks/results/spin_step.json")
  p.add_argument("--batches", default="1,8,64")
  p.add_argument("--slots", default="131072,524288")
  p.add_argument("--sparsities", default="0.2,0.4,0.5")
  p.add_argument("--state-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                 help="SPIN's EMA state dtype")
  p.add_argument("--step-only", action="store_true",
                 help="time only the full step and the SPIN step (warm=True), not its stages "
                      "(selection + compaction, EMA update, block-sparse scoring, top-K)")
  p.add_argument("--topk-finish", default="",
                 help="TopkConfig.finish for both steps' top-K (default: the library's)")
  p.add_argument("--reduction", default="A1", choices=("A0", "A1", "A2"),
                 help="SPIN's block reduction (A2: the step updates only block states)")
  p.add_argument("--unsorted", action="store_true",
                 help="both steps return the top-K as a set (sorted=False)")
  p.add_argument("--spin-mosaic-pages", type=int, default=0,
                 help="pages per CTA of the SPIN step's Mosaic block-sparse scoring kernel "
                      "(0: the library default)")
  p.add_argument("--explore", default="random", choices=("random", "query"),
                 help="SpinConfig.explore of the SPIN step")
  a = p.parse_args(argv)
  sdc = None
  if a.spin_mosaic_pages:
    from pallas_kernels.indexer_decode import DecodeConfig
    sdc = DecodeConfig(mosaic_pages=a.spin_mosaic_pages)
  if a.quick:
    rows = bench.bench_spin((2,), (4096,), (0.4,), k=64, heads=8, head_dim=64, reps=2, calls=2,
                            unsorted=a.unsorted, reduction=a.reduction, explore=a.explore)
  else:
    rows = bench.bench_spin(tuple(int(v) for v in a.batches.split(",")),
                            tuple(int(v) for v in a.slots.split(",")),
                            tuple(float(v) for v in a.sparsities.split(",")),
                            step_only=a.step_only, state_dtype=a.state_dtype,
                            unsorted=a.unsorted, topk_config=_topk_config(a),
                            reduction=a.reduction, spin_decode_config=sdc,
                            explore=a.explore)
  print_table(rows, ["B", "N", "sparsity", "impl", "us", "time_vs_full", "us_undonated",
                     "kernel_us", "kernel_time_vs_full",
                     "select_us", "update_us",
                     "sparse_scores_us", "topk_width_us", "predict_update_us",
                     "predict_update_frac", "realized", "error"])
  write_json(a.out, dict(environment=environment(), rows=rows))
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

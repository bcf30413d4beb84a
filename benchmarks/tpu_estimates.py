"""TPU cost estimates of the Mosaic TPU kernels (no TPU measured them): bytes moved, MXU FLOPs
and vector ops counted from the kernels' code, against the v5e and v6e rooflines. Writes the
README's TPU table as JSON.

  python benchmarks/tpu_estimates.py --out benchmarks/results/tpu_estimates.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxsparse._bench.timing import environment, write_json  # noqa: E402

CHIPS = {"v5e": {"hbm_gbs": 819, "bf16_tflops": 197}, "v6e": {"hbm_gbs": 1640, "bf16_tflops": 918}}
H, D = 64, 128  # DeepSeek-V3.2 indexer shapes


def rows():
  b, n = 64, 131072
  out = []
  # decode: a bf16 key and a float32 score per slot; 2 H D FLOPs per slot
  out.append(dict(kernel="decode scoring, bf16, 64 x 128K slots", bytes=b * n * (2 * D + 4),
                  flops=b * n * 2 * H * D, vector_ops=0))
  t, nk = 2048, 65536  # prefill: keys once, the [T, N] float32 scores out
  out.append(dict(kernel="prefill scoring, 2048 x 64K keys", bytes=nk * D * 2 + t * nk * 4,
                  flops=t * nk * 2 * H * D, vector_ops=0))
  # top-K, K = 2048: two streaming passes over the rows, group maxima (groups of 8) out and in;
  # compaction per 8 x 128 vreg: prefix 7 x 3 ops, 7 rotation steps x 12, 8 row stores x 10;
  # bitonic finish: 78 stages x 32 vregs (4096 candidates) x 12 ops per row
  vregs = b * n // 1024
  out.append(dict(kernel="top-K 64 x 128K, K=2048", bytes=2 * b * n * 4 + 2 * b * n // 8 * 4,
                  flops=0, vector_ops=vregs * (21 + 84 + 80) + b * 78 * 32 * 12))
  # SPIN (64-slot blocks, 40%: 1248 blocks scored): D read for the block scores, V and D read
  # and written by the update, the scored blocks' float32 scores read; selection per request:
  # 2 searches x 32 steps x 16 vregs x 3 ops, ~1000 for prefix and compaction
  out.append(dict(kernel="SPIN block scores + update, 64 x 128K, bf16 state",
                  bytes=b * n * 2 + 4 * b * n * 2 + b * 1248 * 64 * 4, flops=0,
                  vector_ops=b * (2 * 32 * 16 * 3 + 1000)))
  for r in out:
    for chip, c in CHIPS.items():
      hbm = r["bytes"] / (c["hbm_gbs"] * 1e9)
      mxu = r["flops"] / (c["bf16_tflops"] * 1e12)
      r[f"floor_{chip}_us"] = max(hbm, mxu) * 1e6
      r[f"bound_{chip}"] = "HBM" if hbm >= mxu else "MXU"
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  rs = rows()
  for r in rs:
    print(f"{r['kernel']}: {r['bytes'] / 1e6:.0f} MB, {r['flops'] / 1e9:.0f} GFLOP, "
          f"{r['vector_ops'] / 1e6:.2f}M vector ops, v5e {r['floor_v5e_us']:.0f} us "
          f"({r['bound_v5e']}), v6e {r['floor_v6e_us']:.0f} us ({r['bound_v6e']})")
  write_json(a.out, {"environment": {**environment(), "command": " ".join(sys.argv),
                                     "kind": "estimate, not a measurement"},
                     "chips": CHIPS, "rows": rs})


if __name__ == "__main__":
  main()

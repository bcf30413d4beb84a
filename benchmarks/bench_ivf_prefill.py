"""AttentionIndex prefill time against full DSA's, 64K-1M tokens (the indexer stage only).

For each context N: `ivf.prefill_topk` (index maintenance, representative ranking, candidate
gathering and scoring, top-K; Pallas kernels on a GPU/TPU) and HiSA through the same path
(`method="hisa"`: fixed blocks, no index maintenance) against full DSA's exact top-K for every
query (`jaxsparse.causal_prefill_topk`: query segments, each against the keys up to its end,
through the scoring and top-K kernels; no [N, N] buffer), and both methods' recall of the
exact top-K on sampled queries. Keys: random clustered ones, or with --trace a real prefill
trace's layers tiled to N as rotated copies (`traces.tile_prefill`), at DeepSeek-V3.2's shapes
(H 64, D 128 by default). Wall-clock seconds of one whole prefill after a warm-up (at the
smallest N unless --warmup-tokens); each N runs --repeats times and the fastest counts (the
first compiles for the new shapes); full_scoring_s is full DSA's scoring without its top-K.
--stages times each stage apart (index maintenance, inverted lists, group ranking, candidate
packing, candidate scoring, top-K); --profile adds the kernel seconds of one whole run of each
method (what the wall-clock time holds beyond kernels is host dispatch and launch gaps).
--recall-only measures recall alone (`ivf.evaluate`, the trace's shapes in float32): contexts
up to 1M on a CPU. --metric-timing also times the prefill under a grouping metric. Writes JSON.

  python benchmarks/bench_ivf_prefill.py --tokens 65536,262144,1048576 --out r.json
  python benchmarks/bench_ivf_prefill.py --trace prefill_8k.npz --layers 0,1,2 --out r.json
  python benchmarks/bench_ivf_prefill.py --trace prefill_8k.npz --layers 3,15,27 --tokens 262144 \
      --query-block 64 --budget 49152 --recall-only --out r.json
  python benchmarks/bench_ivf_prefill.py --quick --out r.json      (CPU check)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jaxsparse  # noqa: E402
from jaxsparse import ivf, traces  # noqa: E402
from jaxsparse._bench.timing import environment, print_table, write_json  # noqa: E402


def case(n, h, d, seed=0):
  """Clustered keys (a center per 512 keys, at random positions, plus noise) and iid queries;
  the queries ([n, h, d], 32 GB of float32 at 1M tokens) are drawn on the device."""
  rng = np.random.default_rng(seed)
  centers = rng.standard_normal((max(n // 512, 8), d)).astype(np.float32)
  k = centers[rng.integers(0, len(centers), n)] + 0.5 * rng.standard_normal((n, d))
  q = jax.random.normal(jax.random.key(seed), (n, h, d), jnp.bfloat16)
  w = rng.uniform(0, 1, (n, h)).astype(np.float32)
  return (q, jnp.asarray(k, jnp.bfloat16), jnp.asarray(w))


def trace_case(tr, layer, n, h, d, seed=0):
  """Layer `layer` (an index into the trace's layers) of a real prefill trace tiled to n tokens
  as rotated copies and widened to h heads x d dims (`traces.tile_prefill`: scores inside a
  copy are the trace's); q and k bf16 on the device."""
  return traces.tile_prefill(tr.q[layer], tr.k[layer], tr.w[layer], n, heads=h, dim=d,
                             seed=seed, dtype=jnp.bfloat16)


def recall(q, k, w, sel, qs, topk):
  """Mean over queries qs of the share of their exact top-K (prefill_topk on those queries)
  that the selections sel [len(qs), topk'] hold."""
  ref = np.asarray(jaxsparse.prefill_topk(q[qs], k, w[qs], topk,
                                          query_positions=jnp.asarray(qs, jnp.int32))[1])
  return float(np.mean([np.isin(r[r >= 0], s_).mean() for r, s_ in zip(ref, sel)]))


def full_topk(q, k, w, topk, segments):
  """Full DSA: every query's exact top-K (`jaxsparse.causal_prefill_topk`: the sequence in
  `segments` query segments, each against the keys up to its end; no [N, N] buffer)."""
  return jax.block_until_ready(jaxsparse.causal_prefill_topk(q, k, w, topk,
                                                             segments=segments)[1])


def stages(q, k, w, cfg, samples):
  """Seconds per stage of one prefill: seal and refit summed over every window (each synced);
  the query stages timed on `samples` evenly spaced whole query windows (a second, compiled
  call) and scaled to all of them. With cfg.query_block > 1 "pack" is the blocks' candidate
  sets and "score" their gather and dense scoring (the shared path). Returns (seconds per
  stage, and on a GPU for the last sampled window each stage's wall and kernel seconds (device
  trace) with its four longest kernels: launch-bound stages show wall far above kernel
  time)."""
  from jaxsparse import backend
  from jaxsparse.ivf import candidates, index
  from jaxsparse.ivf import prefill as pf
  plat = backend.kernel_platform() if backend.resolve(None) == "pallas" else None
  n, wnd = k.shape[0], cfg.seal_window
  nw = n // wnd
  # windows with a whole window of queries (the last seal's window holds the last query alone
  # when N is a multiple of W): the sampled ones stand for all of them
  full = max(nw - 1 if n % wnd == 0 else nw, 1)
  sample = set(np.linspace(1, full, samples).astype(int).tolist())
  rank = jax.jit(pf._group_scores, static_argnames="platform")
  select = jax.jit(pf._select, static_argnames=("topk", "platform", "block"))
  pack = jax.jit(functools.partial(pf._pack, budget=cfg.budget, sink=cfg.sink, window=wnd,
                                   platform=plat))
  score = jax.jit(functools.partial(pf._score_packed, budget=cfg.budget, sink=cfg.sink,
                                    platform=plat))
  blk = cfg.query_block  # > 1: the shared path's candidate sets ("pack") and block scoring
  shared_pack = jax.jit(functools.partial(pf._shared_candidates, budget=cfg.budget,
                                          sink=cfg.sink, window=wnd, block=blk))
  shared_score = jax.jit(functools.partial(pf._shared_scores, block=blk, platform=plat))
  t = dict(seal=0.0, refit=0.0, lists=0.0, rank=0.0, pack=0.0, score=0.0, topk=0.0)
  kernels = {}  # GPU: the last sampled window's kernel seconds per stage, and its top kernels

  def timed(name, f, scale):
    f()  # compiled (and warm) first
    t0 = time.perf_counter()
    out = jax.block_until_ready(f())
    dt = time.perf_counter() - t0
    t[name] += dt * scale
    if plat is not None and plat.kind == "gpu" and not plat.interpret:
      from jaxsparse._bench.timing import kernel_time
      total, per = kernel_time(f, (), calls=3, warmup=1)
      top = sorted(per.items(), key=lambda kv: -kv[1])[:4]
      kernels[name] = dict(wall_s=dt, kernel_s=total, kernel_names=len(per),
                           top={k_[:60]: v for k_, v in top})
    return out

  state = index.init_state(n, k.shape[1], cfg)
  t0 = time.perf_counter()  # every window's k-means, as prefill_topk runs them (compiled)
  clusters = jax.block_until_ready(index.cluster_windows(k, cfg, platform=plat))
  t["seal"] += time.perf_counter() - t0
  for v in range(1, nw + 1):
    p = v * wnd
    t0 = time.perf_counter()
    state = jax.block_until_ready(index.seal(state, k, p, config=cfg, platform=plat,
                                             clusters=clusters))
    t["seal"] += time.perf_counter() - t0
    if cfg.refit_interval and p % cfg.refit_interval == 0:
      t0 = time.perf_counter()
      state = jax.block_until_ready(index.refit(state, k, p, config=cfg, platform=plat))
      t["refit"] += time.perf_counter() - t0
    lo, hi = p - 1, min(p - 1 + wnd, n)
    if v not in sample or lo >= hi:
      continue
    sc = full / len(sample)
    qlo = lo - (blk - 1)  # shared blocks: the queries ranking the first block
    pos = jnp.arange(qlo, hi, dtype=jnp.int32)
    gend = jnp.full((hi - qlo,), state["grouped_end"], jnp.int32)
    members, offsets = timed("lists", lambda: candidates.lists_by_rank(
        state["assign"], state["rank"], state["sizes"]), sc)
    gs = timed("rank", lambda: rank(q[qlo:hi], w[qlo:hi], state["centers"], state["sizes"],
                                    state["last"], gend, platform=plat), sc)
    if blk > 1:
      idx, bpos = timed("pack", lambda: shared_pack(gs, state["sizes"], members, offsets, gend,
                                                    pos), sc)
      z, _ = timed("score", lambda: shared_score(q[qlo:hi], w[qlo:hi], k, idx, bpos), sc)
    else:
      packed = timed("pack", lambda: pack(gs, state["sizes"], members, offsets, gend, pos), sc)
      z, idx = timed("score", lambda: score(q[lo:hi], w[lo:hi], k, members, packed), sc)
    timed("topk", lambda: select(z, idx, min(cfg.topk, n), platform=plat,
                                 block=blk if blk > 1 else 1), sc)
  return t, kernels


def full_scores(q, k, w, chunk, segments):
  """Full DSA's scoring alone (the kernels' [chunk, keys] scores, no top-K) over the same
  segments as `full_topk`, `chunk` queries a call: what the top-K adds to it."""
  from jaxsparse.selection import causal_segments
  last = None
  for s_lo, s_hi in causal_segments(k.shape[0], segments):
    for lo in range(s_lo, s_hi, chunk):
      hi = min(lo + chunk, s_hi)
      last = jaxsparse.indexer_scores(q[lo:hi], k[:s_hi], w[lo:hi],
                                      query_positions=jnp.arange(lo, hi, dtype=jnp.int32))
  return jax.block_until_ready(last)


def recall_only(a, cfg, tr, tokens, layers):
  """Recall of AttentionIndex (cfg; per query beside shared blocks) and HiSA at the benchmark's
  recall queries, each listed trace layer tiled to each N (float32, the trace's shapes)."""
  rows = []
  for n in tokens:
    qs = np.linspace(4 * a.seal_window, n - 1, a.recall_queries).astype(int)
    for li in layers:
      q, k, w = traces.tile_prefill(tr.q[li], tr.k[li], tr.w[li], n, seed=n)
      rec = lambda c, m="ivf": float(ivf.evaluate(q, k, w, c, method=m,  # noqa: E731
                                                  query_positions=qs)["recall"].mean())
      row = dict(tokens=n, layer=int(tr.layers[li]), recall=rec(cfg),
                 hisa_recall=rec(cfg, "hisa"))
      if cfg.query_block > 1:
        row["per_query_recall"] = rec(dataclasses.replace(cfg, query_block=1))
      rows.append(row)
      print(f"{n} layer {row['layer']}: " + ", ".join(f"{k_} {v:.4f}" for k_, v in row.items()
                                                       if k_.endswith("recall")), flush=True)
      write_json(a.out, {"environment": {**environment(), "command": " ".join(sys.argv)},
                         "config": vars(a), "rows": rows})
  print_table(rows, [c for c in ("tokens", "layer", "recall", "per_query_recall",
                               "hisa_recall") if c in rows[0]])
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--tokens", default="65536,262144,1048576")
  p.add_argument("--heads", type=int, default=64)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--topk", type=int, default=2048)
  p.add_argument("--budget", type=int, default=24576)
  p.add_argument("--seal-window", type=int, default=1024)
  p.add_argument("--cluster-size", type=int, default=128)
  p.add_argument("--refit-interval", type=int, default=16384)
  p.add_argument("--query-block", type=int, default=1,
                 help="IVFConfig.query_block: queries sharing one candidate set (1: each its own)")
  p.add_argument("--chunk", type=int, default=2048,
                 help="queries per call of full DSA's scoring-alone timing")
  p.add_argument("--segments", type=int, default=8,
                 help="full DSA's causal segments (jaxsparse.causal_prefill_topk)")
  p.add_argument("--recall-queries", type=int, default=64)
  p.add_argument("--repeats", type=int, default=2,
                 help="runs per N; the fastest is reported (the first compiles)")
  p.add_argument("--stages", type=int, default=8, metavar="WINDOWS",
                 help="time each stage apart on this many windows per N (0: off)")
  p.add_argument("--profile", action="store_true",
                 help="GPU: also record the kernel seconds of one whole IVF and full DSA run "
                 "(device trace) and their longest kernels")
  p.add_argument("--warmup-tokens", type=int, default=0,
                 help="context of the untimed warm-up run (default: the smallest --tokens)")
  p.add_argument("--trace", default="",
                 help="a real prefill trace (jaxsparse.traces): its layers tiled to each N "
                 "instead of random clustered keys")
  p.add_argument("--layers", default="0",
                 help="with --trace: indexes of its layers; the first is timed, every one's "
                 "recall is measured")
  p.add_argument("--recall-only", action="store_true",
                 help="with --trace: recall alone (ivf.evaluate at the recall queries, the "
                 "trace's own shapes in float32; per-query IVF beside shared blocks), no timing: "
                 "long contexts on a CPU")
  p.add_argument("--metric-timing", action="store_true",
                 help="also time the prefill under a grouping metric (`ivf.metric`) fitted on "
                      "the run's first 8,192 tokens: the mapped path's cost (a synthetic "
                      "sequence's metric says nothing of real text's recall)")
  p.add_argument("--quick", action="store_true", help="tiny shapes for a CPU check")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  if a.quick:
    a.tokens, a.heads, a.dim, a.topk, a.budget = "512,1024", 4, 16, 16, 160
    a.seal_window, a.cluster_size, a.refit_interval, a.chunk = 64, 16, 256, 256
    a.repeats, a.stages = 1, 2
  cfg = ivf.IVFConfig(topk=a.topk, budget=a.budget, seal_window=a.seal_window,
                      cluster_size=a.cluster_size, refit_interval=a.refit_interval,
                      query_block=a.query_block)
  rows = []
  tokens = [int(t) for t in a.tokens.split(",")]
  tr = traces.load(a.trace) if a.trace else None
  layers = [int(x) for x in a.layers.split(",")] if tr is not None else [None]
  if tr is not None and (tr.kind != "prefill" or not all(0 <= x < len(tr.layers)
                                                         for x in layers)):
    p.error(f"--trace must be a prefill trace and --layers {a.layers} indexes into its "
            f"{len(tr.layers)} layers")

  if a.recall_only:
    if tr is None:
      p.error("--recall-only needs --trace")
    return recall_only(a, cfg, tr, tokens, layers)

  def make(n, layer, seed):
    return (case(n, a.heads, a.dim, seed=seed) if tr is None
            else trace_case(tr, layer, n, a.heads, a.dim, seed=seed))

  warm = make(a.warmup_tokens or min(tokens), layers[0], 0)
  jax.block_until_ready(ivf.prefill_topk(*warm, cfg))
  jax.block_until_ready(ivf.prefill_topk(*warm, cfg, method="hisa"))
  full_topk(*warm, a.topk, a.segments)
  del warm  # at 1M its q alone is 16 GB
  for n in tokens:
    q, k, w = make(n, layers[0], n)
    t_ivf = t_hisa = t_full = t_scores = t_metric = float("inf")
    if a.metric_timing:  # fitted on the run's first tokens: the mapped path's cost
      from jaxsparse.ivf import metric as ivf_metric
      head = min(n, 8192)
      mapped = ivf_metric.fit(q[:head], k[:head], w[:head])
    qs = np.linspace(4 * a.seal_window, n - 1, a.recall_queries).astype(int)
    for _ in range(a.repeats):  # the first run at a new N compiles for its shapes
      t0 = time.perf_counter()
      sel, num = jax.block_until_ready(ivf.prefill_topk(q, k, w, cfg))
      t_ivf = min(t_ivf, time.perf_counter() - t0)
      sel, num = sel[qs], float(num.mean())  # only the sampled rows stay (8 GB each at 1M)
      t0 = time.perf_counter()
      sel_h, _ = jax.block_until_ready(ivf.prefill_topk(q, k, w, cfg, method="hisa"))
      t_hisa = min(t_hisa, time.perf_counter() - t0)
      sel_h = sel_h[qs]
      if a.metric_timing:
        t0 = time.perf_counter()
        sel_m, _ = jax.block_until_ready(ivf.prefill_topk(q, k, w, cfg, metric=mapped))
        t_metric = min(t_metric, time.perf_counter() - t0)
        sel_m = sel_m[qs]
      t0 = time.perf_counter()
      full_topk(q, k, w, a.topk, a.segments)
      t_full = min(t_full, time.perf_counter() - t0)
    rec, rec_h = (recall(q, k, w, x, qs, a.topk) for x in (sel, sel_h))
    rows.append(dict(tokens=n, ivf_s=t_ivf, full_s=t_full, speedup=t_full / t_ivf,
                     recall=rec, mean_candidates=num, hisa_s=t_hisa,
                     hisa_speedup=t_full / t_hisa, hisa_recall=rec_h))
    if a.metric_timing:
      rows[-1].update(ivf_metric_s=t_metric, metric_speedup=t_full / t_metric,
                      metric_recall=recall(q, k, w, sel_m, qs, a.topk))
      print(f"  under a grouping metric: {t_metric:.2f} s, recall "
            f"{rows[-1]['metric_recall']:.3f}", flush=True)
    write_json(a.out, {"environment": {**environment(), "command": " ".join(sys.argv)},
                       "config": vars(a), "rows": rows})  # rows so far, if a later step fails
    full_scores(q, k, w, a.chunk, a.segments)  # compiles; after the rows above are safe
    for _ in range(a.repeats):  # full DSA's scoring alone
      t0 = time.perf_counter()
      full_scores(q, k, w, a.chunk, a.segments)
      t_scores = min(t_scores, time.perf_counter() - t0)
    rows[-1]["full_scoring_s"] = t_scores
    if tr is not None:  # every listed layer's recall (the timed one's included)
      rows[-1]["layer"] = int(tr.layers[layers[0]])
      by = [dict(layer=int(tr.layers[layers[0]]), recall=rec, hisa_recall=rec_h)]
      for li in layers[1:]:
        ql, kl, wl = make(n, li, n)
        by.append(dict(layer=int(tr.layers[li]),
                       recall=recall(ql, kl, wl, ivf.prefill_topk(ql, kl, wl, cfg)[0][qs], qs,
                                     a.topk),
                       hisa_recall=recall(ql, kl, wl, ivf.prefill_topk(
                           ql, kl, wl, cfg, method="hisa")[0][qs], qs, a.topk)))
        del ql, kl, wl
      rows[-1]["recall_by_layer"] = by
      print("  recall by layer: " + ", ".join(f"{b_['layer']} {b_['recall']:.3f} (HiSA "
                                              f"{b_['hisa_recall']:.3f})" for b_ in by),
            flush=True)
    print(f"{n}: IVF {t_ivf:.2f} s, full DSA {t_full:.2f} s ({t_full / t_ivf:.2f}x; its "
          f"scoring alone {t_scores:.2f} s), recall {rec:.3f}; HiSA {t_hisa:.2f} s "
          f"({t_full / t_hisa:.2f}x), recall {rec_h:.3f}", flush=True)
    if a.profile and jax.default_backend() == "gpu":  # kernel seconds of one whole run
      from jaxsparse._bench.timing import kernel_time
      for name, f in (("ivf", lambda: jax.block_until_ready(ivf.prefill_topk(q, k, w, cfg))),
                      ("full", lambda: full_topk(q, k, w, a.topk, a.segments))):
        tot, per = kernel_time(f, (), calls=1, warmup=0)
        top = sorted(per.items(), key=lambda kv: -kv[1])[:8]
        rows[-1][f"{name}_kernels"] = dict(kernel_s=tot, kernel_names=len(per),
                                           top={k_[:60]: v for k_, v in top})
        print(f"  {name}: kernels {tot:.3f} s of a run: " + ", ".join(
            f"{k_[:40]} {v:.3f}" for k_, v in top), flush=True)
    if a.stages:
      rows[-1]["stages_s"], kern = stages(q, k, w, cfg, a.stages)
      if kern:  # GPU: one window's kernel time per stage against its wall time
        rows[-1]["window_kernels"] = kern
        for s_, v in kern.items():
          print(f"  {s_}: wall {v['wall_s'] * 1e3:.2f} ms, kernels {v['kernel_s'] * 1e3:.2f} ms "
                f"({v['kernel_names']} names): " + ", ".join(
                    f"{n_} {t_ * 1e3:.2f}" for n_, t_ in v["top"].items()), flush=True)
      print("  stages (s): " + ", ".join(f"{s_} {v:.3f}" for s_, v in
                                         rows[-1]["stages_s"].items()), flush=True)
    write_json(a.out, {"environment": {**environment(), "command": " ".join(sys.argv)},
                       "config": vars(a), "rows": rows})  # rows so far, if a later N fails
  print_table(rows, ["tokens", "ivf_s", "full_s", "speedup", "recall", "hisa_s", "hisa_recall"])
  write_json(a.out, {"environment": {**environment(), "command": " ".join(sys.argv)},
                     "config": vars(a), "rows": rows})


if __name__ == "__main__":
  main()

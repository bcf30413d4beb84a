"""Where the time of jaxsparse.topk goes: each pass of the threshold filter timed alone, in-graph.
(--configs sweeps chunk, warps and bisection steps.)

  python benchmarks/topk_stages.py --out benchmarks/results/topk_stages_h200.json

Stages are timed in-graph, unrolled (benchtools.time_in_graph); the floor, the whole call and
lax.top_k also with the fori_loop timing, to show what the loop itself adds. Each stage gets the real outputs of the stages before it as inputs (computed once, outside the
timed loop), so the per-stage times add up to the pipeline minus fusion and launch overlap.
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxsparse import backend, selection
from jaxsparse._bench.cases import _emit
from jaxsparse._bench.timing import environment, kernel_time, print_table, time_in_graph, write_json
from pallas_kernels._util import next_pow2, pad_axis
from pallas_kernels.topk import TopkConfig, gpu_chunk, group_size, persist_chunk
from pallas_kernels.topk import gpu as kg


def _label(c: TopkConfig) -> str:
  """chunk:warps:bisect_iters:bitonic_run:skip_groups[:compact[:run_warps[:gather]]], as
  --configs takes it (compact, TopkConfig.compact: none or 0 "scan", 1 "lane", 2 "rows", 3
  "auto", the default from session 13, whose earlier default was "scan"; run_warps:
  TopkConfig.bitonic_run_warps when not 4; both from session 13; gather: 0 False (the
  meaning of a label without it), 1 True, 2 "auto" (TopkConfig.gather, from session 14);
  then +field=value for each LABEL_BASE field that differs (from session 15); files before
  session 10's third call have chunk:warps:iters[:scan_block:bitonic_run])."""
  tail = {"scan": "", "lane": ":1", "rows": ":2", "auto": ":3"}[c.compact]
  if c.bitonic_run_warps != 4 or c.gather:
    tail = f":{tail[1:] or 0}:{c.bitonic_run_warps}"
  if c.gather:
    tail += ":1" if c.gather is True else ":2"
  tail += "".join(f"+{f}={getattr(c, f)}" for f, v in LABEL_BASE.items() if getattr(c, f) != v)
  return f"{c.chunk}:{c.num_warps}:{c.bisect_iters}:{c.bitonic_run}:{int(c.skip_groups)}{tail}"


# fields a label names as +field=value where they differ from these (the values before
# session 15, so a label keeps its meaning when the defaults move; session 15's first call
# also swept fused_max_n, a one-program-per-row filter, and session 16's first bisect_points,
# a multisection threshold, both since removed: benchmarks/NOTES.md; the persist_* fields
# from session 17, whose fourth call also swept persist_rank, the persistent kernel's rank
# step, since removed; fused_rank, repair_in_finish, bitonic_mid and rank_rows from session
# 18, whose first call also swept fused_repair and fused_threshold_rows, since removed;
# rank_preload, rank_split_ties and rank_buckets from session 19, rank_buckets_min_k and
# falsi_slack_entries and rank_pivot_probes from session 20; 0 entries: the slack is
# falsi_slack alone; bucket_chunk and bucket_chunk_min_entries from session 21, 0: small_chunk,
# as before; bitonic_rank_merge and rank_merge_warps from session 21, rank_merge_max_rows
# and rank_merge_min_k and rank_merge_samples from session 22; rank_merge_live_probes,
# rank_merge_run_warps (False / 4: as before) and rank_merge_arity from session 23)
LABEL_BASE = dict(finish="bitonic", rank_max_rows=16, rank_min_k=1024, rank_block_i=64,
                  rank_block_j=256, rank_warps=4, threshold_warps=8, threshold="bisect",
                  falsi_slack=64, small_chunk_entries=0, small_chunk=512, groups_per_k=4,
                  max_group=64, max_group_rows=8, persist_max_rows=0, persist_programs=0,
                  persist_block_i=16, persist_block_j=512, persist_warps=8,
                  fused_rank=False, repair_in_finish=False, bitonic_mid=0, rank_rows=False,
                  rank_preload=0, rank_split_ties=False, rank_buckets=False,
                  rank_buckets_min_k=1024, falsi_slack_entries=0, rank_pivot_probes=0,
                  bucket_chunk=0, bucket_chunk_min_entries=0, bitonic_rank_merge=0,
                  rank_merge_warps=4, rank_merge_max_rows=8, rank_merge_min_k=1024,
                  rank_merge_samples=0, rank_merge_live_probes=False, rank_merge_run_warps=4,
                  rank_merge_arity=2)


def stages(bsz: int, n: int, k: int, config: TopkConfig, rows: list, *, brief: bool = False,
           only: tuple = (), kernels: bool = False, kernels_only: bool = False):
  """Time each pass alone at one shape; brief=True: only the filter passes and the whole
  call (sorted and as a set), for config sweeps; only: keep the stages whose name contains
  one of these strings; kernels: also the device trace's time of each kernel of every timed
  stage (GPU); kernels_only: that time alone (no in-graph timing)."""
  plat = backend.kernel_platform()
  interp = plat.interpret
  x = jax.random.normal(jax.random.PRNGKey(0), (bsz, n), jnp.float32)
  lens = jnp.full((bsz,), n, jnp.int32)
  g = group_size(n, k, config, "gpu", rows=bsz)
  chunk, _ = gpu_chunk(config, bsz, n, k, g, config.finish_for(bsz, k))
  capacity = next_pow2(config.capacity_factor * k)
  nw = config.num_warps

  f_gm = jax.jit(lambda x, l: kg.group_max(x, l, chunk=chunk, group=g, num_warps=nw,
                                           interpret=interp))
  gm = f_gm(x, lens)
  gp = pad_axis(gm, 1, next_pow2(gm.shape[1]), value=float("-inf"))
  thr_fns = {it: jax.jit(lambda gp, it=it: kg.threshold(
      gp, k, iters=it, num_warps=8, interpret=interp,
      slack=config.falsi_slack if it == config.bisect_iters and config.threshold == "falsi"
      else 0))
             for it in (config.bisect_iters, 8)}
  thr = thr_fns[config.bisect_iters](gp)
  f_cnt = jax.jit(lambda x, l, t: kg.count(x, l, t, chunk=chunk, num_warps=nw, interpret=interp))
  counts = f_cnt(x, lens, thr)
  f_scan = jax.jit(lambda c: (jnp.cumsum(c, axis=1) - c, c.sum(axis=1)))
  offsets, total = f_scan(counts)
  f_cmp = jax.jit(lambda x, l, t, o: kg.compact(x, l, t, o, capacity=capacity, chunk=chunk,
                                                num_warps=nw, interpret=interp))
  cv_raw, ci_raw = f_cmp(x, lens, thr, offsets)
  live = jnp.minimum(total, capacity).astype(jnp.int32)
  f_atomic = jax.jit(lambda x, l, t: kg.compact_atomic(x, l, t, capacity=capacity, chunk=chunk,
                                                       num_warps=nw, interpret=interp,
                                                       placement=config.placement(
                                                           bsz, n, k)))
  bitonic = {w: jax.jit(lambda cv, ci, l, w=w: kg.bitonic_finish(
      cv, ci, l, k, capacity, num_warps=w, interpret=interp)) for w in (8, 16, 32)}
  bitonic_cfg = dataclasses.replace(config, finish="bitonic")

  def masked(cv, ci, total):  # compact leaves the slots past the count uninitialised
    ok = jnp.arange(capacity) < jnp.minimum(total, capacity)[:, None]
    return jnp.where(ok, cv[:, :capacity], float("-inf")), ci[:, :capacity]

  cv, ci = masked(cv_raw, ci_raw, total)

  def final_topk(cv, ci):
    v, p = lax.top_k(cv, k)
    return v, jnp.take_along_axis(ci, p, axis=1)

  def final_sort(cv, ci):
    nv, i = lax.sort((-cv, ci), dimension=1, num_keys=2)
    return -nv[:, :k], i[:, :k]

  def no_cond(x):  # topk_rows without overflow handling (then a lax.cond, now the repair kernel)
    gm = kg.group_max(x, lens, chunk=chunk, group=g, num_warps=nw, interpret=interp)
    gp = pad_axis(gm, 1, next_pow2(gm.shape[1]), value=float("-inf"))
    thr = kg.threshold(gp, k, iters=config.bisect_iters, num_warps=8, interpret=interp)
    c = kg.count(x, lens, thr, chunk=chunk, num_warps=nw, interpret=interp)
    cv, ci = kg.compact(x, lens, thr, jnp.cumsum(c, axis=1) - c, capacity=capacity, chunk=chunk,
                        num_warps=nw, interpret=interp)
    return final_topk(*masked(cv, ci, c.sum(axis=1)))

  timed = {
      "floor: one tiny op": (jax.jit(lambda c: c + 1), (counts,)),
      "group_max": (f_gm, (x, lens)),
      f"threshold (bisect {config.bisect_iters})": (thr_fns[config.bisect_iters], (gp,)),
      "threshold (bisect 8)": (thr_fns[8], (gp,)),
      "count": (f_cnt, (x, lens, thr)),
      "cumsum": (f_scan, (counts,)),
      "compact": (f_cmp, (x, lens, thr, offsets)),
      f"final lax.top_k [{bsz},{capacity}]": (jax.jit(final_topk), (cv, ci)),
      f"final lax.sort 2 keys [{bsz},{capacity}]": (jax.jit(final_sort), (cv, ci)),
      f"final set in index order [{bsz},{capacity}] (kernel)": (jax.jit(
          lambda cv, ci, l: kg.index_order_finish(cv, ci, l, k, capacity, interpret=interp)),
          (cv_raw, ci_raw, live)),
      "compact, one pass (atomic)": (f_atomic, (x, lens, thr)),
      **{f"final bitonic [{bsz},{capacity}] (kernel, {w} warps)": (f, (cv_raw, ci_raw, live))
         for w, f in bitonic.items()},
      **{f"final bitonic split [{bsz},{capacity}] (runs of {run})": (jax.jit(
          lambda cv, ci, l, run=run: kg.bitonic_finish_split(
              cv, ci, l, k, capacity, run=run, num_warps=config.bitonic_warps,
              interpret=interp)), (cv_raw, ci_raw, live))
         for run in (256, 512, 1024) if run < capacity},
      f"final rank [{bsz},{capacity}] (kernel)": (jax.jit(
          lambda cv, ci, l: kg.rank_finish(cv, ci, l, k, capacity, interpret=interp)),
          (cv_raw, ci_raw, live)),
      "whole topk, rank": (jax.jit(lambda x: selection.topk(
          x, k, implementation="pallas", config=dataclasses.replace(config, finish="rank"))),
          (x,)),
      "whole topk": (jax.jit(lambda x: selection.topk(x, k, implementation="pallas",
                                                      config=config)), (x,)),
      "whole topk, bitonic": (jax.jit(lambda x: selection.topk(
          x, k, implementation="pallas", config=bitonic_cfg)), (x,)),
      "whole topk, no fallback cond": (jax.jit(no_cond), (x,)),
      "lax.top_k": (jax.jit(lambda x: lax.top_k(x, k)), (x,)),
  }
  parties = config.persist_parties(bsz, 0 if interp else kg.sm_count())
  if parties:  # the persistent kernel cut after each step (its steps' cumulative times)
    def persistent(x, stop):
      gm, ctr = kg.group_max(x, None, chunk=chunk, group=g, num_warps=nw, interpret=interp,
                             zeros=kg.PERSIST_SLOTS)
      return kg.persistent_select(
          x, None, gm, ctr, k=k, capacity=capacity, parties=parties,
          chunk=persist_chunk(x.shape[1], chunk, parties), iters=config.bisect_iters,
          slack=config.falsi_slack * (config.threshold == "falsi"),
          block_i=config.persist_block_i, block_j=config.persist_block_j,
          num_warps=config.persist_warps, spin=config.persist_spin, interpret=interp, stop=stop)

    for stop in ("search", "filter", "barrier", ""):
      timed[f"persistent to {stop or 'the end'}"] = (
          jax.jit(lambda x, stop=stop: persistent(x, stop)), (x,))
  timed["whole topk, set"] = (jax.jit(lambda x: selection.topk(
      x, k, implementation="pallas", config=config, sorted=False)), (x,))
  if only:  # overrides brief's list; "=name" keeps that stage only
    timed = {name: v for name, v in timed.items()
             if any(name == o[1:] if o.startswith("=") else o in name for o in only)}
  elif brief:
    keep = ("group_max", f"threshold (bisect {config.bisect_iters})", "count", "compact",
            "compact, one pass (atomic)", "whole topk", "whole topk, bitonic", "whole topk, set")
    timed = {name: v for name, v in timed.items() if name in keep}
  loop_too = () if brief else ("floor: one tiny op", "whole topk", "lax.top_k")
  for name, (f, args) in timed.items():
    err = ""
    for unrolled in () if kernels_only else (True, False) if name in loop_too else (True,):
      try:
        us, err = time_in_graph(f, args, unrolled=unrolled, calls=10) * 1e6, ""
      except Exception as e:  # noqa: BLE001 - report, keep going
        us, err = float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
      _emit(rows, dict(op="topk stage", B=bsz, N=n, K=k, stage=name,
                       config=_label(config),
                       timing="unrolled" if unrolled else "fori_loop", us=us, error=err,
                       candidates_max=int(total.max()), groups=int(gm.shape[1]), group=g))
    if (kernels or kernels_only) and not err:
      # the device trace's kernel time per call and per kernel (the in-graph time minus this
      # is what launch gaps and the timer add)
      try:
        total_s, per = kernel_time(f, args)
      except Exception as e:  # noqa: BLE001 - report, keep going
        total_s, per = float("nan"), {}
        print(f"kernel_time failed: {type(e).__name__}: {e}", flush=True)
      for kname, sec in [("all kernels", total_s)] + sorted(per.items(), key=lambda t: -t[1]):
        _emit(rows, dict(op="topk kernel", B=bsz, N=n, K=k, stage=name, kernel=kname[:60],
                         config=_label(config),
                         timing="device trace", us=sec * 1e6, error=""))


def _parse(spec: str) -> TopkConfig:
  """"chunk:warps:bisect_iters[:bitonic_run[:skip_groups[:compact[:run_warps[:gather]]]]]"
  then any +field=value (LABEL_BASE's fields) -> TopkConfig."""
  spec, *extra = spec.split("+")
  v = [int(t) for t in spec.split(":")]
  if not 3 <= len(v) <= 8:
    raise ValueError(f"--configs entry {spec!r}: chunk:warps:iters[:bitonic_run[:skip_groups"
                     "[:compact[:run_warps[:gather]]]]]")
  names = ("chunk", "num_warps", "bisect_iters", "bitonic_run", "skip_groups", "compact",
           "bitonic_run_warps", "gather")
  kw = dict(LABEL_BASE, **dict(zip(names, v)))  # a field the label leaves out: LABEL_BASE's
  kw.setdefault("compact", 0)  # a label without the field: "scan", as before session 13
  kw.setdefault("gather", 0)  # a label without it: every chunk read, as before session 14
  kw["gather"] = (False, True, "auto")[kw["gather"]]
  if "skip_groups" in kw:
    kw["skip_groups"] = bool(kw["skip_groups"])
  if "compact" in kw:
    kw["compact"] = ("scan", "lane", "rows", "auto")[kw["compact"]]
  for item in extra:  # +field=value (LABEL_BASE's fields)
    name, _, val = item.partition("=")
    if name not in LABEL_BASE:
      raise ValueError(f"--configs entry {spec!r}: +{name}= is not one of {sorted(LABEL_BASE)}")
    base = LABEL_BASE[name]
    kw[name] = (val if isinstance(base, str) else val in ("1", "True") if isinstance(base, bool)
                else int(val))
  return TopkConfig(**kw)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", default="benchmarks/results/topk_stages_h200.json")
  p.add_argument("--shapes", default="64x131072,8x131072,1x131072,64x1048576")
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--configs", default="",
                 help="comma list of chunk:num_warps:bisect_iters[:bitonic_run[:skip_groups"
                      "[:compact[:run_warps[:gather]]]]][+field=value...] TopkConfig variants to "
                      "sweep (brief: filter passes and whole call only; +field=value sets a "
                      "LABEL_BASE field, e.g. +finish=rank); default: TopkConfig() in full")
  p.add_argument("--only", default="",
                 help="comma list of substrings: time only the stages whose name holds one "
                      "(=name: exactly that stage)")
  p.add_argument("--kernels", action="store_true",
                 help="also each kernel's time in the device trace (GPU profiler) for every "
                      "timed stage")
  p.add_argument("--kernels-only", action="store_true",
                 help="the device trace's kernel times only, no in-graph timing (a third of "
                      "the compiles: no unrolled programs)")
  a = p.parse_args(argv)
  only = tuple(o for o in a.only.split(",") if o)
  rows = []
  cfgs = [_parse(spec) for spec in a.configs.split(",") if spec]
  env = environment()
  for s in a.shapes.split(","):
    b, n = (int(v) for v in s.split("x"))
    for cfg in cfgs or [TopkConfig()]:
      stages(b, n, a.k, cfg, rows, brief=bool(cfgs), only=only, kernels=a.kernels,
             kernels_only=a.kernels_only)
      # after every (shape, config): a run cut short by a timeout keeps what it measured
      write_json(a.out, dict(environment=env, rows=rows))
  print_table(rows, ["B", "N", "K", "config", "stage", "kernel", "timing", "us", "candidates_max",
                     "error"])
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()

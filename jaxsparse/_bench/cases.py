"""Indexer and top-K benchmarks: shapes in, table rows out (the CLI and benchmarks/ call these)."""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import indexer as _indexer
from jaxsparse import selection as _topk
from jaxsparse.prep import quantize_fp8
from jaxsparse._bench.timing import (COPY_TBPS, MATMUL_TFLOPS, in_graph_mode, kernel_time,
                                     time_calls, time_in_graph)

__all__ = ["bench_decode", "bench_prefill", "bench_topk", "bench_decode_topk", "bench_spin",
           "ragged_paged_case", "rows_not_echoed"]

L2_BYTES = 60 << 20
NEG_INF = float("-inf")
FP8 = "float8_e4m3fn"  # fp8 keys, bf16 queries
FP8_QK = "fp8 q+k"  # fp8 queries and keys (DeepSeek-V3.2's indexer precision)


def _timed(fn, arg_sets, **kw):
  """time_calls (or, with $JAXSPARSE_IN_GRAPH set, time_in_graph on the first argument set), but a
  variant that fails to compile or run is reported, not fatal to a sweep."""
  try:
    if in_graph_mode():
      return time_in_graph(fn, arg_sets[0], calls=kw.get("calls", 20), reps=kw.get("reps", 5),
                           carry=kw.get("carry")), ""
    return time_calls(fn, arg_sets, **kw), ""
  except Exception as e:  # noqa: BLE001 - any lowering/runtime failure of one variant
    return float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


class _Rand:
  """Device-side random inputs (host numpy is far too slow for 10-GB caches)."""

  def __init__(self, seed: int):
    self.key = jax.random.PRNGKey(seed)

  def normal(self, shape, dtype=jnp.bfloat16):
    self.key, sub = jax.random.split(self.key)
    return jax.random.normal(sub, shape, dtype)


def _kernel_us(fn, args, per_kernel: dict | None = None, carry=None) -> float:
  """Kernel microseconds per call from the device trace (benchtools.kernel_time) on a GPU; NaN
  elsewhere or when the profiler fails (the wall-clock column still stands). per_kernel: a
  dict to fill with microseconds per call of each kernel name (largest first). carry: as in
  kernel_time."""
  if jax.default_backend() != "gpu":
    return float("nan")
  try:
    total, kernels = kernel_time(fn, args, carry=carry)
    if per_kernel is not None:
      per_kernel.update({n: round(t * 1e6, 2) for n, t in
                         sorted(kernels.items(), key=lambda kv: -kv[1])})
    return total * 1e6
  except Exception as e:  # noqa: BLE001 - a profiler failure must not end a sweep
    print(f"kernel_time failed: {type(e).__name__}: {e}", flush=True)
    return float("nan")


def _sets(nbytes: int) -> int:
  """How many input copies to rotate so that repeated calls miss in L2."""
  return 1 if nbytes > 4 * L2_BYTES else 4


def _jnp_decode(q, keys, w):
  s = jnp.einsum("bhd,bnd->bhn", q, keys, preferred_element_type=jnp.float32)
  return jnp.einsum("bhn,bh->bn", jnp.maximum(s, 0.0), w)


_ECHO = [True]


@contextlib.contextmanager
def rows_not_echoed():
  """Inside, result rows are not printed as they come: for callers that print tables of them
  (`jaxsparse bench`). $JAXSPARSE_BENCH_JSONL still receives every row."""
  _ECHO.append(False)
  try:
    yield
  finally:
    _ECHO.pop()


def _row_line(row: dict) -> str:
  """One result row as `key=value` words; NaN (not measured) and empty fields left out."""
  words = []
  for k, v in row.items():
    if isinstance(v, float):
      if math.isnan(v):
        continue
      v = f"{v:.4g}"
    elif v in ("", None):
      continue
    words.append(f"{k}={v}")
  return " ".join(words)


def _emit(rows, row):
  """Append a result row and print it at once as one line (unless `rows_not_echoed`; and
  append it to $JAXSPARSE_BENCH_JSONL when set), so a run cut short still leaves its numbers."""
  rows.append(row)
  if _ECHO[-1]:
    print(_row_line(row), flush=True)
  path = os.environ.get("JAXSPARSE_BENCH_JSONL")
  if path:
    with open(path, "a") as f:
      f.write(json.dumps(row, default=float) + "\n")


def _decode_request(rng, bsz, n, heads, head_dim):
  """Queries, weights, full lengths and a shuffled block table over B * n / 64 pages."""
  pages = n // _indexer.PAGE_SIZE
  q = jnp.asarray(rng.standard_normal((bsz, heads, head_dim)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((bsz, heads)), jnp.float32)
  lens = jnp.full((bsz,), n, jnp.int32)
  table = jnp.asarray(np.stack([rng.permutation(pages) + b * pages for b in range(bsz)]),
                      jnp.int32)
  return q, w, lens, table


def ragged_paged_case(rng, *, b=5, heads=64, head_dim=128, num_blocks=700, max_blocks=100):
  """A small decode case for kernel checks: bf16 q [b, H, D] and cache [num_blocks, 64, D], a
  random block table [b, max_blocks], ragged lengths (full, 1 slot, one page, mid-page x 2) and
  f32 weights [b, H] -> (q, k_cache, block_table, lengths, w)."""
  q = jnp.asarray(rng.standard_normal((b, heads, head_dim)), jnp.bfloat16)
  kc = jnp.asarray(rng.standard_normal((num_blocks, 64, head_dim)), jnp.bfloat16)
  table = jnp.asarray(rng.integers(0, num_blocks, (b, max_blocks)), jnp.int32)
  lens = jnp.asarray([max_blocks * 64, 1, 64, 3000, 5000][:b], jnp.int32)
  w = jnp.asarray(rng.standard_normal((b, heads)), jnp.float32)
  return q, kc, table, lens, w


def _paged_cases(batches, slots_list, heads, head_dim, seed):
  """(B, N, (q, w, lengths, block_table, bf16 key cache)) for every shape, random keys."""
  rng = np.random.default_rng(seed)
  dev = _Rand(seed)
  for bsz, n in itertools.product(batches, slots_list):
    q, w, lens, table = _decode_request(rng, bsz, n, heads, head_dim)
    kc = dev.normal((bsz * (n // _indexer.PAGE_SIZE), 64, head_dim))
    yield bsz, n, (q, w, lens, table, kc)


def bench_decode(batches, slots_list, *, heads=64, head_dim=128, key_dtypes=("bfloat16",),
                 configs=(None,), implementation=None, baseline=True, seed=0, reps=5, calls=20):
  """Paged decode scoring; one row per (B, N, key dtype, config) plus a plain-jnp baseline row."""
  rng = np.random.default_rng(seed)
  dev = _Rand(seed)
  rows = []
  for bsz, n in itertools.product(batches, slots_list):
    pages = n // _indexer.PAGE_SIZE
    q, w, lens, table = _decode_request(rng, bsz, n, heads, head_dim)
    base_us = base_kus = None
    if baseline:
      nbytes = bsz * n * head_dim * 2
      sets = [(q, dev.normal((bsz, n, head_dim)), w)
              for _ in range(_sets(nbytes))]
      f = jax.jit(_jnp_decode)
      sec = time_calls(f, sets, reps=reps, calls=calls)  # host loop: rotating input copies
      base_us = sec * 1e6
      base_kus = _kernel_us(f, sets[0])
      moved = nbytes + bsz * n * 4
      _emit(rows, dict(op="decode", B=bsz, N=n, keys="bfloat16", impl="jnp einsum", config="",
                       us=base_us, tbps=moved / sec / 1e12, roofline=moved / sec / 1e12 / COPY_TBPS,
                       speedup_vs_jnp=1.0, kernel_us=base_kus, kernel_tbps=moved / base_kus / 1e6,
                       kernel_speedup_vs_jnp=1.0))
      del sets
    for kd in key_dtypes:
      qq = quantize_fp8(q)[0] if kd == FP8_QK else q
      item = 1 if kd in (FP8, FP8_QK) else 2
      nbytes = bsz * n * head_dim * item
      sets = []
      for _ in range(_sets(nbytes)):
        kc = dev.normal((bsz * pages, 64, head_dim))
        ks = None
        if kd in (FP8, FP8_QK):  # values do not change the speed; avoid a f32 copy of 16 GB
          kc = (kc * 16).astype(jnp.float8_e4m3fn)
          ks = jnp.full((bsz * pages, 64), 1 / 16, jnp.float32)
        sets.append((qq, kc, table, lens, w, ks))
      for cfg in configs:
        f = jax.jit(lambda q, kc, t, l, w, ks, cfg=cfg: _indexer.paged_indexer_scores(
            q, kc, t, l, w, k_scale=ks, implementation=implementation, config=cfg))
        sec, err = _timed(f, sets, reps=reps, calls=calls)
        kus = float("nan") if err else _kernel_us(f, sets[0])
        moved = nbytes + bsz * n * 4 + (bsz * n * 4 if kd in (FP8, FP8_QK) else 0)
        _emit(rows, dict(op="decode", B=bsz, N=n, keys=kd, impl=implementation or "auto",
                         config=_cfg_str(cfg), error=err, us=sec * 1e6, tbps=moved / sec / 1e12,
                         roofline=moved / sec / 1e12 / COPY_TBPS,
                         speedup_vs_jnp=(base_us / (sec * 1e6)) if base_us else float("nan"),
                         kernel_us=kus, kernel_tbps=moved / kus / 1e6,
                         kernel_speedup_vs_jnp=(base_kus / kus) if base_kus else float("nan")))
      del sets
  return rows


def _cfg_str(cfg) -> str:
  if cfg is None:
    return "default"
  base = vars(type(cfg)())
  diff = [f"{k}={v}" for k, v in vars(cfg).items() if base.get(k) != v]
  return ",".join(diff) or "default"


def _jnp_prefill(q, k, w, pos):
  return _indexer.indexer_scores_xla(q, k, w, None, pos)


def bench_prefill(keys_list, *, chunk=2048, heads=64, head_dim=128, key_dtypes=("bfloat16",),
                  configs=(None,), implementation=None, baseline_max_keys=65536, seed=0, reps=3,
                  calls=10):
  """Causal prefill scoring of the last `chunk` queries against N keys."""
  rng = np.random.default_rng(seed)
  dev = _Rand(seed)
  rows = []
  for n in keys_list:
    t = min(chunk, n)
    q = jnp.asarray(rng.standard_normal((t, heads, head_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((t, heads)), jnp.float32)
    pos = jnp.arange(n - t, n, dtype=jnp.int32)
    pairs = float(t) * n - t * (t - 1) / 2  # visible (query, key) pairs
    flops = 2.0 * heads * head_dim * pairs
    kb = dev.normal((n, head_dim))
    base_ms = None
    if n <= baseline_max_keys:
      sec = time_calls(jax.jit(_jnp_prefill), [(q, kb, w, pos)], reps=reps, calls=calls)
      base_ms = sec * 1e3
      _emit(rows, dict(op="prefill", T=t, N=n, keys="bfloat16", impl="jnp einsum", config="",
                       ms=base_ms, tflops=flops / sec / 1e12,
                       roofline=flops / sec / 1e12 / MATMUL_TFLOPS, speedup_vs_jnp=1.0))
    for kd in key_dtypes:
      qq = quantize_fp8(q)[0] if kd == FP8_QK else q
      if kd in (FP8, FP8_QK):
        kk, ks = quantize_fp8(kb)
      else:
        kk, ks = kb, None
      for cfg in configs:
        f = jax.jit(lambda q, k, w, p, ks, cfg=cfg: _indexer.indexer_scores(
            q, k, w, k_scale=ks, query_positions=p, implementation=implementation, config=cfg))
        sec, err = _timed(f, [(qq, kk, w, pos, ks)], reps=reps, calls=calls)
        _emit(rows, dict(op="prefill", T=t, N=n, keys=kd, impl=implementation or "auto",
                         config=_cfg_str(cfg), error=err, ms=sec * 1e3, tflops=flops / sec / 1e12,
                         roofline=flops / sec / 1e12 / MATMUL_TFLOPS,
                         speedup_vs_jnp=(base_ms / (sec * 1e3)) if base_ms else float("nan")))
  return rows


def bench_topk(batches, n_list, k_list, *, implementations=("xla", "pallas"), approx=True,
               torch_topk=True, configs=(None,), seed=0, reps=5, calls=20, unsorted=False,
               kernels=False):
  """Exact top-k of random float32 rows: lax.top_k, approx_max_k, torch.topk and jaxsparse.

  unsorted: also time the top-k as a set (jaxsparse sorted=False: index order; torch.topk
  sorted=False: unspecified order), the form sparse attention consumes.

  JAX timings go through `_timed` (JAXSPARSE_IN_GRAPH=1 removes host dispatch); torch.topk is
  timed with CUDA events. kernels=True also records `kernel_us` (the device trace's kernel
  time per call) for lax.top_k and jaxsparse.
  """
  dev = _Rand(seed)
  rows = []
  try:
    import torch
    have_torch = torch_topk and torch.cuda.is_available()
  except ImportError:
    have_torch = False
  for bsz, n, k in itertools.product(batches, n_list, k_list):
    nbytes = bsz * n * 4
    sets = [(dev.normal((bsz, n), jnp.float32),)
            for _ in range(_sets(nbytes))]
    def add(impl, timed, cfg="", fn=None, args=sets[0]):
      sec, err = timed
      extra = {"kernel_us": _kernel_us(fn, args)} if kernels and fn is not None else {}
      _emit(rows, dict(op="topk", B=bsz, N=n, K=k, impl=impl, config=cfg, error=err,
                       us=sec * 1e6, tbps=nbytes / sec / 1e12, **extra))

    if "xla" in implementations:
      f = jax.jit(lambda x: jax.lax.top_k(x, k))
      add("lax.top_k", _timed(f, sets, reps=reps, calls=calls), fn=f)
    if approx:
      add("lax.approx_max_k", _timed(jax.jit(lambda x: jax.lax.approx_max_k(x, k)), sets,
                                     reps=reps, calls=calls))
    if have_torch:
      add("torch.topk", (_time_torch(sets, k, reps=reps, calls=calls), ""))
      if unsorted:
        add("torch.topk(sorted=False)", (_time_torch(sets, k, reps=reps, calls=calls,
                                                     sorted=False), ""))
    if "pallas" in implementations:
      for cfg in configs:
        f = jax.jit(lambda x, cfg=cfg: _topk.topk(x, k, implementation="pallas", config=cfg))
        add("jaxsparse", _timed(f, sets, reps=reps, calls=calls), _cfg_str(cfg), fn=f)
        if unsorted:
          f = jax.jit(lambda x, cfg=cfg: _topk.topk(x, k, implementation="pallas", sorted=False,
                                                    config=cfg))
          add("jaxsparse(sorted=False)", _timed(f, sets, reps=reps, calls=calls), _cfg_str(cfg))
    del sets
  _add_ratios(rows)
  return rows


def _time_torch(sets, k, *, reps, calls, sorted=True):  # noqa: A002
  import torch
  xs = [torch.from_numpy(np.asarray(s[0])).cuda() for s in sets]
  for x in xs:
    torch.topk(x, k, dim=-1, sorted=sorted)
  torch.cuda.synchronize()
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  samples = []
  for _ in range(reps):
    start.record()
    for i in range(calls):
      torch.topk(xs[i % len(xs)], k, dim=-1, sorted=sorted)
    end.record()
    torch.cuda.synchronize()
    samples.append(start.elapsed_time(end) / 1e3 / calls)
  return float(np.median(samples))


def _add_ratios(rows):
  by_shape = {}
  for r in rows:
    by_shape.setdefault((r["B"], r["N"], r["K"]), {})[r["impl"]] = r["us"]
  for r in rows:
    ref = by_shape[(r["B"], r["N"], r["K"])]
    r["speedup_vs_lax_top_k"] = ref.get("lax.top_k", float("nan")) / r["us"]
    r["speedup_vs_torch"] = ref.get("torch.topk", float("nan")) / r["us"]


def bench_decode_topk(batches, slots_list, k, *, heads=64, head_dim=128, seed=0, reps=5,
                      calls=20):
  """Full decode indexer step (scores + top-k): plain jnp + lax.top_k, separate kernels, fused."""
  rows = []
  for bsz, n, (q, w, lens, table, kc) in _paged_cases(batches, slots_list, heads, head_dim,
                                                      seed):
    dense = kc[table].reshape(bsz, n, head_dim)
    variants = {
        "jnp einsum + lax.top_k": (jax.jit(lambda q, d, w: jax.lax.top_k(_jnp_decode(q, d, w), k)),
                                   (q, dense, w)),
        "kernels, separate": (jax.jit(lambda q, kc, t, l, w: _topk.topk(
            _indexer.paged_indexer_scores(q, kc, t, l, w, implementation="pallas"), k,
            lengths=l, implementation="pallas")), (q, kc, table, lens, w)),
        "indexer_topk (fused)": (jax.jit(lambda q, kc, t, l, w: _topk.indexer_topk(
            q, kc, t, l, w, k, implementation="pallas", fuse_group_max=True)),
                                 (q, kc, table, lens, w)),
    }
    base = None
    for name, (f, args) in variants.items():
      sec, err = _timed(f, [args], reps=reps, calls=calls)
      base = base or sec
      _emit(rows, dict(op="decode+topk", B=bsz, N=n, K=k, impl=name, error=err, us=sec * 1e6,
                       speedup_vs_jnp=base / sec))
  return rows


def bench_spin(batches, slots_list, sparsities, *, k=2048, heads=64, head_dim=128, seed=0,
               reps=5, calls=20, step_only=False, state_dtype="bfloat16", unsorted=False,
               topk_config=None, reduction="A1", spin_decode_config=None,
               explore="random"):
  """Full decode indexer step (fused scoring + top-K) vs the SPIN step, and SPIN's own
  predict + update cost, per (B, N, target sparsity). Random keys: speed does not depend on
  values; the block masks come from a warmed state. unsorted: both steps return their top-K
  as a set (sorted=False), as sparse attention needs. topk_config: both steps' TopkConfig.
  reduction: SPIN's block reduction (A2 updates only block states). spin_decode_config: the
  SPIN step's DecodeConfig for its block-sparse scoring (None: the library default).
  explore: SpinConfig.explore ("query" keeps every block's mean key in the state)."""
  srt = not unsorted
  from jaxsparse import spin
  rows = []
  for bsz, n, (q, w, lens, table, kc) in _paged_cases(batches, slots_list, heads, head_dim,
                                                      seed):
    full = jax.jit(lambda q, kc, t, l, w: _topk.indexer_topk(q, kc, t, l, w, k, sorted=srt,
                                                              topk_config=topk_config))
    full_s, err = _timed(full, [(q, kc, table, lens, w)], reps=reps, calls=calls)
    full_kernels = {}
    full_kus = _kernel_us(full, (q, kc, table, lens, w), full_kernels)
    _emit(rows, dict(op="spin", B=bsz, N=n, sparsity=0.0, impl="full step", error=err, sorted=srt,
                     topk_config=_cfg_str(topk_config), us=full_s * 1e6, time_vs_full=1.0,
                     kernel_us=full_kus, kernel_time_vs_full=1.0, realized=0.0,
                     kernels_us=full_kernels))
    for rho in sparsities:
      cfg = spin.SpinConfig(block_size=64, topk=k, sparsity=rho, state_dtype=state_dtype,
                            reduction=reduction, explore=explore)
      st = spin.init_state(n, cfg, (bsz,), head_dim=head_dim if explore == "query" else None)
      key = jax.random.PRNGKey(0)
      _, _, st, _ = spin.decode_step(st, q, kc, table, lens, w, cfg, key)  # warm: dense step
      _, _, st, info = spin.decode_step(st, q, kc, table, lens, w, cfg, key)
      width = spin.serving._aligned_width(spin.max_selected_blocks(n // 64, cfg), n // 64)
      on_gpu = jax.default_backend() in ("gpu", "cuda")
      masks = info["block_masks"]
      sel, counts = spin.compact_blocks(masks, width)
      zsel = jnp.where(jnp.repeat(sel, 64, axis=1) >= 0,
                       jax.random.normal(key, (bsz, width * 64), jnp.float32), NEG_INF)
      group = spin.serving._fused_group(bsz, width * 64, cfg, topk_config)
      # the step's stages alone, as the step runs them on this state's selection (the EMA
      # update's new state is threaded through the calls: otherwise XLA computes only the one
      # element of the elementwise update that the timing loop reads)
      stages = {
          "select": (lambda st, l, q, w, cfg=cfg: spin.select_compact_batched(
              st, l - 1, l, cfg, key, width, kernel=on_gpu,
              priorities=None if explore != "query" else jax.vmap(spin.query_priorities)(
                  q, w, st["KM"])), (st, lens, q, w), None),
          "update": (_spin_update(cfg, group, on_gpu), (st, zsel, sel, lens), (0, None)),
          "sparse_scores": (lambda q, kc, t, l, w, s, c: spin.serving._sparse_scores(
              q[:, None], kc, t, l, w[:, None], s, c, None, "pallas", None, 64)[0],
                            (q, kc, table, lens, w, sel, counts), None),
          "topk_width": (lambda z: _topk.topk(z, k, sorted=srt, config=topk_config), (zsel,),
                         None),
      }
      stage_us, err2 = {}, ""
      for sname, (sf, sargs, carry) in ({} if step_only else stages).items():
        sec, e = _timed(jax.jit(sf), [sargs], reps=reps, calls=calls, carry=carry)
        stage_us[sname], err2 = sec * 1e6, err2 or e
      variants = ((("SPIN step", None),) if not step_only else ()) + (
          ("SPIN step, warm=True", True),)
      for name, warm in variants:
        # the whole step, EMA update included (the new state is an output and, in-graph, the
        # next call's state, as in a decode loop)
        # (the PRNG key is an argument, as a serving loop passes it: a key closed over is a
        # constant that XLA materialises with a ~0.8 us kernel every step)
        def step_fn(st, q, kc, t, l, w, k, cfg=cfg, warm=warm):
          return spin.decode_step(st, q, kc, t, l, w, cfg, k, warm=warm, sorted=srt,
                                  topk_config=topk_config,
                                  decode_config=spin_decode_config)[:3]

        # wall time as a serving loop runs the step: the state donated and threaded from call
        # to call, so the update kernel writes it in place (the library's advice, spin.serving);
        # without donation XLA copies the aliased [B, N] V / D states and the passed-through
        # ones every call (us_undonated)
        donated = jax.jit(step_fn, donate_argnums=0)
        sec, err = _timed(donated, [(jax.tree.map(jnp.copy, st), q, kc, table, lens, w, key)],
                          reps=reps, calls=calls, carry=(0, 2))
        sec_u, err_u = _timed(jax.jit(step_fn), [(st, q, kc, table, lens, w, key)], reps=reps,
                              calls=calls, carry=(0, 2))
        # kernel time of the same donated loop
        step_kernels = {}
        kus = float("nan") if err else _kernel_us(
            donated, (jax.tree.map(jnp.copy, st), q, kc, table, lens, w, key), step_kernels,
            carry=(0, 2))
        pu = stage_us.get("select", math.nan) + stage_us.get("update", math.nan)
        _emit(rows, dict(op="spin", B=bsz, N=n, sparsity=rho, impl=name, state_dtype=state_dtype,
                         spin_decode_config=str(spin_decode_config or "default"),
                         sorted=srt, topk_config=_cfg_str(topk_config), reduction=reduction,
                         explore=explore, error=err or err_u or err2, us=sec * 1e6, time_vs_full=sec / full_s,
                         us_undonated=sec_u * 1e6, undonated_time_vs_full=sec_u / full_s,
                         kernel_us=kus, kernel_time_vs_full=kus / full_kus, kernels_us=step_kernels,
                         **{f"{s}_us": v for s, v in stage_us.items()},
                         predict_update_us=pu, predict_update_frac=pu * 1e-6 / full_s,
                         realized=float(np.asarray(info["realized_sparsity"]).mean())))
  return rows


def _spin_update(cfg, group: int, on_gpu: bool):
  """SPIN's EMA update as the step runs it: (state, scores, sel, lengths) -> new state."""
  from jaxsparse import spin
  if on_gpu:
    return lambda st, z, s, l: spin.update_batched(st, z, s, l - 1, l, cfg, group=group)[0]
  if cfg.reduction == "A2":
    return lambda st, z, s, l: spin.update_block_states(st, z, s, l - 1, l, cfg)
  return lambda st, z, s, l: jax.vmap(spin.update_blocks, in_axes=(0, 0, 0, 0, 0, None))(
      st, z, s, l - 1, l, cfg)

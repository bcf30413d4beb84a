"""AttentionIndex prefill sharded over devices: each device keeps the index of its own keys.

The sequence is cut into 2P chunks of whole seal windows and device d holds chunks d and
2P-1-d (zig-zag, as `sharded_prefill_topk`). Every window is sealed on the device that holds
it, by the same k-means on the same keys as on one device; a refit regroups each device's own
keys before the refit point (the index of a shard covers only its keys). A version's groups
are the union of every shard's groups, numbered as one device numbers them (by the window that
created the group's slot), so queries rank all shards' representatives together and the
candidate packing, scoring and top-K are those of `jaxsparse.ivf.prefill_topk`. Without
refits (`refit_interval=0`) the result is exactly one device's for any device count; with
refits the groups of a shard are fitted to fewer keys. Under a grouping metric
(`jaxsparse.ivf.metric`) every shard groups its keys mapped by A and the queries rank the
groups with q @ A^-1, a query chunk at a time on its device, as one device does; a learned
correction is made on the shard that holds a group, from its members.

The device arrays of a shard (its keys and index state) stay on that device, and each query
chunk is scored on the device that holds its queries; jax dispatches to the devices
asynchronously, so the shards' seals, refits and scoring overlap. One process drives every
device (for several hosts, `sharded_prefill_topk` is the multi-controller path).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _checks
from jaxsparse.ivf import candidates, index
from jaxsparse.ivf.prefill import (chunk_topk, exact_before_first_seal, map_queries,
                                   prefill_inputs)

__all__ = ["sharded_ivf_prefill_topk"]


_map_queries = jax.jit(map_queries)  # a chunk's ranking queries under a grouping metric


@functools.partial(jax.jit, static_argnums=1)
def _sizes_last(assign, g: int):
  """(sizes [g] int32, last [g] int32: the newest member's position, -1 when empty) of the
  groups of assign [N] (-1: ungrouped)."""
  seg = jnp.where(assign >= 0, assign, g)
  sizes = jax.ops.segment_sum((assign >= 0).astype(jnp.int32), seg, num_segments=g + 1)[:g]
  last = jax.ops.segment_max(jnp.where(assign >= 0, jnp.arange(assign.shape[0]), -1), seg,
                             num_segments=g + 1)[:g]
  return sizes, jnp.maximum(last, -1).astype(jnp.int32)


@_checks.array_args("q", "k", "w", optional=("k_scale",))
def sharded_ivf_prefill_topk(q, k, w, config, *, devices=None, metric=None, corrector=None,
                             layer=None, implementation=None, k_scale=None):
  """Every query's AttentionIndex top-K with the index sharded over `devices`.

  q [N, H, D], k [N, D], w [N, H] float (query n at position n sees keys 0..n); k_scale [N]
  float32 or None (DeepSeek-V3.2's fp8 format: float8_e4m3fn q and k, one scale a key; the
  shards group the dequantised keys, candidates score times k_scale); config:
  `jaxsparse.ivf.IVFConfig`; devices: a list of devices (default: all); metric: a grouping
  metric (an A [D, D] array, or a file of `jaxsparse fit-metric` with `layer`); corrector: a
  learned representative correction (a model, a file of `jaxsparse train corrector` with
  `layer`, or a callable), applied to each shard's groups; implementation: None (the kernels
  on a GPU/TPU, XLA on a CPU), "xla" or "pallas"; all as in `jaxsparse.ivf.prefill_topk`.
  Returns (indices [N, topk] int32, -1 where fewer keys are visible; num_candidates [N]
  int32), as `jaxsparse.ivf.prefill_topk`.
  """
  from jaxsparse.ivf import IVFConfig
  _checks.check_instance("config", config, IVFConfig)
  from jaxsparse import backend
  x = prefill_inputs(q, k, w, k_scale=k_scale, metric=metric, layer=layer, corrector=corrector,
                     host=True)
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("devices must not be empty")
  bad = [d for d in devices if not isinstance(d, jax.Device)]
  if bad:
    raise ValueError(f"devices must be jax devices (jax.devices()); got {bad[0]!r}")
  _checks.check_implementation(implementation)
  plat = backend.kernel_platform() if backend.resolve(implementation) == "pallas" else None
  corrector, qmap, amat = x.corrector, x.qmap, x.metric
  # host copies: the scoring inputs (fp8 upcast to bfloat16), the keys the index groups (k,
  # dequantised when scaled, @ A under a metric) and the keys a corrector reads
  q, k, w, keys, ki = (np.asarray(a) for a in (x.q, x.k, x.w, x.keys, x.index_keys))
  ks = None if x.k_scale is None else np.asarray(x.k_scale)
  n = k.shape[0]
  p_dev, wnd, d = len(devices), config.seal_window, k.shape[1]
  gw = wnd // config.cluster_size
  c = -(-n // (2 * p_dev * wnd)) * wnd  # chunk length: whole windows
  holder = lambda chunk: chunk if chunk < p_dev else 2 * p_dev - 1 - chunk
  local_pos = [np.concatenate([np.arange(e * c, (e + 1) * c),
                               np.arange((2 * p_dev - 1 - e) * c, (2 * p_dev - e) * c)])
               for e in range(p_dev)]
  kpad = np.concatenate([ki, np.zeros((2 * p_dev * c - n, d), ki.dtype)])
  k_loc = [jax.device_put(kpad[lp], dev) for lp, dev in zip(local_pos, devices)]
  k_own = k_loc  # the original keys of each shard, which a corrector reads
  if corrector is not None and x.keys is not x.index_keys:
    kpad = np.concatenate([keys, np.zeros((2 * p_dev * c - n, d), keys.dtype)])
    k_own = [jax.device_put(kpad[lp], dev) for lp, dev in zip(local_pos, devices)]
  sinks = [jax.device_put(jnp.int32(config.sink if e == 0 else 0), dev)
           for e, dev in enumerate(devices)]
  states = [jax.device_put(index.init_state(2 * c, d, config), dev) for dev in devices]
  slot_gid = [np.full(index.group_capacity(2 * c, config), -1, np.int64) for _ in devices]
  used = [0] * p_dev
  k_all = [jax.device_put(k, dev) for dev in devices]
  s_all = [None if ks is None else jax.device_put(ks, dev) for dev in devices]
  qmaps = [jax.device_put(qmap, dev) for dev in devices] if amat is not None else None
  g_cap = index.group_capacity(n, config)
  assign = np.full(n, -1, np.int32)
  topk = min(config.topk, n)
  out_idx, out_num = exact_before_first_seal(q, k, w, config, k_scale=ks)

  def local_prefix(e, p):  # a shard's keys before global position p: a prefix of its array
    return (min(max(p - e * c, 0), c) + min(max(p - (2 * p_dev - 1 - e) * c, 0), c))

  reps = np.zeros((g_cap, d), index.state_dtypes(n, config)["centers"])

  def export(e):  # the shard's assignment and representatives (member means, corrected when
    ga = np.asarray(states[e]["assign"])  # a corrector is given) onto global group ids
    lp = local_pos[e]
    ok = (ga >= 0) & (lp < n)
    assign[lp[ok]] = slot_gid[e][ga[ok]]
    live = slot_gid[e] >= 0
    r = (states[e]["centers"] if corrector is None else
         index.representatives(states[e], k_own[e], corrector, amat))
    reps[slot_gid[e][live]] = np.asarray(r)[live]

  pending = []
  for v in range(1, n // wnd + 1):
    p = v * wnd
    e = holder((p - wnd) // c)
    states[e] = index.seal(states[e], k_loc[e], local_prefix(e, p), config=config,
                           sink=sinks[e], platform=plat)
    slot_gid[e][used[e]:used[e] + gw] = (p - wnd) // wnd * gw + np.arange(gw)
    used[e] += gw
    if config.refit_interval and p % config.refit_interval == 0:
      for f in range(p_dev):
        if local_prefix(f, p) > 0:
          states[f] = index.refit(states[f], k_loc[f], local_prefix(f, p), config=config,
                                  sink=sinks[f], platform=plat)
      for f in range(p_dev):
        export(f)
    else:
      export(e)
    lo, hi = p - 1, min(p - 1 + wnd, n)
    if lo >= hi:
      continue
    dev = devices[holder(lo // c)]
    ga = jax.device_put(jnp.asarray(assign), dev)
    kd = k_all[devices.index(dev)]
    put = lambda x: jax.device_put(x, dev)
    sizes, last = _sizes_last(ga, g_cap)
    members, offsets = candidates.inverted_lists(ga, g_cap)
    qlo = lo - (config.query_block - 1)  # shared blocks: the queries ranking the first one
    qc = put(q[qlo:hi])
    rank = {} if amat is None else dict(rank_q=_map_queries(qc, qmaps[devices.index(dev)]))
    res = chunk_topk(qc, kd, put(w[qlo:hi]), put(reps.copy()), sizes, last,
                     members, offsets, put(jnp.full((hi - qlo,), p, jnp.int32)),
                     put(jnp.arange(qlo, hi, dtype=jnp.int32)), topk=topk,
                     budget=config.budget, sink=config.sink, window=wnd,
                     block=config.query_block, platform=plat,
                     k_scale=s_all[devices.index(dev)], **rank)
    pending.append((lo, hi, res))
  for lo, hi, (idx, num) in pending:
    out_idx[lo:hi], out_num[lo:hi] = np.asarray(idx), np.asarray(num)
  return out_idx, out_num

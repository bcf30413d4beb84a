"""Where the rank merge's compiled test stopped (session 22, call 1: no test finished in
150 s): one step per process, each timing its lowering, compile and first run (a stack dump
if a step passes `--watchdog` seconds), and checking the outputs against numpy.

  python3 benchmarks/diag_rank_merge.py --step merge256   (one step)
  python3 benchmarks/diag_rank_merge.py                   (every step, a process each)
"""
import argparse
import faulthandler
import subprocess
import sys
import time

STEPS = ("split", "merge256", "merge128", "merge256w8", "topk", "topk_w8", "topk_w16",
         "topk_norepair")
# the whole call's rank merge configs (8 x 32K x 2048): call 2 found the default 4 warps'
# compile stalled with the overflow repair inside the rank merge kernel
TOPK = {"topk": {}, "topk_w8": {"rank_merge_warps": 8}, "topk_w16": {"rank_merge_warps": 16},
        "topk_norepair": {"repair_in_finish": False}}


def _finish_inputs(rows: int, cap: int, seed: int = 0):
  import numpy as np
  rng = np.random.default_rng(seed)
  cv = rng.standard_normal((rows, cap)).astype(np.float32)
  cv[:, ::97] = -np.inf
  cv[1, :300] = 0.5  # ties, broken by the lower index
  ci = np.stack([rng.permutation(1 << 20)[:cap] for _ in range(rows)]).astype(np.int32)
  live = np.array([cap, 3000, 2100, 0, 1, 2048, cap, 513][:rows], np.int32)
  return cv, ci, live


def _expected(cv, ci, live, k: int):
  import numpy as np
  vs, is_ = [], []
  for v, i, n in zip(cv, ci, live):
    v, i = v[:n], i[:n]
    o = np.lexsort((i, -v.astype(np.float64)))
    o = o[np.isfinite(v[o])][:k]
    vs.append(np.concatenate([v[o], np.full(k - len(o), -np.inf, np.float32)]))
    is_.append(np.concatenate([i[o], np.full(k - len(o), -1, np.int32)]))
  return np.stack(vs), np.stack(is_)


def run_step(step: str) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  t0 = time.perf_counter()
  say = lambda what: print(f"{step}: {what} at {time.perf_counter() - t0:.1f} s", flush=True)
  k, cap = 2048, 4096
  if step in TOPK:
    import jaxsparse
    from pallas_kernels.topk import TopkConfig
    x = np.random.default_rng(1).standard_normal((8, 32768)).astype(np.float32)
    fn = jax.jit(lambda x: jaxsparse.topk(x, k, implementation="pallas",
                                          config=TopkConfig(bitonic_rank_merge=256,
                                                            **TOPK[step])))
    args = (jnp.asarray(x),)
    want = _expected(x, np.broadcast_to(np.arange(32768, dtype=np.int32), x.shape),
                     np.full(8, 32768), k)
  else:
    from pallas_kernels.topk import gpu
    merge = {"split": 0, "merge256": 256, "merge128": 128, "merge256w8": 256}[step]
    warps = 8 if step.endswith("w8") else 4
    cv, ci, live = _finish_inputs(8, cap)
    fn = jax.jit(lambda cv, ci, live: gpu.bitonic_finish_split(
        cv, ci, live, k, cap, run=512, rank_merge=merge, rank_merge_warps=warps))
    args = tuple(map(jnp.asarray, (cv, ci, live)))
    want = _expected(cv, ci, live, k)
  say("start")
  low = fn.lower(*args)
  say("lowered")
  exe = low.compile()
  say("compiled")
  out = jax.block_until_ready(exe(*args))
  say("ran")
  np.testing.assert_array_equal(np.asarray(out[1]), want[1])
  np.testing.assert_array_equal(np.asarray(out[0]), want[0])
  t = time.perf_counter()
  for _ in range(100):
    out = exe(*args)
  jax.block_until_ready(out)
  say(f"correct; {(time.perf_counter() - t) * 1e4:.1f} us per call (wall, 100 calls)")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--step", choices=STEPS, help="one step in this process (default: all)")
  ap.add_argument("--watchdog", type=float, default=80.0,
                  help="seconds before a step's stacks are dumped and it exits")
  ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps (all mode)")
  a = ap.parse_args()
  if a.step:
    faulthandler.dump_traceback_later(a.watchdog, exit=True)
    run_step(a.step)
    return
  for step in a.steps.split(","):
    if step not in STEPS:
      raise SystemExit(f"--steps: unknown step {step!r} (choose from {', '.join(STEPS)})")
    rc = subprocess.call([sys.executable, __file__, "--step", step,
                          "--watchdog", str(a.watchdog)])
    print(f"{step}: exit {rc}", flush=True)


if __name__ == "__main__":
  main()

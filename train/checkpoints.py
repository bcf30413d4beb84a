"""One Orbax checkpoint manager for training runs: atomic saves, the latest N kept, and a resume
that never silently starts over.

- A step whose files cannot be restored (a damaged latest checkpoint, or one half-deleted when
  a run was killed during the clean-up of old steps) is moved aside to `OUT/checkpoints.bad/`
  with a warning, and the newest good step is used; when steps exist and none restores, the
  run stops with `CheckpointError` instead of starting from scratch.
- `OUT/run.json` records the options a resumed run must share (head count, seed, ...) and the
  total steps: a rerun that changes them, or asks for fewer steps than were already taken, is
  refused before the model loads.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings

import jax
import numpy as np

__all__ = ["CheckpointError", "Manager", "prepare_out", "check_identity", "write_identity"]


class CheckpointError(RuntimeError):
  """A checkpoint directory that cannot be resumed from; the message says why."""


def prepare_out(out: str) -> None:
  """Create `out` or fail with a clear message when it cannot be written."""
  try:
    os.makedirs(out, exist_ok=True)
    probe = os.path.join(out, ".write_test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise CheckpointError(f"--out={out!r} is not a writable directory ({e.strerror})") from None


def _identity_path(out):
  return os.path.join(out, "run.json")


def check_identity(out: str, identity: dict, steps: int) -> None:
  path = _identity_path(out)
  if not os.path.isfile(path):
    return
  try:
    with open(path) as f:
      prev = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path} is unreadable ({e}); move --out aside to start anew") from None
  for k, v in identity.items():
    if k in prev.get("identity", {}) and prev["identity"][k] != v:
      raise CheckpointError(f"--{k.replace('_', '-')}={v!r} differs from the run in {out} "
                            f"({prev['identity'][k]!r}); use a new --out to change it")
  done = _latest_step_number(os.path.join(out, "checkpoints"))
  if done is not None and steps < done:
    raise CheckpointError(f"{out} already holds step {done}; {steps} total steps would rewrite "
                          f"history (use a new --out, or at least {done} steps)")


def write_identity(out: str, identity: dict, steps: int) -> None:
  tmp = _identity_path(out) + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"identity": identity, "steps": steps}, f, indent=1)
  os.replace(tmp, _identity_path(out))


def _step_dirs(directory):
  if not os.path.isdir(directory):
    return []
  return sorted((int(d) for d in os.listdir(directory) if d.isdigit()), reverse=True)


def _latest_step_number(directory):
  steps = _step_dirs(directory)
  return steps[0] if steps else None


class Manager:
  """Orbax CheckpointManager over one pytree item (`{"params": ..., "opt": ...}`)."""

  def __init__(self, directory: str, *, save_every: int, keep: int = 2):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    self._mgr = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False))

  def restore_latest(self, target):
    """(step, tree) from the newest step that restores; (0, None) when there is none."""
    steps = _step_dirs(self.directory)
    if not steps:
      return 0, None
    abstract = jax.tree.map(lambda a: np.zeros(np.shape(a), np.asarray(a).dtype), target)
    errors = []
    for step in steps:
      try:
        tree = self._mgr.restore(step, args=self._ocp.args.StandardRestore(abstract))
      except Exception as e:  # noqa: BLE001 -- orbax raises many types for damaged files
        errors.append(f"step {step}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        self._quarantine(step)
        continue
      if errors:
        warnings.warn(f"skipped damaged checkpoint(s) ({'; '.join(errors)}); resuming from "
                      f"step {step}", stacklevel=2)
      return step, tree
    raise CheckpointError(f"no checkpoint under {self.directory} can be restored "
                          f"({'; '.join(errors)}); the damaged steps were moved to "
                          f"{self.directory}.bad")

  def _quarantine(self, step):
    bad = self.directory + ".bad"
    os.makedirs(bad, exist_ok=True)
    dest = os.path.join(bad, str(step))
    if os.path.exists(dest):
      shutil.rmtree(dest)
    shutil.move(os.path.join(self.directory, str(step)), dest)
    self._mgr.reload()

  def maybe_save(self, step: int, tree) -> None:
    if step % self.save_every == 0:
      self.save(step, tree)

  def save(self, step: int, tree) -> None:
    if step in (self._mgr.all_steps() or []):
      return
    self._mgr.save(step, args=self._ocp.args.StandardSave(tree), force=True)

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()

"""One Orbax checkpoint manager for training runs: atomic saves, the latest N kept, and a resume
that never silently starts over.

- Each step, once Orbax has committed it, gets a SHA-256 of its files in
  `OUT/checkpoints.sums/STEP.sha256`; a restore checks it first. A step whose checksum does not
  match, or whose files cannot be restored (a damaged latest checkpoint, or one half-deleted
  when a run was killed during the clean-up of old steps) is moved aside to
  `OUT/checkpoints.bad/` with a warning, and the newest intact step is used; a step whose
  checksum matches is never moved. When steps exist and none restores, the run stops with
  `CheckpointError` instead of starting from scratch.
- Entries named like a step that hold no checkpoint (an empty directory, a stray file, a
  directory with neither Orbax's step files nor a checksum) are moved aside with a warning
  before Orbax sees them, so they never count as the newest step (nor as steps already taken)
  nor push intact steps out of the kept ones.
- `OUT/run.json` records the options a resumed run must share (head count, seed, length
  schedule, ...) and the total steps (the learning-rate schedule spans them): once a checkpoint
  exists, a rerun that changes them is refused before the model loads, so a resumed run ends
  with the parameters of an uninterrupted one. A run stopped before its first checkpoint
  leaves nothing to resume: a run of other options may reuse its folder.
"""
from __future__ import annotations

import hashlib
import math
import json
import os
import shutil
import warnings

import jax
import numpy as np

__all__ = ["CheckpointError", "Manager", "prepare_out", "check_identity", "write_identity",
           "check_run_limits"]


class CheckpointError(RuntimeError):
  """A checkpoint directory that cannot be resumed from; the message says why."""


def check_run_limits(max_seconds: float, seed: int, error=ValueError) -> None:
  """The options every resumable training run shares: --max-seconds finite and >= 0 (0: no
  limit), --seed >= 0; `error` (the command's config error) names the option."""
  if not (max_seconds >= 0 and math.isfinite(max_seconds)):
    raise error(f"--max-seconds={max_seconds} must be a finite number >= 0 (0: no limit)")
  if seed < 0:
    raise error(f"--seed={seed} must be >= 0")


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


RESUME = ("a rerun resumes only with the options the run started with (its learning-rate "
          "schedule spans its total steps): repeat them to resume, or give a new --out to start "
          "a new run")


def _checkpointed_steps(out: str) -> list[int]:
  """The steps saved under `out`'s checkpoint folders (`checkpoints/`, a corrector's
  `layerN/`; never the `.bad` and `.sums` folders beside them)."""
  if not os.path.isdir(out):
    return []
  return [step for name in sorted(os.listdir(out))
          if not name.endswith((".bad", ".sums"))
          for step in _step_dirs(os.path.join(out, name))]


def check_identity(out: str, identity: dict, steps: int, options: dict | None = None) -> None:
  """Refuse a rerun into `out` that changes the options recorded in its run.json (`identity`
  and the total `steps`), once the run there has saved a checkpoint: a run stopped before its
  first checkpoint left nothing to resume, and a new run may take its folder. options: the
  command-line option naming an identity field where it is not `--field-name`."""
  path = _identity_path(out)
  saved = _checkpointed_steps(out)
  if not os.path.isfile(path) or not saved:
    if saved and steps < max(saved):
      raise CheckpointError(f"{out} already holds step {max(saved)}; {steps} total steps would "
                            f"rewrite history: {RESUME}")
    return
  try:
    with open(path) as f:
      prev = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path} is unreadable ({e}); move --out aside to start anew") from None
  for k, v in identity.items():
    if k in prev.get("identity", {}) and prev["identity"][k] != v:
      name = (options or {}).get(k, f"--{k.replace('_', '-')}")
      raise CheckpointError(f"{name}={v!r} differs from the run in {out} "
                            f"({prev['identity'][k]!r}): {RESUME}")
  if prev.get("steps", steps) != steps or steps < max(saved):
    raise CheckpointError(f"{steps} total steps differ from the run in {out} "
                          f"({prev.get('steps', max(saved))}): {RESUME}")


def write_identity(out: str, identity: dict, steps: int) -> None:
  tmp = _identity_path(out) + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"identity": identity, "steps": steps}, f, indent=1)
  os.replace(tmp, _identity_path(out))


# what a step directory Orbax wrote holds at its top (one suffices: a damaged or half-deleted
# step may have lost the others)
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt", "default")


def _is_step(directory, name) -> bool:
  """A directory named by a step number that holds a checkpoint, perhaps a damaged one: Orbax's
  step files, or a checksum this module wrote for it. An empty directory, or one of other
  files, is no step."""
  path = os.path.join(directory, name)
  # canonical step numbers only: Orbax names step 7 "7", so "0007" is not one of its steps
  if not (name.isdigit() and name == str(int(name)) and os.path.isdir(path)):
    return False
  if os.path.isfile(os.path.join(directory + ".sums", f"{name}.sha256")):
    return True
  return any(m in _ORBAX_MARKERS for m in os.listdir(path))


def _step_dirs(directory):
  if not os.path.isdir(directory):
    return []
  return sorted((int(d) for d in os.listdir(directory) if _is_step(directory, d)),
                reverse=True)


def _digest(path: str) -> str:
  """SHA-256 over a step directory's files: their relative paths and contents, in order."""
  h = hashlib.sha256()
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      full = os.path.join(root, name)
      h.update(os.path.relpath(full, path).encode() + b"\0")
      with open(full, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
          h.update(block)
      h.update(b"\0")
  return h.hexdigest()


def _latest_step_number(directory):
  steps = _step_dirs(directory)
  return steps[0] if steps else None


class Manager:
  """Orbax CheckpointManager over one pytree item (`{"params": ..., "opt": ...}`)."""

  def __init__(self, directory: str, *, save_every: int, keep: int = 2):
    for name, value in (("save_every", save_every), ("keep", keep)):
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
          or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if not isinstance(directory, (str, os.PathLike)):
      raise ValueError(f"directory={directory!r} must be a path")
    if os.path.exists(directory) and not os.path.isdir(directory):
      raise ValueError(f"directory={os.fspath(directory)!r} exists and is not a folder")
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    self.sums = self.directory + ".sums"
    self._strays = self._set_aside_strays()
    self._mgr = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False))

  def restore_latest(self, target):
    """(step, tree) from the newest step that restores; (0, None) when there is none."""
    steps = _step_dirs(self.directory)
    if not steps and self._strays:
      raise CheckpointError(f"no checkpoint under {self.directory} can be restored: "
                            f"{', '.join(self._strays)} named like steps held none (moved to "
                            f"{self.directory}.bad)")
    if not steps:
      return 0, None
    abstract = jax.tree.map(lambda a: np.zeros(np.shape(a), np.asarray(a).dtype), target)
    errors = []
    for step in steps:
      verified = self._verify(step)
      if verified is False:
        errors.append(f"step {step}: its files do not match the checksum written when it was "
                      "saved")
        self._quarantine(step)
        continue
      try:
        tree = self._mgr.restore(step, args=self._ocp.args.StandardRestore(abstract))
      except Exception as e:  # noqa: BLE001 -- orbax raises many types for damaged files
        if verified:  # intact files that do not restore: not damage, never moved aside
          raise CheckpointError(f"step {step} under {self.directory} is intact but does not "
                                f"restore into this run ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:200]})") from None
        errors.append(f"step {step}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        self._quarantine(step)
        continue
      mismatch = self._mismatch(step, abstract)
      if mismatch:  # intact, but saved by a run of other shapes: never moved aside
        raise CheckpointError(f"step {step} under {self.directory} does not fit this run: "
                              f"{mismatch}")
      if errors:
        warnings.warn(f"skipped damaged checkpoint(s) ({'; '.join(errors)}); resuming from "
                      f"step {step}", stacklevel=2)
      return step, tree
    raise CheckpointError(f"no checkpoint under {self.directory} can be restored "
                          f"({'; '.join(errors)}); the damaged steps were moved to "
                          f"{self.directory}.bad")

  def _mismatch(self, step, target) -> str:
    """'' when the saved arrays of `step` (Orbax's metadata) are the target's in shape and
    dtype, else what differs (StandardRestore would silently pad, cut or cast them)."""
    try:
      md = self._mgr.item_metadata(step)
    except Exception:  # noqa: BLE001 -- no metadata to compare: the restore itself decides
      return ""
    saved = [(tuple(m.shape), np.dtype(m.dtype)) for m in jax.tree.leaves(getattr(md, "tree", md))
             if hasattr(m, "shape") and hasattr(m, "dtype")]
    want = [(tuple(np.shape(a)), np.asarray(a).dtype) for a in jax.tree.leaves(target)]
    if len(saved) != len(want):
      return f"it holds {len(saved)} arrays, this run {len(want)}"
    key = lambda sd: (str(sd[1]), sd[0])  # noqa: E731
    for a, b in zip(sorted(saved, key=key), sorted(want, key=key)):
      if a != b:
        extra = sorted(set(saved) - set(want), key=key)[:1] or [a]
        return (f"it holds {extra[0][1]}{list(extra[0][0])}, which this run's arrays "
                f"({', '.join(f'{d}{list(s)}' for s, d in sorted(set(want) - set(saved), key=key)[:3]) or 'none'}) do not match")
    return ""

  def _sum_path(self, step) -> str:
    return os.path.join(self.sums, f"{step}.sha256")

  def _verify(self, step):
    """True: the step's files match its checksum; False: they do not; None: no checksum (a
    step saved before checksums, or killed between its commit and its checksum)."""
    try:
      with open(self._sum_path(step)) as f:
        want = f.read().strip()
    except OSError:
      return None
    return _digest(os.path.join(self.directory, str(step))) == want

  def _set_aside_strays(self):
    """Move entries named like a step but holding no checkpoint to `.bad` (see above)."""
    if not os.path.isdir(self.directory):
      return []
    strays = sorted(n for n in os.listdir(self.directory)
                    if n.isdigit() and not _is_step(self.directory, n))
    for name in strays:
      warnings.warn(f"{os.path.join(self.directory, name)} is named like a step but holds "
                    f"no checkpoint; moved to {self.directory}.bad", stacklevel=3)
      self._move_aside(name)
    return strays

  def _move_aside(self, name):
    bad = self.directory + ".bad"
    os.makedirs(bad, exist_ok=True)
    dest = os.path.join(bad, name)
    if os.path.isdir(dest):
      shutil.rmtree(dest)
    elif os.path.exists(dest):
      os.remove(dest)
    shutil.move(os.path.join(self.directory, name), dest)

  def _quarantine(self, step):
    self._move_aside(str(step))
    self._mgr.reload()

  @staticmethod
  def _check_step(step) -> None:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step={step!r} must be an int >= 0")

  def maybe_save(self, step: int, tree) -> None:
    self._check_step(step)
    if step % self.save_every == 0:
      self.save(step, tree)

  def save(self, step: int, tree) -> None:
    self._check_step(step)
    step = int(step)
    if step in (self._mgr.all_steps() or []):
      return
    self._mgr.save(step, args=self._ocp.args.StandardSave(tree), force=True)
    self._mgr.wait_until_finished()  # committed: only now is the checksum written
    os.makedirs(self.sums, exist_ok=True)
    tmp = self._sum_path(step) + ".tmp"
    with open(tmp, "w") as f:
      f.write(_digest(os.path.join(self.directory, str(step))) + "\n")
    os.replace(tmp, self._sum_path(step))

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()

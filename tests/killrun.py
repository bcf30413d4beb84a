"""Run a training command, SIGKILL it once a checkpoint of at least `min_step` exists, then
run it again to completion: the shared procedure of the resume-after-kill tests."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def kill_then_resume(args, checkpoint_dir: str, min_step: int, poll: float = 0.02):
  env = {**os.environ, "PYTHONPATH": os.getcwd()}
  proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(checkpoint_dir) and any(
        d.isdigit() and int(d) >= min_step for d in os.listdir(checkpoint_dir)):
      break
    time.sleep(poll)
  killed = proc.poll() is None
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert killed, "training finished before it could be killed"
  after_kill = set(os.listdir(os.path.dirname(checkpoint_dir)))
  rc = subprocess.run(args, env=env, capture_output=True, text=True)
  assert rc.returncode == 0, rc.stderr[-2000:]
  return after_kill

"""The device driver (benchmarks/run_h200.sh): every target the README names exists, and each
target runs the commands that regenerate its files (checked with stand-in executables)."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DRIVER = os.path.join(ROOT, "benchmarks", "run_h200.sh")


def _targets():
  body = open(DRIVER).read()
  return set(re.findall(r"^    ([a-z0-9-]+)\)", body, flags=re.M))


def _dry_run(tmp_path, *targets, **env):
  """Runs the driver with python3 / jaxsparse / nvidia-smi replaced by scripts that log argv."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  log = tmp_path / "calls.log"
  for name in ("python3", "jaxsparse"):
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
  full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out"),
              "HOME": str(tmp_path), **env}
  res = subprocess.run(["bash", DRIVER, *targets], cwd=ROOT, env=full_env, capture_output=True,
                       text=True, timeout=60)
  calls = log.read_text().splitlines() if log.exists() else []
  return res.returncode, [c for c in calls if not c.startswith("python3 -c")], res.stdout


def test_every_readme_target_exists():
  readme = open(os.path.join(ROOT, "README.md")).read()
  named = set()
  for m in re.finditer(r"run_h200\.sh((?: [a-z0-9-]+)+)", readme):
    named.update(m.group(1).split())
  assert named, "the README names no driver target"
  missing = named - _targets()
  assert not missing, f"README names driver targets that do not exist: {sorted(missing)}"


def test_unknown_target_fails(tmp_path):
  rc, calls, out = _dry_run(tmp_path, "no-such-target")
  assert rc == 2 and "unknown target" in out


def test_ivf_recall_records_only_missing_traces(tmp_path):
  traces = tmp_path / "traces"
  traces.mkdir()
  rc, calls, _ = _dry_run(tmp_path, "ivf-recall", CONTEXTS="8192", TRACES=str(traces))
  assert rc == 0
  records = [c for c in calls if "record_prefill.py" in c]
  offsets = (3100000, 600000, 1600000)  # three calibration texts by default
  assert len(records) == 4 and all(f"--offset {o}" in c for o, c in zip(offsets, records[1:]))
  bench = [c for c in calls if "bench_ivf_recall.py" in c]
  assert len(bench) == 1 and "--query-block 64" in bench[0]
  cal = ",".join(f"{traces}/train_8k_{o}.npz" for o in offsets)
  assert f"--calibration-trace {cal}" in bench[0]
  # with every trace present nothing is recorded again; 32K takes the paper's settings
  for name in ("prefill_32k.npz", "train_32k_2000000.npz", "train_32k_1000000.npz",
               "train_32k_3000000.npz"):
    (traces / name).write_bytes(b"")
  (tmp_path / "calls.log").unlink()
  rc, calls, _ = _dry_run(tmp_path, "ivf-recall", CONTEXTS="32768", TRACES=str(traces))
  assert rc == 0 and not [c for c in calls if "record_prefill.py" in c]
  (bench,) = [c for c in calls if "bench_ivf_recall.py" in c]
  assert "--seal-window 1024 --cluster-size 128 --refit-interval 8192" in bench
  assert bench.endswith("ivf_recall_32k")


def test_ivf_recall_takes_chosen_layers_and_several_calibration_texts(tmp_path):
  traces = tmp_path / "traces"
  rc, calls, _ = _dry_run(tmp_path, "ivf-recall", CONTEXTS="32768", TRACES=str(traces),
                          LAYERS="2", OFFSETS="2000000 1000000")
  assert rc == 0
  records = [c for c in calls if "record_prefill.py" in c]
  assert len(records) == 3 and all("--tokens 32768 --layers 2 " in c for c in records)
  assert [c.split("--out ")[1] for c in records] == [
      f"{traces}/prefill_32k_l2.npz", f"{traces}/train_32k_l2_2000000.npz",
      f"{traces}/train_32k_l2_1000000.npz"]
  (bench,) = [c for c in calls if "bench_ivf_recall.py" in c]
  assert (f"--calibration-trace {traces}/train_32k_l2_2000000.npz,"
          f"{traces}/train_32k_l2_1000000.npz") in bench
  assert f"--trace {traces}/prefill_32k_l2.npz" in bench and bench.endswith("ivf_recall_32k_l2")


def test_ivf_recall_can_record_without_evaluating(tmp_path):
  """RECORD_ONLY=1 records the missing traces and runs no benchmark (a later call does)."""
  traces = tmp_path / "traces"
  rc, calls, _ = _dry_run(tmp_path, "ivf-recall", CONTEXTS="32768", TRACES=str(traces),
                          RECORD_ONLY="1")
  assert rc == 0
  assert len([c for c in calls if "record_prefill.py" in c]) == 4
  assert not [c for c in calls if "bench_ivf_recall.py" in c]


def test_gpu_tests_run_in_parallel_and_leave_a_json_record(tmp_path):
  rc, calls, _ = _dry_run(tmp_path, "gpu-tests", WORKERS="12")
  assert rc == 0
  out = tmp_path / "out"
  (run,) = [c for c in calls if c.startswith("python3 -m pytest")]
  assert "-n 12" in run and f"--junitxml={out}/gpu_tests.xml tests/test_gpu.py" in run
  (rec,) = [c for c in calls if "jaxsparse._bench.junit" in c]
  assert rec.startswith(f"python3 -m jaxsparse._bench.junit {out}/gpu_tests.xml "
                        f"{out}/gpu_tests.json WORKERS=12 python3 -m pytest")


def test_junit_record_counts_what_pytest_wrote(tmp_path):
  from jaxsparse._bench import junit
  xml = tmp_path / "r.xml"
  xml.write_text(
      '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="1" '
      'skipped="1" tests="5" time="12.5">'
      '<testcase classname="tests.test_gpu" name="test_a" time="1"/>'
      '<testcase classname="tests.test_gpu" name="test_b" time="1"><failure message="x"/>'
      '</testcase><testcase classname="tests.test_gpu" name="test_c" time="1"><error/>'
      '</testcase><testcase classname="tests.test_gpu" name="test_d" time="0"><skipped/>'
      '</testcase><testcase classname="tests.test_gpu" name="test_e" time="1"/>'
      '</testsuite></testsuites>')
  out = tmp_path / "r.json"
  assert junit.main([str(xml), str(out), "pytest tests/test_gpu.py"]) == 0
  rec = json.loads(out.read_text())
  assert (rec["tests"], rec["passed"], rec["failures"], rec["errors"], rec["skipped"]) == (
      5, 2, 1, 1, 1)
  assert rec["seconds"] == 12.5 and rec["environment"]["command"] == "pytest tests/test_gpu.py"
  assert rec["failed_tests"] == ["tests.test_gpu::test_b", "tests.test_gpu::test_c"]
  assert junit.main([str(xml)]) == 2


@pytest.mark.parametrize("target, scripts", [
    ("cpu-tables", ["jaxsparse eval", "spin_studies.py", "tpu_estimates.py",
                    "ivf_prefill_recall_b24576_cpu.json", "ivf_prefill_recall_1m_cpu.json",
                    "ivf_recall_8k_g16", "--float32-index --out", "ivf_recall_index_compact",
                    "train/corrector.py"]),
    ("readme-tables", ["decode_table.json", "topk_table_b64.json", "topk_table_1m.json",
                       "topk_table_b1.json"]),
    ("prefill-sharded", ["--tokens 262144,524288"]),
])
def test_targets_run_their_commands(tmp_path, target, scripts):
  rc, calls, _ = _dry_run(tmp_path, target)
  assert rc == 0
  joined = "\n".join(calls)
  for s in scripts:
    assert s in joined, f"{target} does not run {s}"


def test_spin_target_names_its_file_and_can_skip_stages(tmp_path):
  """`spin` writes spin_step.json with the stage timings by default; STEP_ONLY and SPIN_NAME
  give the command-buffer files their names."""
  rc, calls, _ = _dry_run(tmp_path, "spin")
  spin = [c for c in calls if "bench_spin.py" in c]
  assert rc == 0 and len(spin) == 1
  assert "spin_step.json" in spin[0] and "--step-only" not in spin[0]
  (tmp_path / "b").mkdir()
  rc, calls, _ = _dry_run(tmp_path / "b", "spin", STEP_ONLY="1",
                          SPIN_NAME="spin_step_cmdbuf_off")
  spin = [c for c in calls if "bench_spin.py" in c]
  assert rc == 0 and "--step-only" in spin[-1] and "spin_step_cmdbuf_off.json" in spin[-1]


def test_ivf_prefill_target_times_the_metric_path_on_request(tmp_path):
  rc, calls, _ = _dry_run(tmp_path, "ivf-prefill", TOKENS="262144")
  (bench,) = [c for c in calls if "bench_ivf_prefill.py" in c]
  assert rc == 0 and "--metric-timing" not in bench and "ivf_prefill_262144.json" in bench
  (tmp_path / "b").mkdir()
  rc, calls, _ = _dry_run(tmp_path / "b", "ivf-prefill", TOKENS="262144", METRIC="1")
  (bench,) = [c for c in calls if "bench_ivf_prefill.py" in c]
  assert rc == 0 and "--metric-timing" in bench

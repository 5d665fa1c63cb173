"""``staging-store serve``: one-line errors before it listens (the loopback run is in test_http_serve.py)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from store import open_store
from store.cli.app import main


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
    token.write_text("abcdefghijklmnop-0123\n")
    token.chmod(0o600)
    return str(path), token


def test_serve_refuses_bad_token_files(made: tuple[str, Path], tmp_path: Path, capsys: Any) -> None:
    store, _ = made
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    spaced = tmp_path / "spaced"
    spaced.write_text("two words")
    empty.chmod(0o600)
    spaced.chmod(0o600)
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


def _token_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / f"token-{len(list(tmp_path.iterdir()))}"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_serve_refuses_short_and_non_ascii_tokens(made: tuple[str, Path], tmp_path: Path, capsys: Any) -> None:
    store, _ = made
    for text, says in (("abc\n", "at least 16"), ("tökén-0123456789abcdef", "visible ASCII")):
        code, err = _run(capsys, "serve", store, "--token-file", str(_token_file(tmp_path, text)))
        assert code == 2 and says in _one_line(err), err


def test_serve_refuses_a_token_file_other_users_can_read_or_write(
    made: tuple[str, Path], tmp_path: Path, capsys: Any
) -> None:
    store, _ = made
    for mode in (0o644, 0o604, 0o602, 0o620, 0o666):
        path = _token_file(tmp_path, "abcdefghijklmnop-0123", mode)
        code, err = _run(capsys, "serve", store, "--token-file", str(path))
        line = _one_line(err)
        assert code == 2 and f"mode {mode:04o}" in line and f"chmod 600 {path}" in line, err


def test_serve_refuses_plain_http_beyond_loopback_unless_asked(
    made: tuple[str, Path], tmp_path: Path, capsys: Any
) -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    store, token = made
    for host in ("0.0.0.0", "::", "192.0.2.1", "worker.example"):
        code, err = _run(capsys, "serve", store, "--token-file", str(token), "--host", host)
        assert code == 2 and "not a loopback address" in _one_line(err) and "--allow-plain-http" in err
    # Asked for: a warning, then it goes on (here to a busy port, so the test need not stop a server).
    group = _token_file(tmp_path, "abcdefghijklmnop-0123", 0o640)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        code, err = _run(
            capsys,
            "serve",
            store,
            "--token-file",
            str(group),
            "--host",
            "0.0.0.0",
            "--port",
            port,
            "--allow-plain-http",
        )
    lines = err.splitlines()
    assert code == 3 and "cannot listen on 0.0.0.0" in lines[-1], err
    assert any("warning: the token file" in line and "readable by its group" in line for line in lines)
    assert any("warning: serving plain HTTP on 0.0.0.0" in line for line in lines)


def test_serve_refuses_half_a_tls_pair_and_an_unusable_certificate(
    made: tuple[str, Path], tmp_path: Path, capsys: Any
) -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    store, token = made
    junk = _token_file(tmp_path, "not a certificate")
    code, err = _run(capsys, "serve", store, "--token-file", str(token), "--tls-certfile", str(junk))
    assert code == 2 and "go together" in _one_line(err)
    code, err = _run(
        capsys, "serve", store, "--token-file", str(token), "--tls-certfile", str(junk), "--tls-keyfile", str(junk)
    )
    assert code == 2 and "cannot use the TLS certificate" in _one_line(err)


def test_serve_refuses_more_connections_than_the_fd_limit_allows(
    made: tuple[str, Path], capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    import resource

    store, token = made
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    code, err = _run(capsys, "serve", store, "--token-file", str(token), "--max-connections", "1000")
    line = _one_line(err)
    assert code == 2 and "the limit is 1024" in line and "ulimit -n" in line


def test_serve_refuses_a_replica_wait_without_a_replica(made: tuple[str, Path], capsys: Any) -> None:
    store, token = made
    code, err = _run(capsys, "serve", store, "--token-file", str(token), "--replica-wait", "3")
    assert code == 2 and "--replica-wait needs --replica" in _one_line(err)
    code, err = _run(capsys, "serve", store, "--token-file", str(token), "--replica", "r.db", "--replica-wait", "0")
    assert code == 2 and "--replica-wait" in _one_line(err)

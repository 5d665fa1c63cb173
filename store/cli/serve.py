"""``serve``: a standalone control server (generation cuts and ledger routes) for workers that are not FastAPI apps."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import click

from store.cli import exits
from store.cli.opening import STORE_HELP, shown, store_argument, writable

_EXTRA = "the serve command needs the [http] extra: pip install 'staging-store[http]'"


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store serve demo-store/demo.db --token-file token.txt\n\n"
    "  staging-store serve postgresql://user@db/store --token-file /run/secrets/ng --host 0.0.0.0 --port 8700",
)
@store_argument
@click.option(
    "--token-file",
    required=True,
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    help="File holding the bearer token every request must carry (surrounding whitespace ignored).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=8700,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to listen on (0: any free port; the one chosen is printed).",
)
def serve(store: str | None, token_file: Path, host: str, port: int) -> int:
    """Serve the worker control routes over HTTP until interrupted.

    POST /ng-control/v1/generation-cut, and GET .../rollouts/{id}/manifest, POST
    .../rollouts/retire and .../rollouts/delete under /training-token-capture/control.
    Prints one line with the address once listening; Ctrl-C or SIGTERM stops it (exit 0).
    """
    try:
        import uvicorn  # noqa: F401  (the extra's server; checked here for a one-line error)

        from store.http.routes import control_app
    except ImportError as exc:
        raise exits.CommandError(f"{_EXTRA} ({exc.name} is missing)") from exc
    from store.errors import CaptureError
    from store.worker.capture import RolloutTokenCapture

    token = _token(token_file)

    def no_admissions() -> int:
        raise CaptureError("the standalone control server admits no calls")

    with writable(store) as opened:
        capture = RolloutTokenCapture(store=opened, weight_version_fn=no_admissions)
        try:
            listener = _listen(host, port)
            bound_host, bound_port = listener.getsockname()[:2]
            app = control_app(capture, opened, token)
            server = _server(app)
            sys.stdout.write(f"serving {shown(opened)} on http://{bound_host}:{bound_port}\n")
            sys.stdout.flush()
            server.run(sockets=[listener])
        finally:
            capture.close()
    return exits.INTERRUPTED if signal.SIGINT in server.stopped_by else exits.OK


def _server(app: Any) -> Any:
    """uvicorn's server, stopping gracefully on SIGTERM/SIGINT without re-raising the signal
    afterwards (uvicorn would, so the command could not close the store and exit with its code)."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.stopped_by: list[int] = []

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.stopped_by.append(sig)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C skips the graceful wait
            self.should_exit = True

    return Server(uvicorn.Config(app, log_level="warning", access_log=False))


def _token(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise exits.CommandError(f"cannot read the token file {path}: {exc}", exits.USAGE) from exc
    if not token:
        raise exits.CommandError(f"the token file {path} is empty", exits.USAGE)
    if any(ch.isspace() for ch in token):
        raise exits.CommandError(f"the token in {path} holds whitespace; a bearer token is one word", exits.USAGE)
    return token


def _listen(host: str, port: int) -> socket.socket:
    """Bind before serving, so a busy port is a one-line error and port 0 can be reported."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise exits.CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return listener

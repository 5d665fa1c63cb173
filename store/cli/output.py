"""Output: JSON on stdout, rich tables and trees on stdout, progress bars on stderr (a terminal only)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
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

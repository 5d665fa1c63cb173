"""The ``staging-store`` command line: click commands, rich output, one module per command group.

Importing this package imports nothing (``main`` imports click, with ``store.cli.app``, when it
runs, and each command imports the library when it runs), so ``staging-store --help`` answers at
once, and a Ctrl-C that lands while the interpreter is still importing ends the command quietly
with 130.  (No submodule is named ``main``: importing it would replace this function on the
package, and ``from store.cli import main`` would then give the module.)
"""

from __future__ import annotations

from collections.abc import Sequence

INTERRUPTED = 130  # as store.cli.exits.INTERRUPTED, which cannot be imported before click


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (errors are one line on stderr)."""
    try:
        from store.cli.app import main as run
    except KeyboardInterrupt:  # Ctrl-C during start-up: nothing has been opened yet
        return INTERRUPTED
    return run(argv)


__all__ = ["main"]

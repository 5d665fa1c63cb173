"""The ``staging-store`` command line: click commands, rich output, one module per command group.

Importing this package imports only click: each command imports the library when it runs,
so ``staging-store --help`` answers at once.
"""

from store.cli.main import main

__all__ = ["main"]

"""How the user runs this ``staging-store`` from their shell as it is, for the lines it prints.

``make demo`` installs the script into ``.venv/bin``, which is not on ``PATH`` until the venv
is activated; a printed ``staging-store audit ...`` would then fail with "command not found".
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

NAME = "staging-store"


def script() -> Path:
    """This installation's script: the one beside the interpreter running the command."""
    return Path(sys.executable).parent / NAME


def command() -> str:
    """``staging-store`` when that name on ``PATH`` is this installation's script; else the
    script's path, relative to the current folder when it lies inside it (``.venv/bin/staging-store``)."""
    mine = script()
    found = shutil.which(NAME)
    if not mine.exists() or (found is not None and _same(Path(found), mine)):
        return NAME
    return shlex.quote(shown_path(mine))


def activation_hint() -> str | None:
    """How to put this script on ``PATH``, when it is not there (None when it is)."""
    if command() == NAME:
        return None
    activate = script().parent / "activate"
    if not activate.exists():
        return f"{NAME} is not on your PATH"
    return f"{NAME} is not on your PATH: `. {shlex.quote(shown_path(activate))}` puts it there"


def shown_path(path: str | os.PathLike[str]) -> str:
    """A path as the user would type it here: relative when it lies inside the current folder."""
    absolute = Path(os.path.abspath(path))
    try:
        relative = absolute.relative_to(Path.cwd())
    except (ValueError, OSError):
        return str(absolute)
    return str(relative) if str(relative) != "." else str(absolute)


def _same(one: Path, other: Path) -> bool:
    try:
        return one.resolve() == other.resolve() or os.path.samefile(one, other)
    except OSError:
        return False

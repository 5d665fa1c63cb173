"""README.md and docs/ stay true: the README's example runs, and every public name and command is documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import store
from store.cli.main import COMMANDS, cli

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOCS = "\n".join(path.read_text(encoding="utf-8") for path in DOC_FILES)
CLI = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")


def test_every_public_name_is_documented() -> None:
    missing = [name for name in store.__all__ if f"`{name}" not in DOCS and f"{name}(" not in DOCS]
    assert missing == []


def test_every_cli_command_is_documented() -> None:
    """Each command has a usage line and a section (`### staging-store NAME`) in docs/cli.md."""
    assert set(cli.list_commands(None)) == set(COMMANDS)  # type: ignore[arg-type]
    part = CLI
    for command in COMMANDS:
        assert f"staging-store {command}" in part, command
        assert f"### `staging-store {command}`" in part, command
    for option in ("--json", "--version", "STAGING_STORE", "--stale", "--max-lag", "--repair", "--create", "-o"):
        assert option in part, option
    for code in ("0", "1", "2", "3", "130", "141"):
        assert f"`{code}`" in part, code


def test_every_public_name_loads_on_first_use() -> None:
    """``store`` imports its names lazily: each one named in ``__all__`` resolves to its module's object."""
    import importlib

    assert set(store._MODULES) == set(store.__all__)
    for name, module in store._MODULES.items():
        assert getattr(store, name) is getattr(importlib.import_module(module), name), name
    assert set(store.__all__) <= set(dir(store))


def test_the_readme_library_example_runs(tmp_path: Path) -> None:
    example = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    result = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "every projection matches the log" in result.stdout
    assert (tmp_path / "staging.db").exists()

"""README stays true: its example runs, and every public name and command is documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import store
from store.cli import build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def test_every_public_name_is_documented_in_the_readme() -> None:
    missing = [name for name in store.__all__ if f"`{name}" not in README and f"{name}(" not in README]
    assert missing == []


def test_every_cli_command_is_documented_in_the_readme() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == {"demo", "replay", "calls"}
    for command in commands:
        assert f"staging-store {command}" in README


def test_the_readme_library_example_runs(tmp_path: Path) -> None:
    example = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    result = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "every projection matches the log" in result.stdout
    assert (tmp_path / "staging.db").exists()

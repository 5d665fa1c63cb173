"""The package's layers: every import inside ``store`` points down (docs/testing.md, "How the code is laid out").

Imports made only for type hints or inside a function count too: an import that points up
is a circle waiting to happen, wherever it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import store

# Bottom first.  A part may import from any part on a lower line, never from its own line or above.
LAYERS: list[set[str]] = [
    {"errors"},
    {"wire", "failpoints", "lifecycle"},
    {"log", "rebuild"},
    {"projections", "arguments"},
    {"append", "queries"},
    {"audit", "lineage", "retention"},
    {"shipping"},
    {"store"},
    {"worker", "coordinator"},
    {"adapters"},
    {"http", "demo"},
    {"cli"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
ROOT = Path(store.__file__).parent


def _part(module: str) -> str | None:
    """The top-level part of ``store`` a dotted module name lies in (None outside the package)."""
    names = module.split(".")
    if names[0] != "store" or len(names) == 1:
        return None
    return names[1]


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every ``store`` module a file imports, with its line."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "store":
                found.extend((f"store.{alias.name}", node.lineno) for alias in node.names)
            else:
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found


def _own_part(path: Path) -> str | None:
    relative = path.relative_to(ROOT).with_suffix("").parts
    return None if relative == ("__init__",) else relative[0]


def test_every_part_of_the_package_has_a_layer() -> None:
    modules = {path.stem for path in ROOT.glob("*.py")} - {"__init__"}
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert modules | packages == set(RANK), "add new parts of store/ to LAYERS (and to docs/testing.md's layout table)"


def test_imports_inside_the_package_point_down() -> None:
    upward: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        own = _own_part(path)
        if own is None:  # store/__init__.py hands on names from every part
            continue
        for module, line in _imports(path):
            part = _part(module)
            if part is None or part == own or part not in RANK:
                continue
            if RANK[part] >= RANK[own]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module} ({own} -> {part})")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The walk above reads the kinds of import the package uses, so a violation cannot hide."""
    source = tmp_path / "sample.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from store import failpoints\n"
        "if TYPE_CHECKING:\n"
        "    from store.store import Store\n"
        "def late():\n"
        "    import store.worker.cuts\n"
    )
    found = [module for module, _ in _imports(source)]
    assert found == ["typing", "store.failpoints", "store.store", "store.worker.cuts"]
    assert [_part(module) for module in found] == [None, "failpoints", "store", "worker"]

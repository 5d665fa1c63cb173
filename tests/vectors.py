"""Where the golden digest vectors are: a copy kept in the repo (``tests/data``), or the
file named by ``STORE_VECTORS_PATH``.  ``test_vectors`` checks the copy against
``../shared/conformance/vectors.json`` whenever that file is beside the repo."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO_COPY = Path(__file__).resolve().parent / "data" / "vectors.json"
SHARED_COPY = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "vectors.json"


def vectors_path() -> Path:
    override = os.environ.get("STORE_VECTORS_PATH")
    return Path(override) if override else REPO_COPY


def load_vectors() -> list[dict[str, Any]]:
    """Every element of the vector file, the ``_meta`` header first."""
    data = json.loads(vectors_path().read_text(encoding="utf-8"))
    assert isinstance(data, list) and data, "the vector file must be a non-empty JSON array"
    return data


def vectors_by_id() -> dict[str, dict[str, Any]]:
    return {case["id"]: case for case in load_vectors()}

"""Checks of the capture-key lists that retire, forget and delete take (wire-contract 6.5)."""

from __future__ import annotations

from typing import Any

from store import arguments
from store.errors import InvalidRecordError

# The HTTP routes take 1..4096 ids per call; the library keeps the same bound.
MAX_IDS = 4096


def capture_keys(name: str, values: Any) -> list[str]:
    """A list of 1..4096 distinct non-empty strings, refused whole before anything is written."""
    keys = arguments.texts(name, values)
    if not keys:
        raise InvalidRecordError(f"{name} must name at least one capture key")
    if len(keys) > MAX_IDS:
        raise InvalidRecordError(f"{name} names {len(keys)} capture keys; at most {MAX_IDS} per call")
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise InvalidRecordError(f"{name} names {key!r} more than once")
        seen.add(key)
    return keys

"""The field checks every wire record makes: each raises an ``InvalidRecordError`` that names
the record, the field and the rule (``fail``), and shows a bad value cut short (``short``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from store.errors import InvalidRecordError
from store.wire import digest as _digest


def fail(record: str, message: str) -> InvalidRecordError:
    return InvalidRecordError(f"{record}: {message}")


def identifier(record: str, name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise fail(record, f"{name} must be a non-empty string, got {value!r}")
    encodable(record, name, value)


def encodable(record: str, name: str, value: str) -> None:
    """Text is stored and hashed as UTF-8: a lone surrogate can never be, so it is refused here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise fail(record, f"{name} is not valid Unicode text ({exc.reason} at position {exc.start})") from None


def optional_identifier(record: str, name: str, value: Any) -> None:
    if value is not None:
        identifier(record, name, value)


U64_MAX = 2**64 - 1  # every count and version is hashed or stored as a u64


def non_negative(record: str, name: str, value: Any) -> None:
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise fail(record, f"{name} must be an int in [0, 2**64-1] (bools and floats are refused), got {short(value)}")


def positive(record: str, name: str, value: Any) -> None:
    if type(value) is not int or not 1 <= value <= U64_MAX:
        raise fail(record, f"{name} must be an int in [1, 2**64-1], got {short(value)}")


def short(value: Any) -> str:
    """``repr`` for an error message, cut short (a hostile int may have thousands of digits)."""
    big = type(value) is int and value.bit_length() >= 256
    shown = f"an int of {value.bit_length()} bits" if big else repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def digest_hex(record: str, name: str, value: Any) -> None:
    if not _digest.is_digest_hex(value):
        raise fail(record, f"{name} must be 64 lowercase hex characters, got {value!r}")


def optional_digest_hex(record: str, name: str, value: Any) -> None:
    if value is not None:
        digest_hex(record, name, value)


def strict_float(record: str, name: str, value: Any, optional: bool = True) -> None:
    if value is None and optional:
        return
    if type(value) is not float or not math.isfinite(value):
        raise fail(record, f"{name} must be a finite float (an int is refused), got {value!r}")


def literal(record: str, name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed or type(value) is bool:
        raise fail(record, f"{name} must be one of {allowed!r}, got {value!r}")


def schema(record: str, value: Any) -> None:
    if type(value) is not int or value not in _digest.SUPPORTED_SCHEMA_VERSIONS:
        raise fail(record, f"unsupported schema_version {value!r}; this store reads schemas 2 and 3")


def versions(record: str, struct: Any) -> None:
    schema(record, struct.schema_version)
    if type(struct.digest_version) is not int or struct.digest_version != _digest.STAGING_DIGEST_VERSION:
        raise fail(record, f"unsupported digest_version {struct.digest_version!r}; must be 2")
    if type(struct.extras_digest_version) is not int or struct.extras_digest_version != _digest.EXTRAS_DIGEST_VERSION:
        raise fail(record, f"unsupported extras_digest_version {struct.extras_digest_version!r}; must be 1")


def lineage(record: str, parent_call_id: Any, prev_len: int, mode: Any | None) -> None:
    if parent_call_id is None:
        if prev_len != 0:
            raise fail(record, "a root (no parent_call_id) requires prev_len == 0")
        if mode is not None and mode != "text":
            raise fail(record, "a root (no parent_call_id) must be text mode")
    else:
        if prev_len <= 0:
            raise fail(record, "a child (parent_call_id set) requires prev_len > 0")
        if mode is not None and mode != "token_in":
            raise fail(record, "a child (parent_call_id set) must be token_in mode")


def instances(record: str, name: str, values: Any, kind: type) -> None:
    if not isinstance(values, (list, tuple)) or not all(isinstance(value, kind) for value in values):
        raise fail(record, f"{name} must be a list of {kind.__name__}")


def optional_text(record: str, name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise fail(record, f"{name} must be a string or null, got {value!r}")
    if value is not None:
        encodable(record, name, value)


def plain_texts(values: Sequence[Any]) -> bool:
    """Whether every value is a non-empty ``str`` that encodes as UTF-8, checked in one pass:
    a call's staging keys are checked at every cut and grow with its chunks (the caller's own
    check of each value runs only when this is False, and names the bad one)."""
    if not all(type(value) is str and value for value in values):
        return False
    try:
        "".join(values).encode("utf-8")  # strict: any lone surrogate fails, wherever it stands
    except UnicodeEncodeError:
        return False
    return True


def unique(record: str, name: str, values: Sequence[str]) -> None:
    if not plain_texts(values):
        for value in values:
            identifier(record, f"{name} entry", value)
    if len(set(values)) != len(values):
        raise fail(record, f"{name} must be unique")


def terminal_finish(record: str, finish: Any, stop: Any) -> None:
    """A terminal finish reason and stop reason, as an acknowledgement or continuation carries them."""
    if finish is not None:
        literal(record, "terminal_finish_reason", finish, ("stop", "length"))
    if stop is not None:
        if type(stop) not in (str, int):
            raise fail(record, f"terminal_stop_reason must be a string or int, got {stop!r}")
        if type(stop) is str:
            encodable(record, "terminal_stop_reason", stop)
        elif not -(2**63) <= stop <= U64_MAX:  # what msgpack (and the event log) can hold
            raise fail(record, f"terminal_stop_reason {short(stop)} is outside [-2**63, 2**64-1]")
        if finish is None:
            raise fail(record, "a terminal_stop_reason requires a terminal_finish_reason")

"""Records of another implementation of the same wire: NeMo Gym's pydantic models.

Gym's ``RolloutTokenCapture`` hands its sink Gym's own ``StagedCallRecord`` and accepts only
Gym's own ``StageResult`` back (it checks ``isinstance``); Gym's ``verify_and_linearize``
accepts only Gym's ``StagedCallBaseSnapshot``.  The store never imports Gym: a foreign record
is read through its JSON (pydantic's ``model_dump_json``, the wire form both sides share) and
fully validated as the store's own record, and an answer is built in the caller's family --
the ``StageResult`` class of the module that defines the record's class (or a base of it),
validated from the store's JSON by that class.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import msgspec

from store.errors import InvalidRecordError
from store.wire.codec import from_json, to_json
from store.wire.records import StagedCallRecord

_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


def is_foreign_model(value: object) -> bool:
    """Whether ``value`` is a pydantic-style model (not one of the store's msgspec records)."""
    return not isinstance(value, msgspec.Struct) and callable(getattr(value, "model_dump_json", None))


def native_record(record: Any, where: str = "stage()") -> StagedCallRecord:
    """The store's ``StagedCallRecord`` of a Gym ``StagedCallRecord`` (its JSON read and every
    check and digest of the store's own record verified); ``InvalidRecordError`` otherwise."""
    if not is_foreign_model(record):
        raise InvalidRecordError(
            f"{where} takes a StagedCallRecord (the store's, or NeMo Gym's pydantic model), got {type(record).__name__}"
        )
    try:
        raw = record.model_dump_json()
    except _ERRORS as exc:  # pydantic's serialization errors are ValueErrors
        raise InvalidRecordError(f"{where}: cannot read the {type(record).__name__} as JSON: {exc}") from exc
    if not isinstance(raw, (str, bytes)):
        raise InvalidRecordError(f"{where}: {type(record).__name__}.model_dump_json() returned {type(raw).__name__}")
    return from_json(raw, StagedCallRecord)


def family_class(record_type: type, name: str) -> Any | None:
    """The class ``name`` beside ``record_type``'s definition (or a base's), if it is a
    pydantic-style model class (has ``model_validate_json``); None when there is none."""
    for cls in record_type.__mro__:
        module = sys.modules.get(cls.__module__)
        found = getattr(module, name, None) if module is not None else None
        if isinstance(found, type) and callable(getattr(found, "model_validate_json", None)):
            return found
    return None


def as_model(value: msgspec.Struct, model: Any) -> Any:
    """``value`` (a store record) as an instance of the pydantic-style ``model`` class, built by
    the class's own validation of the store's JSON; ``InvalidRecordError`` if it refuses it."""
    try:
        return model.model_validate_json(to_json(value))
    except _ERRORS as exc:  # pydantic's ValidationError is a ValueError
        raise InvalidRecordError(
            f"{getattr(model, '__name__', model)!s} refuses the store's {type(value).__name__}: {exc}"
        ) from exc


def as_snapshot(snapshot: StagedCallRecord, model: Any) -> Any:
    """A fetched snapshot as ``model``; a model without an ``extras`` field (Gym's base
    snapshot, which forbids unknown fields) gets the record without its extras payload."""
    fields = getattr(model, "model_fields", None)
    if isinstance(fields, Mapping) and "extras" not in fields:
        wire = msgspec.json.decode(to_json(snapshot))
        wire.pop("extras", None)
        try:
            return model.model_validate_json(msgspec.json.encode(wire))
        except _ERRORS as exc:
            raise InvalidRecordError(
                f"{getattr(model, '__name__', model)!s} refuses the store's {type(snapshot).__name__}: {exc}"
            ) from exc
    return as_model(snapshot, model)


def snapshot_model(snapshot_type: Any) -> Any:
    """Check a ``fetch(snapshot_type=...)`` argument: a pydantic-style model class."""
    if not isinstance(snapshot_type, type) or not callable(getattr(snapshot_type, "model_validate_json", None)):
        raise InvalidRecordError(
            "snapshot_type must be a pydantic model class with the wire's fields (NeMo Gym's "
            f"StagedCallSnapshot or StagedCallBaseSnapshot), got {snapshot_type!r}"
        )
    return snapshot_type

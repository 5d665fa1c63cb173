"""Records of another implementation of the same wire: NeMo Gym's pydantic models.

Gym's ``RolloutTokenCapture`` hands its sink Gym's own ``StagedCallRecord`` and accepts only
Gym's own ``StageResult`` back (it checks ``isinstance``); Gym's ``verify_and_linearize``
accepts only Gym's ``StagedCallBaseSnapshot``.  The store never imports Gym: a foreign record's
wire fields are read as attributes and fully validated as the store's own record, and an
answer is built in the caller's family --
the ``StageResult`` class of the module that defines the record's class (or a base of it),
validated by that class from the store's record's wire fields.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import msgspec

from store.errors import InvalidRecordError
from store.wire.codec import lean_builtins
from store.wire.records import StagedCallRecord

_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


def is_foreign_model(value: object) -> bool:
    """Whether ``value`` is a pydantic-style model (not one of the store's msgspec records)."""
    return not isinstance(value, msgspec.Struct) and callable(getattr(value, "model_dump_json", None))


_RECORD_FIELDS = StagedCallRecord.__struct_fields__


def native_record(record: Any, where: str = "stage()") -> StagedCallRecord:
    """The store's ``StagedCallRecord`` of a Gym ``StagedCallRecord``: its fields, read as
    attributes (no serialization, so any record Gym builds is read, however deep its extras),
    and every check and digest of the store's own record verified; ``InvalidRecordError``
    otherwise."""
    if not is_foreign_model(record):
        raise InvalidRecordError(
            f"{where} takes a StagedCallRecord (the store's, or NeMo Gym's pydantic model), got {type(record).__name__}"
        )
    declared = getattr(type(record), "model_fields", None)
    if not isinstance(declared, Mapping) or set(declared) != set(_RECORD_FIELDS):
        found = sorted(declared) if isinstance(declared, Mapping) else None
        raise InvalidRecordError(
            f"{where}: a {type(record).__name__} must have exactly the wire's StagedCallRecord fields, has {found}"
        )
    fields = {name: getattr(record, name) for name in _RECORD_FIELDS}
    for name in ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta"):
        if not isinstance(fields[name], list):
            raise InvalidRecordError(f"{where}: {name} must be a list, got {type(fields[name]).__name__}")
    extras = fields["extras"]
    if extras is not None and type(extras) is not dict:
        raise InvalidRecordError(f"{where}: extras must be a dict or None, got {type(extras).__name__}")
    try:
        return StagedCallRecord(**fields)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        if isinstance(exc, InvalidRecordError):
            raise
        raise InvalidRecordError(f"{where}: the {type(record).__name__} is not a valid record: {exc}") from exc


def family_class(record_type: type, name: str) -> Any | None:
    """The class ``name`` beside ``record_type``'s definition (or a base's), if it is a
    pydantic-style model class (has ``model_validate``); None when there is none."""
    for cls in record_type.__mro__:
        module = sys.modules.get(cls.__module__)
        found = getattr(module, name, None) if module is not None else None
        if isinstance(found, type) and callable(getattr(found, "model_validate", None)):
            return found
    return None


def as_model(value: msgspec.Struct, model: Any, *, drop: tuple[str, ...] = ()) -> Any:
    """``value`` (a store record) as an instance of the pydantic-style ``model`` class, built by
    the class's own validation of the record's wire fields (Python values, not JSON text: Gym's
    JSON parser stops at a shallower nesting than its records allow), less ``drop``;
    ``InvalidRecordError`` if the class refuses it."""
    wire = lean_builtins(value)
    for name in drop:
        wire.pop(name, None)
    try:
        return model.model_validate(wire)
    except _ERRORS as exc:  # pydantic's ValidationError is a ValueError
        raise InvalidRecordError(
            f"{getattr(model, '__name__', model)!s} refuses the store's {type(value).__name__}: {exc}"
        ) from exc


def as_snapshot(snapshot: StagedCallRecord, model: Any) -> Any:
    """A fetched snapshot as ``model``; a model without an ``extras`` field (Gym's base
    snapshot, which forbids unknown fields) gets the record without its extras payload."""
    fields = getattr(model, "model_fields", None)
    without_extras = isinstance(fields, Mapping) and "extras" not in fields
    return as_model(snapshot, model, drop=("extras",) if without_extras else ())


def snapshot_model(snapshot_type: Any) -> Any:
    """Check a ``fetch(snapshot_type=...)`` argument: a pydantic-style model class."""
    if not isinstance(snapshot_type, type) or not callable(getattr(snapshot_type, "model_validate", None)):
        raise InvalidRecordError(
            "snapshot_type must be a pydantic model class with the wire's fields (NeMo Gym's "
            f"StagedCallSnapshot or StagedCallBaseSnapshot), got {snapshot_type!r}"
        )
    return snapshot_type

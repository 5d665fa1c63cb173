"""JSON and msgpack codecs of the wire records: one encoder per format, one decoder per record
type, reused (msgspec's own advice); decoding validates fully (a staged record's digest is
verified) and every failure is an ``InvalidRecordError`` naming the record type."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from store.errors import InvalidRecordError
from store.wire import digest as _digest
from store.wire.columns import FloatColumn, TokenIds

T = TypeVar("T", bound=msgspec.Struct)


def _enc_hook(value: Any) -> Any:
    if isinstance(value, (TokenIds, FloatColumn)):
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_JSON_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)
_MSGPACK_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_JSON_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}
_MSGPACK_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def to_json(record: msgspec.Struct) -> bytes:
    """Encode a record as JSON with Gym's field names (fields NeMo Gym 0.7.0 does not know
    are written only when they carry something: see ``_OMITTED_WHEN_EMPTY``)."""
    return _encode(_JSON_ENCODER, _lean(record))


def to_msgpack(record: msgspec.Struct) -> bytes:
    return _encode(_MSGPACK_ENCODER, _lean(record))


# The store's fields beyond NeMo Gym 0.7.0's models (which forbid unknown fields): written
# only when they carry something, so Gym's models accept every record that does not use them.
_OMITTED_WHEN_EMPTY: dict[str, tuple[str, ...]] = {
    "CallRecord": ("capture_key",),
    "CaptureAdmission": ("generation_cut",),
    "CaptureLedgerCommit": ("parent_manifest",),
}
# Records that hold such records (their rows are made lean too).
_HOLDERS = frozenset({"RolloutManifest", "RolloutReceipt", "CaptureLedgerCommit"})


def lean_builtins(record: msgspec.Struct) -> Any:
    """The record as JSON-ready builtins (``to_json``'s fields: empty extension fields left out)."""
    lean = _lean(record)
    return lean if not isinstance(lean, msgspec.Struct) else msgspec.to_builtins(lean, enc_hook=_enc_hook)


def _lean(record: Any) -> Any:
    """``record``, or (for a record with an empty extension field) its builtins without it."""
    name = type(record).__name__
    if name not in _OMITTED_WHEN_EMPTY and name not in _HOLDERS:
        return record
    try:
        return _lean_builtins(record)
    except (TypeError, ValueError, NotImplementedError, RecursionError, msgspec.EncodeError):
        return record  # let the encoder name the problem


def _lean_builtins(record: Any) -> Any:
    if not isinstance(record, msgspec.Struct):
        return record
    name = type(record).__name__
    omitted = _OMITTED_WHEN_EMPTY.get(name, ())
    if not omitted and name not in _HOLDERS:
        return msgspec.to_builtins(record, enc_hook=_enc_hook)
    out: dict[str, Any] = {}
    for field in msgspec.structs.fields(record):
        value = getattr(record, field.name)
        if field.name in omitted and (value is None or value == ()):
            continue
        if isinstance(value, msgspec.Struct):
            out[field.encode_name] = _lean_builtins(value)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], msgspec.Struct):
            out[field.encode_name] = [_lean_builtins(item) for item in value]
        else:
            out[field.encode_name] = msgspec.to_builtins(value, enc_hook=_enc_hook)
    return out


# What an encoder raises for a value it cannot write: text that is not Unicode, an int
# beyond msgpack's range, a type it does not know, a free-form payload nested too deep.
_ENCODE_ERRORS = (msgspec.EncodeError, UnicodeEncodeError, OverflowError, TypeError, ValueError, RecursionError)


def _encode(encoder: Any, record: msgspec.Struct) -> bytes:
    try:
        return encoder.encode(record)  # type: ignore[no-any-return]
    except NotImplementedError as exc:  # from the encode hook
        raise InvalidRecordError(f"cannot encode {type(record).__name__}: {exc}") from exc
    except _ENCODE_ERRORS as exc:
        raise InvalidRecordError(f"cannot encode {type(record).__name__}: {type(exc).__name__}: {exc}") from exc


def from_json(data: bytes | str, record_type: type[T]) -> T:
    """Decode and fully validate a record (a staged record's digest is verified)."""
    decoder = _JSON_DECODERS.get(_wire_type(record_type))
    if decoder is None:
        decoder = _JSON_DECODERS[record_type] = msgspec.json.Decoder(record_type)
    return _decode(decoder, data, record_type, (bytes, bytearray, memoryview, str))


def from_msgpack(data: bytes, record_type: type[T]) -> T:
    decoder = _MSGPACK_DECODERS.get(_wire_type(record_type))
    if decoder is None:
        decoder = _MSGPACK_DECODERS[record_type] = msgspec.msgpack.Decoder(record_type)
    return _decode(decoder, data, record_type, (bytes, bytearray, memoryview))


def _wire_type(record_type: type[T]) -> type[T]:
    if not (isinstance(record_type, type) and issubclass(record_type, msgspec.Struct)):
        raise InvalidRecordError(f"record_type must be a wire record class, got {record_type!r}")
    return record_type


def _decode(decoder: Any, data: Any, record_type: type[T], accepted: tuple[type, ...]) -> T:
    name = record_type.__name__
    if not isinstance(data, accepted):
        raise InvalidRecordError(
            f"{name}: cannot decode a {type(data).__name__}; pass {' or '.join(t.__name__ for t in accepted)}"
        )
    try:
        return decoder.decode(data)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, InvalidRecordError):
            raise type(cause)(f"{cause} (decoding {name})") from exc
        raise InvalidRecordError(f"{name}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRecordError(f"{name}: malformed input: {exc}") from exc
    except UnicodeEncodeError as exc:  # a str input holding a lone surrogate
        raise InvalidRecordError(f"{name}: the input is not valid Unicode text ({exc.reason})") from exc
    except RecursionError as exc:  # msgspec nests deeper than Python allows before any check of ours runs
        raise InvalidRecordError(
            f"{name}: the input nests too deeply (extras may nest at most EXTRAS_MAX_DEPTH = "
            f"{_digest.EXTRAS_MAX_DEPTH} levels)"
        ) from exc

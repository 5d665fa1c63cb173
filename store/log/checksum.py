"""The events table's checksum: xxh3-128 over an event's stored columns, each framed with
its type and length (a corruption check the log, fetch, audit and shipping make of every
row; not a wire digest).  ``ChecksumParts`` frames an event before the write lock."""

from __future__ import annotations

import operator
import struct
from collections.abc import Mapping
from typing import Any

import xxhash

# The events columns an event's checksum covers, in checksum order: everything but ``seq``
# (assigned by the database; ``fetch`` checks the event it reached instead) and the checksum.
CHECKSUMMED_COLUMNS = (
    "rollout_id",
    "model_call_id",
    "stream_version",
    "kind",
    "staging_key",
    "writer_pid",
    "recorded_at",
    "body",
    "token_ids",
    "token_mask",
    "log_probs",
)
_CHECKSUM_LAYOUT = b"event-checksum-2"  # a later layout changes this, and migrates stored rows
_NULL = b"n"


def event_checksum(values: Mapping[str, Any]) -> bytes:
    """xxh3-128 over an event's stored columns (a corruption check, not a wire digest).

    Each value is framed with its type and length, so no two different rows hash the
    same framed bytes.  A value of a type the column cannot hold (what a damaged SQLite
    file can return) raises ``TypeError``.
    """
    checked = _checksummed_values(values)
    rollout_id, model_call_id, stream_version, kind, staging_key, writer_pid, recorded_at = checked[:7]
    stored = checked[7:]
    if (
        type(rollout_id) is str
        and type(model_call_id) is str
        and type(kind) is str
        and type(staging_key) in _KEY_TYPES
        and type(stream_version) is int
        and type(writer_pid) is int
        and type(recorded_at) is float
        and _I64_MIN <= stream_version <= _I64_MAX
        and _I64_MIN <= writer_pid <= _I64_MAX
    ):
        # Every pass over the log runs this once per event, and stored rows have these types:
        # the framed head is one ``struct`` pack (the general loop's bytes in a third of its time).
        r = rollout_id.encode("utf-8", "surrogatepass")
        m = model_call_id.encode("utf-8", "surrogatepass")
        k = kind.encode("utf-8", "surrogatepass")
        if staging_key is None:
            lengths: tuple[int, ...] = (len(r), len(m), len(k))
            packer = _HEAD_PACKERS.get(lengths) or _head_packer(lengths)
            head = packer.pack(
                _CHECKSUM_LAYOUT, b"s", lengths[0], r, b"s", lengths[1], m, b"i", stream_version,
                b"s", lengths[2], k, _NULL, b"i", writer_pid, b"f", recorded_at,
            )  # fmt: skip
        else:
            key = staging_key.encode("utf-8", "surrogatepass")
            lengths = (len(r), len(m), len(k), len(key))
            packer = _HEAD_PACKERS.get(lengths) or _head_packer(lengths)
            head = packer.pack(
                _CHECKSUM_LAYOUT, b"s", lengths[0], r, b"s", lengths[1], m, b"i", stream_version,
                b"s", lengths[2], k, b"s", lengths[3], key, b"i", writer_pid, b"f", recorded_at,
            )  # fmt: skip
        hashed = _hashed_with_stored(head, stored)
        if hashed is not None:
            return hashed
    return _general_checksum(checked)


_KEY_TYPES = frozenset({str, type(None)})
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_HEAD_PACKERS: dict[tuple[int, ...], struct.Struct] = {}


def _head_packer(lengths: tuple[int, ...]) -> struct.Struct:
    """The ``struct`` layout of a framed head (``_framed``'s bytes for the first seven columns)
    whose texts have these UTF-8 lengths; three lengths: no staging key.  Cached, and the
    cache is emptied when it holds a few hundred layouts."""
    r, m, k = lengths[:3]
    key = f"cQ{lengths[3]}s" if len(lengths) == 4 else "1s"
    packer = struct.Struct(f">{len(_CHECKSUM_LAYOUT)}scQ{r}scQ{m}scqcQ{k}s{key}cqcd")
    if len(_HEAD_PACKERS) >= 512:
        _HEAD_PACKERS.clear()
    _HEAD_PACKERS[lengths] = packer
    return packer


def _hashed_with_stored(head: bytes, stored: tuple[Any, ...]) -> bytes | None:
    """The checksum of ``head`` followed by the framed stored columns, for the two shapes
    stored rows have: a record's (a short body and mask, long ids and log-probs) and a
    bookkeeping event's (a short body, no token columns).  None for any other shape."""
    body, ids, mask, log_probs = stored
    if type(body) is not bytes or len(body) >= _INLINE_BYTES:
        return None
    if ids is None and mask is None and log_probs is None:
        return xxhash.xxh3_128(b"".join((head, b"b", len(body).to_bytes(8, "big"), body, b"nnn"))).digest()
    if (
        type(ids) is bytes
        and type(mask) is bytes
        and type(log_probs) is bytes
        and len(ids) >= _INLINE_BYTES
        and len(mask) < _INLINE_BYTES
        and len(log_probs) >= _INLINE_BYTES
    ):
        hasher = xxhash.xxh3_128(
            b"".join((head, b"b", len(body).to_bytes(8, "big"), body, b"b", len(ids).to_bytes(8, "big")))
        )
        hasher.update(ids)  # long columns are hashed in place, not copied
        hasher.update(b"".join((b"b", len(mask).to_bytes(8, "big"), mask, b"b", len(log_probs).to_bytes(8, "big"))))
        hasher.update(log_probs)
        return hasher.digest()
    return None


def _general_checksum(checked: tuple[Any, ...]) -> bytes:
    # The small framed values are gathered and hashed in one update, the token columns hashed
    # in place (the same bytes either way).
    hasher = xxhash.xxh3_128()
    pending = [_CHECKSUM_LAYOUT]
    for value in checked:
        kind = type(value)
        if kind is str:
            data = value.encode("utf-8", "surrogatepass")
            pending.append(b"s" + len(data).to_bytes(8, "big") + data)
        elif kind is int:
            pending.append(b"i" + value.to_bytes(8, "big", signed=True))  # OverflowError: not a stored integer
        elif isinstance(value, (bytes, memoryview)):
            data = value if isinstance(value, bytes) else value.tobytes()
            pending.append(b"b" + len(data).to_bytes(8, "big"))
            if len(data) < _INLINE_BYTES:
                pending.append(data)
            else:
                hasher.update(b"".join(pending))
                hasher.update(data)
                pending = []
        else:
            pending.append(_framed(value))
    hasher.update(b"".join(pending))
    return hasher.digest()


_checksummed_values = operator.itemgetter(*CHECKSUMMED_COLUMNS)
_INLINE_BYTES = 1024  # shorter bytes values (bodies, small columns) join the pending update


class ChecksumParts:
    """An event's ``event_checksum`` framing, made before the write lock: everything but the
    three columns only the append knows (stream_version, writer_pid, recorded_at), which
    ``checksum`` frames between the parts.  The same bytes as ``event_checksum`` hashes."""

    __slots__ = ("head", "middle", "tail")

    def __init__(
        self,
        rollout_id: str,
        model_call_id: str,
        kind: str,
        staging_key: str | None,
        stored: tuple[bytes, bytes | None, bytes | None, bytes | None],
    ) -> None:
        # Built once per event on the write path: texts framed inline, the kind's framing kept.
        if type(rollout_id) is str and type(model_call_id) is str:
            rollout = rollout_id.encode("utf-8", "surrogatepass")
            call = model_call_id.encode("utf-8", "surrogatepass")
            self.head = b"".join(
                (_LAYOUT_TEXT, _pack_length(len(rollout)), rollout, b"s", _pack_length(len(call)), call)
            )
        else:
            self.head = _CHECKSUM_LAYOUT + _framed_text(rollout_id) + _framed_text(model_call_id)
        framed_kind = _FRAMED_KINDS.get(kind) if type(kind) is str else None
        if framed_kind is None:
            framed_kind = _framed_text(kind)
            if type(kind) is str and len(_FRAMED_KINDS) < _FRAMED_KINDS_KEPT:
                _FRAMED_KINDS[kind] = framed_kind
        if staging_key is None:
            self.middle = framed_kind + _NULL
        elif type(staging_key) is str:
            key = staging_key.encode("utf-8", "surrogatepass")
            self.middle = b"".join((framed_kind, b"s", _pack_length(len(key)), key))
        else:
            self.middle = framed_kind + _framed_text(staging_key)
        tail: list[bytes] = []
        pending: list[bytes] = []
        for value in stored:  # body, token_ids, token_mask, log_probs
            if value is None:
                pending.append(_NULL)
                continue
            if type(value) is not bytes and not isinstance(value, bytes):
                raise TypeError(f"a stored event column cannot hold a {type(value).__name__}")
            size = len(value)
            pending.append(b"b" + _pack_length(size))
            if size < _INLINE_BYTES:
                pending.append(value)
            else:  # hashed in place, not copied
                tail.append(b"".join(pending))
                tail.append(value)
                pending = []
        if pending:
            tail.append(b"".join(pending))
        self.tail = tuple(tail)

    def checksum(self, stream_version: int, writer_pid: int, recorded_at: float) -> bytes:
        known = None
        if type(stream_version) is int and type(writer_pid) is int and type(recorded_at) is float:
            # The append's own types: ``_framed``'s bytes without its type tests.
            try:
                known = b"".join(
                    (
                        self.head,
                        _pack_version(b"i", stream_version),
                        self.middle,
                        _pack_pid_time(b"i", writer_pid, b"f", recorded_at),
                    )
                )
            except struct.error:  # beyond 64 bits: ``_framed`` raises what it raises
                known = None
        if known is None:
            known = self.head + _framed(stream_version) + self.middle + _framed(writer_pid) + _framed(recorded_at)
        hasher = xxhash.xxh3_128(known)
        for piece in self.tail:
            hasher.update(piece)
        return hasher.digest()


_pack_length = struct.Struct(">Q").pack
_pack_version = struct.Struct(">cq").pack
_pack_pid_time = struct.Struct(">cqcd").pack
_LAYOUT_TEXT = _CHECKSUM_LAYOUT + b"s"
_FRAMED_KINDS: dict[str, bytes] = {}  # an event kind's framing (a few kinds, each framed once)
_FRAMED_KINDS_KEPT = 64
_pack_double = struct.Struct(">d").pack


def _framed_text(value: Any) -> bytes:
    """``_framed`` of a text column, a plain str without its type tests."""
    if type(value) is not str:
        return _framed(value)
    data = value.encode("utf-8", "surrogatepass")
    return b"s" + len(data).to_bytes(8, "big") + data


def _framed(value: Any) -> bytes:
    if value is None:
        return _NULL
    if isinstance(value, str):
        # surrogatepass: hashing never fails where the database itself would refuse the text
        data = value.encode("utf-8", "surrogatepass")
        return b"s" + len(data).to_bytes(8, "big") + data
    if isinstance(value, bool):
        raise TypeError("a stored event column cannot hold a bool")
    if isinstance(value, int):
        return b"i" + value.to_bytes(8, "big", signed=True)  # OverflowError: not a stored integer
    if isinstance(value, float):
        return b"f" + struct.pack(">d", value)
    raise TypeError(f"a stored event column cannot hold a {type(value).__name__}")

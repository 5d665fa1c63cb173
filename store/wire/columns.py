"""Packed token columns: validated once, immutable, hashed and stored without re-encoding.

A record's three token columns are held as numpy arrays wrapped in small read-only
sequence types.  The big-endian bytes the staging digest hashes are derived once and
cached on the column; the compact storage form (``encode_*``) is derived from the same
arrays, so a record built locally is never re-encoded when it is staged.
"""

from __future__ import annotations

import array
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, overload

import msgspec
import numpy as np

from store.errors import DigestValueError

_U64_MAX = 2**64 - 1
_LITTLE = sys.byteorder == "little"
_INT_ARRAY_CODES = frozenset("bBhHiIlLqQ")
_F32_BE = np.dtype(">f4")
_U64_BE = np.dtype(">u8")
# Big-endian binary32 bit patterns read as native uint32 (no conversion of the column).
_ONE_BITS = np.array([1.0], dtype=_F32_BE).view(np.uint32)[0]
_ABS_BITS = ~np.array([-0.0], dtype=_F32_BE).view(np.uint32)[0]  # clears the sign bit
_FLOAT_ARRAY_CODES = frozenset("fd")
# The smallest magnitude binary64 value that rounds to infinity in binary32 (halfway past its max).
_F32_OVERFLOW = 2.0**128 - 2.0**103
_F32_OVERFLOW_SQUARED = _F32_OVERFLOW * _F32_OVERFLOW  # about 1.16e77: finite in binary64
_DOT_SLICE = 8_192  # values per BLAS dot (OpenBLAS goes multi-threaded above 10,000)
_EXACT_CHECK_MIN = 16_384  # values: from this length a column checks whether binary32 holds it exactly
# msgpack writes every exact float as 0xcb then its big-endian binary64 bits: 9 bytes a value.
_MSGPACK_ENCODE_INTO = msgspec.msgpack.Encoder().encode_into
_SCRATCH = threading.local()  # .buffer: this thread's msgpack scratch bytearray
_SCRATCH_KEEP = 1 << 20  # bytes (~116,000 floats): a larger scratch buffer is not kept per thread
_MSGPACK_F64 = np.dtype([("tag", "u1"), ("value", ">f8")])
_MSGPACK_F64_TAG = 0xCB
# What encoding a list of a hostile or foreign element raises (the slow path then names it).
_LIST_ERRORS = (TypeError, ValueError, OverflowError, RecursionError)


def _readonly(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


class TokenIds(Sequence[int]):
    """An immutable column of u64 token ids, held big-endian: the form every digest hashes."""

    __slots__ = ("_block", "_stored", "_values")

    def __init__(self, values: np.ndarray) -> None:
        # Trusted: callers pass a validated uint64 array, in either byte order (use
        # ``coerce`` otherwise).  One big-endian copy serves hashing and reading alike.
        self._values = _readonly(_big_endian_u64(values))
        self._stored: bytes | None = None  # encode_ids' result, kept: a column is encoded once
        self._block: tuple[np.ndarray, int] | None = None  # (block array, start) when a view of a ColumnBlock

    @classmethod
    def _block_view(cls, base: np.ndarray, start: int, end: int) -> TokenIds:
        column = cls(base[start:end])
        column._block = (base, start)
        return column

    @classmethod
    def coerce(cls, ids: Any, name: str = "token ids") -> TokenIds:
        """Validate ``ids`` (exact non-negative ints below 2**64) into a column."""
        if isinstance(ids, TokenIds):
            return ids
        if isinstance(ids, (np.ndarray, array.array)):
            return cls(_ids_from_buffer(ids, name))
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise DigestValueError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
        if not ids:
            return cls(np.empty(0, dtype=np.uint64))
        if type(ids) is list or type(ids) is tuple:  # a subclass may override what the C paths read
            packed = _ids_from_list(ids)
            if packed is not None:
                return cls(packed)
        # The slow path: names what is wrong (or converts an unusual sequence exactly).
        kinds = set(map(type, ids))
        if kinds != {int}:
            bad = sorted(k.__name__ for k in kinds if k is not int)
            raise DigestValueError(f"{name} must be exact ints (a bool is refused); found {', '.join(bad)}")
        try:
            values = np.array(ids, dtype=np.uint64)
        except (OverflowError, ValueError) as exc:
            raise DigestValueError(f"{name} must lie in [0, 2**64-1]") from exc
        return cls(values)

    @classmethod
    def concat(cls, parts: Sequence[TokenIds]) -> TokenIds:
        if not parts:
            return cls(np.empty(0, dtype=np.uint64))
        adjacent = _adjacent_in_block(parts)
        if adjacent is not None:  # already side by side in one block: the row is a view, not a copy
            return cls._block_view(*adjacent)
        # Join the big-endian words as bits: no byte swapping.
        return cls(np.concatenate([p._values.view(np.uint64) for p in parts]).view(_U64_BE))

    @property
    def array(self) -> np.ndarray:
        """The read-only values (a big-endian uint64 array; numpy reads it as numbers)."""
        return self._values

    def big_endian(self) -> np.ndarray:
        """The ids as u64 big-endian, exactly as the wire digests hash them."""
        return self._values

    def tolist(self) -> list[int]:
        return list(self._values.tolist())

    def __len__(self) -> int:
        return int(self._values.shape[0])

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...
    def __getitem__(self, index: int | slice) -> int | TokenIds:
        if isinstance(index, slice):
            return TokenIds(self._values[index].copy())
        return int(self._values[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self._values.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return bool(np.array_equal(self._values, other._values))
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})" if len(self) <= 16 else f"TokenIds(<{len(self)} ids>)"


def _big_endian_u64(values: np.ndarray) -> np.ndarray:
    if values.dtype == _U64_BE:
        return values
    if values.dtype == np.uint64 and _LITTLE:
        return values.byteswap().view(_U64_BE)
    return values.astype(_U64_BE)


def _msgpack_scratch(values: list[Any] | tuple[Any, ...]) -> bytearray | None:
    """``values`` msgpack-encoded into this thread's scratch buffer; None when they cannot be.

    Reusing one buffer per thread spares a fresh allocation (and its page faults) per column.
    """
    buffer: bytearray | None = getattr(_SCRATCH, "buffer", None)
    if buffer is None:
        buffer = _SCRATCH.buffer = bytearray()
    try:
        try:
            _MSGPACK_ENCODE_INTO(values, buffer)
        except BufferError:  # a view of an earlier call's buffer is still alive (say, in a traceback)
            buffer = _SCRATCH.buffer = bytearray()
            _MSGPACK_ENCODE_INTO(values, buffer)
    except _LIST_ERRORS:
        return None
    return buffer


def _release_scratch(buffer: bytearray) -> None:
    if len(buffer) > _SCRATCH_KEEP:
        _SCRATCH.buffer = None  # a very long column's buffer is not kept


def _ids_from_list(ids: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """Exact ints in [0, 2**64-1] as a big-endian array, in C passes; None: let the slow path judge.

    ``array('Q')`` converts at CPython's speed and refuses floats, text, negative and too
    large values, but takes a bool as 0 or 1 and any object with ``__index__``.  msgpack
    encoding refuses those objects (numpy scalars, int subclasses; an ``IntEnum`` member is
    its value), and a bool can only hide where the array holds 0 or 1: those positions alone
    are checked one by one.
    """
    scratch = _msgpack_scratch(ids)
    if scratch is None:
        return None
    _release_scratch(scratch)
    try:
        packed = array.array("Q", ids)
    except _LIST_ERRORS:
        return None
    native = np.frombuffer(packed, dtype=np.uint64)
    suspects = np.flatnonzero(native <= 1)
    if suspects.size and any(type(ids[i]) is bool for i in suspects.tolist()):
        return None
    del native
    if _LITTLE:
        packed.byteswap()  # in place: the array becomes the big-endian column, no copy
    return np.frombuffer(packed, dtype=_U64_BE)


def _ids_from_buffer(ids: np.ndarray | array.array[int], name: str) -> np.ndarray:
    if isinstance(ids, array.array):
        if ids.typecode not in _INT_ARRAY_CODES:
            raise DigestValueError(f"{name} must be integers, got array typecode {ids.typecode!r}")
        values = np.frombuffer(ids, dtype=np.dtype(ids.typecode))
    else:
        values = ids
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise DigestValueError(f"{name} must be a 1-d integer array, got {values.dtype} x{values.ndim}d")
    if values.dtype.kind == "i" and values.size and int(values.min()) < 0:
        raise DigestValueError(f"{name} must lie in [0, 2**64-1]; found a negative id")
    return values.astype(_U64_BE)  # one converting copy, already in the byte order digests hash


def _floats_from_list(values: list[Any] | tuple[Any, ...]) -> tuple[np.ndarray, bytearray] | None:
    """Exact floats as a (strided, big-endian) binary64 view of one msgpack encoding, and its buffer.

    None: let the slow path judge.  Every exact float encodes as nine bytes, tag 0xcb first;
    anything else (an int, a bool, None, text) encodes otherwise, and numpy scalars and float
    subclasses do not encode at all.  So the first non-float lands on a checked tag
    position.  (A float-valued ``Enum`` member encodes as its value and counts as it.)
    The view must be dropped before the thread encodes again.
    """
    count = len(values)
    scratch = _msgpack_scratch(values)
    if scratch is None:
        return None
    header = 1 if count < 16 else 3 if count < 2**16 else 5  # msgpack's array header
    if len(scratch) != header + 9 * count:
        return None
    tagged = np.frombuffer(scratch, dtype=_MSGPACK_F64, offset=header)
    if not (tagged["tag"] == _MSGPACK_F64_TAG).all():
        return None
    return tagged["value"], scratch


def _squares_below(values: np.ndarray, bound: float) -> bool:
    """Whether each slice's sum of squares (one BLAS dot) is below ``bound``, so every square is.

    Slices stay below the length from which OpenBLAS hands a dot to extra threads, whose
    spinning afterwards would cost the process far more CPU than it saves.
    """
    with np.errstate(over="ignore"):  # a square past binary64's range is inf, and fails the test
        for start in range(0, len(values), _DOT_SLICE):
            part = values[start : start + _DOT_SLICE]
            if not float(np.dot(part, part)) < bound:
                return False
    return True


def _adjacent_in_block(parts: Sequence[TokenIds] | Sequence[FloatColumn]) -> tuple[np.ndarray, int, int] | None:
    """(block array, start, end) when ``parts`` are views of one ``ColumnBlock`` array, each
    starting where the one before ends; None otherwise."""
    first = parts[0]._block
    if first is None:
        return None
    base, start = first
    end = start
    for part in parts:
        block = part._block
        if block is None or block[0] is not base or block[1] != end:
            return None
        end += len(part)
    return base, start, end


def _joined_carry(parts: Sequence[FloatColumn]) -> int | None:
    """The carry of binary32 parts joined, from their known carries (-1: some part's is not known).

    Joined, they are k times +0.0 then only +1.0 when every part is: zeros first, at most one
    part mixing both, then parts without zeros.
    """
    total, ones = 0, False
    for part in parts:
        carry = part._carry
        if carry is None:
            return None
        if carry == -1:
            return -1
        if ones and carry:
            return None
        total += carry
        ones = ones or carry < len(part)
    return total


class FloatColumn(Sequence[float]):
    """An immutable column of finite floats hashed as IEEE-754 binary32 (wire-contract 2.5)."""

    __slots__ = ("_block", "_carry", "_f32", "_from_storage", "_stored_floats", "_stored_mask", "_values")

    def __init__(self, values: np.ndarray | None, f32: np.ndarray) -> None:
        # Trusted: ``values`` are finite float64 (None: the binary32 values widened, made on
        # first use), ``f32`` their binary32 rounding.  numpy operations return native byte
        # order, so normalise to big-endian here.
        self._values = None if values is None else _readonly(values)
        # Read back from storage: judged on its binary32 patterns (see ``stored_carry``).  A
        # column given values binary32 holds exactly keeps no float64 copy, yet is not this.
        self._from_storage = values is None
        self._f32 = _readonly(f32 if f32.dtype == _F32_BE else f32.astype(_F32_BE))
        self._carry: int | None = -1  # -1: not computed yet (see carry_count)
        # encode_mask's and encode_floats' results, kept: a column is encoded once.
        self._stored_mask: bytes | None = None
        self._stored_floats: bytes | None = None
        self._block: tuple[np.ndarray, int] | None = None  # (block array, start) when a view of a ColumnBlock

    @classmethod
    def coerce(cls, values: Any, name: str) -> FloatColumn:
        """Validate exact finite floats that fit binary32 into a column."""
        if isinstance(values, FloatColumn):
            return values
        if isinstance(values, array.array):
            if values.typecode not in _FLOAT_ARRAY_CODES:
                raise DigestValueError(f"{name} must be floats, got array typecode {values.typecode!r}")
            given = np.frombuffer(values, dtype=np.dtype(values.typecode))
        elif isinstance(values, np.ndarray):
            if values.ndim != 1 or values.dtype.kind != "f":
                raise DigestValueError(f"{name} must be a 1-d float array, got {values.dtype}")
            given = values
        elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise DigestValueError(f"{name} must be a sequence of floats, got {type(values).__name__}")
        elif not values:
            given = np.empty(0, dtype=np.float64)
        else:
            encoded = None
            if type(values) is list or type(values) is tuple:  # a subclass may override what C reads
                encoded = _floats_from_list(values)
            if encoded is not None:
                view, scratch = encoded
                try:
                    given = view.astype(np.float64)  # native and contiguous: the column keeps it
                finally:
                    del view, encoded  # the scratch buffer is free again
                    _release_scratch(scratch)
                return cls._from_given(given, name, owned=True)
            kinds = set(map(type, values))
            if kinds != {float}:
                bad = sorted(k.__name__ for k in kinds if k is not float)
                raise DigestValueError(
                    f"{name} must be exact floats (ints and bools are refused); found {', '.join(bad)}"
                )
            return cls._from_given(np.array(values, dtype=np.float64), name, owned=True)
        return cls._from_given(given, name)

    @classmethod
    def _from_given(cls, given: np.ndarray, name: str, *, owned: bool = False) -> FloatColumn:
        """Check and pack float values; ``owned``: ``given`` is a fresh native copy the column may keep.

        Otherwise ``given`` may change later (the caller's buffer, a scratch buffer), so the
        column copies what it keeps.
        """
        # Finite and within binary32's range, in one BLAS pass: every term of the sum of
        # squares is non-negative, so the rounded sum is at least each rounded square, and a
        # sum below the overflow bound squared bounds every value (NaN and inf fail the test).
        # Otherwise (rare) min and max decide exactly.
        if given.size and not _squares_below(given, _F32_OVERFLOW_SQUARED):
            if not np.isfinite(given).all():
                raise DigestValueError(f"{name} must be finite (NaN and infinity are refused)")
            if not (given.min() > -_F32_OVERFLOW and given.max() < _F32_OVERFLOW):
                raise DigestValueError(f"{name} holds a value too large for binary32")
        f32 = given.astype(_F32_BE)
        if owned:
            return cls(given, f32)
        # A long column binary32 holds exactly (every valid mask; an engine's float32
        # log-probs) keeps no float64 copy: widening gives its values back as given, and the
        # copy's fresh pages cost more than the check.  Short columns are simply copied.
        if given.size >= _EXACT_CHECK_MIN and bool((f32 == given).all()):
            column = cls(None, f32)
            column._from_storage = False
            return column
        return cls(given.astype(np.float64), f32)

    @classmethod
    def from_f32(cls, f32: np.ndarray) -> FloatColumn:
        """A column whose values are the given binary32 values widened (exact)."""
        return cls(None, f32)

    @classmethod
    def _block_view(cls, base: np.ndarray, start: int, end: int) -> FloatColumn:
        """A column read back from storage, held as positions ``[start, end)`` of a block array."""
        column = cls(None, base[start:end])
        column._block = (base, start)
        return column

    @classmethod
    def concat_binary32(cls, parts: Sequence[FloatColumn]) -> FloatColumn:
        """The parts' binary32 values joined, as a column read back from storage holds them
        (no float64 values): what a linearized row carries, whatever the parts were built from."""
        adjacent = _adjacent_in_block(parts) if parts else None
        if adjacent is not None:  # side by side in one block: a view, not a copy
            column = cls._block_view(*adjacent)
            column._carry = _joined_carry(parts)  # block views are judged on their binary32 patterns
            return column
        return cls.from_f32(np.concatenate([p._f32.view(np.uint32) for p in parts]).view(_F32_BE))

    @classmethod
    def concat(cls, parts: Sequence[FloatColumn]) -> FloatColumn:
        if not parts:
            return cls(np.empty(0, dtype=np.float64), np.empty(0, dtype=">f4"))
        # Join the binary32 bit patterns as bytes: no float conversion, no byte swapping.
        f32 = np.concatenate([p._f32.view(np.uint32) for p in parts]).view(_F32_BE)
        if all(p._values is None for p in parts):
            column = cls(None, f32)
            column._from_storage = all(p._from_storage for p in parts)
            column._carry = _joined_carry(parts)
            return column
        return cls(np.concatenate([p.array for p in parts]), f32)

    @classmethod
    def filled(cls, value: float, count: int) -> FloatColumn:
        return cls.coerce(np.full(count, value, dtype=np.float64), "filled column")

    @property
    def array(self) -> np.ndarray:
        """The read-only float64 values as given (their binary32 rounding is what is hashed)."""
        if self._values is None:
            self._values = _readonly(self._f32.astype(np.float64))
        return self._values

    def big_endian_f32(self) -> np.ndarray:
        return self._f32

    def carry_count(self) -> int | None:
        """As a mask: k when it is k times +0.0 then only +1.0, else None (cached)."""
        if self._carry == -1:
            bits = self._f32.view(np.uint32)
            nonzero = bits != 0
            carry = int(np.argmax(nonzero)) if nonzero.any() else len(bits)
            self._carry = carry if bool((bits[carry:] == _ONE_BITS).all()) else None
        return self._carry

    def given_carry(self) -> int | None:
        """As a mask: k when its values as given are k times +0.0 then only 1.0, else None.

        Judged on the float64 values when the column has them (a valid mask then has the same
        shape in binary32, so ``carry_count`` is set too), else on the binary32 patterns.
        """
        values = self._values
        if values is None:
            return self.carry_count()
        if not values.size:
            return 0
        nonzero = values.view(np.uint64) != 0  # +0.0 is the all-zero pattern; -0.0 is not
        carry = int(nonzero.argmax())
        if not nonzero[carry]:
            carry = len(values)  # all +0.0
        if not bool((values[carry:] == 1.0).all()):
            return None
        self._carry = carry
        return carry

    def stored_carry(self) -> int | None:
        """``carry_count`` of a column read back from storage (binary32 patterns only), else None.

        Such a column is judged on its patterns alone, so when it is k times +0.0 then only
        +1.0 the flags of ``zero_one_flags`` are exactly "the first k" and "the rest".
        A column built from float64 values is judged on those values: always None here.
        """
        return self.carry_count() if self._from_storage else None

    def zero_one_flags(self) -> tuple[np.ndarray, np.ndarray]:
        """Per position: equal to 0.0 (either sign), equal to 1.0.

        Judged on the values as given; a column read back from storage is judged on its
        binary32 patterns, which avoids widening it (the widened values are identical).
        """
        if self._values is not None:
            return self._values == 0.0, self._values == 1.0
        bits = self._f32.view(np.uint32)
        return (bits & _ABS_BITS) == 0, bits == _ONE_BITS

    def any_nonzero(self, where: np.ndarray | slice) -> bool:
        """Whether any selected position differs from 0.0 (-0.0 counts as 0.0)."""
        if self._values is not None:
            return bool((self._values[where] != 0.0).any())
        bits = self._f32.view(np.uint32)[where]
        if not np.count_nonzero(bits):  # every pattern +0.0 (a carry's log-probs, as written): one C pass
            return False
        return bool(((bits & _ABS_BITS) != 0).any())

    def tolist(self) -> list[float]:
        return list(self.array.tolist())

    def __len__(self) -> int:
        return int(self._f32.shape[0])

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> FloatColumn: ...
    def __getitem__(self, index: int | slice) -> float | FloatColumn:
        if isinstance(index, slice):
            values = None if self._values is None else self._values[index].copy()
            part = FloatColumn(values, self._f32[index].copy())
            part._from_storage = self._from_storage
            return part
        return float(self.array[index])

    def __iter__(self) -> Iterator[float]:
        return iter(self.array.tolist())

    def __eq__(self, other: object) -> bool:
        # Equal when they hash equal: compare the binary32 bit patterns (-0.0 != 0.0).
        if isinstance(other, FloatColumn):
            return self._f32.tobytes() == other._f32.tobytes()
        if isinstance(other, (list, tuple)):
            try:
                return self == FloatColumn.coerce(list(other), "other")
            except DigestValueError:
                return False
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FloatColumn({self.tolist()!r})" if len(self) <= 16 else f"FloatColumn(<{len(self)} values>)"


# ---------------------------------------------------------------------------------------
# Compact storage forms.  Each starts with a one-byte tag so the layout can evolve.

_IDS_U32 = b"4"
_IDS_U64 = b"8"
_MASK_RUN = b"R"  # u64 count of +0.0 carry positions, then only +1.0 generated positions
_MASK_RAW = b"F"  # raw big-endian binary32 patterns
_F32_RAW = b"F"
_ZERO_F32 = b"\x00\x00\x00\x00"
_ONE_F32 = b"\x3f\x80\x00\x00"


def encode_ids(ids: TokenIds) -> bytes:
    """u32 little-endian when every id fits (typical vocabularies), else u64."""
    stored = ids._stored
    if stored is None:
        # Each big-endian word is (high, low) 32-bit halves: every id fits u32 when no high
        # half has a bit set, judged on the raw halves (no byte swapping, no u64 arithmetic).
        halves = ids.array.view(">u4").reshape(-1, 2)
        if not halves[:, 0].view(np.uint32).any():
            stored = b"".join((_IDS_U32, halves[:, 1].astype("<u4").data))
        else:
            stored = b"".join((_IDS_U64, ids.array.astype("<u8").data))
        ids._stored = stored
    return stored


def decode_ids(data: bytes) -> TokenIds:
    tag = data[:1]
    if tag == _IDS_U32:
        # One widening, byte-swapping copy straight into the big-endian form digests hash
        # (numpy converts and swaps in a single pass; twice as fast as zeroing then filling).
        return TokenIds(np.frombuffer(data, dtype="<u4", offset=1).astype(_U64_BE))
    if tag == _IDS_U64:
        return TokenIds(np.frombuffer(data, dtype="<u8", offset=1).astype(_U64_BE))
    raise ValueError(f"unknown token-id column tag {tag!r}")


def carry_count(mask: FloatColumn) -> int | None:
    """k when the mask is k times +0.0 then only +1.0 (carry-then-generation), else None."""
    return mask.carry_count()


def encode_mask(mask: FloatColumn) -> bytes:
    """Carry-then-generation masks (the common shape) take seventeen bytes whatever their length."""
    stored = mask._stored_mask
    if stored is None:
        carry = carry_count(mask)
        if carry is not None:
            stored = _MASK_RUN + carry.to_bytes(8, "big") + len(mask).to_bytes(8, "big")
        else:
            stored = _MASK_RAW + mask.big_endian_f32().tobytes()
        mask._stored_mask = stored
    return stored


def _run_mask_carry(data: bytes, length: int) -> int | None:
    """The carry of a stored run-length mask of ``length`` tokens; None when its counts do not
    fit (checked before anything is allocated: damaged counts must not ask for gigabytes)."""
    if len(data) != 17 or int.from_bytes(data[9:17], "big") != length:
        return None
    carry = int.from_bytes(data[1:9], "big")
    return carry if carry <= length else None


def decode_mask(data: bytes, length: int) -> FloatColumn:
    """The mask column of a record of ``length`` tokens (its ids column's length)."""
    tag = data[:1]
    if tag == _MASK_RUN:
        carry = _run_mask_carry(data, length)
        if carry is None:
            raise ValueError(f"run-length mask does not fit {length} token ids")
        f32 = np.frombuffer(_ZERO_F32 * carry + _ONE_F32 * (length - carry), dtype=">f4")
        column = FloatColumn.from_f32(f32)
        column._carry = carry  # built as carry times +0.0 then +1.0: its carry is known
        return column
    if tag == _MASK_RAW:
        return FloatColumn.from_f32(np.frombuffer(data[1:], dtype=">f4"))
    raise ValueError(f"unknown mask column tag {tag!r}")


class ColumnBlock:
    """The three columns of several stored records, back to back in one allocation.

    A rollout read for linearizing decodes each record's stored columns straight into its
    slot here (``decode_into``), so the training row of a chain stored in order is a view
    of the block (``TokenIds.concat``, ``FloatColumn.concat_binary32``), never a copy, and a
    linearize allocates once, not per column and per record.
    """

    __slots__ = ("_raw", "ids", "log_probs", "mask")

    def __init__(self, count: int) -> None:
        self._raw = np.empty(16 * count, dtype=np.uint8)  # 8 bytes an id, 4 a mask value, 4 a log-prob
        self.ids = self._raw[: 8 * count].view(_U64_BE)
        self.mask = self._raw[8 * count : 12 * count].view(_F32_BE)
        self.log_probs = self._raw[12 * count :].view(_F32_BE)

    def seal(self) -> None:
        """Every slot is written: nothing writes the block again."""
        for values in (self._raw, self.ids, self.mask, self.log_probs):
            values.flags.writeable = False

    def decode_into(
        self, start: int, token_ids: Any, token_mask: Any, log_probs: Any
    ) -> tuple[TokenIds, FloatColumn, FloatColumn] | None:
        """A record's stored columns decoded into positions ``[start, start + count)``, where
        ``count`` is ``stored_id_count(token_ids)``; None when any column is not a stored form of
        that length (the caller decodes it alone, and ``decode_*`` names what is wrong)."""
        count = stored_id_count(token_ids)
        end = start + count
        if not count or end > len(self.ids) or type(token_mask) is not bytes or type(log_probs) is not bytes:
            return None
        if log_probs[:1] != _F32_RAW or len(log_probs) != 1 + 4 * count:
            return None
        carry: int | None = None  # None: a raw mask
        if token_mask[:1] == _MASK_RUN:
            carry = _run_mask_carry(token_mask, count)
            if carry is None:
                return None
        elif token_mask[:1] != _MASK_RAW or len(token_mask) != 1 + 4 * count:
            return None
        # The u32/u64 little-endian ids widen and swap straight into the big-endian block.
        self.ids[start:end] = np.frombuffer(token_ids, dtype=_STORED_ID_TYPES[token_ids[:1]], offset=1)
        self.log_probs[start:end] = np.frombuffer(log_probs, dtype=_F32_BE, offset=1)
        if carry is None:
            self.mask[start:end] = np.frombuffer(token_mask, dtype=_F32_BE, offset=1)
        else:
            self.mask[start : start + carry] = 0.0
            self.mask[start + carry : end] = 1.0
        mask = FloatColumn._block_view(self.mask, start, end)
        if carry is not None:
            mask._carry = carry  # written as carry times +0.0 then +1.0, as decode_mask knows it
        return TokenIds._block_view(self.ids, start, end), mask, FloatColumn._block_view(self.log_probs, start, end)


_STORED_ID_TYPES: dict[bytes, np.dtype[Any]] = {_IDS_U32: np.dtype("<u4"), _IDS_U64: np.dtype("<u8")}


def stored_id_count(token_ids: Any) -> int:
    """How many ids a stored ids column holds, from its tag and length; 0 when it is not one."""
    if type(token_ids) is not bytes:
        return 0
    dtype = _STORED_ID_TYPES.get(token_ids[:1])
    if dtype is None or (len(token_ids) - 1) % dtype.itemsize:
        return 0
    return (len(token_ids) - 1) // int(dtype.itemsize)


def encode_floats(values: FloatColumn) -> bytes:
    stored = values._stored_floats
    if stored is None:
        stored = values._stored_floats = b"".join((_F32_RAW, values.big_endian_f32().data))
    return stored


def decode_floats(data: bytes) -> FloatColumn:
    if data[:1] != _F32_RAW:
        raise ValueError(f"unknown float column tag {data[:1]!r}")
    return FloatColumn.from_f32(np.frombuffer(data[1:], dtype=">f4"))

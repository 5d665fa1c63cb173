"""Routed-expert envelopes (wire-contract 6.5): which experts each token was routed to.

A call's extras may carry ``routed_experts`` as the version-1 envelope
``nrlre1:<dtype>:<T>x<L>x<K>:<base64>`` (``int8``/``int16``/``int32`` little-endian values,
every dimension > 0, the byte length matching the shape), or in the legacy form, a nested
``[T][L][K]`` list of ints of constant shape.  Tokens of calls without routes are filled with
``MISSING_ROUTE_SENTINEL`` when a row's routes are rebuilt (``with_routed_experts``).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Final

import numpy as np

from store.errors import RebuildError

ROUTED_EXPERTS_ENVELOPE_VERSION: Final = 1
ROUTED_EXPERTS_MAGIC: Final = "nrlre1"
MISSING_ROUTE_SENTINEL: Final = -1
LEGACY_ROUTES_DTYPE: Final = "legacy-int"  # the dtype reported for the nested-list form
_ENVELOPE_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
}


class RoutedExperts:
    """An immutable ``[tokens][layers][topk]`` table of expert ids and the dtype it travelled in.

    Compares equal to another table of the same dtype and values, or to a nested list.
    """

    __slots__ = ("_values", "dtype")

    def __init__(self, values: np.ndarray, dtype: str) -> None:
        if values.ndim != 3:
            raise _invalid(f"routed experts need three dimensions, got shape {values.shape}")
        values.flags.writeable = False
        self._values = values
        self.dtype = dtype

    @property
    def values(self) -> np.ndarray:
        """The read-only ``(tokens, layers, topk)`` array."""
        return self._values

    @property
    def num_layers(self) -> int:
        return int(self._values.shape[1])

    @property
    def topk(self) -> int:
        return int(self._values.shape[2])

    def tolist(self) -> list[list[list[int]]]:
        return self._values.tolist()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return int(self._values.shape[0])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RoutedExperts):
            return self.dtype == other.dtype and bool(np.array_equal(self._values, other._values))
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RoutedExperts(<{'x'.join(map(str, self._values.shape))} {self.dtype}>)"


def _invalid(detail: str) -> RebuildError:
    return RebuildError("invalid_routes", detail)


def encode_routed_experts(values: Any, dtype: str = "int16") -> str:
    """The version-1 envelope of a ``[T][L][K]`` table (nested lists or an integer array)."""
    if dtype not in _ENVELOPE_DTYPES:
        raise _invalid(f"unsupported routed_experts dtype {dtype!r}; use one of {sorted(_ENVELOPE_DTYPES)}")
    table = values.values if isinstance(values, RoutedExperts) else _legacy_table(values)
    wire = _ENVELOPE_DTYPES[dtype]
    info = np.iinfo(wire)
    if table.size and (int(table.min()) < info.min or int(table.max()) > info.max):
        raise _invalid(f"a routed expert id does not fit {dtype}")
    shape = "x".join(str(dim) for dim in table.shape)
    payload = base64.b64encode(table.astype(wire).tobytes()).decode("ascii")
    return f"{ROUTED_EXPERTS_MAGIC}:{dtype}:{shape}:{payload}"


def decode_routed_experts(payload: Any) -> RoutedExperts:
    """Decode an envelope (or validate the legacy nested list); ``RebuildError`` ``invalid_routes`` otherwise."""
    if not isinstance(payload, str):
        return RoutedExperts(_legacy_table(payload), LEGACY_ROUTES_DTYPE)
    parts = payload.split(":", 3)
    if len(parts) != 4 or parts[0] != ROUTED_EXPERTS_MAGIC:
        raise _invalid(f"unsupported routed_experts envelope; expected the {ROUTED_EXPERTS_MAGIC} prefix")
    _, dtype, shape_text, encoded = parts
    wire = _ENVELOPE_DTYPES.get(dtype)
    if wire is None:
        raise _invalid(f"unsupported routed_experts dtype {dtype!r}")
    dims = shape_text.split("x")
    if len(dims) != 3 or not all(dim.isascii() and dim.isdigit() for dim in dims):
        raise _invalid(f"routed_experts shape must be <tokens>x<layers>x<topk>, got {shape_text!r}")
    shape = tuple(int(dim) for dim in dims)
    if min(shape) <= 0:
        raise _invalid(f"routed_experts dimensions must be positive, got {shape_text}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _invalid("routed_experts envelope holds invalid base64") from exc
    expected = shape[0] * shape[1] * shape[2] * wire.itemsize
    if len(raw) != expected:
        raise _invalid(f"routed_experts holds {len(raw)} bytes, its shape {shape_text} needs {expected}")
    return RoutedExperts(np.frombuffer(raw, dtype=wire).reshape(shape), dtype)


def _legacy_table(payload: Any) -> np.ndarray:
    """A nested ``[T][L][K]`` list of exact ints of constant, non-empty shape."""
    if type(payload) is not list or not payload:
        raise _invalid("legacy routed_experts must be a non-empty nested list")
    layers = _width(payload[0], "token row")
    topk = _width(payload[0][0], "layer row")
    for token_row in payload:
        if _width(token_row, "token row") != layers:
            raise _invalid("routed_experts layer count must be constant")
        for layer_row in token_row:
            if _width(layer_row, "layer row") != topk:
                raise _invalid("routed_experts top-k width must be constant")
            if any(type(expert) is not int for expert in layer_row):
                raise _invalid("routed_experts values must be exact ints")
    try:
        return np.array(payload, dtype=np.int64)
    except OverflowError as exc:
        raise _invalid("a routed expert id does not fit a signed 64-bit int") from exc


def _width(row: Any, name: str) -> int:
    if type(row) is not list or not row:
        raise _invalid(f"each routed_experts {name} must be a non-empty list")
    return len(row)

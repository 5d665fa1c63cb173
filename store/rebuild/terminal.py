"""Which call ended a rollout: terminal selection (wire-contract 6.3) and witness attribution (6.4).

Both read token-free manifest rows (``CallRecord``) only, never tokens, and fail closed: a
shape with two defensible answers selects nothing and says why.  A wrong choice could only
pick a shorter verified chain, because ``verify_and_linearize`` still checks every digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from store.rebuild import fingerprint
from store.rebuild.fingerprint import UnfingerprintableError
from store.wire.records import CallRecord

# --- outcomes of select_terminal_call (wire-contract 3.10) ------------------------------------
SELECTED: Final = "selected"
NO_RECORDS: Final = "no_records"
DUPLICATE_CALL_ID: Final = "duplicate_call_id"
ORPHANED_ROW: Final = "orphaned_row"
NO_ROOT: Final = "no_root"
AMBIGUOUS_TERMINAL: Final = "ambiguous_terminal"


@dataclass(frozen=True, slots=True)
class TerminalSelection:
    """The inferred terminal call (``reason == "selected"``), or None and why none was chosen."""

    terminal_model_call_id: str | None
    reason: str


# --- the call forest ---------------------------------------------------------------------------


def root_order_key(records: Sequence[CallRecord]) -> Callable[[CallRecord], tuple[bool, float, int]]:
    """Order by admission time, unstamped rows last, ties by manifest position (commit order)."""
    position = {record.model_call_id: index for index, record in enumerate(records)}

    def key(record: CallRecord) -> tuple[bool, float, int]:
        stamped = record.admitted_at
        return (stamped is None, float(stamped) if stamped is not None else 0.0, position[record.model_call_id])

    return key


def children_by_parent(records: Iterable[CallRecord]) -> dict[str, list[CallRecord]]:
    """Parent id -> its children, in manifest order."""
    children: dict[str, list[CallRecord]] = {}
    for record in records:
        if record.parent_call_id is not None:
            children.setdefault(record.parent_call_id, []).append(record)
    return children


def survivors(candidates: Sequence[CallRecord], children: Mapping[str, Sequence[CallRecord]]) -> list[CallRecord]:
    """The candidates that were extended (have children), or all of them when none was.

    A childless call beside an extended sibling is an abandoned retry; two childless siblings
    (a retry of the final call) cannot be told apart, so both survive and the caller refuses.
    """
    extended = [record for record in candidates if children.get(record.model_call_id)]
    return extended or list(candidates)


def descend_to_leaf(start: CallRecord, children: Mapping[str, Sequence[CallRecord]]) -> CallRecord | None:
    """Walk down from ``start`` through the single surviving child at each level; None if a fork survives."""
    node = start
    while True:
        below = children.get(node.model_call_id)
        if not below:
            return node
        pool = survivors(below, children)
        if len(pool) > 1:
            return None
        node = pool[0]


def select_terminal_call(records: Sequence[CallRecord]) -> TerminalSelection:
    """Infer the terminal call of a rollout from parent links alone (no witness; 6.3).

    The main root is the earliest-admitted extended root (a root with children beats a
    childless one); the walk then descends through the single surviving child at each level.
    """
    if not records:
        return TerminalSelection(None, NO_RECORDS)
    ids = {record.model_call_id for record in records}
    if len(ids) != len(records):
        return TerminalSelection(None, DUPLICATE_CALL_ID)
    if any(record.parent_call_id is not None and record.parent_call_id not in ids for record in records):
        return TerminalSelection(None, ORPHANED_ROW)
    roots = [record for record in records if record.parent_call_id is None]
    if not roots:  # every row names a present parent: the rows form cycles
        return TerminalSelection(None, NO_ROOT)
    children = children_by_parent(records)
    main_root = min(survivors(roots, children), key=root_order_key(records))
    leaf = descend_to_leaf(main_root, children)
    if leaf is None:
        return TerminalSelection(None, AMBIGUOUS_TERMINAL)
    return TerminalSelection(leaf.model_call_id, SELECTED)


# --- the assistant fingerprint (content witness) ----------------------------------------------

# Version stamped in CallRecord.fingerprint_version by writers that use ``assistant_fingerprint``
# (NeMo Gym's version 2, ``store.rebuild.fingerprint``); rows stamped 1 (this store's earlier
# fingerprint) are matched with that one, and any other version (0: none recorded) takes no part.
ASSISTANT_FINGERPRINT_VERSION: Final = fingerprint.FINGERPRINT_VERSION
LEGACY_FINGERPRINT_VERSION: Final = 1
_FINGERPRINT_DOMAIN = b"staging-store-assistant-fingerprint-v1"
_TEXT_PART_TYPES = frozenset({"text", "output_text", "input_text"})


def assistant_fingerprint(items: Sequence[Any]) -> str | None:
    """NeMo Gym's assistant fingerprint (version 2) of the model-authored items, in order.

    User, system, tool-output and reasoning items are skipped, so reformatted tool output never
    changes it; None when there is no model-authored item.  Responses ``function_call`` items,
    chat ``tool_calls`` and Anthropic ``tool_use`` blocks hash alike; JSON arguments hash
    canonically.  Raises ``UnfingerprintableError`` (a ``ValueError``) for an item it cannot read.
    """
    return fingerprint.assistant_fingerprint(items) or None


def legacy_assistant_fingerprint(items: Sequence[Any]) -> str | None:
    """This store's version-1 fingerprint, for rows stamped with it (SHA-256 over tagged,
    length-prefixed assistant text and tool calls); None when there is no model-authored item."""
    hasher = hashlib.sha256(_FINGERPRINT_DOMAIN)
    count = 0
    for item in items:
        if not isinstance(item, Mapping):
            raise UnfingerprintableError(f"output item is not an object: {type(item).__name__}")
        if not is_model_authored(item):
            continue
        count += 1
        for text in _texts(item):
            _field(hasher, b"T", text)
        for call_id, name, arguments in _tool_calls(item):
            _field(hasher, b"C", call_id)
            _field(hasher, b"N", name)
            _field(hasher, b"A", arguments)
    return hasher.hexdigest() if count else None


def is_model_authored(item: Mapping[str, Any]) -> bool:
    """Model-authored as version 1 reads it (assistant messages and function calls)."""
    kind = item.get("type")
    if kind == "function_call":
        return True
    return kind in (None, "message") and item.get("role") == "assistant"


def _field(hasher: Any, tag: bytes, value: str) -> None:
    raw = value.encode("utf-8", "surrogatepass")
    hasher.update(tag + len(raw).to_bytes(8, "big") + raw)


def _texts(item: Mapping[str, Any]) -> list[str]:
    content = item.get("content")
    if content is None or item.get("type") == "function_call":
        return []
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        raise UnfingerprintableError(f"message content is neither text nor a list of parts: {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, Mapping) and part.get("type") in ("tool_use", "refusal"):
            continue  # tool_use blocks are read by _tool_calls; refusals carry no training text
        else:
            raise UnfingerprintableError(f"unreadable content part {part!r:.80}")
    return [text for text in texts if text]


def _tool_calls(item: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    if item.get("type") == "function_call":
        return [_call(item.get("call_id"), item.get("name"), item.get("arguments"))]
    calls = []
    for call in item.get("tool_calls") or []:  # chat dialect
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise UnfingerprintableError("a chat tool call has no function object")
        calls.append(_call(call.get("id"), function.get("name"), function.get("arguments")))
    content = item.get("content")
    for part in content if isinstance(content, list) else []:  # Anthropic tool_use blocks
        if isinstance(part, Mapping) and part.get("type") == "tool_use":
            calls.append(_call(part.get("id"), part.get("name"), part.get("input")))
    return calls


def _call(call_id: Any, name: Any, arguments: Any) -> tuple[str, str, str]:
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise UnfingerprintableError("a tool call needs a string id and name")
    return call_id, name, _canonical_arguments(arguments)


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        text = arguments
        try:
            arguments = json.loads(text)
        except ValueError:
            return text  # not JSON: hashed verbatim
    try:
        return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnfingerprintableError(f"tool-call arguments are not JSON: {exc}") from exc


def trailing_block(
    items: Sequence[Any], authored: Callable[[Mapping[str, Any]], bool] = is_model_authored
) -> list[Any]:
    """The final run of consecutive model-authored items (empty if the output ends otherwise)."""
    end = len(items)
    start = end
    while start > 0 and isinstance(items[start - 1], Mapping) and authored(items[start - 1]):
        start -= 1
    return list(items[start:end])


# --- witness attribution (6.4) ---------------------------------------------------------------

Method = Literal["declared", "response_id", "content"]


@dataclass(frozen=True, slots=True)
class TerminalAttribution:
    """What the witnesses say ended the rollout.

    ``model_call_id``/``method`` are None when nothing was attributed.  ``reason`` is the
    comma-joined trail (each abstention, ``corroborated_by=...`` or ``witness_disagreement[...]``).
    ``may_fall_back`` is true only when every witness abstained without a declared id: then
    (and only then) the caller may use ``select_terminal_call`` (``heuristic``).
    """

    model_call_id: str | None
    method: Method | None
    reason: str
    may_fall_back: bool = False


_Identity = tuple[str, str, int]


def _identity(record: CallRecord) -> _Identity:
    return (record.cumulative_hash, record.chain_hash, record.cum_len)


def _collapse(candidates: Iterable[CallRecord]) -> list[CallRecord]:
    """One candidate per distinct token sequence: identical (cumulative, chain, cum_len) keep the smallest id."""
    groups: dict[_Identity, CallRecord] = {}
    for record in candidates:
        key = _identity(record)
        if key not in groups or record.model_call_id < groups[key].model_call_id:
            groups[key] = record
    return list(groups.values())


def _response_field(response: Any, name: str) -> Any:
    if isinstance(response, Mapping):
        return response.get(name)
    return getattr(response, name, None)


def _by_response_id(records: Sequence[CallRecord], response_id: str) -> list[CallRecord]:
    return _collapse(record for record in records if record.response_id == response_id)


def _response_id_witness(records: Sequence[CallRecord], response: Any) -> CallRecord | str:
    response_id = _response_field(response, "id")
    if not isinstance(response_id, str) or not response_id:
        return "response_has_no_id"
    matches = _by_response_id(records, response_id)
    if not matches:
        return "response_id_no_match"
    return matches[0] if len(matches) == 1 else "response_id_ambiguous"


def _content_witness(records: Sequence[CallRecord], response: Any) -> CallRecord | str:
    output = _response_field(response, "output")
    if not output or not isinstance(output, (list, tuple)):
        return "response_has_no_output"
    items = [item for item in output if isinstance(item, Mapping)]  # as Gym reads it: objects only
    try:
        whole = fingerprint.assistant_fingerprint(items)
        block = trailing_block(items, fingerprint.is_assistant_authored)
        tail = fingerprint.assistant_fingerprint(block) if block else ""
    except (UnfingerprintableError, TypeError, ValueError, RecursionError):
        return "response_output_unfingerprintable"
    if not whole:
        return "no_model_authored_output"
    readings: dict[int, tuple[str | None, str | None]] = {ASSISTANT_FINGERPRINT_VERSION: (whole, tail or None)}
    if any(record.fingerprint_version == LEGACY_FINGERPRINT_VERSION for record in records):
        readings[LEGACY_FINGERPRINT_VERSION] = _legacy_readings(output)
    matches = _collapse(
        record
        for record in records
        if record.fingerprint_version in readings and _content_matches(record, *readings[record.fingerprint_version])
    )
    if not matches:
        return "no_content_match"
    return matches[0] if len(matches) == 1 else "content_ambiguous"


def _legacy_readings(output: Sequence[Any]) -> tuple[str | None, str | None]:
    """Version 1's (whole, trailing block) fingerprints of the output; (None, None) when it
    cannot read the output (rows stamped 1 then match nothing)."""
    try:
        block = trailing_block(output)
        return legacy_assistant_fingerprint(output), legacy_assistant_fingerprint(block) if block else None
    except (UnfingerprintableError, TypeError, ValueError, RecursionError):
        return None, None


def _content_matches(record: CallRecord, whole: str | None, tail: str | None) -> bool:
    if whole is None:
        return False
    return whole in (record.continuation_fingerprint, record.output_fingerprint) or (
        tail is not None and tail == record.output_fingerprint
    )


_RESPONSE_WITNESSES: tuple[tuple[Method, Callable[[Sequence[CallRecord], Any], CallRecord | str]], ...] = (
    ("response_id", _response_id_witness),
    ("content", _content_witness),
)


def resolve_terminal(
    records: Sequence[CallRecord], response: Any, declared_response_id: str | None = None
) -> TerminalAttribution:
    """Attribute the terminal call from independent witnesses (6.4); never raises.

    ``response`` is the scored response object (a mapping or an object with ``id`` and
    ``output``), or None.  A declared response id is authoritative: if it matches no row, or
    several different ones, nothing is attributed and there is no fallback.  Witnesses that
    attribute must agree (calls with identical token sequences count as one); a disagreement
    attributes nothing.
    """
    rows = list(records)
    if not all(isinstance(record, CallRecord) for record in rows):
        return TerminalAttribution(None, None, "invalid_records")
    named: list[tuple[Method, CallRecord]] = []
    reasons: list[str] = []
    if declared_response_id is not None:
        matches = _by_response_id(rows, declared_response_id) if isinstance(declared_response_id, str) else []
        if not matches:
            return TerminalAttribution(None, None, "declared_terminal_not_captured")
        if len(matches) > 1:
            return TerminalAttribution(None, None, "declared_ambiguous")
        named.append(("declared", matches[0]))
    if response is None:
        reasons.append("no_response_object")
    else:
        for method, witness in _RESPONSE_WITNESSES:
            outcome = witness(rows, response)
            if isinstance(outcome, str):
                reasons.append(outcome)
            else:
                named.append((method, outcome))
    if not named:
        return TerminalAttribution(None, None, ",".join(reasons), may_fall_back=declared_response_id is None)
    if len({_identity(record) for _, record in named}) > 1:
        trail = ";".join(f"{method}={record.model_call_id}" for method, record in named)
        return TerminalAttribution(None, None, ",".join([*reasons, f"witness_disagreement[{trail}]"]))
    chosen = min((record for _, record in named), key=lambda record: record.model_call_id)
    if len(named) > 1:
        reasons.append("corroborated_by=" + "+".join(method for method, _ in named[1:]))
    return TerminalAttribution(chosen.model_call_id, named[0][0], ",".join(reasons))

"""Conversation fingerprints as NeMo Gym 0.7.0 computes them (fingerprint version 2).

``assistant_fingerprint`` hashes the model-authored turns of a list of chat, Responses or
Anthropic items (what a ``CallRecord``'s ``output_fingerprint`` / ``continuation_fingerprint``
hold, and what parent resolution looks up); ``conversation_digest`` hashes every turn, tool
results included (what proves a continuation's request still begins with its parent's
context, unchanged).  Both are SHA-256 over tagged, length-prefixed UTF-8 fields, so no field
boundary can move.  Written from the wire contract and Gym's observable results (the tests
compare both with Gym's functions on every dialect); canonical JSON is written as orjson
writes it with sorted keys (Gym uses orjson), so equal values hash equal in both.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

FINGERPRINT_VERSION: Final = 2
_ASSISTANT_DOMAIN = b"nemo-gym-lineage"
_CONTEXT_DOMAIN = b"nemo-gym-lineage-context"
_TEXT_BLOCKS = frozenset({"", "text", "input_text", "output_text"})
_JSON_DEPTH = 255  # orjson refuses deeper values (and Gym with it)


class UnfingerprintableError(ValueError):
    """An item has a shape the fingerprint cannot read (Gym raises ``ValueError`` alike)."""


def assistant_fingerprint(items: Sequence[Any]) -> str:
    """SHA-256 hex over the model-authored items in order ("" when there is none).

    Model-authored: ``role == "assistant"`` (any item type) or a Responses ``function_call``.
    Per item: its content parts (type, text or canonical JSON) and its tool calls (id, name,
    canonical arguments), from chat ``tool_calls``, Anthropic ``tool_use`` blocks or the
    ``function_call`` item itself, so the dialects hash alike.
    """
    hasher = hashlib.sha256(_ASSISTANT_DOMAIN)
    authored = 0
    for item in _objects(items):
        if not is_assistant_authored(item):
            continue
        authored += 1
        for kind, payload in _content_parts(item.get("content")):
            _field(hasher, b"\x00", kind)
            _field(hasher, b"\x01", payload)
        for call_id, name, arguments in _tool_calls(item):
            _field(hasher, b"\x02", call_id)
            _field(hasher, b"\x03", name)
            _field(hasher, b"\x04", arguments)
    return hasher.hexdigest() if authored else ""


def conversation_digest(items: Sequence[Any]) -> str:
    """SHA-256 hex over every item: its role (or type), content parts, tool calls and tool results."""
    hasher = hashlib.sha256(_CONTEXT_DOMAIN)
    for item in _objects(items):
        _field(hasher, b"\x00", str(item.get("role") or item.get("type") or ""))
        for kind, payload in _content_parts(item.get("content")):
            _field(hasher, b"\x01", kind)
            _field(hasher, b"\x02", payload)
        for call_id, name, arguments in _tool_calls(item):
            _field(hasher, b"\x03", call_id)
            _field(hasher, b"\x04", name)
            _field(hasher, b"\x05", arguments)
        for call_id, output in _tool_results(item):
            _field(hasher, b"\x06", call_id)
            _field(hasher, b"\x07", output)
    return hasher.hexdigest()


def is_assistant_authored(item: Mapping[str, Any]) -> bool:
    """Reasoning items are not model-authored here: a harness need not echo them."""
    return item.get("role") == "assistant" or item.get("type") == "function_call"


def canonical_arguments(value: Any) -> str:
    """Tool-call arguments for comparison: JSON text is parsed and written canonically, other
    text is stripped, a structured value is written canonically; None is ""."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value.strip()
        return canonical_json(parsed)
    return canonical_json(value)


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys, written as orjson writes it (floats included)."""
    out: list[str] = []
    _write(value, out, 0)
    return "".join(out)


# --- internals -------------------------------------------------------------------------------


def _objects(items: Any) -> list[Mapping[str, Any]]:
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        raise UnfingerprintableError(f"items must be a list of objects, got {type(items).__name__}")
    for item in items:
        if not isinstance(item, Mapping):
            raise UnfingerprintableError(f"request item is not an object: {type(item).__name__}")
    return list(items)


def _field(hasher: Any, tag: bytes, value: str) -> None:
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnfingerprintableError(f"text that is not valid Unicode: {exc.reason}") from exc
    hasher.update(tag + len(raw).to_bytes(8, "big") + raw)


def _content_parts(content: Any) -> list[tuple[str, str]]:
    """Typed content parts; tool_use and tool_result blocks are read elsewhere."""
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)] if content else []
    if not isinstance(content, list):
        raise UnfingerprintableError(f"unsupported message content: {type(content).__name__}")
    parts: list[tuple[str, str]] = []
    for block in content:
        if isinstance(block, str):
            if block:
                parts.append(("text", block))
            continue
        if not isinstance(block, Mapping):
            raise UnfingerprintableError(f"unsupported content block: {type(block).__name__}")
        kind = str(block.get("type") or "")
        if kind in ("tool_use", "tool_result"):
            continue
        text = block.get("text")
        if isinstance(text, str) and kind in _TEXT_BLOCKS:
            if text:
                parts.append(("text", text))
            continue
        if not kind:
            raise UnfingerprintableError("content block has no supported type")
        parts.append((kind, canonical_json(block)))
    return parts


def _tool_calls(item: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(id, name, canonical arguments) of a function_call item, tool_use blocks and chat tool_calls."""
    calls: list[tuple[str, str, str]] = []
    if item.get("type") == "function_call":
        name = str(item.get("name", ""))
        if item.get("namespace"):  # two tools of one short name in different namespaces differ
            name = f"{item['namespace']}__{name}"
        calls.append(
            (str(item.get("call_id") or item.get("id") or ""), name, canonical_arguments(item.get("arguments")))
        )
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "tool_use":
                calls.append(
                    (str(block.get("id") or ""), str(block.get("name", "")), canonical_arguments(block.get("input")))
                )
    for call in item.get("tool_calls") or []:
        call = call or {}
        if not isinstance(call, Mapping):
            raise UnfingerprintableError(f"a chat tool call is not an object: {type(call).__name__}")
        function = call.get("function") or {}
        if not isinstance(function, Mapping):
            raise UnfingerprintableError(f"a chat tool call's function is not an object: {type(function).__name__}")
        calls.append(
            (str(call.get("id") or ""), str(function.get("name", "")), canonical_arguments(function.get("arguments")))
        )
    return calls


def _tool_results(item: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(call id, output) of a function_call_output item, a chat tool message, tool_result blocks."""
    results: list[tuple[str, str]] = []
    if item.get("type") == "function_call_output":
        output = item.get("output")
        results.append((str(item.get("call_id") or item.get("id") or ""), _text_or_json(output)))
    elif item.get("role") == "tool":
        results.append((str(item.get("tool_call_id") or ""), _text_or_json(item.get("content"))))
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "tool_result":
                call_id = str(block.get("tool_use_id") or block.get("id") or "")
                results.append((call_id, _text_or_json(block.get("content"))))
    return results


def _text_or_json(value: Any) -> str:
    return value if isinstance(value, str) else canonical_json(value)


def _write(value: Any, out: list[str], depth: int) -> None:
    if depth > _JSON_DEPTH:
        raise UnfingerprintableError("content nests too deeply to write as JSON")
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnfingerprintableError(f"text that is not valid Unicode: {exc.reason}") from exc
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise UnfingerprintableError(f"integer {value} does not fit 64 bits")
        out.append(str(int(value)))
    elif isinstance(value, float):
        out.append(_float(value))
    elif isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise UnfingerprintableError("an object with a key that is not a string")
        out.append("{")
        for index, key in enumerate(sorted(value)):
            if index:
                out.append(",")
            _write(key, out, depth + 1)
            out.append(":")
            _write(value[key], out, depth + 1)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for index, entry in enumerate(value):
            if index:
                out.append(",")
            _write(entry, out, depth + 1)
        out.append("]")
    else:
        raise UnfingerprintableError(f"unsupported prompt content: {type(value).__name__}")


def _float(value: float) -> str:
    """A float as orjson writes it: null when not finite; Python's shortest repr, except that
    an exponent has no leading zero and 1e-5 <= |x| < 1e-4 is written without one."""
    if not math.isfinite(value):
        return "null"
    text = repr(float(value))
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    power = int(exponent)
    if power == -5:
        sign = "-" if mantissa.startswith("-") else ""
        return sign + "0.0000" + mantissa.lstrip("-").replace(".", "")
    return f"{mantissa}e{'+' if power > 0 else '-'}{abs(power)}"

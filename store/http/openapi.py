"""OpenAPI descriptions of the control routes, built from the store's own msgspec records.

The routes read their bodies as bytes (the wire stays the contract's, not a pydantic model
of it), so FastAPI cannot see their shapes; these schemas give it them.  Each schema is
inlined (no ``$ref``), so the routes describe themselves correctly in any host app's
document, vLLM's included.
"""

from __future__ import annotations

from typing import Any

import msgspec

from store.http.bodies import JSON_MEDIA_TYPE

_ERRORS = {
    400: "malformed JSON, a value the store refuses, or a client that went away",
    401: "a missing or wrong bearer token",
    408: "the body did not arrive in time",
    409: "a cut or write the store refuses, or a checkpoint is open",
    410: "the rollout was retired",
    413: "the body, or the number of entries in it, is over the limit",
    415: "the body is not application/json",
    422: "the body is not the route's record",
    503: "the store is closed or unavailable",
}
_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string"}, "detail": {"type": "string"}},
    "required": ["code", "detail"],
}


def schema_of(record_type: type[Any]) -> dict[str, Any]:
    """The JSON schema of a msgspec record with every ``$ref`` replaced by its definition."""
    schema = msgspec.json.schema(record_type)
    definitions = schema.pop("$defs", {})
    return _inline(schema, definitions, ())  # type: ignore[no-any-return]


def _inline(node: Any, definitions: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:  # a recursive record: leave it open rather than loop
                return {"type": "object"}
            return _inline(definitions[name], definitions, (*seen, name))
        return {key: _inline(value, definitions, seen) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline(item, definitions, seen) for item in node]
    return node


def request_body(record_type: type[Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``record_type``."""
    content = {JSON_MEDIA_TYPE: {"schema": schema_of(record_type)}}
    return {"requestBody": {"required": True, "content": content}}


def responses(record_type: type[Any], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """The route's 200 answer and the listed error statuses (each ``{"code", "detail"}``)."""
    described: dict[int | str, dict[str, Any]] = {
        200: {"description": record_type.__name__, "content": {JSON_MEDIA_TYPE: {"schema": schema_of(record_type)}}}
    }
    for status in statuses:
        described[status] = {"description": _ERRORS[status], "content": {JSON_MEDIA_TYPE: {"schema": _ERROR_SCHEMA}}}
    return described

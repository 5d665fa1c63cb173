"""The control routes (wire-contract 5.2, 5.5, 6.5) through FastAPI's TestClient: cuts, the
ledger routes, the bearer token, size limits, and every refusal a 4xx JSON that writes nothing."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from capture_helpers import event_count, writes_nothing
from fastapi import FastAPI
from fastapi.testclient import TestClient
from http_helpers import TOKEN, inventory, start_live_calls
from test_ledger import Conversation

from store import (
    ConfigurationError,
    GenerationCutReceipt,
    RolloutManifest,
    RolloutRemoval,
    RolloutTokenCapture,
    Store,
    control_app,
    control_router,
    from_json,
    open_store,
    to_json,
)
from store.http.routes import DEFAULT_MAX_CUT_PREFIXES

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
CUT = "/ng-control/v1/generation-cut"
LEDGER = "/training-token-capture/control/rollouts"


def client_for(
    store: Store,
    capture: RolloutTokenCapture | None = None,
    *,
    root: str = "",
    checkpoint_open: Callable[[], bool] | None = None,
    max_body_bytes: int = 1 << 20,
    max_cut_prefixes: int = DEFAULT_MAX_CUT_PREFIXES,
) -> TestClient:
    capture = capture or RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    app = FastAPI()
    app.include_router(
        control_router(
            capture,
            store,
            TOKEN,
            root=root,
            checkpoint_open=checkpoint_open,
            max_body_bytes=max_body_bytes,
            max_cut_prefixes=max_cut_prefixes,
        )
    )
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def ledger_client(store: Store) -> Iterator[tuple[TestClient, Conversation]]:
    conversation = Conversation(store, "r0")
    conversation.commit("c0")
    conversation.commit("c1", parent="c0")
    with client_for(store) as client:
        yield client, conversation


def _refused(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body: dict[str, Any] = response.json()
    assert body["code"] == code, body
    assert body["detail"] and "Traceback" not in body["detail"]
    return body


# --- generation cut ---------------------------------------------------------------------------


def test_cut_route_serves_live_calls_and_replays_the_identical_receipt_after_restart(store_url: str) -> None:
    sent = inventory(3)
    with open_store(store_url) as store:
        capture = start_live_calls(store, 3, 5)
        with client_for(store, capture, root="/worker") as client:
            response = client.post(f"/worker{CUT}", content=to_json(sent), headers=AUTH)
        capture.close()
    assert response.status_code == 200, response.text
    receipt = from_json(response.content, GenerationCutReceipt)
    receipt.validate_for(sent)
    assert [ack.disposition for ack in receipt.prefixes] == ["durable_prefix"] * 3
    assert [ack.prefix_token_count for ack in receipt.prefixes] == [5, 5, 5]

    # A restarted worker: a new store handle and capture with no live calls.
    with open_store(store_url) as store:
        before = event_count(store)
        with client_for(store, root="/worker") as client:
            again = client.post(f"/worker{CUT}", content=to_json(sent), headers=AUTH)
        assert again.status_code == 200
        assert again.content == response.content
        assert event_count(store) == before


def test_cut_route_refuses_bad_tokens_without_writing(store: Store) -> None:
    capture = start_live_calls(store, 1, 4)
    body = to_json(inventory(1))
    with client_for(store, capture) as client, writes_nothing(store):
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": TOKEN},
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": "Bearer"},
        ):
            _refused(client.post(CUT, content=body, headers=headers), 401, "unauthorized")
        _refused(client.get(f"{LEDGER}/r0/manifest"), 401, "unauthorized")
        _refused(client.post(f"{LEDGER}/retire", json={"rollout_ids": ["h0"]}), 401, "unauthorized")
    capture.close()


def test_cut_route_refuses_malformed_oversized_and_invalid_bodies_without_writing(store: Store) -> None:
    capture = start_live_calls(store, 1, 4)
    good = json.loads(to_json(inventory(1)))
    extra = {**good, "surprise": 1}
    wrong_digest = {**good, "inventory_digest": "0" * 64}
    not_an_inventory = {"rollout_ids": ["h0"]}
    with client_for(store, capture, max_body_bytes=4096) as client, writes_nothing(store):
        _refused(client.post(CUT, content=b"{not json", headers=AUTH), 400, "malformed_json")
        _refused(client.post(CUT, content=b"", headers=AUTH), 400, "invalid_request")
        _refused(client.post(CUT, content=b"x" * 5000, headers=AUTH), 413, "body_too_large")
        for body in (extra, wrong_digest, not_an_inventory, [good], None, 7):
            _refused(client.post(CUT, content=json.dumps(body), headers=AUTH), 422, "invalid_request")
        # A body that streams past the cap without a Content-Length is cut off too.
        chunks = iter([b"[" + b"1," * 3000, b"1]"])
        _refused(client.post(CUT, content=chunks, headers=AUTH), 413, "body_too_large")
    capture.close()


def test_cut_route_refuses_an_inventory_the_capture_refuses_with_a_4xx(store: Store) -> None:
    capture = start_live_calls(store, 1, 4)
    # The same call twice in one inventory (5.5 batch mode) is an error, not a 500.
    from store import GenerationCutInventory, GenerationCutPrefix

    prefixes = [
        GenerationCutPrefix(ticket_id=t, rollout_id="h0", attempt_index=0, model_call_id="c0", admitted_at=1.5)
        for t in ("t1", "t2")
    ]
    duplicated = GenerationCutInventory.build(checkpoint_id="k", server_name="policy", active_prefixes=prefixes)
    with client_for(store, capture) as client, writes_nothing(store):
        body = _refused(client.post(CUT, content=to_json(duplicated), headers=AUTH), 409, "generation_cut_refused")
        assert "more than once" in body["detail"]
    capture.close()


# --- ledger routes ----------------------------------------------------------------------------


def test_manifest_route_returns_the_ledger_and_410_once_retired(
    ledger_client: tuple[TestClient, Conversation],
) -> None:
    client, conversation = ledger_client
    response = client.get(f"{LEDGER}/r0/manifest", headers=AUTH)
    assert response.status_code == 200
    manifest = from_json(response.content, RolloutManifest)
    assert manifest == conversation.ledger.manifest("r0")
    assert [row.model_call_id for row in manifest.records] == ["c0", "c1"]
    empty = from_json(client.get(f"{LEDGER}/never/manifest", headers=AUTH).content, RolloutManifest)
    assert empty.records == [] and empty.rollout_id == "never"

    retired = client.post(f"{LEDGER}/retire", json={"rollout_ids": ["r0", "never"]}, headers=AUTH)
    assert retired.status_code == 200
    assert from_json(retired.content, RolloutRemoval) == RolloutRemoval(removed=["r0"], absent=["never"])
    _refused(client.get(f"{LEDGER}/r0/manifest", headers=AUTH), 410, "rollout_retired")
    again = client.post(f"{LEDGER}/retire", json={"rollout_ids": ["r0"]}, headers=AUTH)
    assert from_json(again.content, RolloutRemoval) == RolloutRemoval(removed=["r0"])  # as the ledger answers
    _refused(client.get(f"{LEDGER}/r0/manifest", headers=AUTH), 410, "rollout_retired")

    deleted = client.post(f"{LEDGER}/delete", json={"rollout_ids": ["r0"]}, headers=AUTH)
    assert deleted.status_code == 200
    assert from_json(client.get(f"{LEDGER}/r0/manifest", headers=AUTH).content, RolloutManifest).records == []


def test_removal_routes_refuse_bad_bodies_without_writing(ledger_client: tuple[TestClient, Conversation]) -> None:
    client, conversation = ledger_client
    store = conversation.store
    with writes_nothing(store):
        for path in (f"{LEDGER}/retire", f"{LEDGER}/delete"):
            _refused(client.post(path, json={"rollout_ids": []}, headers=AUTH), 422, "invalid_request")
            too_many = {"rollout_ids": [f"x{i}" for i in range(4097)]}
            body = _refused(client.post(path, json=too_many, headers=AUTH), 422, "invalid_request")
            assert "4097" in body["detail"]
            _refused(client.post(path, json={"rollout_ids": ["r0"], "all": True}, headers=AUTH), 422, "invalid_request")
            _refused(client.post(path, json={"rollout_ids": "r0"}, headers=AUTH), 422, "invalid_request")
            _refused(client.post(path, json={"rollout_ids": [1]}, headers=AUTH), 422, "invalid_request")
            _refused(client.post(path, json={}, headers=AUTH), 422, "invalid_request")
            _refused(client.post(path, content=b"[", headers=AUTH), 400, "malformed_json")
            _refused(client.post(path, json={"rollout_ids": ["r0", "r0"]}, headers=AUTH), 400, "invalid_request")
            _refused(client.post(path, json={"rollout_ids": [""]}, headers=AUTH), 400, "invalid_request")
    assert store.ledger().has_rows("r0")


def test_removal_routes_answer_409_while_a_checkpoint_is_open(store: Store) -> None:
    conversation = Conversation(store, "r0")
    conversation.commit("c0")
    state = {"open": True}
    with client_for(store, checkpoint_open=lambda: state["open"]) as client:
        with writes_nothing(store):
            for path in (f"{LEDGER}/retire", f"{LEDGER}/delete"):
                _refused(client.post(path, json={"rollout_ids": ["r0"]}, headers=AUTH), 409, "checkpoint_open")
        assert client.get(f"{LEDGER}/r0/manifest", headers=AUTH).status_code == 200  # reads are not blocked
        state["open"] = False
        done = client.post(f"{LEDGER}/retire", json={"rollout_ids": ["r0"]}, headers=AUTH)
        assert from_json(done.content, RolloutRemoval).removed == ["r0"]


def test_unknown_routes_and_methods_are_json_4xx(store: Store) -> None:
    with client_for(store) as client:
        assert client.get(CUT, headers=AUTH).status_code == 405
        assert client.get("/nothing", headers=AUTH).status_code == 404
        assert client.get(f"{LEDGER}/r0/manifest/more", headers=AUTH).json()["detail"]


def test_a_store_failure_is_a_json_error_not_a_traceback(store_url: str) -> None:
    store = open_store(store_url)
    with client_for(store) as client:
        store.close()
        response = client.get(f"{LEDGER}/r0/manifest", headers=AUTH)
    assert response.status_code == 503
    assert response.json()["code"] == "store_closed"


@pytest.mark.parametrize(
    "options",
    [
        {"token": ""},
        {"token": "  "},
        {"token": None},
        {"token": "short"},  # guessable: under 16 characters
        {"token": "s3cret-tökén-0123456789"},  # no HTTP header can carry it: every client would get 401
        {"token": "s3cret token 0123456789"},
        {"root": "worker"},
        {"root": "/w/"},
        {"max_body_bytes": 0},
        {"body_timeout": 0},
        {"body_timeout": float("inf")},
        {"max_cut_prefixes": 0},
    ],
)
def test_control_router_refuses_bad_configuration(store: Store, options: dict[str, Any]) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    arguments: dict[str, Any] = {"token": TOKEN, **options}
    token = arguments.pop("token")
    with pytest.raises(ConfigurationError):
        control_router(capture, store, token, **arguments)
    with pytest.raises(ConfigurationError):
        control_router(store, store, TOKEN)  # type: ignore[arg-type]


# --- hostile bodies (issue 22) ------------------------------------------------------------------


def test_deeply_nested_json_is_a_400_not_a_500(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    capture = start_live_calls(store, 1, 4)
    deep = b"[" * 1000 + b"]" * 1000
    nested_field = b'{"checkpoint_id": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with client_for(store, capture) as client, writes_nothing(store):
        for body in (deep, nested_field, b'{"a":' * 3000 + b"1" + b"}" * 3000):
            detail = _refused(client.post(CUT, content=body, headers=AUTH), 400, "malformed_json")["detail"]
            assert "nested too deeply" in detail
        _refused(client.post(f"{LEDGER}/retire", content=deep, headers=AUTH), 400, "malformed_json")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a refusal logs no traceback"
    capture.close()


def test_post_routes_refuse_a_body_that_is_not_declared_json(store: Store) -> None:
    capture = start_live_calls(store, 1, 4)
    body = to_json(inventory(1))
    bearer = {"Authorization": AUTH["Authorization"]}
    with client_for(store, capture) as client, writes_nothing(store):
        for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx", "json"):
            headers = bearer if content_type is None else {**bearer, "Content-Type": content_type}
            _refused(client.post(CUT, content=body, headers=headers), 415, "unsupported_media_type")
            ids = b'{"rollout_ids": ["h0"]}'
            _refused(client.post(f"{LEDGER}/retire", content=ids, headers=headers), 415, "unsupported_media_type")
        # The token is checked first: a stranger learns nothing about the routes' bodies.
        _refused(client.post(CUT, content=body, headers={"Content-Type": "text/plain"}), 401, "unauthorized")
    with client_for(store, capture) as client:
        charset = {**bearer, "Content-Type": "Application/JSON; charset=utf-8"}
        assert client.post(CUT, content=body, headers=charset).status_code == 200
    capture.close()


def test_an_inventory_naming_more_calls_than_the_cap_is_413_and_writes_nothing(store: Store) -> None:
    capture = start_live_calls(store, 4, 4)
    with client_for(store, capture, max_cut_prefixes=3) as client:
        with writes_nothing(store):
            body = _refused(client.post(CUT, content=to_json(inventory(4)), headers=AUTH), 413, "too_many_prefixes")
            assert "4 calls" in body["detail"] and "at most 3" in body["detail"]
        assert client.post(CUT, content=to_json(inventory(3)), headers=AUTH).status_code == 200
    capture.close()
    assert DEFAULT_MAX_CUT_PREFIXES == 4096


def test_control_app_publishes_its_openapi_document(store: Store) -> None:
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    with TestClient(control_app(capture, store, TOKEN)) as client:
        response = client.get("/openapi.json")  # no token: the document describes routes, it holds no data
    assert response.status_code == 200
    document = response.json()
    assert set(document["paths"]) == {CUT, f"{LEDGER}/{{rollout_id}}/manifest", f"{LEDGER}/retire", f"{LEDGER}/delete"}
    cut = document["paths"][CUT]["post"]
    schema = cut["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["checkpoint_id", "server_name", "active_prefixes", "inventory_digest"]
    assert schema["properties"]["active_prefixes"]["items"]["required"][0] == "ticket_id"  # inlined, no $ref
    assert "$ref" not in json.dumps(document)
    assert {"200", "401", "413", "415", "422"} <= set(cut["responses"])
    receipt = cut["responses"]["200"]["content"]["application/json"]["schema"]
    assert "prefixes" in receipt["properties"]
    retire = document["paths"][f"{LEDGER}/retire"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert retire["required"] == ["rollout_ids"] and retire["additionalProperties"] is False

"""``ControlClient`` (wire-contract 6.5): validation and dedupe before sending, batches of 4,096,
concatenated removals, and the checks of each answer; against the real routes and a fake worker."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from http_helpers import TOKEN, inventory, start_live_calls  # noqa: E402
from test_ledger import Conversation  # noqa: E402

from store import (  # noqa: E402
    ConfigurationError,
    ControlClient,
    ControlRequestError,
    InvalidRecordError,
    RolloutFencedError,
    RolloutManifest,
    RolloutRemoval,
    RolloutTokenCapture,
    Store,
    StoreError,
    control_router,
    to_json,
)


def _client(store: Store, capture: RolloutTokenCapture | None = None, **options: Any) -> ControlClient:
    capture = capture or RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    app = FastAPI()
    app.include_router(control_router(capture, store, TOKEN, **options))
    return ControlClient("http://worker/v1/", TOKEN, http_client=TestClient(app, raise_server_exceptions=False))


def test_client_retires_and_deletes_in_batches_of_4096_and_concatenates(store: Store) -> None:
    for rollout in ("r0", "r1"):
        Conversation(store, rollout).commit("c0")
    requests: list[int] = []
    client = _client(store, checkpoint_open=lambda: requests.append(1) is not None)  # counts removal requests
    ids = ["r0", *[f"x{i}" for i in range(5000)], "r1", "r0", "x7"]  # duplicates are dropped, first kept
    removal = client.retire(ids)
    assert len(requests) == 2  # 5,002 distinct ids: 4,096 + 906
    assert removal.removed == ["r0", "r1"]
    assert removal.absent == [f"x{i}" for i in range(5000)]
    with pytest.raises(RolloutFencedError):
        client.manifest("r1")
    deleted = client.delete(["r1"])
    assert deleted.removed == ["r1"] and deleted.absent == []
    assert client.manifest("r1") == RolloutManifest(rollout_id="r1")


def test_client_reads_manifests_and_cuts(store: Store) -> None:
    conversation = Conversation(store, "r0")
    conversation.commit("c0")
    capture = start_live_calls(store, 2, 3)
    client = _client(store, capture)
    assert client.manifest("r0") == conversation.ledger.manifest("r0")
    sent = inventory(2)
    receipt = client.generation_cut(sent)
    assert [ack.prefix_token_count for ack in receipt.prefixes] == [3, 3]
    assert client.generation_cut(sent) == receipt
    capture.close()


def test_client_surfaces_route_errors(store: Store) -> None:
    Conversation(store, "r0").commit("c0")
    client = _client(store, checkpoint_open=lambda: True)
    with pytest.raises(ControlRequestError) as raised:
        client.retire(["r0"])
    assert (raised.value.status, raised.value.code) == (409, "checkpoint_open")
    bad = ControlClient("http://worker", "wrong", http_client=client._http)
    with pytest.raises(ControlRequestError) as raised:
        bad.manifest("r0")
    assert raised.value.status == 401


class FakeWorker:
    """A worker that answers with whatever the test sets, recording each request."""

    def __init__(self, answer: Any, status: int = 200) -> None:
        self.answer, self.status = answer, status
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        body = self.answer if isinstance(self.answer, bytes) else json.dumps(self.answer).encode()
        return httpx.Response(self.status, content=body)

    def client(self) -> ControlClient:
        return ControlClient("http://w:1/v1", TOKEN, http_client=httpx.Client(transport=httpx.MockTransport(self)))


@pytest.mark.parametrize(
    "ids",
    [[], "r0", ["r0", ""], ["r0", 7], None, [["r0"]]],
)
def test_client_validates_ids_before_sending_anything(ids: Any) -> None:
    worker = FakeWorker({"removed": [], "absent": []})
    with pytest.raises(InvalidRecordError):
        worker.client().retire(ids)
    assert worker.requests == []


def test_client_sends_the_token_and_the_routes_paths() -> None:
    worker = FakeWorker(json.loads(to_json(RolloutRemoval(removed=["a"]))))
    worker.client().delete(["a", "a"])
    (request,) = worker.requests
    assert request.url == "http://w:1/training-token-capture/control/rollouts/delete"
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert json.loads(request.content) == {"rollout_ids": ["a"]}


def test_client_checks_the_manifest_rollout_id() -> None:
    worker = FakeWorker(json.loads(to_json(RolloutManifest(rollout_id="other"))))
    with pytest.raises(ControlRequestError, match="wrong_manifest"):
        worker.client().manifest("r0")


def test_client_refuses_a_removal_naming_ids_it_did_not_send() -> None:
    worker = FakeWorker({"removed": ["zzz"], "absent": []})
    with pytest.raises(ControlRequestError, match="wrong_removal"):
        worker.client().retire(["a"])


def test_client_validates_the_receipt_against_its_inventory(store: Store) -> None:
    capture = start_live_calls(store, 1, 2)
    other = _client(store, capture).generation_cut(inventory(1, "checkpoint-other"))
    capture.close()
    worker = FakeWorker(json.loads(to_json(other)))
    with pytest.raises(StoreError):
        worker.client().generation_cut(inventory(1))


@pytest.mark.parametrize("answer", [b"not json", b"{}", b'{"records": 5}'])
def test_client_refuses_an_answer_that_is_not_the_record(answer: bytes) -> None:
    with pytest.raises(ControlRequestError, match="invalid_answer"):
        FakeWorker(answer).client().manifest("r0")


def test_client_reports_an_unreachable_worker() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = ControlClient("http://w:1", TOKEN, http_client=httpx.Client(transport=httpx.MockTransport(refuse)))
    with pytest.raises(ControlRequestError) as raised:
        client.manifest("r0")
    assert (raised.value.status, raised.value.code) == (0, "unreachable")


@pytest.mark.parametrize("token", ["tökén-0123456789abcdef", "s3cret token", "tab\there", "line\nbreak"])
def test_client_refuses_a_token_no_header_can_carry_before_sending(token: str) -> None:
    sent: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(200))
    with pytest.raises(ConfigurationError, match="visible ASCII"):
        ControlClient("http://w:1", token, http_client=httpx.Client(transport=transport))
    assert sent == []

"""NeMo Gym 0.7.0's own code against the store (issue 32, items 1 and 2): Gym's
``RolloutTokenCapture`` stages into the store as it is, Gym's verifier takes what the store
fetches, and Gym's models (and its control client) accept what the store writes.

Skipped where Gym's token-capture package is not importable (``make real-clients`` installs it).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from store import (
    AttachmentsUnsupportedError,
    CallRecord,
    CaptureAdmission,
    CaptureLedgerCommit,
    GenerationCutContinuation,
    InvalidRecordError,
    RolloutManifest,
    StagedCallRecord,
    Store,
    compute_chain_hash,
    from_json,
    hash_token_ids,
    receipt_from_manifest,
    to_json,
    to_msgpack,
)

gym_staging = pytest.importorskip(
    "nemo_gym.token_id_capture.staging", reason="NeMo Gym 0.7.0 is not installed (make real-clients)"
)
gym_records = pytest.importorskip("nemo_gym.token_id_capture.staging.records", reason="NeMo Gym 0.7.0 is not installed")

H = "ab" * 32


def _capture(store: Store, version: int = 3) -> Any:
    return gym_staging.RolloutTokenCapture(sink=store, weight_version_fn=lambda: version)


def _stage_chain(store: Store, rollout: str = "r1") -> tuple[Any, Any]:
    """Two calls through Gym's capture: a text root, then a token_in child continuing it."""
    capture = _capture(store)
    root = capture.begin_call(gym_staging.CaptureAdmission(rollout_id=rollout, model_call_id="c1", mode="text"))
    first = capture.complete_call(
        root, prompt_token_ids=[1, 2, 3], generated_token_ids=[4, 5], generated_logprobs=[-0.1, -0.25]
    )
    prefix = [1, 2, 3, 4, 5]
    admission = gym_staging.CaptureAdmission(
        rollout_id=rollout,
        model_call_id="c2",
        parent_call_id="c1",
        prev_len=5,
        mode="token_in",
        required_prefix_token_ids=prefix,
        parent_chain_hash=first.chain_hash,
    )
    child = capture.begin_call(admission)
    second = capture.complete_call(
        child,
        prompt_token_ids=[*prefix, 6, 7],
        generated_token_ids=[8],
        generated_logprobs=[-0.5],
        extras={"routed_experts": "nrlre1:int8:1x1x1:AA=="},
    )
    return first, second


def _gym_row(coords: Any, mode: str, response_id: str) -> Any:
    return gym_records.CallRecord(
        model_call_id=coords.model_call_id,
        parent_call_id=coords.parent_call_id,
        prev_len=coords.prev_len,
        delta_len=coords.delta_len,
        cum_len=coords.cum_len,
        weight_version=coords.weight_version,
        digest=coords.digest,
        extras_digest=coords.extras_digest,
        staging_key=coords.staging_key,
        mode=mode,
        chain_hash=coords.chain_hash,
        cumulative_hash=coords.cumulative_hash,
        response_id=response_id,
    )


# --- item 1: the store as Gym's sink and source -------------------------------------------


def test_gym_capture_stages_every_call_into_the_store(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    assert isinstance(store, gym_staging.StagingSink)
    assert isinstance(store, gym_staging.StagingSource)
    with caplog.at_level(logging.WARNING):
        first, second = _stage_chain(store)
    assert [first.disposition, second.disposition] == ["staged", "staged"], caplog.text
    assert not caplog.records  # no capture_failed log line
    assert [first.staging_key, second.staging_key] == ["r1/c1", "r1/c2"]
    own = store.fetch([first.staging_key, second.staging_key])
    assert [snapshot.digest for snapshot in own] == [first.digest, second.digest]
    assert own[1].extras == {"routed_experts": "nrlre1:int8:1x1x1:AA=="}


def test_stage_answers_a_gym_record_with_gyms_stage_result(store: Store) -> None:
    record = _gym_record()
    result = store.stage(record)
    assert type(result) is gym_records.StageResult
    assert (result.ok, result.staging_key, result.error) == (True, "r9/c1", None)
    assert type(store.stage(record)) is gym_records.StageResult  # identical again: ok, nothing written
    different = _gym_record(logprob=-0.75)
    refused: Any = store.stage(different)
    assert type(refused) is gym_records.StageResult
    assert refused.ok is False and "different" in (refused.error or "")
    [snapshot] = store.fetch(["r9/c1"])
    assert snapshot.digest == record.digest


def test_a_bad_gym_record_is_refused_with_the_stores_error_and_nothing_written(store: Store) -> None:
    record = _gym_record().model_copy(update={"digest": "0" * 64})  # model_copy skips Gym's validation
    with pytest.raises(InvalidRecordError, match="digest"):
        store.stage(record)
    with pytest.raises(InvalidRecordError, match="takes a StagedCallRecord"):
        store.stage(object())  # type: ignore[arg-type]
    assert store.staged_keys() == []


def test_stage_all_names_a_gym_record_it_does_not_take(store: Store) -> None:
    from store import StageEntry

    with pytest.raises(InvalidRecordError, match=r"holds the store's StagedCallRecord, got nemo_gym\."):
        store.stage_all([StageEntry(_gym_record())])
    assert store.staged_keys() == []


def test_attachments_are_refused_never_dropped(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(AttachmentsUnsupportedError, match="holds no attachments"):
        store.stage(_gym_record(), attachments={"pixel_values": b"\x00"})
    with pytest.raises(InvalidRecordError, match="attachments must be a mapping"):
        store.stage(_gym_record(), attachments=[("a", 1)])  # type: ignore[arg-type]
    assert store.staged_keys() == []
    # None or empty: staged as without (Gym passes the keyword only when the caller gave a mapping).
    assert store.stage(_gym_record(), attachments={}).ok
    capture = _capture(store)
    call = capture.begin_call(gym_staging.CaptureAdmission(rollout_id="r2", model_call_id="c1", mode="text"))
    with caplog.at_level(logging.WARNING):
        coords = capture.complete_call(
            call, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5], attachments={"a": 1}
        )
    assert coords.disposition == "capture_failed"  # Gym's rule: a sink that cannot hold them rejects the call
    assert "holds no attachments" in caplog.text
    assert store.staged_keys("r2") == []


@pytest.mark.parametrize("base", [False, True])
def test_gyms_verifier_accepts_what_the_store_fetches(store: Store, base: bool) -> None:
    first, second = _stage_chain(store)
    keys = [first.staging_key, second.staging_key]
    with pytest.raises(TypeError, match="StagedCallBaseSnapshot"):  # the store's own snapshots: Gym refuses
        gym_staging.verify_and_linearize(_receipt(first, second), store.fetch(keys))
    model = gym_records.StagedCallBaseSnapshot if base else gym_records.StagedCallSnapshot
    snapshots = store.fetch(keys, snapshot_type=model)
    assert [type(snapshot) for snapshot in snapshots] == [model, model]
    if not base:
        assert snapshots[1].extras == {"routed_experts": "nrlre1:int8:1x1x1:AA=="}
    row = gym_staging.verify_and_linearize(_receipt(first, second), snapshots)
    assert row.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row.model_call_ids == ["c1", "c2"]


def test_fetch_refuses_a_snapshot_type_that_is_not_a_model(store: Store) -> None:
    first, _ = _stage_chain(store)
    for bad in (dict, StagedCallRecord, "StagedCallSnapshot"):
        with pytest.raises(InvalidRecordError, match="snapshot_type must be a pydantic model class"):
            store.fetch([first.staging_key], snapshot_type=bad)


def test_a_schema_3_record_is_one_gym_cannot_express(store: Store) -> None:
    """Generation cuts stage schema-3 records; Gym 0.7.0's models know schema 2 only, so such a
    record (a cut rollout's chunks and continuations) is refused by Gym's class, in the store's words."""
    ids = [1, 2, 3]
    record = StagedCallRecord.from_components(
        rollout_id="cut",
        model_call_id="c1",
        parent_call_id=None,
        mode="text",
        prev_len=0,
        weight_version=1,
        token_ids_delta=ids,
        token_mask_delta=[0.0, 1.0, 1.0],
        generation_log_probs_delta=[0.0, -0.5, -0.5],
        chain_hash=compute_chain_hash(None, ids),
        cumulative_hash=hash_token_ids(ids),
        schema_version=3,
    )
    assert store.stage(record).ok
    with pytest.raises(InvalidRecordError, match="StagedCallSnapshot refuses the store's StagedCallSnapshot"):
        store.fetch(["cut/c1"], snapshot_type=gym_records.StagedCallSnapshot)
    [own] = store.fetch(["cut/c1"])
    assert own.schema_version == 3


def _gym_record(logprob: float = -0.5) -> Any:
    ids = [7, 8]
    fields = {
        "rollout_id": "r9",
        "model_call_id": "c1",
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": 2,
        "cum_len": 2,
        "weight_version": 1,
        "token_ids_delta": ids,
        "token_mask_delta": [0.0, 1.0],
        "generation_log_probs_delta": [0.0, logprob],
        "extras_digest": gym_staging.compute_extras_digest(None),
        "chain_hash": gym_staging.compute_chain_hash(None, ids),
        "cumulative_hash": gym_staging.hash_token_ids(ids),
    }
    digest = gym_staging.compute_staging_digest(schema_version=2, digest_version=2, extras_digest_version=1, **fields)
    return gym_records.StagedCallRecord(digest=digest, **fields)


def _receipt(first: Any, second: Any) -> Any:
    return gym_records.RolloutReceipt(
        rollout_id="r1",
        terminal_model_call_id="c2",
        manifest=[_gym_row(first, "text", "resp-1"), _gym_row(second, "token_in", "resp-2")],
        terminal_selection="heuristic",
    )


# --- item 2: what the store writes, Gym's models accept --------------------------------------


def _row(call: str = "c1", **fields: Any) -> CallRecord:
    base: dict[str, Any] = {
        "model_call_id": call,
        "prev_len": 0,
        "delta_len": 2,
        "cum_len": 2,
        "weight_version": 1,
        "digest": H,
        "extras_digest": H,
        "staging_key": f"r/{call}",
        "mode": "text",
        "chain_hash": H,
        "cumulative_hash": H,
        "response_id": f"resp-{call}",
    }
    return CallRecord(**{**base, **fields})


def test_gyms_models_accept_admissions_rows_manifests_receipts_and_commits() -> None:
    row = _row(admitted_at=1.5, output_fingerprint=H, fingerprint_version=2)
    assert b"capture_key" not in to_json(row)
    # Byte-identical to what Gym's own model writes for the same row.
    assert gym_records.CallRecord.model_validate_json(to_json(row)).model_dump_json().encode() == to_json(row)
    manifest = RolloutManifest(rollout_id="r", records=[row])
    assert gym_records.RolloutManifest.model_validate_json(to_json(manifest)).model_dump_json().encode() == to_json(
        manifest
    )
    gym_records.RolloutReceipt.model_validate_json(to_json(receipt_from_manifest(manifest, reward=1.0)))
    admission = CaptureAdmission(rollout_id="r", model_call_id="c", mode="text")
    assert b"generation_cut" not in to_json(admission)
    gym_records.CaptureAdmission.model_validate_json(to_json(admission))
    commit = CaptureLedgerCommit(rollout_id="r", record=row, staging_chain=("r/c1",), request_items=[{"a": 1}])
    assert b"parent_manifest" not in to_json(commit)
    gym_records.CaptureLedgerCommit.model_validate_json(to_json(commit))
    # The leaner JSON and msgpack still decode to the same records.
    for record in (row, manifest, admission, commit):
        assert from_json(to_json(record), type(record)) == record
        assert msgspec.msgpack.decode(to_msgpack(record)) == msgspec.json.decode(to_json(record))


def test_extension_fields_are_written_where_they_carry_something() -> None:
    row = _row(capture_key="r#1")
    assert b'"capture_key":"r#1"' in to_json(row)
    assert from_json(to_json(row), CallRecord).capture_key == "r#1"
    cut = GenerationCutContinuation(
        schema_version=3,
        source_capture_key="r",
        source_model_call_id="c",
        staging_keys=("k",),
        generation_token_count=1,
        digest=H,
        effective_output_limit=8,
    )
    admission = CaptureAdmission(schema_version=3, rollout_id="r#1", model_call_id="c", mode="text", generation_cut=cut)
    assert from_json(to_json(admission), CaptureAdmission).generation_cut == cut
    with pytest.raises(ValueError):  # a schema-3 admission is not Gym 0.7.0's to read
        gym_records.CaptureAdmission.model_validate_json(to_json(admission))
    manifest = RolloutManifest(rollout_id="r", records=[row, _row("c2")])
    raw = to_json(manifest)
    assert raw.count(b"capture_key") == 1
    assert from_json(raw, RolloutManifest) == manifest


def test_ledger_manifest_and_receipt_validate_under_gym(store: Store) -> None:
    first, second = _stage_chain(store, "led")
    ledger = store.ledger()
    for coords, mode, parent_chain in ((first, "text", ()), (second, "token_in", ("led/c1",))):
        record = from_json(
            gym_records.CallRecord.model_dump_json(_gym_row(coords, mode, f"resp-{coords.model_call_id}")), CallRecord
        )
        ledger.record(
            CaptureLedgerCommit(
                rollout_id="led",
                record=record,
                staging_chain=(*parent_chain, coords.staging_key),
                request_items=[{"role": "user", "content": "hi"}],
                response_items=[{"role": "assistant", "content": "yo"}],
            )
        )
    manifest = ledger.manifest("led")
    gym_manifest = gym_records.RolloutManifest.model_validate_json(to_json(manifest))
    receipt = gym_records.RolloutReceipt.model_validate_json(to_json(receipt_from_manifest(manifest)))
    keys = [row.staging_key for row in gym_manifest.records]
    row = gym_staging.verify_and_linearize(receipt, store.fetch(keys, snapshot_type=gym_records.StagedCallSnapshot))
    assert row.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_commit_recorded_with_capture_key_null_is_the_same_commit(store: Store) -> None:
    """A ledger written before the lean JSON holds ``"capture_key":null``; recording the same
    commit again is still a no-op, not a conflict."""
    from store.append.new_event import NewEvent
    from store.log.events import EventKind, LedgerRecordBody
    from store.projections.fold import LEDGER_PREFIX

    commit = CaptureLedgerCommit(rollout_id="old", record=_row(), staging_chain=("r/c1",))
    old_bytes = msgspec.json.encode(msgspec.structs.asdict(commit) | {"record": msgspec.structs.asdict(commit.record)})
    assert b'"capture_key":null' in old_bytes
    body = LedgerRecordBody(commit=old_bytes, fingerprint=None)
    store._write(lambda tx: tx.append(NewEvent(EventKind.LEDGER_RECORDED, "old", LEDGER_PREFIX + "c1", body)))
    store.ledger().record(commit)  # no LedgerConflictError
    assert store.ledger().manifest("old").records == [commit.record]


# --- Gym's control client over the store's manifest route ------------------------------------


@pytest.fixture
def gym_control_client(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Gym's ``RolloutControlClient`` against the store's routes in-process.

    Gym's client sends through ``nemo_gym.server_utils.request`` (aiohttp), a module that needs
    Ray to import; it is stood in by a ``request`` that answers from FastAPI's TestClient, so
    the URL, the header, the status check and the model validation are Gym's own.
    """
    control_routes = pytest.importorskip("nemo_gym.token_id_capture.control_routes")
    testclient = pytest.importorskip("fastapi.testclient")
    from store import RolloutTokenCapture, control_app

    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 1)
    token = "gym-control-token-0123456789"
    client = testclient.TestClient(control_app(capture, store, token), raise_server_exceptions=False)

    class _Answer:
        def __init__(self, status: int, body: bytes) -> None:
            self.status = status
            self._body = body

        async def text(self) -> str:
            return self._body.decode()

        async def json(self) -> Any:
            return msgspec.json.decode(self._body)

    async def request(method: str, url: str, **kwargs: Any) -> _Answer:
        answer = client.request(method, url.removeprefix("http://store"), headers=kwargs.get("headers"))
        return _Answer(answer.status_code, answer.content)

    monkeypatch.setitem(sys.modules, "nemo_gym.server_utils", types.SimpleNamespace(request=request))
    with client:
        yield control_routes.RolloutControlClient("http://store", auth_token=token, request_timeout_s=5.0)
    capture.close()


def test_gyms_control_client_reads_the_manifest_route(store: Store, gym_control_client: Any) -> None:
    first, second = _stage_chain(store, "route")
    ledger = store.ledger()
    for coords, mode, chain in ((first, "text", ("route/c1",)), (second, "token_in", ("route/c1", "route/c2"))):
        row = from_json(
            gym_records.CallRecord.model_dump_json(_gym_row(coords, mode, f"id-{coords.model_call_id}")), CallRecord
        )
        ledger.record(CaptureLedgerCommit(rollout_id="route", record=row, staging_chain=chain))
    ledger.record_failure("route", "c3", "worker_capture_failed")
    manifest = asyncio.run(gym_control_client.manifest("route"))
    assert type(manifest) is gym_records.RolloutManifest
    assert [row.model_call_id for row in manifest.records] == ["c1", "c2"]
    assert [(failure.model_call_id, failure.reason) for failure in manifest.failures] == [
        ("c3", "worker_capture_failed")
    ]
    ledger.retire(["route"])
    with pytest.raises(RuntimeError, match="HTTP 410"):  # Gym's client refuses every non-200 alike
        asyncio.run(gym_control_client.manifest("route"))


def test_gyms_control_client_is_refused_without_the_right_token(store: Store, gym_control_client: Any) -> None:
    gym_control_client._headers["Authorization"] = "Bearer not-the-token-0123456789"
    with pytest.raises(RuntimeError, match="HTTP 401"):
        asyncio.run(gym_control_client.manifest("route"))


# --- item 6: the smaller items -----------------------------------------------------------------


def _deep(depth: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return {"deep": value}


@pytest.mark.parametrize("depth", [40, 255])
def test_every_record_gym_can_write_is_storable(store: Store, depth: int) -> None:
    """Extras as deep as Gym's own JSON writer goes (255: pydantic refuses deeper) are staged
    through Gym's capture, fetched equal, and read back by Gym's class."""
    capture = _capture(store)
    call = capture.begin_call(gym_staging.CaptureAdmission(rollout_id="deep", model_call_id="c1", mode="text"))
    coords = capture.complete_call(
        call, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5], extras=_deep(depth)
    )
    assert coords.disposition == "staged"
    [snapshot] = store.fetch([coords.staging_key])
    assert snapshot.extras == _deep(depth)
    [gym_snapshot] = store.fetch([coords.staging_key], snapshot_type=gym_records.StagedCallSnapshot)
    assert gym_snapshot.extras == _deep(depth)


def test_extras_deeper_than_gym_can_write_are_refused_bounded(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    from pydantic_core import PydanticSerializationError

    from store import EXTRAS_MAX_DEPTH

    assert EXTRAS_MAX_DEPTH == 255
    capture = _capture(store)
    call = capture.begin_call(gym_staging.CaptureAdmission(rollout_id="deeper", model_call_id="c1", mode="text"))
    sink_saw: list[Any] = []

    class Spy:
        def stage(self, record: Any, *, attachments: Any = None) -> Any:
            sink_saw.append(record)
            return store.stage(record)

    capture = gym_staging.RolloutTokenCapture(sink=Spy(), weight_version_fn=lambda: 1)
    call = capture.begin_call(gym_staging.CaptureAdmission(rollout_id="deeper", model_call_id="c1", mode="text"))
    with caplog.at_level(logging.WARNING):
        coords = capture.complete_call(
            call, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5], extras=_deep(256)
        )
    assert coords.disposition == "capture_failed" and "EXTRAS_MAX_DEPTH" in caplog.text
    with pytest.raises(PydanticSerializationError):  # Gym cannot write this record out either
        sink_saw[0].model_dump_json()
    assert store.staged_keys() == []


def test_log_probs_come_back_as_the_float32_values_the_digest_commits_to(store: Store) -> None:
    """Documented (docs/reference.md): the digest packs log-probs as float32, so the store keeps and
    returns the float32 values; Gym's verifier accepts them and the digest is the staged one."""
    import struct

    first, second = _stage_chain(store)
    [snapshot] = store.fetch([first.staging_key])
    staged = [0.0, 0.0, 0.0, -0.1, -0.25]
    assert list(snapshot.generation_log_probs_delta) == [struct.unpack(">f", struct.pack(">f", v))[0] for v in staged]
    assert snapshot.generation_log_probs_delta[3] == -0.10000000149011612 != -0.1
    assert snapshot.digest == first.digest
    snapshots = store.fetch([first.staging_key, second.staging_key], snapshot_type=gym_records.StagedCallSnapshot)
    assert gym_staging.verify_and_linearize(_receipt(first, second), snapshots).logprobs[3] == -0.10000000149011612


def test_gyms_install_capture_takes_the_store_as_its_sink(store: Store) -> None:
    """``install_capture`` and ``CaptureHost`` are Gym's serving-layer wiring; the store does not
    repeat them: Gym's own take the store as the sink."""
    host = gym_staging.CaptureHost()
    capture = gym_staging.install_capture(host, sink=store, weight_version_fn=lambda: 5)
    assert host.token_capture is capture
    call = capture.begin_call(gym_staging.CaptureAdmission(rollout_id="host", model_call_id="c1", mode="text"))
    coords = capture.complete_call(call, prompt_token_ids=[1], generated_token_ids=[2], generated_logprobs=[-0.5])
    assert coords.disposition == "staged" and store.fetch([coords.staging_key])[0].weight_version == 5


def test_the_stores_digests_meet_gyms_golden_vectors() -> None:
    """Gym's ``load_golden_vectors`` / ``assert_golden_vectors`` check Gym's own functions; the
    store does not repeat them, and its functions give Gym's expected digests."""
    from store import compute_extras_digest, compute_staging_digest

    vectors = gym_staging.load_golden_vectors()
    assert compute_extras_digest(vectors["extras"]) == vectors["extras_digest"]
    assert compute_staging_digest(**vectors["staged_call"]) == vectors["staged_call_digest"]


def test_the_gym_names_the_store_offers_are_gyms() -> None:
    import store

    assert store.STAGING_DIGEST_VERSION == gym_staging.STAGING_DIGEST_VERSION
    assert store.EXTRAS_DIGEST_VERSION == gym_staging.EXTRAS_DIGEST_VERSION
    assert store.staging_key("r", "c") == gym_staging.staging_key("r", "c") == "r/c"
    for empty in (("", "c"), ("r", "")):
        with pytest.raises(ValueError):
            store.staging_key(*empty)
    assert set(store.CaptureMode.__args__) == set(gym_records.CaptureMode.__args__)
    assert set(store.CaptureDisposition.__args__) == set(gym_records.CaptureDisposition.__args__)
    for ids in ([], [0], [1, 2, 3], [2**64 - 1, 5]):
        assert store.encode_token_ids(ids) == gym_staging.encode_token_ids(ids)


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
def test_gyms_routing_helpers_read_the_stores_envelopes(dtype: str) -> None:
    """``routed_experts_token_count`` and friends are Gym's; they read the store's envelopes."""
    from store import decode_routed_experts, encode_routed_experts

    table = [[[layer * 3 + k for k in range(2)] for layer in range(4)] for _ in range(5)]
    envelope = encode_routed_experts(table, dtype)
    assert envelope == gym_staging.encode_routed_experts(table, dtype=dtype)
    assert gym_staging.routed_experts_token_count(envelope) == 5
    assert gym_staging.decode_routed_experts(envelope).values == table
    assert decode_routed_experts(gym_staging.encode_routed_experts(table, dtype=dtype)) == decode_routed_experts(
        envelope
    )

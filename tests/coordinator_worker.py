"""A policy worker process for the coordinator tests (not a test module).

``serve`` runs in a process of its own (multiprocessing, forkserver: a fresh process, not a
fork of the test).  It registers with the coordinator (sending ``{"ready": <pid>, "index": n}``),
then answers one command per message on its pipe with
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": {"code", "status", "detail"}}``.
Commands: ``begin`` (capture_key, model_call_id[, staging_key]), ``deliver`` (capture_key,
model_call_id), ``return_cut``, ``report``, ``control`` (action, ...), ``state``, ``stop``,
and with ``--store``: ``stage`` (rollout_id, model_call_id) and ``admit`` (rollout_id, model_call_id).
A lost coordinator SIGTERMs the process, as a real worker does.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for factories

from store.coordinator import CoordinatorError, WorkerClient


def serve(conn: Connection, socket_path: str, store_url: str | None) -> None:
    """The worker's life: register, then answer the test's commands until ``stop``."""
    store = None
    if store_url:
        from store import open_store

        store = open_store(store_url)
    try:
        client = WorkerClient.connect(socket_path, message_timeout=10.0)
    except CoordinatorError as exc:
        conn.send({"ok": False, "error": exc.wire()})
        return
    conn.send({"ready": os.getpid(), "index": client.index})
    calls: dict[tuple[str, str], Any] = {}
    while True:
        try:
            command = conn.recv()
        except EOFError:
            break
        op = command["op"]
        try:
            reply: dict[str, Any] = {"ok": True, "result": run(client, store, calls, command)}
        except CoordinatorError as exc:
            reply = {"ok": False, "error": exc.wire()}
        conn.send(reply)
        if op == "stop":
            break
    if store is not None:
        store.close()


def run(client: WorkerClient, store: Any, calls: dict[tuple[str, str], Any], command: dict[str, Any]) -> Any:
    op = command.pop("op")
    if op == "begin":
        call = client.begin_call(
            command["capture_key"], command["model_call_id"], staging_key=command.get("staging_key")
        )
        calls[(call.capture_key, call.model_call_id)] = call
        return {"continuation": call.continuation}
    if op == "deliver":
        client.deliver(calls[(command["capture_key"], command["model_call_id"])])
        return None
    if op == "return_cut":
        return client.return_cut(calls[(command["capture_key"], command["model_call_id"])])
    if op == "report":
        return client.report()
    if op == "control":
        return client.control(command.pop("action"), **command)
    if op == "state":
        return {
            "accepting": client.accepting,
            "generation": client.generation,
            "checkpoint": client.checkpoint,
            "retired": sorted(client.retired),
            "restored_pending": sorted(client.restored_pending),
            "restored_targets": sorted(client.restored_targets),
        }
    if op == "stop":
        return client.stop()
    if op == "stage":
        from factories import make_record

        record = make_record(rollout_id=command["rollout_id"], model_call_id=command["model_call_id"])
        return store.stage(record).staging_key
    if op == "admit":
        from store.log.events import AdmissionBody

        body = AdmissionBody(
            schema_version=2, parent_call_id=None, mode="text", prev_len=0, parent_chain_hash=None, weight_version=7
        )
        return store.record_admission(command["rollout_id"], command["model_call_id"], body)
    raise ValueError(f"unknown op {op!r}")

"""``TokenTransport``: Gym's complete-record transport (``TokenSink``, ``TokenSource``,
``LineageResolver``) on the store's event log.

Every call is one write transaction of the log (group commit shared with staging): a put is a
``tokens_put`` event, durable and visible to every process on the store when ``put`` returns;
``begin_call``, ``mark_incomplete``, ``freeze`` and ``drop`` are events too, on the rollout's
transport stream, so the rollout's version, its frozen snapshot and its incomplete mark are
projections (``token_rollouts``, ``token_entries``) that ``replay`` rebuilds and ``audit``
checks.  Because each write runs in the store's transaction, the fences are strict: a put after
the freeze is refused (``RolloutFrozenError``), and a conditional drop compares the snapshot id
and version in the same transaction that retires it.

The ``*_now`` methods are the synchronous API; the coroutines Gym awaits run them in a thread.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from store import arguments
from store.append import token_rules
from store.append.new_event import NewEvent
from store.append.transaction import WriteTransaction
from store.errors import InvalidRecordError
from store.lifecycle import operation
from store.log import schema
from store.log.engine import Statement
from store.log.events import EventKind, TokenCallBody, TokenDroppedBody, TokenFrozenBody, TokenPutBody
from store.projections.tokens import TOKEN_STREAM, TokenRolloutState
from store.queries.integrity import verified_event
from store.store import Store, open_store
from store.transport import gym
from store.transport.entries import encode_entry, token_digest
from store.transport.lineage import Candidate, pick_parent

_EVENT_COLUMNS = tuple(column.name for column in schema.events.c)


class TokenTransport:
    """Gym's ``TokenSink``, ``TokenSource`` and ``LineageResolver`` over one store.

    ``TokenTransport(store)`` uses an open store (closing the transport leaves it open);
    ``TokenTransport.open(url_or_path, **open_store_options)`` opens a store of its own, which
    ``close`` closes.  Thread-safe; each process (each Gym worker) opens its own.
    """

    def __init__(self, store: Store, *, owns_store: bool = False) -> None:
        if not isinstance(store, Store):
            raise InvalidRecordError(f"TokenTransport takes a Store, got {type(store).__name__}")
        self._store = store
        self._owns_store = owns_store
        # The store's internals the transport writes and reads through (as its capture ledger does):
        # its log's group commit, its engine for reads, its lifecycle gate (close and fork wait).
        self._log = store._log
        self._engine = store._engine
        self._calls = store._calls
        self._check_process = store._check_process
        events, entries, rollouts = schema.events, schema.token_entries, schema.token_rollouts
        rollout_id: sa.BindParameter[str] = sa.bindparam("rollout_id")
        self._entry_events_query = (
            sa.select(*events.c)
            .select_from(entries.join(events, events.c.seq == entries.c.event_seq))
            .where(entries.c.rollout_id == rollout_id)
            .order_by(entries.c.event_seq)
        )
        self._entry_events = Statement(self._entry_events_query, self._engine)
        self._candidates = (
            sa.select(
                entries.c.model_call_id,
                entries.c.event_seq,
                entries.c.token_digest,
                entries.c.cum_len,
                entries.c.parent_call_id,
                entries.c.prompt_is_delta,
                entries.c.fingerprint_version,
                entries.c.context_len,
                entries.c.context_digest,
            )
            .select_from(entries.join(rollouts, rollouts.c.rollout_id == entries.c.rollout_id))
            .where(entries.c.rollout_id == rollout_id, entries.c.fingerprint == sa.bindparam("fingerprint"))
            .where(rollouts.c.dropped == 0)
        )
        self._entry_of_call = (
            sa.select(*events.c, entries.c.prompt_is_delta, entries.c.parent_call_id)
            .select_from(entries.join(events, events.c.seq == entries.c.event_seq))
            .where(entries.c.rollout_id == rollout_id, entries.c.model_call_id == sa.bindparam("model_call_id"))
        )
        self._closed = False

    @classmethod
    def open(cls, url_or_path: str | os.PathLike[str], **options: Any) -> TokenTransport:
        """A transport over a store of its own (``open_store(url_or_path, **options)``)."""
        return cls(open_store(url_or_path, **options), owns_store=True)

    @property
    def store(self) -> Store:
        return self._store

    # --- the sink -------------------------------------------------------------------------------

    @operation
    def put_now(self, entry: Any) -> bool:
        """Store one complete record durably; True if written, False if the identical entry
        (byte for byte) was already there.  A different entry for the call raises
        ``EntryConflictError``; a frozen rollout ``RolloutFrozenError``; a dropped one
        ``RolloutDroppedError``; a retired capture key ``RolloutFencedError``; an entry that is
        not a valid ``TokenEntry`` ``InvalidRecordError`` (its digest ``DigestMismatchError``).
        Nothing is written whenever it raises."""
        encoded = encode_entry(entry)
        event = NewEvent(EventKind.TOKENS_PUT, encoded.rollout_id, TOKEN_STREAM, encoded.body)

        return self._log.write(lambda tx: token_rules.put_entry(tx, event))

    @operation
    def begin_call_now(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record a pre-dispatch intent: a freeze that finds no entry for the call marks
        the rollout incomplete.  A call that has its entry already writes nothing."""
        arguments.stream(rollout_id, model_call_id)
        event = NewEvent(EventKind.TOKENS_INTENT, rollout_id, TOKEN_STREAM, TokenCallBody(model_call_id=model_call_id))

        def work(tx: WriteTransaction) -> None:
            state, digest = token_rules.lookup(tx, rollout_id, model_call_id)
            token_rules.refuse_dropped(rollout_id, state)
            token_rules.refuse_frozen(rollout_id, state, "begin_call")
            if digest is None and (state is None or model_call_id not in state.open_intents):
                tx.append(event)

        self._log.write(work)

    @operation
    def mark_incomplete_now(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably mark the rollout incomplete (a call failed to capture); allowed after the
        freeze, and it moves the version, so a consumer's drop of an earlier snapshot fails."""
        arguments.text("rollout_id", rollout_id)
        call = arguments.text("model_call_id", model_call_id, empty=True)
        event = NewEvent(EventKind.TOKENS_INCOMPLETE, rollout_id, TOKEN_STREAM, TokenCallBody(model_call_id=call))

        def work(tx: WriteTransaction) -> None:
            token_rules.refuse_dropped(rollout_id, tx.token_rollout(rollout_id))
            tx.append(event)

        self._log.write(work)

    # --- the source -----------------------------------------------------------------------------

    @operation
    def freeze_now(self, rollout_id: str) -> Any:
        """Freeze the rollout (once: later freezes return the same snapshot id and version) and
        return its snapshot: Gym's ``TokenCaptureSnapshot`` of ``TokenEntry`` objects when Gym is
        installed, else a ``TokenSnapshot`` of JSON mappings.  ``incomplete`` when a call was
        marked lost or a call's intent has no entry."""
        arguments.text("rollout_id", rollout_id)
        frozen = NewEvent(
            EventKind.TOKENS_FROZEN, rollout_id, TOKEN_STREAM, TokenFrozenBody(snapshot_id=uuid.uuid4().hex)
        )

        def work(tx: WriteTransaction) -> tuple[TokenRolloutState, list[bytes]]:
            state = tx.token_rollout(rollout_id)
            token_rules.refuse_dropped(rollout_id, state)
            if state is None or not state.frozen:
                tx.append(frozen)
                state = tx.token_rollout(rollout_id)
                assert state is not None
            cursor = tx.run(self._entry_events, {"rollout_id": rollout_id})
            return state, [_payload(row) for row in cursor.fetchall()]

        state, payloads = self._log.write(work)
        assert state.snapshot_id is not None
        return gym.snapshot(rollout_id, payloads, state.masked, state.snapshot_id, state.version)

    @operation
    def entries_now(self, rollout_id: str) -> tuple[Any, ...]:
        """The entries the log holds for the rollout, frozen or not, dropped or not (a drop
        retires the snapshot; the entries stay until ``Store.delete``), in put order: Gym's
        ``TokenEntry`` objects when Gym is installed, else JSON mappings.  Writes nothing."""
        arguments.text("rollout_id", rollout_id)
        with self._engine.connect() as connection:
            rows = connection.execute(self._entry_events_query, {"rollout_id": rollout_id}).fetchall()
            connection.rollback()
        return gym.entries([_payload(row._mapping) for row in rows])

    @operation
    def drop_now(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire the exact frozen snapshot consumed: True if it was still the rollout's
        snapshot at that version (a ``tokens_dropped`` event is appended), False if anything
        changed since (nothing written).  The entries stay in the log until ``Store.delete``."""
        arguments.text("rollout_id", rollout_id)
        arguments.text("snapshot_id", snapshot_id)
        if type(version) is not int or version < 0:
            raise InvalidRecordError(f"version must be a non-negative int, got {version!r}")
        event = NewEvent(
            EventKind.TOKENS_DROPPED,
            rollout_id,
            TOKEN_STREAM,
            TokenDroppedBody(snapshot_id=snapshot_id, version=version),
        )

        def work(tx: WriteTransaction) -> bool:
            state = tx.token_rollout(rollout_id)
            if state is None or state.dropped or not state.frozen:
                return False
            if state.snapshot_id != snapshot_id or state.version != version:
                return False
            tx.append(event)
            return True

        return self._log.write(work)

    # --- the lineage resolver -------------------------------------------------------------------

    @operation
    def resolve_now(self, rollout_id: str, request_items: Sequence[Mapping[str, Any]]) -> Any:
        """Gym's ``LineageResolution`` for a request: ``root`` without model-authored history,
        ``resolved`` with the one committed entry whose continuation fingerprint and recorded
        context the request extends (its cumulative tokens read back and checked against its
        digest), else ``unresolved`` (never a guess)."""
        arguments.text("rollout_id", rollout_id)
        if not isinstance(request_items, (list, tuple)):
            raise InvalidRecordError(f"request_items must be a list of items, got {type(request_items).__name__}")
        lineage = gym.gym_lineage()
        fingerprint = lineage.assistant_fingerprint(list(request_items))
        if not fingerprint:
            return lineage.resolution(lineage.status.ROOT)
        with self._engine.connect() as connection:
            rows = connection.execute(self._candidates, {"rollout_id": rollout_id, "fingerprint": fingerprint})
            candidates = [Candidate(*row) for row in rows]
            winner, reason = pick_parent(candidates, list(request_items), lineage)
            if winner is None:
                return lineage.resolution(lineage.status.UNRESOLVED, reason=reason)
            tokens = self._cumulative_tokens(connection, rollout_id, winner)
            connection.rollback()
        if tokens is None:
            return lineage.resolution(lineage.status.UNRESOLVED, reason="digest_mismatch")
        match = lineage.match(
            model_call_id=winner.model_call_id, cumulative_token_ids=tokens, digest=winner.token_digest or ""
        )
        return lineage.resolution(lineage.status.RESOLVED, match=match)

    def _cumulative_tokens(
        self, connection: sa.Connection, rollout_id: str, winner: Candidate
    ) -> tuple[int, ...] | None:
        """The winner's cumulative tokens: its prompt and generation, after its parents' when
        its prompt is a delta; None when they fail the winner's digest (fail closed)."""
        chain: list[Any] = []
        call: str | None = winner.model_call_id
        seen: set[str] = set()
        while call is not None:
            if call in seen:
                return None  # a cycle of delta parents
            seen.add(call)
            row = connection.execute(self._entry_of_call, {"rollout_id": rollout_id, "model_call_id": call}).first()
            if row is None:
                return None
            values = row._mapping
            chain.append(values)
            call = values["parent_call_id"] if values["prompt_is_delta"] else None
        tokens: list[int] = []
        for values in reversed(chain):
            entry = _entry_fields(_payload(values))
            tokens.extend(entry["prompt_token_ids"])
            tokens.extend(entry["generation_token_ids"])
        if winner.token_digest and token_digest(tokens) != winner.token_digest:
            return None
        return tuple(tokens)

    def is_process_shared(self) -> bool:
        """Every process on the store sees an entry once its ``put`` returned."""
        return True

    # --- Gym's coroutines ------------------------------------------------------------------------

    async def put(self, entry: Any) -> None:
        await asyncio.to_thread(self.put_now, entry)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await asyncio.to_thread(self.begin_call_now, rollout_id, model_call_id)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await asyncio.to_thread(self.mark_incomplete_now, rollout_id, model_call_id)

    async def freeze(self, rollout_id: str) -> Any:
        return await asyncio.to_thread(self.freeze_now, rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await asyncio.to_thread(self.drop_now, rollout_id, snapshot_id=snapshot_id, version=version)

    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> Any:
        return await asyncio.to_thread(self.resolve_now, rollout_id, request_items)

    async def close(self) -> None:
        """Idempotent; nothing is buffered (every put was durable when it returned).  Closes the
        store only when the transport opened it (``TokenTransport.open``)."""
        self.close_now()

    def close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_store:
            self._store.close()

    def __enter__(self) -> TokenTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_now()

    def __repr__(self) -> str:
        return f"TokenTransport({self._store.url!r})"


def open_token_transport(url_or_path: str | os.PathLike[str], **options: Any) -> TokenTransport:
    """``TokenTransport.open``: a transport over a store of its own."""
    return TokenTransport.open(url_or_path, **options)


def _payload(row: Any) -> bytes:
    """A put event's payload, its row checksum and payload digest verified (``verified_event``)."""
    values = row if isinstance(row, Mapping) else dict(zip(_EVENT_COLUMNS, row, strict=False))
    body = verified_event(values).body
    assert isinstance(body, TokenPutBody)
    return body.payload


def _entry_fields(payload: bytes) -> dict[str, Any]:
    import msgspec

    decoded: dict[str, Any] = msgspec.json.decode(payload)
    return decoded

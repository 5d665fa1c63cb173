"""``CaptureLedger``: Gym's capture ledger (wire-contract 6.5) over the store's own log.

Each commit is a ``ledger_recorded`` event on the stream ``(capture key, LEDGER_PREFIX +
call)``, written durably before ``record`` returns, so every process using the store sees
it.  The ledger shares the store's fences: a retired capture key refuses later commits and
failures, and its manifest is refused (Gym answers 410) until ``delete`` or ``forget``.

It also resolves admissions the way Gym's lineage resolver does: the request's
model-authored items (``assistant_fingerprint``, Gym's version 2) must equal the
conversation, request plus response, of exactly one committed row whose request is, unchanged,
the start of this request (``conversation_digest`` over every item, user and tool turns
included); that row is the parent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from store import arguments
from store.append.log import EventLog
from store.append.new_event import NewEvent
from store.append.transaction import WriteTransaction
from store.errors import InvalidRecordError, LedgerConflictError, RolloutFencedError, StoreError
from store.lifecycle import CallGate, operation
from store.log import schema
from store.log.events import EventKind, FailureBody, LedgerRecordBody
from store.projections.fold import LEDGER_PREFIX, ROLLOUT_COLUMNS, Event, RolloutState
from store.queries.integrity import verified_event
from store.queries.reads import Reader
from store.rebuild.fingerprint import UnfingerprintableError, conversation_digest
from store.rebuild.terminal import ASSISTANT_FINGERPRINT_VERSION, assistant_fingerprint, select_terminal_call
from store.retention import ids, removal
from store.retention.reasons import UNRESOLVED_PARENT
from store.wire.codec import from_json, to_json
from store.wire.records import (
    CaptureAdmission,
    CaptureLedgerCommit,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    RolloutRemoval,
)


@dataclass(frozen=True)
class LedgerAdmission:
    """What ``CaptureLedger.admit`` resolved: an admission, or the poison reason written instead."""

    admission: CaptureAdmission | None
    failure: str | None = None


@dataclass(frozen=True)
class _Row:
    model_call_id: str
    commit: CaptureLedgerCommit | None  # None: a legacy lineage row (fingerprint only)
    fingerprint: str | None


class CaptureLedger:
    """The capture ledger of one store (``Store.ledger()``); thread-safe, shared by processes."""

    def __init__(
        self,
        log: EventLog,
        reader: Reader,
        statements: removal.RetentionStatements,
        calls: CallGate,
        check_process: Callable[[], None],
    ) -> None:
        self._log = log
        self._reader = reader
        self._sql = statements
        self._calls = calls  # the store's lifecycle gate: a closed store refuses ledger calls too
        self._check_process = check_process

    # --- writes ------------------------------------------------------------------------------

    @operation
    def record(self, commit: CaptureLedgerCommit) -> None:
        """Commit one ledger row; durable and visible to every process before it returns.

        Recording an identical commit again writes nothing; a different commit for the same
        call raises ``LedgerConflictError``; a retired capture key raises ``RolloutFencedError``.
        """
        if not isinstance(commit, CaptureLedgerCommit):
            raise InvalidRecordError(f"record() takes a CaptureLedgerCommit, got {type(commit).__name__}")
        rollout_id, call_id = commit.rollout_id, commit.record.model_call_id
        arguments.ids("the ledger commit's id", rollout_id, call_id)
        payload = to_json(commit)
        conversation = [*commit.request_items, *commit.response_items]
        body = LedgerRecordBody(commit=payload, fingerprint=_fingerprint(conversation, strict=False))
        stream = LEDGER_PREFIX + call_id

        def work(tx: WriteTransaction) -> None:
            tx.check_fence(rollout_id)
            existing = _recorded(tx, rollout_id, stream)
            if existing is not None:
                # Compared as records, not bytes: a commit recorded before empty extension
                # fields were left out of the JSON ("capture_key":null) is the same commit.
                if existing != payload and from_json(existing, CaptureLedgerCommit) != commit:
                    raise LedgerConflictError(
                        f"the ledger of {rollout_id!r} already holds a different commit for call {call_id!r}"
                    )
                return
            tx.append(NewEvent(EventKind.LEDGER_RECORDED, rollout_id, stream, body))

        self._log.write(work)

    @operation
    def record_lineage(
        self,
        rollout_id: str,
        model_call_id: str,
        request_items: Sequence[Mapping[str, Any]],
        response_items: Sequence[Mapping[str, Any]],
    ) -> None:
        """A legacy lineage row: a conversation fingerprint without commit coordinates.

        What the plain lineage resolver wrote before the ledger carried ``CallRecord``s; such
        rows never enter a manifest and never resolve a parent (they have no coordinates).
        """
        arguments.stream(rollout_id, model_call_id)
        items = [*_items("request_items", request_items), *_items("response_items", response_items)]
        body = LedgerRecordBody(commit=b"", fingerprint=_fingerprint(items, strict=False))
        event = NewEvent(EventKind.LEDGER_RECORDED, rollout_id, LEDGER_PREFIX + model_call_id, body)
        self._log.write(lambda tx: tx.append(event))

    @operation
    def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """A poison row: the call failed (``reason`` from the 3.10 vocabulary, or the caller's own).
        The same failure twice writes nothing."""
        arguments.stream(rollout_id, model_call_id)
        reason = arguments.text("reason", reason, free=True)
        stream = LEDGER_PREFIX + model_call_id

        def work(tx: WriteTransaction) -> None:
            tx.check_fence(rollout_id)
            if reason not in _failures(tx, rollout_id, stream):
                tx.append(NewEvent(EventKind.LEDGER_FAILED, rollout_id, stream, FailureBody(reason=reason)))

        self._log.write(work)

    @operation
    def retire(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Fence the rollouts: later commits, failures and staging for them are refused.

        ``removed`` names those that had ledger rows, ``absent`` the others (fenced too, so a
        late first write is refused as well).  Retiring again is a no-op."""
        keys = ids.capture_keys("rollout_ids", rollout_ids)
        return self._log.write(lambda tx: removal.retire(tx, self._sql, keys, ledger_only=True))

    @operation
    def delete(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Remove the ledger rows and the fence (a tombstone stays); staged records are untouched
        (``Store.delete`` removes those).  ``absent``: no ledger row and no fence."""
        keys = ids.capture_keys("rollout_ids", rollout_ids)
        return self._log.write(lambda tx: removal.delete(tx, self._sql, keys, ledger_only=True))

    # --- reads ---------------------------------------------------------------------------------

    @operation
    def manifest(self, rollout_id: str) -> RolloutManifest:
        """The rollout's committed rows (commit order) and failures; ``RolloutFencedError`` if retired."""
        rows, failures = self._read(arguments.text("rollout_id", rollout_id))
        records = [row.commit.record for row in rows if row.commit is not None]
        return RolloutManifest(rollout_id=rollout_id, records=records, failures=failures)

    @operation
    def has_rows(self, rollout_id: str) -> bool:
        """Whether the rollout has ledger rows (commits or failures) that are not retired."""
        state = self._state(arguments.text("rollout_id", rollout_id))
        return state is not None and not state.fenced and (state.ledger_rows + state.ledger_failures) > 0

    @operation
    def admit(self, rollout_id: str, model_call_id: str, request_items: Sequence[Mapping[str, Any]]) -> LedgerAdmission:
        """Resolve a new call's admission from the ledger (Gym's lineage resolution).

        No model-authored item in the request: a text root.  An empty ledger: a text root
        too (the history was seeded, not generated here).  Exactly one committed row whose
        conversation fingerprint equals the request's (a row stamped with fingerprint version 2,
        ``ASSISTANT_FINGERPRINT_VERSION``, as Gym writes them), and whose own request items begin this
        request unchanged (a rewritten, dropped or summarized turn breaks it): a ``token_in``
        admission continuing it (its staging chain, length and chain hash).  Otherwise (no
        match, siblings that match alike, or a changed context) the call is poisoned with
        ``unresolved_parent``, never made a new root -- as Gym's ``FileLineageStore`` decides.
        """
        arguments.stream(rollout_id, model_call_id)
        fingerprint = _fingerprint(_items("request_items", request_items))
        text_root = CaptureAdmission(rollout_id=rollout_id, model_call_id=model_call_id, mode="text")
        if fingerprint is None:
            return LedgerAdmission(text_root)
        rows, failures = self._read(rollout_id)
        committed = [row for row in rows if row.commit is not None]
        if not committed and not failures:
            return LedgerAdmission(text_root)
        failed = {failure.model_call_id for failure in failures}
        matches = [
            row
            for row in committed
            if row.model_call_id not in failed and _stamped(row) and _conversation(row) == fingerprint
        ]
        if len(matches) != 1 or not _begins(list(request_items), matches[0]):
            self.record_failure(rollout_id, model_call_id, UNRESOLVED_PARENT)
            return LedgerAdmission(None, UNRESOLVED_PARENT)
        commit = matches[0].commit
        assert commit is not None
        parent = commit.record
        admission = CaptureAdmission(
            rollout_id=rollout_id,
            model_call_id=model_call_id,
            parent_call_id=parent.model_call_id,
            prev_len=parent.cum_len,
            mode="token_in",
            staging_chain=commit.staging_chain,
            parent_chain_hash=parent.chain_hash,
        )
        return LedgerAdmission(admission)

    def _state(self, rollout_id: str) -> RolloutState | None:
        rollouts = schema.rollouts
        query = sa.select(*(rollouts.c[name] for name in ROLLOUT_COLUMNS)).where(rollouts.c.rollout_id == rollout_id)
        with self._reader.connection("reading the ledger") as connection:
            row = connection.execute(query).fetchone()
        return None if row is None else RolloutState.from_row(tuple(row))

    def _read(self, rollout_id: str) -> tuple[list[_Row], list[ManifestFailure]]:
        """The ledger's rows in commit order, in one snapshot with the fence that guards them."""
        events = schema.events
        query = (
            sa.select(*events.c)
            .where(events.c.rollout_id == rollout_id, events.c.kind.like("ledger_%"))
            .order_by(events.c.seq)
        )
        rollouts = schema.rollouts
        fence = sa.select(rollouts.c.fenced, rollouts.c.fence_seq).where(rollouts.c.rollout_id == rollout_id)
        with self._reader.connection("reading the ledger") as connection:
            fenced = connection.execute(fence).fetchone()
            if fenced is not None and fenced[0]:
                raise RolloutFencedError(rollout_id, fenced[1])
            stored = [verified_event(row._mapping) for row in connection.execute(query)]
        rows: list[_Row] = []
        failures: list[ManifestFailure] = []
        for event in stored:
            call_id = event.model_call_id.removeprefix(LEDGER_PREFIX)
            if event.kind is EventKind.LEDGER_FAILED:
                failures.append(ManifestFailure(model_call_id=call_id, reason=event.body.reason))
            else:
                rows.append(_Row(call_id, _commit(event), event.body.fingerprint))
        return rows, failures


def receipt_from_manifest(manifest: RolloutManifest, *, reward: float | None = None) -> RolloutReceipt:
    """A ``RolloutReceipt`` for ``verify_and_linearize``: the manifest's rows, the terminal by
    heuristic selection (6.3); poisoned when the ledger holds failures or nothing was selected."""
    if not isinstance(manifest, RolloutManifest):
        raise InvalidRecordError(f"receipt_from_manifest() takes a RolloutManifest, got {type(manifest).__name__}")
    selection = select_terminal_call(manifest.records)
    terminal = selection.terminal_model_call_id
    failure = manifest.failures[0].reason if manifest.failures else None
    if terminal is None:
        failure = failure or selection.reason
    return RolloutReceipt(
        rollout_id=manifest.rollout_id,
        reward=reward,
        terminal_model_call_id=terminal,
        manifest=list(manifest.records),
        capture_poisoned=failure is not None,
        failure_reason=failure,
        terminal_selection=None if terminal is None else "heuristic",
    )


def _commit(event: Event) -> CaptureLedgerCommit | None:
    body: LedgerRecordBody = event.body
    if not body.commit:
        return None
    try:
        return from_json(body.commit, CaptureLedgerCommit)
    except StoreError as exc:
        raise StoreError(f"ledger event {event.seq} holds an unreadable commit: {exc}") from exc


def _recorded(tx: WriteTransaction, rollout_id: str, stream: str) -> bytes | None:
    """The commit already recorded for the call, if any (a legacy lineage row counts as none)."""
    for kind, body in tx.stream_bodies(rollout_id, stream):
        if kind is EventKind.LEDGER_RECORDED and body.commit:
            return bytes(body.commit)
    return None


def _failures(tx: WriteTransaction, rollout_id: str, stream: str) -> set[str]:
    return {body.reason for kind, body in tx.stream_bodies(rollout_id, stream) if kind is EventKind.LEDGER_FAILED}


def _stamped(row: _Row) -> bool:
    """Whether the row's ``CallRecord`` is stamped with the current fingerprint version: as in
    Gym, a row of another version (0: none recorded) never resolves a parent."""
    assert row.commit is not None
    return row.commit.record.fingerprint_version == ASSISTANT_FINGERPRINT_VERSION


def _conversation(row: _Row) -> str | None:
    """The committed row's conversation fingerprint, from its commit's items (version 2; the
    event's stored fingerprint of a row recorded before version 2 is version 1's)."""
    assert row.commit is not None
    return _fingerprint([*row.commit.request_items, *row.commit.response_items], strict=False)


def _begins(request: list[Mapping[str, Any]], row: _Row) -> bool:
    """Whether the row's request items are, unchanged, the first items of ``request`` (Gym's
    context check: ``conversation_digest`` over every turn, user and tool turns included)."""
    assert row.commit is not None
    context = row.commit.request_items
    if len(request) < len(context):
        return False
    try:
        return conversation_digest(request[: len(context)]) == conversation_digest(context)
    except (UnfingerprintableError, TypeError, RecursionError):
        return False


def _fingerprint(items: Sequence[Any], *, strict: bool = True) -> str | None:
    """The conversation's model-authored fingerprint.  A committed row whose items cannot be
    read gets none (it resolves no child); a request that cannot be read is refused."""
    try:
        return assistant_fingerprint(items)
    except UnfingerprintableError as exc:
        if not strict:
            return None
        raise InvalidRecordError(f"the request items cannot be fingerprinted: {exc}") from exc


def _items(name: str, values: Any) -> list[Mapping[str, Any]]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(item, Mapping) for item in values):
        raise InvalidRecordError(f"{name} must be a list of objects")
    return list(values)

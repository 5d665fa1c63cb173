"""The store's error tree: every error the library raises derives from ``StoreError``.

Digest and record errors also derive from the builtin ``ValueError``/``TypeError`` that
NeMo Gym raises for the same inputs, so callers written against Gym keep working.
"""

from __future__ import annotations


class StoreError(Exception):
    """Root of every error this library raises."""


class DigestValueError(StoreError, ValueError):
    """A digest input has a bad value (Gym raises ``ValueError`` for the same input)."""


class DigestTypeError(StoreError, TypeError):
    """A digest input has a bad type (Gym raises ``TypeError`` for the same input)."""


class InvalidRecordError(StoreError, ValueError):
    """A wire record violates its schema or a cross-field rule."""


class DigestMismatchError(InvalidRecordError):
    """A record's supplied digest does not match its fields."""


class StagingRefusedError(StoreError):
    """An all-or-nothing staging batch was refused: a key already holds a different record."""


class AttachmentsUnsupportedError(StoreError, TypeError):
    """``stage(record, attachments=...)`` was given attachments: the store holds none, so it
    refuses the call (nothing written) rather than drop them (Gym's ``StagingSink`` rule)."""


class ConfigurationError(StoreError, ValueError):
    """``open_store`` was given an unusable URL, path or option."""


class StorageError(StoreError):
    """The database failed; the driver's error is chained as ``__cause__``."""


class MigrationError(StorageError):
    """The schema could not be brought to the version this library needs."""


class ServerUnavailableError(StorageError):
    """The database server could not be reached: connection refused, no answer in the connect
    timeout, or a name that does not resolve.  Nothing was written; retrying later is safe."""


class ServerStartingError(ServerUnavailableError):
    """The server answered that it cannot take connections now: it is starting up, shutting down
    or recovering from a crash (SQLSTATE 57P03).  Nothing was written; retry once it is up."""


class LockTimeoutError(StorageError):
    """The store's write lock was not granted within the lock timeout (another writer held it
    that long).  Nothing was written; retrying is safe."""


class ConnectionLostError(StorageError):
    """The connection to the server broke (or the server stopped answering within its deadline)
    before the transaction's COMMIT was sent: nothing of it was committed; retrying is safe."""


class CommitUncertainError(StorageError):
    """The connection broke (or the server stopped answering) after COMMIT was sent and before
    the server answered: the commit may or may not have happened.  Re-staging an identical
    record is a no-op, so staging it again settles it either way."""


class ReplicaUnavailableError(StoreError):
    """A stage under ``replicate_terminal=True`` committed in this store, but its terminal record
    did not reach the replica within ``replica_wait`` (unreachable, or too slow).  The record is
    kept here (``results``: what the stage returned) and ships once the replica answers;
    staging the identical record again is a no-op that waits for the replica again."""

    def __init__(self, message: str, results: object = ()) -> None:
        super().__init__(message)
        self.results = results

    def __reduce__(self) -> tuple[type, tuple[str, object]]:
        return type(self), (str(self), self.results)


class RolloutFencedError(StoreError):
    """A write for a capture key that was retired: the fence refuses it and nothing is written."""

    def __init__(self, rollout_id: str, fence_seq: int | None) -> None:
        at = "" if fence_seq is None else f" at event {fence_seq}"
        super().__init__(
            f"capture key {rollout_id!r} was retired (fence{at}); its late writes are refused "
            "(forget() or delete() removes the fence)"
        )
        self.rollout_id = rollout_id
        self.fence_seq = fence_seq

    def __reduce__(self) -> tuple[type, tuple[str, int | None]]:
        return type(self), (self.rollout_id, self.fence_seq)


class LedgerConflictError(StoreError, ValueError):
    """A capture-ledger commit differs from the one already recorded for the same call."""


class StoreClosedError(StoreError):
    """The store was used after ``close()``."""


class ReadOnlyStoreError(StoreError):
    """A write was asked of a store opened with ``read_only=True``; nothing was written."""


class UnknownKeyError(StoreError, KeyError):
    """``fetch`` was asked for a staging key that holds no record."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown staging key"


class CorruptRecordError(StoreError):
    """Stored bytes failed their checksum, or a stored record failed its digest."""


class CaptureError(StoreError):
    """A worker-capture rule was violated (a caller bug); nothing was staged.

    ``code`` names the rule, so a worker can tell refusals apart without reading messages:
    each check of ``begin_call`` on a continuation has its own (``keys``, ``source_call``,
    ``chunk_kind``, ``own_attempt``, ``lineage``, ``parent_chain``, ``cumulative_hash``,
    ``token_count``, ``policy_version``, ``digest``, ``unreadable``), and so do ``output_limit``,
    ``prompt``, ``finished_call``, ``not_authorized`` and ``forked`` (a capture used in a
    forked child); the class's own code otherwise.
    """

    default_code = "capture"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code or self.default_code

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # keeps .code across pickling
        return type(self), (str(self), self.code)


class StreamingUnsupportedError(CaptureError):
    """Token capture needs the whole response; streaming is refused."""

    default_code = "streaming"


class GenerationCutError(CaptureError):
    """A generation cut could not be served, or a continuation could not be resolved."""

    default_code = "generation_cut"


class AdmissionTypeError(CaptureError, TypeError):
    """``begin_call`` needs a typed ``CaptureAdmission`` (Gym raises ``TypeError`` too)."""

    default_code = "admission_type"


class CaptureDataError(CaptureError, ValueError):
    """A prompt or engine output does not fit its call; completion turns it into failed coords."""

    default_code = "data"


class ReceiptVerificationError(StoreError, ValueError):
    """A rollout receipt or a staged snapshot failed verification (wire-contract 6.1).

    ``code`` is the contract's machine-readable reason (``corrupt_digest``, ``wrong_prev_len``,
    ...); the message adds the detail.  Gym raises a ``ValueError`` subclass, and so does this.
    """

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # keeps .code across pickling
        return type(self), (self.code, str(self).removeprefix(f"{self.code}: "))


class RebuildError(ReceiptVerificationError):
    """A verified manifest cannot form a token chain: a missing parent, a broken link, a cycle, ..."""


class ReceiptTypeError(ReceiptVerificationError, TypeError):
    """``verify_and_linearize`` was handed something that is not a receipt or a base snapshot
    (Gym raises ``TypeError`` for the same input)."""


class ControlRequestError(StoreError):
    """A control route (``store.http``) answered with an error, or with a body the client refuses.

    ``status`` is the HTTP status (0 when the server could not be reached or its answer was not
    the record asked for) and ``code`` the route's machine-readable reason.
    """

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{code} ({status}): {detail}" if status else f"{code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[int, str, str]]:
        return type(self), (self.status, self.code, self.detail)


class EntryConflictError(StoreError, ValueError):
    """The complete-record transport holds a different entry for the same call of the rollout
    (a rebuilt entry is a conflict, not a retry); nothing was written."""


class RolloutFrozenError(StoreError):
    """A transport write (``put``, ``begin_call``) for a rollout already frozen: the fence is
    strict (checked in the write transaction), and nothing was written."""


class RolloutDroppedError(StoreError):
    """A transport call for a rollout whose frozen snapshot was dropped (retired); nothing was written."""

"""The durability domain's methods of ``Store`` (``open_store(replica=, domain=, replicate_terminal=,
replica_wait=)``): what the domain is, waiting for the replica, and a kept receipt's domain.

A mixin of ``store.store.Store``, kept apart from it (one concern, and ``store.py``'s size);
the shipping thread and its watermark are ``store.shipping.replica``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from store import arguments
from store.errors import ConfigurationError, ReplicaUnavailableError
from store.lifecycle import CallGate, operation
from store.queries.reads import Reader
from store.shipping import replica as replication
from store.wire.records import StageResult


class DurabilityDomain:
    """``Store``'s durability-domain methods (see ``open_store``)."""

    _domain: replication.DomainOptions
    _replicator: replication.Replicator | None
    _reader: Reader
    _calls: CallGate
    _check_process: Callable[[], None]

    @property
    def domain(self) -> str:
        """Where an acknowledgement is durable: ``"local"`` (in this store) or ``"replicated"``
        (in this store and in its replica, ``replica_url``; see ``open_store``)."""
        return self._domain.domain

    @property
    def replica_url(self) -> str | None:
        """The replica's URL or path as given to ``open_store`` (None in the local domain)."""
        return self._domain.replica

    @property
    def replica_wait(self) -> float | None:
        """The most seconds an acknowledgement waits for the replica (None in the local domain)."""
        return self._domain.replica_wait if self._replicator is not None else None

    @property
    def replicate_terminal(self) -> bool:
        """Whether a terminal stage waits for the replica too (``open_store(replicate_terminal=)``)."""
        return self._domain.replicate_terminal

    @operation
    def replicate(self, *, wait: float | None = None) -> bool:
        """Wait until every event committed so far is in the replica: True once it is, False when
        ``wait`` seconds (default ``replica_wait``) ran out first; shipping goes on either way.
        ``ConfigurationError`` on a store of the local domain."""
        seconds = arguments.optional_seconds("replicate() wait", wait)
        replicator = self._replication()
        deadline = time.monotonic() + (seconds if seconds is not None else self._domain.replica_wait)
        return replicator.reach(replication.head(self._reader), deadline)

    @operation
    def _replicated_through(self, seq: int, wait: float) -> bool:
        """``replicate`` up to source event ``seq`` only (known to the caller: no read of the head)."""
        return self._replication().reach(seq, time.monotonic() + wait)

    @operation
    def _replicated_keys(
        self,
        keys: Sequence[str],
        deadline: float,
        staged_through: int | None = None,
        staged: Collection[str] = (),
    ) -> set[str]:
        """``_keys_in_replica`` as an operation of its own (a cut's)."""
        return self._keys_in_replica(keys, deadline, staged_through, staged)

    def _keys_in_replica(
        self,
        keys: Sequence[str],
        deadline: float,
        staged_through: int | None = None,
        staged: Collection[str] = (),
    ) -> set[str]:
        """Of ``keys`` (staged here), those whose events are in the replica by ``deadline``.

        ``staged_through``: the last seq the caller just committed, at or above every key's
        event: the ship up to it is waited for first and the keys' seqs are read after it, so
        that read never competes for the interpreter with the shipping thread's reading and
        verifying (with two busy threads each waits out the other's switch interval).
        ``staged``: the keys of that commit (each holds its record, at a seq up to
        ``staged_through``): only the others' seqs are read (a cut's first chunks: none)."""
        replicator = self._replication()
        # One ticket for both waits: a round that began after this call answers them (the
        # commits they wait for came before it), and shipping starts now.
        ticket = replicator.ask()
        if staged_through is not None:
            replicator.wait(ticket, staged_through, deadline)
        known = set(staged) if staged_through is not None else set()
        others = [key for key in keys if key not in known]
        seqs = replication.key_seqs(self._reader, others) if others else {}
        if staged_through is not None:
            seqs.update((key, staged_through) for key in keys if key in known)
        return replication.in_replica(replicator, seqs, deadline, ticket)

    def _replication(self) -> replication.Replicator:
        if self._replicator is None:
            raise ConfigurationError('this store has no replica: open it with replica= and domain="replicated"')
        return self._replicator

    def _replicate_terminal(self, results: list[StageResult], what: str) -> None:
        """Under ``replicate_terminal``: wait for the staged terminal records' events to be in the
        replica; ``ReplicaUnavailableError`` (the records are kept here) when the wait runs out."""
        keys = [result.staging_key for result in results if result.staging_key is not None]
        deadline = time.monotonic() + self._domain.replica_wait
        there = replication.in_replica(self._replication(), replication.key_seqs(self._reader, keys), deadline)
        missing = [key for key in keys if key not in there]
        if missing:
            replicator = self._replication()
            reason = replicator.last_error or f"the replica did not answer within {self._domain.replica_wait:g} s"
            raise ReplicaUnavailableError(
                f"{what}: staged here, but key {missing[0]!r} did not reach the replica {self._domain.replica} "
                f"within replica_wait={self._domain.replica_wait:g} s ({reason}); it ships once the replica answers",
                results,
            )

    @operation
    def cut_domain(self, checkpoint_id: str, inventory_digest: str) -> str | None:
        """The durability domain of the receipt kept for this inventory: ``"replicated"`` when every
        record its ``durable_prefix`` acknowledgements name was in the replica before it was
        returned, ``"local"`` when they are durable in the store that served the cut (the
        receipt kept in this store, shipped or not); None when no receipt is kept."""
        arguments.text("checkpoint_id", checkpoint_id)
        arguments.text("inventory_digest", inventory_digest)
        body = self._reader.cut_receipt_body(checkpoint_id, inventory_digest)
        return None if body is None else body.domain

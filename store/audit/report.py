"""What an audit found: one ``AuditProblem`` per fault, and the counts of what it checked."""

from __future__ import annotations

from dataclasses import dataclass, field

# Problem codes, in the order the audit meets them.
STORAGE = "storage"  # SQLite: the file's pages are not well formed (PRAGMA quick_check)
CHECKSUM = "checksum"  # an event's stored bytes fail their xxh3 checksum
UNDECODABLE = "undecodable"  # an event passes its checksum (or cannot be read) but cannot be decoded
DIGEST = "digest"  # a record does not match its staged digest
CHAIN = "chain"  # a record's chain hash does not recompute from its parent's
PARENT_LENGTH = "parent_length"  # a child's prev_len is not its parent's cum_len
MISSING_PARENT = "missing_parent"  # a record's parent was never in the log, and no delete removed it
CUMULATIVE = "cumulative"  # a leaf's cumulative hash (or length) does not match its lineage's tokens
CONTINUATION = "continuation"  # a continued call did not resume the cut it names
STAGED_KEY = "staged_key"  # a staged key does not point at its own record
PROJECTION = "projection"  # a projection row differs from a replay of the log
TOMBSTONE = "tombstone"  # a delete's tombstone stands, but events it removed are still in the log
MISPLACED = "misplaced"  # an event was written for another store (a pooler or a session setting sent it here)

CODES = (
    STORAGE,
    CHECKSUM,
    UNDECODABLE,
    DIGEST,
    CHAIN,
    PARENT_LENGTH,
    MISSING_PARENT,
    CUMULATIVE,
    CONTINUATION,
    STAGED_KEY,
    PROJECTION,
    TOMBSTONE,
    MISPLACED,
)


@dataclass(frozen=True)
class AuditProblem:
    """One fault: its ``code``, where it is (event, key, rollout, call, as far as known) and why."""

    code: str
    reason: str
    seq: int | None = None
    staging_key: str | None = None
    rollout_id: str | None = None
    model_call_id: str | None = None

    def __str__(self) -> str:
        where = [f"event {self.seq}"] if self.seq is not None else []
        if self.staging_key is not None:
            where.append(f"key {self.staging_key!r}")
        if self.rollout_id is not None:
            where.append(f"call {self.rollout_id}/{self.model_call_id}")
        return f"[{self.code}] {', '.join(where) or 'store'}: {self.reason}"


@dataclass(frozen=True)
class AuditReport:
    """``ok`` when nothing was found.  ``problems`` keeps the first ``MAX_PROBLEMS`` problems;
    ``problems_total`` counts them all.  ``counts`` says how much was checked:
    ``events``, ``records``, ``calls``, ``chains`` (records whose chain hash was recomputed),
    ``leaves`` (cumulative hashes recomputed over a whole lineage), ``continuations``,
    ``resumed_records`` (continued calls' records matched against their cut),
    ``projection_rows``, and ``unverifiable`` (records whose parent tokens a delete removed, so
    their chain or cumulative hash could not be recomputed; a parent the log never had is a
    ``missing_parent`` problem), and after deletes
    ``tombstones``, ``deleted_events`` (what they removed) and ``continuations_of_deleted``
    (continued calls whose cut went with its attempt's delete)."""

    ok: bool
    problems: tuple[AuditProblem, ...]
    problems_total: int
    counts: dict[str, int] = field(default_factory=dict)

    def codes(self) -> set[str]:
        """The codes of the problems kept."""
        return {problem.code for problem in self.problems}

    def summary(self) -> str:
        checked = ", ".join(f"{count} {name}" for name, count in self.counts.items())
        if self.ok:
            return f"audit ok: {checked}"
        lines = [f"audit found {self.problems_total} problem(s) ({checked})"]
        lines += [f"  {problem}" for problem in self.problems]
        if self.problems_total > len(self.problems):
            lines.append(f"  ... and {self.problems_total - len(self.problems)} more")
        return "\n".join(lines)


MAX_PROBLEMS = 1000

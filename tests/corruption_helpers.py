"""A small store with one event of every kind, and probes that judge every read after damage.

Shared by ``tests/test_corruption.py`` and ``tools/soak_corruption.py``.  A probe reads every
staged key (``fetch`` and ``fetch_chunks``), every completion, the cut receipt and the replay,
and sorts each outcome: the right answer, a ``StoreError`` (detected), or a violation (another
key's record, a raw exception, a wrong answer).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from factories import make_record

from store import (
    AuditReport,
    CaptureAdmission,
    CorruptRecordError,
    EventKind,
    GenerationCutInventory,
    GenerationCutPrefix,
    RolloutTokenCapture,
    StagedCallSnapshot,
    Store,
    StoreError,
    open_store,
)
from store.queries.reads import StoredCompletion
from store.queries.replay import ReplayReport


@dataclass(frozen=True)
class Expected:
    """What an undamaged store answers."""

    records: dict[str, tuple[str, str, str, list[int]]]  # key -> rollout, call, digest, token ids
    completions: dict[tuple[str, str], StoredCompletion]
    receipt: tuple[str, str, bytes]  # checkpoint id, inventory digest, receipt JSON


def populate(store: Store) -> Expected:
    """Records staged directly and through a capture: admissions, a cut chunk and its receipt,
    terminal records (one with completion evidence) and a failed call."""
    records = [
        make_record(rollout_id="r1", model_call_id="c1", extras={"tool": "search", "n": [1, 2]}),
        make_record(rollout_id="r1", model_call_id="c2", generated=(30, 31, 32)),
        make_record(rollout_id="r2", model_call_id="c1", generated=(2**40, 7)),
    ]
    for record in records:
        assert store.stage(record).ok
    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: 3)
    try:
        call = capture.begin_call(CaptureAdmission(rollout_id="r3", model_call_id="c0", mode="text"))
        capture.track(call, prompt_token_ids=[10, 11], effective_output_limit=8)
        capture.observe(call, [12, 13], [-0.5, -0.25])
        ticket = GenerationCutPrefix(
            ticket_id="t-r3-c0", rollout_id="r3", attempt_index=0, model_call_id="c0", admitted_at=1.0
        )
        inventory = GenerationCutInventory.build(
            checkpoint_id="checkpoint-1", server_name="policy", active_prefixes=[ticket]
        )
        capture.serve_generation_cut(inventory)
        capture.complete_call(
            call, prompt_token_ids=[10, 11], generated_token_ids=[12, 13, 14], generated_logprobs=[-0.5, -0.25, -1.0]
        )
        failed = capture.begin_call(CaptureAdmission(rollout_id="r4", model_call_id="c0", mode="text"))
        capture.fail_call(failed, reason="engine error")
    finally:
        capture.close()
    keys = [f"{call.rollout_id}/{call.model_call_id}" for call in store.calls() if call.state == "completed"]
    keys += ["__generation_cut__/checkpoint-1/r3/c0/0"]
    snapshots = store.fetch(keys)
    completion = store.completion("r3", "c0")
    receipt = store.cut_receipt("checkpoint-1", inventory.inventory_digest)
    assert completion is not None and receipt is not None and store.replay().ok
    return Expected(
        records={key: _identity(snapshot) for key, snapshot in zip(keys, snapshots, strict=True)},
        completions={("r3", "c0"): completion},
        receipt=("checkpoint-1", inventory.inventory_digest, receipt),
    )


def _identity(snapshot: StagedCallSnapshot) -> tuple[str, str, str, list[int]]:
    return snapshot.rollout_id, snapshot.model_call_id, snapshot.digest, snapshot.token_ids_delta.tolist()


@dataclass
class Outcome:
    """What one probe saw: reads that detected damage (by name) and violations (must stay empty)."""

    detected: dict[str, BaseException] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    # Reads that answered "nothing" for what exists: lost, not misreported.  Damage to an index
    # (not the row) can do it without any read noticing; only SQLite's integrity_check sees that.
    missing: list[str] = field(default_factory=list)
    replay_differs: bool = False
    replay_report: ReplayReport | None = None
    audit_problems: tuple[str, ...] = ()  # the codes of what the audit found

    def read(self, name: str, action: Callable[[], Any], check: Callable[[Any], str | None]) -> None:
        try:
            value = action()
        except StoreError as exc:
            self.detected[name] = exc
            return
        except Exception as exc:  # a raw error out of a public entry point: a violation
            self.violations.append(f"{name}: raw {type(exc).__name__}: {exc}")
            return
        if isinstance(value, ReplayReport):
            self.replay_differs = not value.ok
            self.replay_report = value
        if isinstance(value, AuditReport):
            self.audit_problems = tuple(sorted(value.codes()))
        problem = check(value)
        if problem is not None:
            self.violations.append(f"{name}: {problem}")

    def corrupt(self, name: str) -> bool:
        return isinstance(self.detected.get(name), CorruptRecordError)

    @property
    def found(self) -> bool:
        """Whether any read noticed damage (an error, a replay that differs, an audit's problem)."""
        return bool(self.detected) or self.replay_differs or bool(self.audit_problems)


def probe(store: Store, expected: Expected, *, each_key: bool = True) -> Outcome:
    """Every read of the sample store; each answer is right, a StoreError, or a violation.

    ``each_key=False`` (faster) reads all keys at once, and one by one only when that fails:
    then ``fetch_chunks`` is read one by one only for the keys whose ``fetch`` failed.
    """
    outcome = Outcome()
    keys = list(expected.records)
    if each_key:
        for key in keys:
            _read_key(store, expected, outcome, "fetch", key)
            _read_key(store, expected, outcome, "fetch_chunks", key)
    else:
        _read_keys(store, expected, outcome, "fetch", keys)
        if "fetch" in outcome.detected:
            del outcome.detected["fetch"]
            for key in keys:
                _read_key(store, expected, outcome, "fetch", key)
        failed = [key for key in keys if f"fetch {key}" in outcome.detected]
        for key in failed:
            _read_key(store, expected, outcome, "fetch_chunks", key)
        _read_keys(store, expected, outcome, "fetch_chunks", [key for key in keys if key not in failed])
    for (rollout_id, model_call_id), completion in expected.completions.items():
        outcome.read(
            f"completion {rollout_id}/{model_call_id}",
            lambda r=rollout_id, c=model_call_id: store.completion(r, c),  # type: ignore[misc]
            lambda found, completion=completion: _same_completion(outcome, found, completion),  # type: ignore[misc]
        )
    checkpoint_id, inventory_digest, receipt = expected.receipt
    outcome.read(
        "cut_receipt",
        lambda: store.cut_receipt(checkpoint_id, inventory_digest),
        lambda found: _same_receipt(outcome, found, receipt),
    )
    outcome.read("calls", store.calls, lambda found: None)
    outcome.read("event_origin", lambda: store.event_origin(1), lambda found: None)  # store id, shipped events
    outcome.read("replay", store.replay, lambda report: None)
    outcome.read("audit", store.audit, lambda report: None)
    return outcome


def _read_key(store: Store, expected: Expected, outcome: Outcome, read: str, key: str) -> None:
    _read_keys(store, expected, outcome, read, [key], f"{read} {key}")


def _read_keys(store: Store, expected: Expected, outcome: Outcome, read: str, keys: list[str], name: str = "") -> None:
    """``fetch`` or ``fetch_chunks`` of ``keys``: each snapshot must be the record of its key."""
    if not keys:
        return
    wanted = [expected.records[key] for key in keys]
    if read == "fetch":
        outcome.read(name or read, lambda: [_identity(s) for s in store.fetch(keys)], _all_same(wanted))
    else:
        outcome.read(name or read, lambda: [_identity(c.snapshot) for c in store.fetch_chunks(keys)], _all_same(wanted))


def _same_receipt(outcome: Outcome, found: bytes | None, receipt: bytes) -> str | None:
    if found is None:
        outcome.missing.append("cut_receipt")
        return None
    return None if found == receipt else f"another receipt: {found!r:.80}"


def _all_same(wanted: list[tuple[str, str, str, list[int]]]) -> Callable[[Any], str | None]:
    return lambda found: None if found == wanted else "other records than those asked"


def _same_completion(outcome: Outcome, found: StoredCompletion | None, completion: StoredCompletion) -> str | None:
    if found is None:
        outcome.missing.append("completion")  # the damaged row no longer reads as one: evidence lost, nothing false
        return None
    return None if found == completion else f"another completion: {found}"


# --- damaging one row through raw SQL ----------------------------------------------------------


@dataclass(frozen=True)
class Damage:
    """``SET column = <sql>`` with ``params``: one way to damage one stored value."""

    column: str
    label: str
    sql: str = ":value"
    value: Any = None


def is_sqlite(connection: sa.Connection) -> bool:
    return connection.dialect.name == "sqlite"


def flip_text(text: str) -> str:
    return chr(ord(text[0]) ^ 1) + text[1:]


def flip_byte(data: bytes, index: int) -> bytes:
    damaged = bytearray(data)
    damaged[index] ^= 0x01
    return bytes(damaged)


def event_damages(row: dict[str, Any], sqlite: bool, *, thorough: bool = True) -> list[Damage]:
    """Damage to every stored column of one event row (each differs from the stored value).

    ``thorough=False`` leaves out the variants that test nothing new (a second flip, a negative int).
    """
    damages: list[Damage] = []
    for column in ("rollout_id", "model_call_id", "staging_key"):
        value = row[column]
        damages.append(
            Damage(column, "another key" if value is None else "a flipped bit", value=flip_text(value or "r1/c2"))
        )
        if column == "staging_key" and value is not None:
            damages.append(Damage(column, "null", value=None))
    for kind in [*(k.value for k in EventKind if k.value != row["kind"]), "bogus"]:
        damages.append(Damage("kind", f"kind {kind}", value=kind))
    for column in ("stream_version", "writer_pid"):
        damages.append(Damage(column, "+1000", value=row[column] + 1000))
        if thorough:
            damages.append(Damage(column, "negative", value=-row[column] - 1))
    damages.append(Damage("recorded_at", "+1s", value=row["recorded_at"] + 1.0))
    for column in ("body", "token_ids", "token_mask", "log_probs", "checksum"):
        data = row[column]
        if data is None:
            damages.append(Damage(column, "bytes where none were", value=b"4\x01\x00\x00\x00"))
            continue
        damages += [
            Damage(column, "a flipped bit in the middle", value=flip_byte(data, len(data) // 2)),
            Damage(column, "truncated", value=data[:-1]),
        ]
        if thorough:
            damages.append(Damage(column, "a flipped last bit", value=flip_byte(data, len(data) - 1)))
        if column in ("token_ids", "token_mask", "log_probs"):
            damages.append(Damage(column, "null", value=None))
    if sqlite:  # SQLite keeps any type in any column: what a damaged file can hold
        damages += [
            Damage("kind", "text that is not UTF-8", "CAST(X'ff' AS TEXT)"),
            Damage("rollout_id", "a blob", "X'7231'"),
            Damage("stream_version", "text in an integer column", "'abc'"),
            Damage("recorded_at", "text in a float column", "'abc'"),
            Damage("body", "text in a blob column", "'abc'"),
            Damage("checksum", "an integer in a blob column", "7"),
        ]
    return damages


def set_value(raw: sa.Connection, table: str, column: str, sql: str, value: Any, where: str, ident: Any) -> None:
    raw.execute(
        sa.text(f"UPDATE {table} SET {column} = {sql} WHERE {where} = :ident"), {"value": value, "ident": ident}
    )


def event_rows(raw: sa.Connection) -> list[dict[str, Any]]:
    rows = raw.execute(sa.text("SELECT * FROM events ORDER BY seq")).mappings()
    return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in row.items()} for row in rows]


def one_event_of_each_kind(raw: sa.Connection) -> list[dict[str, Any]]:
    chosen: dict[tuple[str, bool], dict[str, Any]] = {}
    for row in event_rows(raw):
        has_extras = b"extras" in row["body"] and row["rollout_id"] == "r1"
        chosen.setdefault((row["kind"], has_extras), row)
    return list(chosen.values())


def judge_event_damage(outcome: Outcome, row: dict[str, Any], damage: Damage, expected: Expected) -> list[str]:
    """What the probe after damaging ``row`` got wrong (empty: every read behaved)."""
    problems = list(outcome.violations)
    key = row["staging_key"]
    for name in (f"fetch {key}", f"fetch_chunks {key}"):
        if key in expected.records and not outcome.corrupt(name):
            problems.append(f"{name} was not refused as corrupt")
    for name, error in outcome.detected.items():
        if name.startswith("fetch") and not name.endswith(f" {key}"):
            problems.append(f"{name}: an undamaged record was not served ({error})")
    if row["kind"] == EventKind.CUT_RECEIPT.value and not outcome.corrupt("cut_receipt"):
        problems.append("the damaged receipt was not refused as corrupt")
    if damage.column == "seq":
        if not outcome.replay_differs:
            problems.append("replay did not report the moved event")
    else:
        problems += _replay_names_the_damaged_event(outcome, row["seq"])
    return problems


def _replay_names_the_damaged_event(outcome: Outcome, seq: int) -> list[str]:
    """Replay reports the damaged event as undecodable (never a healthy store)."""
    report = outcome.replay_report
    if report is None:
        return [f"replay gave no report: {outcome.detected.get('replay')!r}"]
    if report.ok or seq not in [undecodable for undecodable, _ in report.undecodable]:
        return [f"replay did not name event {seq} as undecodable: {report.summary()}"]
    return []


# --- random byte flips in a SQLite file ---------------------------------------------------------
Damager = Callable[[bytes], tuple[bytes, list[int]]]


def flipper(rng: random.Random) -> Damager:
    """XOR 1-3 random bytes at random offsets with random non-zero values."""

    def damage(data: bytes) -> tuple[bytes, list[int]]:
        damaged = bytearray(data)
        offsets = [rng.randrange(len(data)) for _ in range(rng.randint(1, 3))]
        for offset in offsets:
            damaged[offset] ^= rng.randint(1, 255)
        return bytes(damaged), offsets

    return damage


@dataclass
class FileTrials:
    planted: int = 0
    found: int = 0  # trials where some read reported the damage (an error or replay differences)
    opened: int = 0  # trials where the damaged file still opened as a store
    lost: int = 0  # trials where some read found nothing where something exists (never a wrong answer)
    violations: list[str] = field(default_factory=list)
    unnoticed: list[bytes] = field(default_factory=list)  # the damaged files no read noticed (if kept)


def run_file_trials(
    data: bytes, expected: Expected, folder: Path, damage: Damager, count: int, *, keep_unnoticed: bool = False
) -> FileTrials:
    """Open a damaged copy of ``data`` per trial and judge every read of it."""
    trials = FileTrials()
    path = folder / "damaged.db"
    for trial in range(count):
        damaged, offsets = damage(data)
        for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            leftover.unlink(missing_ok=True)
        path.write_bytes(damaged)
        trials.planted += 1
        outcome = Outcome()
        store = try_open(path, outcome)
        if store is not None:
            trials.opened += 1
            try:
                outcome = probe(store, expected, each_key=False)
            finally:
                store.close()
        trials.found += outcome.found
        trials.lost += bool(outcome.missing)
        if keep_unnoticed and not outcome.found:
            trials.unnoticed.append(damaged)
        trials.violations += [f"trial {trial} (offsets {offsets}): {v}" for v in outcome.violations]
    return trials


def try_open(path: Path, outcome: Outcome) -> Store | None:
    """The store, or None with the (judged) error of opening it."""
    opened: list[Store] = []
    outcome.read("open", lambda: opened.append(open_store(path)), lambda _: None)
    return opened[0] if opened else None


def sample_file(folder: Path) -> tuple[bytes, Expected]:
    pristine = folder / "pristine.db"
    with open_store(pristine) as store:
        expected = populate(store)
    assert not Path(f"{pristine}-wal").exists()  # the last close checkpointed everything into the file
    return pristine.read_bytes(), expected

"""``Store.export_jsonl``: one JSON object per linearized row, for trainers.

Rollouts are exported one at a time (bounded memory: one rollout's rows in flight).  Every
line is verified as written: it is decoded back and its token ids must hash to the chain
leaf's cumulative hash, its columns must equal the verified row's, and its per-token policy
versions must cover exactly the generated tokens.  A rollout that fails writes no line; it
is reported with its code.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec
import numpy as np

from store.errors import CorruptRecordError, InvalidRecordError, ReceiptVerificationError, UnknownKeyError
from store.lineage.linearize import RolloutRecords, rollout_records
from store.lineage.tree import rollout_ids as all_rollout_ids
from store.log.events import Span
from store.queries.reads import Reader
from store.rebuild.verify import LinearizedRow, verify_and_linearize_all
from store.wire.digest import hash_token_ids

Progress = Callable[[int, int], object]
Writer = Callable[[bytes], object]
_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True)
class ExportFailure:
    """A rollout that was not exported, and why (a ``ReceiptVerificationError`` code, or
    ``corrupt_record`` / ``missing_record`` when stored bytes are damaged or gone)."""

    rollout_id: str
    code: str
    detail: str


@dataclass(frozen=True)
class ExportReport:
    """What ``export_jsonl`` wrote: rollouts and rows exported, and the rollouts it refused."""

    rollouts: int = 0
    rows: int = 0
    failures: list[ExportFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def token_policy_versions(row: LinearizedRow, spans: dict[str, tuple[Span, ...]]) -> list[int | None]:
    """One policy version per token of the row (None for carried tokens), from the projection's spans.

    The spans must cover exactly each call's generated positions (``wrong_version_spans`` otherwise).
    """
    versions: list[int | None] = [None] * len(row.token_ids)
    for call, links in zip(row.weight_version_spans, row.link_spans, strict=True):
        _, carried, generated = links
        covered = 0
        for start, end, version in spans.get(call.model_call_id, ()):
            if not carried <= start < end <= call.end - call.start:
                raise ReceiptVerificationError(
                    "wrong_version_spans", f"call {call.model_call_id}: span [{start}, {end}) is not a generated range"
                )
            versions[call.start + start : call.start + end] = [version] * (end - start)
            covered += end - start
        if covered != generated:
            raise ReceiptVerificationError(
                "wrong_version_spans",
                f"call {call.model_call_id}: its version spans cover {covered} of {generated} generated tokens",
            )
    return versions


def row_object(row: LinearizedRow, spans: dict[str, tuple[Span, ...]]) -> dict[str, Any]:
    """The exported JSON object of one row."""
    return {
        "rollout_id": row.rollout_id,
        "token_ids": row.token_ids.tolist(),
        "token_mask": row.token_mask.tolist(),
        "logprobs": row.logprobs.tolist(),
        "model_call_ids": row.model_call_ids,
        "prompt_len": row.prompt_len,
        "weight_versions": row.weight_versions,
        "weight_version_spans": [
            {"model_call_id": s.model_call_id, "start": s.start, "end": s.end, "weight_version": s.weight_version}
            for s in row.weight_version_spans
        ],
        "link_spans": [list(link) for link in row.link_spans],
        "extras_commitments": [
            {
                "model_call_id": c.model_call_id,
                "extras_digest_version": c.extras_digest_version,
                "extras_digest": c.extras_digest,
            }
            for c in row.extras_commitments
        ],
        "terminal_model_call_id": row.terminal_model_call_id,
        "token_policy_versions": token_policy_versions(row, spans),
    }


def _f32(values: Any) -> bytes:
    return np.asarray(values, dtype=np.float64).astype(">f4").tobytes()


def verified_line(row: LinearizedRow, records: RolloutRecords) -> bytes:
    """The row's JSON line, decoded back and checked against the verified row before it is written."""
    line = _ENCODER.encode(row_object(row, records.spans))
    written = msgspec.json.decode(line)
    leaf = next(r for r in records.receipt.manifest if r.model_call_id == row.terminal_model_call_id)
    if hash_token_ids(written["token_ids"]) != leaf.cumulative_hash:
        raise ReceiptVerificationError("export_mismatch", "the written token ids do not hash to the leaf's hash")
    for name, column in (("token_mask", row.token_mask), ("logprobs", row.logprobs)):
        if _f32(written[name]) != column.big_endian_f32().tobytes():
            raise ReceiptVerificationError("export_mismatch", f"the written {name} differ from the verified row")
    return line + b"\n"


def _lines(reader: Reader, rollout_id: str) -> list[bytes]:
    records = rollout_records(reader, rollout_id)
    result = verify_and_linearize_all(records.receipt, records.snapshots)
    return [verified_line(row, records) for row in result.rows]


def _failure(rollout_id: str, exc: Exception) -> ExportFailure:
    if isinstance(exc, ReceiptVerificationError):  # its message starts with its code: the detail is the rest
        return ExportFailure(rollout_id, exc.code, str(exc).removeprefix(f"{exc.code}: "))
    code = "missing_record" if isinstance(exc, UnknownKeyError) else "corrupt_record"
    return ExportFailure(rollout_id, code, str(exc))


def _checked(write: Writer) -> Writer:
    """A writer whose refusal of the line's type is the caller's error, not a raw TypeError."""

    def checked(line: bytes) -> object:
        try:
            return write(line)
        except TypeError as exc:
            raise InvalidRecordError(f"export_jsonl() could not write to the file: {exc}") from exc

    return checked


@contextmanager
def _sink(file: Any) -> Iterator[Writer]:
    if isinstance(file, (str, os.PathLike)):
        with _replacing(os.fsdecode(file)) as write:
            yield write
        return
    if isinstance(file, io.TextIOBase):
        text: IO[str] = file  # type: ignore[assignment]
        yield lambda line: text.write(line.decode("utf-8"))
        return
    if callable(getattr(file, "write", None)):
        yield _checked(file.write)
        return
    raise InvalidRecordError(f"export_jsonl() writes to a path or a writable file, got {type(file).__name__}")


@contextmanager
def _replacing(path: str) -> Iterator[Writer]:
    """Write a path's new content to a temporary file beside it, renamed over it once complete.

    An export that fails or is interrupted leaves the path as it was (absent, or its old
    content) and no temporary file, so a file that is there is always a whole export.  A
    path that is not a regular file (``/dev/null``, a FIFO) is written in place.
    """
    try:
        existing = os.stat(path)
    except FileNotFoundError:
        existing = None
    except (OSError, ValueError) as exc:
        raise InvalidRecordError(f"export_jsonl() cannot write {path}: {_reason(exc)}") from exc
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        try:
            opened = open(path, "wb")  # noqa: SIM115 (closed below, after the export)
        except (OSError, ValueError) as exc:
            raise InvalidRecordError(f"export_jsonl() cannot write {path}: {_reason(exc)}") from exc
        with opened:
            yield opened.write
        return
    folder, name = os.path.split(os.path.abspath(path))
    partial = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.partial")
    try:  # O_EXCL: never another file's; mode 0666 less the umask, as open() would create it
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except (OSError, ValueError) as exc:
        where = f"the folder {folder} does not exist" if not os.path.isdir(folder) else _reason(exc)
        raise InvalidRecordError(f"export_jsonl() cannot write {path}: {where}") from exc
    try:
        with os.fdopen(descriptor, "wb") as opened:
            yield opened.write
            opened.flush()
            os.fsync(opened.fileno())  # the new content is on disk before it takes the name
        if existing is not None:
            os.chmod(partial, stat.S_IMODE(existing.st_mode))
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def export_jsonl(
    reader: Reader, file: Any, rollout_ids: Sequence[str] | None = None, progress: Progress | None = None
) -> ExportReport:
    """Write every (or each named) rollout's verified rows to ``file``, one JSON object per line."""
    if progress is not None and not callable(progress):
        raise InvalidRecordError(f"progress must be callable, got {type(progress).__name__}")
    wanted = list(rollout_ids) if rollout_ids is not None else all_rollout_ids(reader)
    exported = rows = 0
    failures: list[ExportFailure] = []
    with _sink(file) as write:
        for done, rollout_id in enumerate(wanted, start=1):
            try:
                lines = _lines(reader, rollout_id)
            except (ReceiptVerificationError, CorruptRecordError, UnknownKeyError) as exc:
                failures.append(_failure(rollout_id, exc))
            else:
                for line in lines:
                    write(line)
                exported += 1
                rows += len(lines)
            if progress is not None:
                progress(done, len(wanted))
    return ExportReport(exported, rows, failures)

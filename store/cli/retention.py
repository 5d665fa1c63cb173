"""Retention, the write commands: ``retire``, ``forget``, ``delete`` (capture keys) and ``compact``.

They open an existing store writable (``opening.writable``: a missing path or a file that is
not a store is refused, never created).  Capture keys come from the arguments and/or
``--from-file`` and are checked whole before anything is written: none at all, an empty
key, a key given twice is bad usage (exit 2).  The store takes at most 4,096 keys per call,
so longer lists are sent in batches, each its own transaction.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import click

from store.cli import exits, output
from store.cli.opening import ENV, STORE_HELP, location, looks_like_store, read_only, shown, writable

if TYPE_CHECKING:
    from store.retention.preview import Action
    from store.store import Store
    from store.wire.records import RolloutRemoval

MAX_PER_CALL = 4096  # the store's bound on one retire/forget/delete call (store.retention.ids)
DELETE_BATCH = 256  # smaller batches for delete, so its progress bar moves
KEYS_HELP = (
    f"STORE is a SQLite path or a postgresql:// URL.  It may be left out when ${ENV} is set: then a first "
    "argument that does not look like a store (no '://', no '/', no .db/.sqlite suffix, not an existing file) "
    "is a capture key."
)


def split_store(values: Sequence[str]) -> tuple[str, list[str]]:
    """``[STORE] KEY...``: the store and the capture keys given as arguments."""
    if values and (not os.environ.get(ENV) or looks_like_store(values[0])):
        return location(values[0]), list(values[1:])
    return location(None), list(values)


def _read_keys(source: TextIO, name: str) -> list[str]:
    """One capture key per line; blank lines are skipped, anything else is kept as written."""
    keys = []
    for line in source:
        key = line.rstrip("\r\n")
        if key.strip():
            keys.append(key)
        elif key:
            raise click.UsageError(f"{name} holds a line of only whitespace; one capture key per line")
    return keys


def gather_keys(given: list[str], from_file: str | None) -> list[str]:
    """The capture keys of the arguments then the file, refused whole if any is bad."""
    keys = list(given)
    if from_file is not None:
        if from_file == "-":
            keys += _read_keys(sys.stdin, "stdin")
        else:
            try:
                with open(from_file, encoding="utf-8") as lines:
                    keys += _read_keys(lines, from_file)
            except OSError as exc:
                raise click.UsageError(f"cannot read capture keys from {from_file}: {exits.os_reason(exc)}") from exc
            except UnicodeDecodeError as exc:
                raise click.UsageError(
                    f"cannot read capture keys from {from_file}: it is not UTF-8 text (byte {exc.start})"
                ) from exc
    if not keys:
        raise click.UsageError("no capture keys given: pass KEY arguments or --from-file FILE ('-' for stdin)")
    seen: set[str] = set()
    for key in keys:
        if not key or key != key.strip():
            raise click.UsageError(f"capture key {key!r} is empty or has leading/trailing whitespace")
        if key in seen:
            raise click.UsageError(f"capture key {key!r} is given more than once")
        seen.add(key)
    return keys


def batches(keys: list[str], size: int) -> list[list[str]]:
    return [keys[start : start + size] for start in range(0, len(keys), size)]


def _removal(
    store: str | None,
    keys: list[str],
    action: Callable[[Store, list[str]], RolloutRemoval],
    size: int,
    progress: output.Progress | None = None,
) -> dict[str, Any]:
    removed: list[str] = []
    absent: list[str] = []
    parts = batches(keys, size)
    with writable(store) as opened:
        where = shown(opened)
        for number, part in enumerate(parts):
            if progress is not None:
                progress(number * size, len(keys))
            result = action(opened, part)
            removed += result.removed
            absent += result.absent
        if progress is not None:
            progress(len(keys), len(keys))
    return {"store": where, "requested": len(keys), "batches": len(parts), "removed": removed, "absent": absent}


def _preview(store: str | None, keys: list[str], action: Action) -> dict[str, Any]:
    """What the action would do, read-only (``Store.removal_preview``): nothing is written."""
    rows: list[dict[str, Any]] = []
    with read_only(store) as opened:
        where = shown(opened)
        for part in batches(keys, MAX_PER_CALL):
            for preview in opened.removal_preview(part):
                rows.append(
                    {
                        "capture_key": preview.capture_key,
                        "outcome": preview.outcome(action),
                        "events": preview.events,
                        "records": preview.records,
                        "stored_bytes": preview.stored_bytes,
                        "fenced": preview.fenced,
                    }
                )
    return {
        "command": action,
        "dry_run": True,
        "store": where,
        "requested": len(keys),
        "removed": [row["capture_key"] for row in rows if row["outcome"] == "removed"],
        "absent": [row["capture_key"] for row in rows if row["outcome"] == "absent"],
        "keys": rows,
    }


_WOULD = {"retire": "would be fenced", "forget": "would be unfenced", "delete": "would be deleted"}


def _report_preview(shaped: dict[str, Any], as_json: bool) -> None:
    if as_json:
        output.emit_json(shaped)
        return
    rows = shaped["keys"]
    output.listing(
        None,
        ["capture key", "outcome", "events", "records", "stored bytes", "fenced"],
        [
            [row["capture_key"], row["outcome"], row["events"], row["records"], row["stored_bytes"], row["fenced"]]
            for row in rows
        ],
    )
    removed = [row for row in rows if row["outcome"] == "removed"]
    events = sum(row["events"] for row in removed)
    sizes = (
        f" ({events} events, {sum(row['stored_bytes'] for row in removed):,} bytes)"
        if shaped["command"] == "delete"
        else ""
    )
    output.show(
        f"{shaped['command']} --dry-run: {len(removed)} capture key(s) {_WOULD[shaped['command']]}{sizes}, "
        f"{len(shaped['absent'])} absent; nothing was written",
        f"store: {shaped['store']}",
    )


def _report(shaped: dict[str, Any], as_json: bool, done: str, absent_note: str) -> None:
    if as_json:
        output.emit_json(shaped)
        return
    lines = [f"{shaped['command']}: {len(shaped['removed'])} capture key(s) {done}, {len(shaped['absent'])} absent"]
    if shaped["absent"]:
        shown_absent = ", ".join(shaped["absent"][:10]) + (" ..." if len(shaped["absent"]) > 10 else "")
        lines.append(f"  absent ({absent_note}): {shown_absent}")
    lines.append(f"store: {shaped['store']}")
    output.show(*lines)


def _keys_options(function: Callable[..., Any]) -> Callable[..., Any]:
    function = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a sentence.")(function)
    function = click.option(
        "--dry-run",
        is_flag=True,
        help="Only list what would be done to each key (events, records, bytes, fence), opening the store "
        "read-only: nothing is written.  The exit code is the one the real command would have.",
    )(function)
    function = click.option(
        "--from-file",
        "from_file",
        metavar="FILE",
        help="Also read capture keys from FILE, one per line ('-' reads stdin).  [default: none]",
    )(function)
    return click.argument("arguments", nargs=-1, metavar="[STORE] [KEY]...")(function)


@click.command(
    epilog=f"{KEYS_HELP}\n\nExamples:\n\n  staging-store retire demo-store/demo.db run1-r0 run1-r1\n\n"
    "  cat dead-attempts.txt | staging-store retire demo-store/demo.db --from-file - --json",
)
@_keys_options
def retire(arguments: tuple[str, ...], from_file: str | None, dry_run: bool, as_json: bool) -> int:
    """Fence capture keys: every later write for them (stage, cut, admission, ledger) is refused.

    Their staged records stay readable.  A key that holds nothing yet is fenced too (listed as
    absent); retiring a retired key changes nothing.  More than 4,096 keys go in batches of
    4,096.  Exit 0 once every key is fenced.
    """
    store, given = split_store(arguments)
    keys = gather_keys(given, from_file)
    if dry_run:
        _report_preview(_preview(store, keys, "retire"), as_json)
        return exits.OK
    shaped = {"command": "retire", **_removal(store, keys, lambda s, part: s.retire(part), MAX_PER_CALL)}
    _report(shaped, as_json, "retired", "nothing staged yet; fenced anyway")
    return exits.OK


@click.command(
    epilog=f"{KEYS_HELP}\n\nExample: staging-store forget demo-store/demo.db run1-r0 --json",
)
@_keys_options
def forget(arguments: tuple[str, ...], from_file: str | None, dry_run: bool, as_json: bool) -> int:
    """Remove the fences of retired capture keys, so they accept writes again.

    A key that had no fence is listed as absent and nothing is written for it.  More than
    4,096 keys go in batches of 4,096.  Exit 0 when every key had a fence, 1 when some
    were absent.
    """
    store, given = split_store(arguments)
    keys = gather_keys(given, from_file)
    if dry_run:
        preview = _preview(store, keys, "forget")
        _report_preview(preview, as_json)
        return exits.PROBLEMS if preview["absent"] else exits.OK
    shaped = {"command": "forget", **_removal(store, keys, lambda s, part: s.forget(part), MAX_PER_CALL)}
    _report(shaped, as_json, "unfenced", "had no fence")
    return exits.PROBLEMS if shaped["absent"] else exits.OK


@click.command(
    epilog=f"{KEYS_HELP}\n\nExamples:\n\n  staging-store delete demo-store/demo.db run1-r0 run1-r0-a1\n\n"
    "  staging-store delete demo-store/demo.db --from-file done.txt --dry-run\n\n"
    "  staging-store delete demo-store/demo.db --from-file done.txt && staging-store compact demo-store/demo.db",
)
@_keys_options
def delete(arguments: tuple[str, ...], from_file: str | None, dry_run: bool, as_json: bool) -> int:
    """Delete every event of capture keys (staged tokens, admissions, ledger rows) and their fences.

    A tombstone per key stays in the log so audits explain the gap; `compact` then gives the
    space back to the file system.  Keys go in batches of 256 (a transaction each) with a
    progress bar on a terminal.  Exit 0 when every key was deleted, 1 when some held
    nothing (absent).
    """
    store, given = split_store(arguments)
    keys = gather_keys(given, from_file)
    if dry_run:
        preview = _preview(store, keys, "delete")
        _report_preview(preview, as_json)
        return exits.PROBLEMS if preview["absent"] else exits.OK
    with output.progress_bar("deleting") as progress:
        removal = _removal(store, keys, lambda s, part: s.delete(part), DELETE_BATCH, progress)
    shaped = {"command": "delete", **removal}
    _report(shaped, as_json, "deleted", "held nothing")
    return exits.PROBLEMS if shaped["absent"] else exits.OK


@click.command(
    epilog=f"{STORE_HELP}\n\nExample: staging-store compact demo-store/demo.db --json",
)
@click.argument("store", required=False, metavar="[STORE]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a sentence.")
def compact(store: str | None, as_json: bool) -> int:
    """Give the space of deleted records back to the file system.

    SQLite: incremental vacuum and a WAL truncate (an older store is converted once by a full
    VACUUM); PostgreSQL: VACUUM of the log.  Exit 0.
    """
    with writable(store) as opened:
        report = opened.compact()
        where, backend = shown(opened), opened.backend
    shaped = {
        "store": where,
        "backend": backend,
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "reclaimed": report.reclaimed,
        "converted": report.converted,
    }
    if as_json:
        output.emit_json(shaped)
    elif backend == "sqlite":
        converted = " (converted to incremental vacuum)" if report.converted else ""
        sizes = f"{report.bytes_before:,} -> {report.bytes_after:,} bytes"
        output.show(f"{where}: {sizes}, {report.reclaimed:,} reclaimed{converted}")
    else:
        output.show(f"{where}: vacuumed (PostgreSQL reuses the space; sizes are not measured)")
    return exits.OK

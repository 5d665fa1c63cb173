"""``audit`` and ``replay``: is the store whole?  Exit 1 when they find problems."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from store.cli import exits, output
from store.cli.opening import STORE_HELP, read_only, shown, store_argument, writable

if TYPE_CHECKING:
    from store.audit import AuditReport
    from store.queries.replay import ReplayReport


@click.command(
    epilog=f"{STORE_HELP}\n\nExample: staging-store audit demo-store/demo.db --json",
)
@store_argument
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.  [default: a table]")
def audit(store: str | None, as_json: bool) -> int:
    """Check every checksum, digest, chain, continuation and key, and that projections equal a replay.

    Reads the store read-only in one streaming pass and reports every problem found.
    Exit 0 when clean, 1 when problems were found.
    """
    with read_only(store) as opened, output.progress_bar("auditing") as progress:
        report = opened.audit(progress=progress)
        where = shown(opened)
    if as_json:
        output.emit_json(audit_json(where, report))
    else:
        _show_audit(where, report)
    return exits.OK if report.ok else exits.PROBLEMS


def audit_json(where: str, report: AuditReport) -> dict[str, Any]:
    return {
        "store": where,
        "ok": report.ok,
        "counts": dict(report.counts),
        "problems_total": report.problems_total,
        "problems": [
            {
                "code": problem.code,
                "reason": problem.reason,
                "seq": problem.seq,
                "staging_key": problem.staging_key,
                "rollout_id": problem.rollout_id,
                "model_call_id": problem.model_call_id,
            }
            for problem in report.problems
        ],
    }


def _show_audit(where: str, report: AuditReport) -> None:
    counts = output.table(None, ["checked", "count"], [[name, count] for name, count in report.counts.items()])
    if report.ok:
        output.show(counts, f"[green]audit ok[/green]: {where}")
        return
    problems = output.table(
        f"{report.problems_total} problem(s)",
        ["code", "event", "key", "call", "reason"],
        [
            [
                p.code,
                p.seq,
                p.staging_key,
                None if p.rollout_id is None else f"{p.rollout_id}/{p.model_call_id}",
                p.reason,
            ]
            for p in report.problems
        ],
    )
    more = report.problems_total - len(report.problems)
    output.show(counts, problems, *([f"... and {more} more"] if more else []), f"[red]audit FAILED[/red]: {where}")


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store replay demo-store/demo.db\n\n"
    "  staging-store replay demo-store/demo.db --repair",
)
@store_argument
@click.option(
    "--repair",
    is_flag=True,
    help="Replace differing projection rows with the rebuilt ones (writes; refused if any event is damaged).  "
    "[default: only compare, read-only]",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.  [default: a summary]")
def replay(store: str | None, repair: bool, as_json: bool) -> int:
    """Rebuild every projection from the event log and compare it with the live tables.

    Without --repair the store is opened read-only.  Exit 0 when they match (or were
    repaired), 1 when they differ or an event could not be decoded.
    """
    opening = writable if repair else read_only
    with opening(store) as opened:
        report = opened.replay(repair=repair)
        where = shown(opened)
    if as_json:
        output.emit_json(replay_json(where, report))
    else:
        output.show(report.summary(), f"store: {where}")
    healthy = report.ok or (report.repaired and not report.undecodable)
    return exits.OK if healthy else exits.PROBLEMS


def replay_json(where: str, report: ReplayReport) -> dict[str, Any]:
    return {
        "store": where,
        "ok": report.ok,
        "events": report.events,
        "repaired": report.repaired,
        "differences_total": report.differences_total,
        "differences": [
            {
                "table": difference.table,
                "key": [_plain(part) for part in difference.key],
                "live": _row(difference.live),
                "rebuilt": _row(difference.rebuilt),
                "description": str(difference),
            }
            for difference in report.differences
        ],
        "undecodable": [{"seq": seq, "reason": reason} for seq, reason in report.undecodable],
    }


def _row(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if row is None else {name: _plain(value) for name, value in row.items()}


def _plain(value: Any) -> Any:
    """A JSON value: bytes as hex, everything else as it is (ints, text, None)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)

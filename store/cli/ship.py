"""``ship``: copy a store's log into another store (``Store.ship``), with a progress bar."""

from __future__ import annotations

from typing import Any

import click

from store.cli import exits, output
from store.cli.opening import read_only, shown, writable


@click.command(
    epilog="SRC and DST are SQLite paths or postgresql:// URLs; both must already be stores (create an "
    "empty target with `staging-store migrate DST --create`).\n\n"
    "Examples:\n\n  staging-store ship worker-7.db postgresql://trainer@db/fleet\n\n"
    "  staging-store ship worker-7.db shared.db --json",
)
@click.argument("source", metavar="SRC")
@click.argument("target", metavar="DST")
@click.option("--json", "as_json", is_flag=True, help="Print the ship report as JSON.  [default: a summary]")
def ship(source: str, target: str, as_json: bool) -> int:
    """Ship SRC's events that DST does not hold yet into DST, verified, each keeping its origin.

    SRC is opened read-only; DST is written (never created).  Idempotent and resumable: a
    second ship sends only what is new.  A ship stops at the first event DST refuses
    (a conflict) or that is damaged in SRC, keeps everything before it, and exits 1;
    exit 0 when every event of SRC is in DST.
    """
    with read_only(source) as src, writable(target) as dst, output.progress_bar("shipping") as progress:
        report = src.ship(dst, progress=progress)
        shaped: dict[str, Any] = {
            "source": shown(src),
            "target": shown(dst),
            "ok": report.ok,
            "source_store_id": report.source_store_id,
            "target_store_id": report.target_store_id,
            "read": report.read,
            "appended": report.appended,
            "present": report.present,
            "last_seq": report.last_seq,
            "problems": [
                {
                    "code": problem.code,
                    "reason": problem.reason,
                    "source_seq": problem.source_seq,
                    "origin_store_id": problem.origin_store_id,
                    "origin_seq": problem.origin_seq,
                    "staging_key": problem.staging_key,
                    "rollout_id": problem.rollout_id,
                    "model_call_id": problem.model_call_id,
                }
                for problem in report.problems
            ],
        }
    if as_json:
        output.emit_json(shaped)
    else:
        output.show(report.summary(), f"{shaped['source']} -> {shaped['target']}")
    return exits.OK if report.ok else exits.PROBLEMS

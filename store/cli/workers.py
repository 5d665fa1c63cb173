"""``workers``: the policy worker processes the coordinator logged, and the calls each staged or left in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from store.cli import exits, output
from store.cli.opening import STORE_HELP, read_only, shown, store_argument

if TYPE_CHECKING:
    from store.lineage.workers import PolicyWorker


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store workers demo-store/demo.db\n\n"
    "  staging-store workers demo-store/demo.db --lost --json",
)
@store_argument
@click.option("--lost", is_flag=True, help="Only workers lost without notice.  [default: every worker]")
@output.listing_options
def workers(store: str | None, lost: bool, fmt: str, limit: int | None) -> int:
    """List the policy worker processes by pid: state, the calls each staged, and what a lost one left in flight.

    Read from the worker events the checkpoint coordinator logs (joined, stopped, lost); a
    call belongs to the worker whose process wrote it.  The store is opened read-only.
    """
    with read_only(store) as opened:
        found = opened.workers()
        where = shown(opened)
    chosen = output.limited([worker for worker in found if worker.state == "lost"] if lost else found, limit)
    rows = [worker_json(worker) for worker in chosen]
    shaped = {"store": where, "workers": rows}
    if fmt != "table":
        output.emit_listing(fmt, document=shaped, rows=rows, fields=_FIELDS, title=None, columns=[], table_rows=[])
        return exits.OK
    output.listing(
        f"{len(chosen)} policy worker(s)",
        ["pid", "index", "state", "staged calls", "in flight when it left", "blocked checkpoint"],
        [
            [
                worker.pid,
                worker.index,
                worker.state,
                _calls(worker.staged_calls),
                _calls(worker.in_flight_calls),
                worker.blocked_checkpoint,
            ]
            for worker in chosen
        ],
    )
    output.show(f"store: {where}")
    return exits.OK


_FIELDS = ["pid", "index", "state", "expected", "join_seq", "left_seq", "blocked_checkpoint"]
_FIELDS += ["staged_calls", "in_flight_calls"]


def worker_json(worker: PolicyWorker) -> dict[str, Any]:
    return {
        "pid": worker.pid,
        "index": worker.index,
        "state": worker.state,
        "expected": worker.expected,
        "join_seq": worker.join_seq,
        "left_seq": worker.left_seq,
        "blocked_checkpoint": worker.blocked_checkpoint,
        "staged_calls": [list(call) for call in worker.staged_calls],
        "in_flight_calls": [list(call) for call in worker.in_flight_calls],
    }


def _calls(calls: tuple[tuple[str, str], ...]) -> str | None:
    if not calls:
        return None
    names = [f"{capture}/{call}" for capture, call in calls]
    return ", ".join(names[:6]) + (f" ... ({len(names)})" if len(names) > 6 else "")

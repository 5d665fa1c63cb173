"""``ship``: copy a store's log into another store (``Store.ship``), with a progress bar, or
``--follow`` it (``Store.follow``) until SIGINT or SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import click

from store.cli import exits, output
from store.cli.opening import read_only, shown, writable

SIGNAL_POLL = 0.05  # how soon a noted SIGINT/SIGTERM reaches the follow loop


@click.command(
    epilog="SRC and DST are SQLite paths or postgresql:// URLs; both must already be stores (create an "
    "empty target with `staging-store migrate DST --create`).\n\n"
    "Examples:\n\n  staging-store migrate shared.db --create\n\n"
    "  staging-store ship demo-store/demo.db shared.db --json\n\n"
    "  staging-store ship worker-7.db postgresql://trainer@db/fleet --follow --interval 1",
)
@click.argument("source", metavar="SRC")
@click.argument("target", metavar="DST")
@click.option("--json", "as_json", is_flag=True, help="Print the ship report as JSON.  [default: a summary]")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Ship at most this many events.")
@click.option(
    "--deadline",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Start no batch after this many seconds.",
)
@click.option(
    "--follow",
    is_flag=True,
    help="Keep shipping what SRC commits until SIGINT or SIGTERM (the batch in flight commits first).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0, min_open=True),
    default=0.5,
    show_default=True,
    help="--follow: seconds between looks at SRC once caught up (the lag is at most this plus a round).",
)
def ship(
    source: str, target: str, as_json: bool, limit: int | None, deadline: float | None, follow: bool, interval: float
) -> int:
    """Ship SRC's events that DST does not hold yet into DST, verified, each keeping its origin.

    SRC is opened read-only; DST is written (never created).  Idempotent and resumable: a
    second ship sends only what is new.  A ship goes up to SRC's last event when it began
    (bounded further by --limit and --deadline).  It stops at the first event DST refuses
    (a conflict) or that is damaged in SRC, keeps everything before it, and exits 1;
    exit 0 otherwise.  --follow prints one line per round that shipped something and, on
    SIGINT or SIGTERM, the totals; with --json that is JSON Lines, every line one object
    ({"round": ...} per round, then the report).
    """
    if follow and (limit is not None or deadline is not None):
        raise click.UsageError("--follow ships until stopped; it takes no --limit or --deadline")
    with read_only(source) as src, writable(target) as dst:
        if src.store_id == dst.store_id:
            raise exits.CommandError(
                f"SRC and DST are the same store ({shown(src)}); ship copies a log into another store", exits.USAGE
            )
        if follow:
            with _stop_on_signals() as stop:
                report = src.follow(dst, stop=stop, interval=interval, on_round=_round_printer(as_json))
        else:
            with output.progress_bar("shipping") as progress:
                report = src.ship(dst, progress=progress, limit=limit, deadline=deadline)
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
            "remaining": report.remaining,
            "stopped": report.stopped,
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
    if as_json and follow:  # a stream: JSON Lines, the totals one compact line after the rounds'
        output.emit_jsonl([shaped])
    elif as_json:
        output.emit_json(shaped)
    else:
        output.show(report.summary(), f"{shaped['source']} -> {shaped['target']}")
    return exits.OK if report.ok else exits.PROBLEMS


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event SIGINT and SIGTERM set (the follow stops after the batch in flight), the
    handlers they had put back after.

    The handler only notes the signal; a thread of its own sets the event.  A handler runs in
    the main thread between two of its bytecodes, possibly while that thread holds the event's
    lock (entering or leaving ``stop.wait`` in the follow loop): setting the event there would
    take that lock again and hang the command for good.
    """
    stop = threading.Event()
    asked: list[int] = []  # appended to by the handler: no lock the interrupted code may hold

    def handler(signum: int, _frame: Any) -> None:
        asked.append(signum)

    def relay() -> None:
        while not asked and not stop.is_set():
            time.sleep(SIGNAL_POLL)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    relay_thread = threading.Thread(target=relay, name="staging-store-ship-signals", daemon=True)
    relay_thread.start()
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        stop.set()
        relay_thread.join()


def _round_printer(as_json: bool) -> Any:
    def printed(report: Any) -> None:
        if as_json:
            fields = {"appended": report.appended, "present": report.present, "last_seq": report.last_seq}
            sys.stdout.write(json.dumps({"round": fields, "remaining": report.remaining}) + "\n")
        else:
            print(
                f"shipped {report.read} event(s) ({report.appended} appended) up to source event {report.last_seq}",
                flush=True,
            )
        sys.stdout.flush()

    return printed

"""``Store.follow``: a long-running shipper that tails its source with a bounded lag."""

from __future__ import annotations

import threading
from collections.abc import Callable

from store.shipping.report import ShipReport


def follow(
    ship_once: Callable[[], ShipReport],
    stop: threading.Event,
    interval: float,
    on_round: Callable[[ShipReport], object] | None,
) -> ShipReport:
    """Run ``ship_once`` until ``stop`` is set or a round finds a problem; between rounds that
    caught up, wait ``interval`` (woken at once by ``stop``).  Returns the rounds' totals."""
    read = appended = present = 0
    report: ShipReport | None = None
    while True:
        report = ship_once()
        read, appended, present = read + report.read, appended + report.appended, present + report.present
        if report.read and on_round is not None:
            on_round(report)
        if not report.ok or stop.is_set():
            break
        if report.remaining == 0:  # caught up with the source as it was when the round began
            stop.wait(interval)
            if stop.is_set():
                break
    return ShipReport(
        ok=report.ok,
        source_store_id=report.source_store_id,
        target_store_id=report.target_store_id,
        read=read,
        appended=appended,
        present=present,
        last_seq=report.last_seq,
        problems=report.problems,
        remaining=report.remaining,
        stopped="stopped" if report.ok else None,
    )

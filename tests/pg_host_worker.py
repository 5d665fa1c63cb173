"""A process on a simulated host that writes straight into a PostgreSQL store, for
``test_pg_host_loss.py`` and ``tools/soak_pg_host_loss.py`` (not a test module).  Run inside a
network namespace with ``ip netns exec``; the store's wait limits are its defaults.

    python tests/pg_host_worker.py stage URL PREFIX
        Stages records ``PREFIX-0``, ``PREFIX-1``, ... one after another until a line ``stop``
        comes on stdin, printing ``ACK <key> <start> <end>`` for each acknowledged stage and
        ``ERR <start> <end> <error type>: <message>`` for each that raised (times: the
        system-wide ``time.monotonic()``), then ``BYE``.
    python tests/pg_host_worker.py hold URL PLACE
        Stages one record, prints ``READY``, then takes the write lock in a write that stops
        mid-way (``lock_holder``: PLACE ``pipeline`` or ``copy``), prints ``HOLDING`` and waits
        there until killed.
    python tests/pg_host_worker.py idle URL
        Stages one record, prints ``READY`` and sleeps with its connection open until killed.
"""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lock_holder
from factories import make_record

from store import StorageError, open_store


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def stage(url: str, prefix: str) -> int:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    with open_store(url) as store:
        index = 0
        while not stop.is_set():
            record = make_record(rollout_id=f"{prefix}-{index}")
            index += 1
            started = time.monotonic()
            try:
                ok = store.stage(record).ok
            except StorageError as exc:
                emit(f"ERR {started:.4f} {time.monotonic():.4f} {type(exc).__name__}: {' '.join(str(exc).split())}")
                continue
            ended = time.monotonic()
            emit(
                f"ACK {record.staging_key} {started:.4f} {ended:.4f}"
                if ok
                else f"ERR {started:.4f} {ended:.4f} refused"
            )
    emit("BYE")
    return 0


def hold(url: str, place: str) -> int:
    store = open_store(url)
    assert store.stage(make_record(rollout_id=f"before-{place}")).ok
    emit("READY")
    lock_holder.hold_mid_write(store, place, lambda: emit("HOLDING"), lambda: time.sleep(3600))
    return 0


def idle(url: str) -> int:
    store = open_store(url)
    assert store.stage(make_record(rollout_id="idle")).ok
    emit("READY")
    time.sleep(3600)
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "stage":
        return stage(argv[1], argv[2])
    if argv[0] == "hold":
        return hold(argv[1], argv[2])
    if argv[0] == "idle":
        return idle(argv[1])
    raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

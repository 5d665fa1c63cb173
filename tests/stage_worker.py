"""A child-process program for the multi-process tests (not a test module).

    python tests/stage_worker.py stage URL PREFIX COUNT [--threads N] [--durability D] [--start-at T]
                                    [--writer TAG]
        Stage COUNT records (rollout ``PREFIX``, calls ``c0``, ``c1``, ...; COUNT 0 means
        "until killed"), printing ``ACK <key>`` (flushed) only after ``stage()`` returned ok.
        With ``--writer``, the records carry TAG in their extras (so two writers' records
        under one key conflict), and a refused key prints ``REFUSED <key>`` and goes on.
    python tests/stage_worker.py open URL [--start-at T]
        Open (creating and migrating) the store and print ``OPENED <revision>``.

``--start-at`` is a ``time.time()`` value to wait for, so several processes start together.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for factories

from factories import make_record

from store import open_store
from store.log.schema import SCHEMA_REVISION

_PRINT_LOCK = threading.Lock()


def emit(line: str) -> None:
    with _PRINT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def wait_until(start_at: float | None) -> None:
    if start_at is not None:
        delay = start_at - time.time()
        if delay > 0:
            time.sleep(delay)


def record_for(prefix: str, index: int, writer: str | None = None):  # type: ignore[no-untyped-def]
    return make_record(
        rollout_id=prefix,
        model_call_id=f"c{index}",
        prompt=(1, 2, 3, index % 1000),
        generated=tuple(range(index % 50 + 1)),
        extras={"index": index, "writer": writer or prefix},
    )


def stage(args: argparse.Namespace) -> int:
    counter = itertools.count() if args.count == 0 else iter(range(args.count))
    counter_lock = threading.Lock()
    failures: list[str] = []
    with open_store(args.url, durability=args.durability) as store:
        emit(f"READY {os.getpid()}")
        wait_until(args.start_at)

        def run() -> None:
            while True:
                with counter_lock:
                    index = next(counter, None)
                if index is None:
                    return
                record = record_for(args.prefix, index, args.writer)
                result = store.stage(record)
                if not result.ok and args.writer is not None:
                    emit(f"REFUSED {record.staging_key}")
                    continue
                if not result.ok:
                    failures.append(f"{record.staging_key}: {result.error}")
                    emit(f"FAIL {record.staging_key} {result.error}")
                    return
                emit(f"ACK {result.staging_key}")

        threads = [threading.Thread(target=run) for _ in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    emit("DONE")
    return 1 if failures else 0


def open_only(args: argparse.Namespace) -> int:
    wait_until(args.start_at)
    with open_store(args.url) as store:
        emit(f"OPENED {SCHEMA_REVISION} {store.backend}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    stage_parser = sub.add_parser("stage")
    stage_parser.add_argument("url")
    stage_parser.add_argument("prefix")
    stage_parser.add_argument("count", type=int)
    stage_parser.add_argument("--threads", type=int, default=1)
    stage_parser.add_argument("--durability", default="full")
    stage_parser.add_argument("--start-at", type=float, default=None)
    stage_parser.add_argument("--writer", default=None)
    open_parser = sub.add_parser("open")
    open_parser.add_argument("url")
    open_parser.add_argument("--start-at", type=float, default=None)
    args = parser.parse_args()
    return stage(args) if args.command == "stage" else open_only(args)


if __name__ == "__main__":
    sys.exit(main())

"""WAL checkpoints off the committing thread (SQLite).

SQLite's automatic checkpoint runs inside the commit that crosses its threshold, so one
acknowledgement in every few hundred waits for the whole -wal to be copied into the database
and synced: the write path's latency tail.  The writer turns it off (``Backend.writer_setup_sql``)
and reports what it commits here; past ``every_bytes`` a background thread runs a PASSIVE
checkpoint on its own pooled connection: it copies and syncs the bulk while the writer goes on.

SQLite restarts the -wal from its start only at a write that begins with every frame copied,
which a busy writer never sees while another connection checkpoints.  So once the background
checkpoint is done, the writer runs one more PASSIVE checkpoint itself after its next commit:
it copies only the frames committed meanwhile, and the batch after it restarts the -wal.  If
the thread falls far behind (a failing checkpoint), the writer checkpoints in line as well.
Checkpoints are crash safe in any order with commits (the -wal stays the durable copy until a
checkpoint has synced the database), so durability is unchanged.

A checkpoint needs room: the database grows to hold the pages the -wal added, and the -wal
gives nothing back until all of them are copied.  On a full disk a checkpoint that cannot
finish would spend the space that came back on pages it cannot release (the database grows,
the -wal does not shrink), and every commit, which needs room only at the end of the -wal,
would fail again: 256 KiB freed bought one stage.  So a checkpoint runs only when the file
system can take the database's growth (``room_to_finish``); until then commits use the space,
and the thread tries again every ``RETRY_SECONDS``, finishing once the room is there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from sqlalchemy.engine import Engine

# SQLite's own autocheckpoint threshold is 1,000 pages (about 4 MiB of -wal).
CHECKPOINT_BYTES = 4 * 1024 * 1024
# Requests' worth of unchecked bytes past which the writer no longer trusts the thread and
# checkpoints in line.
BEHIND_REQUESTS = 16
# A checkpoint a reader kept from finishing is tried again this often, so the -wal can restart
# (and shrink) soon after a long reader ends, whether or not more is written.
RETRY_SECONDS = 0.1
# A background pass that took longer than this copied many frames, and the writer committed more
# meanwhile: the thread runs another pass (up to MAX_PASSES) so the writer's part stays small.
SHORT_PASS_SECONDS = 0.002
MAX_PASSES = 8
# Room kept free beyond the database's growth before a checkpoint starts (a few commits' worth).
ROOM_MARGIN = 1024 * 1024


class Checkpointer:
    """One background thread per store that checkpoints when enough was committed."""

    def __init__(
        self, engine: Engine, sql: str, every_bytes: int | None = None, *, database: str | None = None
    ) -> None:
        """``database``: the SQLite file, for ``room_to_finish`` (None: room is not checked)."""
        self._engine = engine
        self._sql = sql
        self._every = CHECKPOINT_BYTES if every_bytes is None else every_bytes
        self._database = database
        self._reset()

    def _reset(self) -> None:
        self._wake = threading.Event()
        # Held while the thread has a connection checked out, and by a fork: no SQLite
        # connection may be open across a fork (see ``Store._before_fork``).
        self._busy = threading.Lock()
        self._held = False
        self._thread: threading.Thread | None = None
        self._closed = False
        # Running totals of committed bytes: the writer moves the first two, the thread the
        # last (single assignments, so no lock): what was committed when a request was made,
        # and what the last successful checkpoint covered.
        self._total = 0
        self._requested = 0
        self._checked = 0
        self._finish_due = False  # the thread's checkpoint is done: the writer finishes it

    def committed(self, nbytes: int) -> None:
        """The writer committed about ``nbytes`` (called by one writer at a time)."""
        self._total += nbytes
        if self._total - self._requested < self._every or self._closed:
            return
        self._requested = self._total
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="store-wal-checkpoint", daemon=True)
            self._thread.start()
        self._wake.set()

    def due_in_line(self) -> bool:
        """Whether the writer should checkpoint now, after its commit (it then calls
        ``checkpointed_in_line``): the thread finished its part, or is far behind."""
        return self._finish_due or self._total - self._checked >= BEHIND_REQUESTS * self._every

    def checkpointed_in_line(self) -> None:
        self._checked = self._total
        self._finish_due = False

    def _run(self) -> None:
        unfinished = False
        while True:
            self._wake.wait(RETRY_SECONDS if unfinished else None)
            self._wake.clear()
            if self._closed:
                return
            requested = self._requested
            for _ in range(MAX_PASSES):
                began = time.monotonic()
                finished = self._checkpoint()
                if not finished or time.monotonic() - began < SHORT_PASS_SECONDS or self._closed:
                    break
            if finished is not None:
                self._checked = max(self._checked, requested)
            if finished:
                self._finish_due = True
            unfinished = not finished

    def _checkpoint(self) -> bool | None:
        """Whether the checkpoint copied the whole -wal (None: it failed)."""
        with self._busy:
            return self._checkpoint_on_pooled_connection()

    def _checkpoint_on_pooled_connection(self) -> bool | None:
        try:
            connection: Any = self._engine.raw_connection()
        except Exception:  # retried; ``behind`` bounds the -wal meanwhile
            return None
        try:
            cursor = connection.cursor()
            if not self.room_to_finish(cursor):
                cursor.close()
                return None  # tried again in RETRY_SECONDS: the space goes to commits meanwhile
            row = cursor.execute(self._sql).fetchone()
            cursor.close()
            # (busy, frames in the -wal, frames copied): a reader's snapshot can hold some back.
            return row is None or row[2] >= row[1]
        except Exception:
            with contextlib.suppress(Exception):
                connection.invalidate()
            return None
        finally:
            with contextlib.suppress(Exception):
                connection.close()

    def room_to_finish(self, cursor: Any) -> bool:
        """Whether the file system can take the database's growth when the -wal is copied into it:
        the pages the connection sees (``page_count``, the -wal's included) less the file's size."""
        if self._database is None:
            return True
        try:
            pages = cursor.execute("PRAGMA page_count").fetchone()[0]
            page_size = cursor.execute("PRAGMA page_size").fetchone()[0]
            growth = int(pages) * int(page_size) - os.path.getsize(self._database)
            if growth <= 0:
                return True
            disk = os.statvfs(os.path.dirname(os.path.abspath(self._database)))
        except (OSError, TypeError, ValueError):
            return True  # unknown: let the checkpoint itself say
        blocks = disk.f_bfree if os.geteuid() == 0 else disk.f_bavail  # root may use the reserved blocks
        return bool(blocks * disk.f_frsize >= growth + ROOM_MARGIN)

    def close(self) -> None:
        """Stop the thread (a checkpoint under way finishes first)."""
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def hold_for_fork(self) -> None:
        """Before a fork: wait for a checkpoint under way, start no other until released."""
        self._busy.acquire()
        self._held = True

    def release_after_fork(self) -> None:
        if self._held:
            self._held = False
            self._busy.release()

    def after_fork_in_child(self) -> None:
        """The parent's thread does not exist in a forked child: start afresh."""
        self._reset()

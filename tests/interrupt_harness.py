"""A child program for the Ctrl-C tests (not a test module): ``staging-store`` stopped in one phase.

    python tests/interrupt_harness.py PHASE SIGN_FD staging-store-arguments...

Runs the command line exactly as the installed script does (``from store.cli import main``,
then ``sys.exit(main())``), after arranging that the given PHASE holds still: when the command
reaches it, the harness writes ``PHASE\\n`` to the file descriptor SIGN_FD (the test's sign that
the command is there) and waits for a SIGINT.  The test then sends one, as Ctrl-C would.

SIGINT starts at its default, Python's KeyboardInterrupt, as in a terminal's foreground job:
a test run started in the background of a non-interactive shell inherits SIGINT *ignored*
(the shell's rule for background jobs), and a child left so would never see the signal.

Phases of ``demo``:

* ``start-up``: while ``store.cli.app`` (and with it click and the commands) is imported;
* ``spawning``: in the spawner thread, after the first worker process started and before
  the next (the main thread waits for it);
* ``serving``: the first workers have reported their calls in flight, before the cut;
* ``respawning``: as ``spawning``, for the fresh workers after the kill;
* ``audit``: inside ``Store.audit``'s pass over the log (read transaction open);
* ``export``: inside the export, after its first line was verified (its file half written).

Phases of the other commands: ``audit`` (``staging-store audit``), ``export``
(``staging-store export -o FILE``).
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import os
import signal
import sys
import threading
import time
from typing import Any

# A plain flag, not a threading.Event: the handler runs in the main thread between two of its
# bytecodes, possibly while that thread holds an Event's lock (entering or leaving a wait), and
# taking the lock again there deadlocks the command for good (seen once in a loaded run).
_interrupted = False


def _on_sigint(signum: int, frame: Any) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def hold(phase: str, sign_fd: int) -> None:
    """Say where the command is, then wait for the SIGINT (raised here in the main thread;
    in another thread, wait until the main thread has it, then go on)."""
    os.write(sign_fd, f"{phase}\n".encode())
    deadline = time.monotonic() + 60
    while not _interrupted and time.monotonic() < deadline:
        time.sleep(0.01)  # in the main thread the handler raises KeyboardInterrupt out of this sleep
    if threading.current_thread() is threading.main_thread():
        raise SystemExit("harness: no SIGINT within 60 s")
    if not _interrupted:
        os._exit(99)


class _HoldImport(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, sign_fd: int) -> None:
        self.module, self.sign_fd = module, sign_fd

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == self.module:
            sys.meta_path.remove(self)
            hold("start-up", self.sign_fd)
        return None


def arrange(phase: str, sign_fd: int) -> None:
    if phase == "start-up":
        sys.meta_path.insert(0, _HoldImport("store.cli.app", sign_fd))
        return
    if phase in ("spawning", "respawning"):
        from store.demo import run

        original = run.Worker.__init__
        started: list[str] = []

        def init(self: Any, path: str, job: dict[str, Any]) -> None:
            original(self, path, job)
            started.append(job["phase"])
            wanted = "serve" if phase == "spawning" else "resume"
            if started.count(wanted) == 1 and job["phase"] == wanted:
                hold(phase, sign_fd)

        run.Worker.__init__ = init  # type: ignore[method-assign]
        return
    if phase == "serving":
        from store.demo import run

        expect = run.Worker.expect

        def expected(self: Any, event: str) -> dict[str, Any]:
            message = expect(self, event)
            if event == "inflight":
                hold(phase, sign_fd)
            return message

        run.Worker.expect = expected  # type: ignore[method-assign]
        return
    if phase == "audit":
        from store.audit import store_audit

        audit_run = store_audit._Audit.run

        def running(self: Any) -> Any:
            hold(phase, sign_fd)
            return audit_run(self)

        store_audit._Audit.run = running  # type: ignore[method-assign]
        return
    if phase == "export":
        from store.lineage import export

        verified = export.verified_line

        def line(*args: Any) -> bytes:
            done = verified(*args)
            if not getattr(line, "held", False):
                line.held = True  # type: ignore[attr-defined]
                hold(phase, sign_fd)
            return done

        export.verified_line = line
        return
    raise SystemExit(f"harness: unknown phase {phase!r}")


def main() -> None:
    phase, sign_fd, arguments = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks of a hung command
    signal.signal(signal.SIGINT, _on_sigint)
    arrange(phase, sign_fd)
    sys.argv = ["staging-store", *arguments]
    from store.cli import main as cli_main  # what the installed script runs

    sys.exit(cli_main())


if __name__ == "__main__":
    main()

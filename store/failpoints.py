"""Deterministic failpoints for the kill tests: where a process dies with SIGKILL.

``STORE_FAILPOINT=<name>`` arms one failpoint; the process kills itself at its first hit,
or at hit N+1 with ``STORE_FAILPOINT_SKIP=N``.  The variables are read once, at import,
so an unarmed failpoint costs one comparison.  Names:

* ``before_commit``: inside a write transaction, after the batch's work, before COMMIT;
* ``after_commit``: after COMMIT, before any caller of the batch is told;
* ``mid_batch``: between two callers' work in one group-commit batch;
* ``mid_cut``: in ``serve_generation_cut``, with the plan built and nothing staged yet.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from store.errors import ConfigurationError

NAME_VARIABLE = "STORE_FAILPOINT"
SKIP_VARIABLE = "STORE_FAILPOINT_SKIP"
NAMES = frozenset({"before_commit", "after_commit", "mid_batch", "mid_cut"})

_armed: str | None = None  # the armed failpoint's name; None on every ordinary run
_remaining = 0  # hits of the armed failpoint to survive before dying
_count_lock = threading.Lock()


def hit(name: str) -> None:
    """Die here if ``name`` is the armed failpoint and its skipped hits are used up."""
    if name == _armed:
        _count_down()


def arm(name: str | None, skip: int = 0) -> None:
    """Arm ``name`` (None disarms); the environment does this at import.  For test programs."""
    global _armed, _remaining
    if name is not None and name not in NAMES:
        raise ConfigurationError(f"{NAME_VARIABLE}={name!r} is not a failpoint; known: {sorted(NAMES)}")
    if type(skip) is not int or skip < 0:
        raise ConfigurationError(f"{SKIP_VARIABLE} must be a non-negative int, got {skip!r}")
    with _count_lock:
        _armed, _remaining = name, skip


def _count_down() -> None:
    global _remaining
    with _count_lock:  # several threads hit the same failpoint; each hit counts once
        if _remaining > 0:
            _remaining -= 1
            return
        with contextlib.suppress(OSError):  # unbuffered, so the note is out before the kill
            os.write(2, f"FAILPOINT {_armed} pid {os.getpid()}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def _arm_from_environment() -> None:
    name = os.environ.get(NAME_VARIABLE) or None
    skip_text = os.environ.get(SKIP_VARIABLE) or "0"
    try:
        skip = int(skip_text)
    except ValueError:
        raise ConfigurationError(f"{SKIP_VARIABLE} must be a non-negative int, got {skip_text!r}") from None
    arm(name, skip)


_arm_from_environment()

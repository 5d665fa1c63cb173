"""Exit codes and the one-line errors the command line prints."""

from __future__ import annotations

OK = 0
PROBLEMS = 1  # the command ran and found problems (audit, replay, a key or rollout not found)
USAGE = 2  # bad arguments or options (click's own code for usage errors)
UNREADABLE = 3  # the store could not be opened or read, or it refused the request
BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command a closed pipe ended
INTERRUPTED = 130  # 128 + SIGINT


class ClosedPipe(Exception):
    """stdout's reader went away (``| head``); raised past click, which would exit 1 on it."""


class CommandError(Exception):
    """A failure the command line reports as one line on stderr, with its exit code."""

    def __init__(self, message: str, code: int = UNREADABLE) -> None:
        super().__init__(message)
        self.code = code


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a store error: a caller's bad value is usage, anything else unreadable/refused."""
    from store.errors import InvalidRecordError

    return USAGE if isinstance(exc, InvalidRecordError) else UNREADABLE


def one_line(exc: BaseException) -> str:
    """The error's own message on one line, without the database driver's text."""
    message = str(exc) or type(exc).__name__
    cause = exc.__cause__
    driver_text = str(getattr(cause, "orig", None) or cause or "")
    if driver_text not in message:  # the store's errors quote a driver's text on one line
        driver_text = " ".join(driver_text.split())
    if driver_text and driver_text in message:
        message = message.replace(f" ({driver_text})", "").replace(f": {driver_text}", "").replace(driver_text, "")
        if "malformed" in driver_text or "not a database" in driver_text:
            message += " (the database file is damaged)"
    first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    return first if len(first) <= 400 else first[:397] + "..."

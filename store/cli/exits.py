"""Exit codes and the one-line errors the command line prints."""

from __future__ import annotations

import re

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


def os_reason(exc: OSError) -> str:
    """An OS error's reason in words ("no space left on device"), without its errno or the Python repr."""
    text = exc.strerror or str(exc)
    return text[:1].lower() + text[1:]


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a store error: a caller's bad value is usage, anything else unreadable/refused."""
    from store.errors import InvalidRecordError

    return USAGE if isinstance(exc, InvalidRecordError) else UNREADABLE


def one_line(exc: BaseException) -> str:
    """The error's own message on one line, without the database driver's text or its type's name,
    and with the driver's reason in the store's words where it is one a user acts on."""
    message = str(exc) or type(exc).__name__
    cause = exc.__cause__
    driver_text = str(getattr(cause, "orig", None) or cause or "")
    if driver_text not in message:  # the store's errors quote a driver's text on one line
        driver_text = " ".join(driver_text.split())
    if driver_text and driver_text in message:
        quoted = re.escape(driver_text)
        message = re.sub(rf"\s*\((?:\w+: )?{quoted}\)|: {quoted}|{quoted}", "", message)
        if "malformed" in driver_text or "not a database" in driver_text:
            message += " (the database file is damaged)"
    message = _TYPE_NAME.sub("", message)
    reason = driver_reason(driver_text)
    if reason is not None and reason not in message:
        message = f"{message.rstrip()}: {reason}"
    first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    return first if len(first) <= 400 else first[:397] + "..."


# A Python type's name left in parentheses ("... (OperationalError)"): never shown.
_TYPE_NAME = re.compile(r"\s*\((?:[A-Za-z_.]+\.)?[A-Z]\w*(?:Error|Exception)\)")
# What a PostgreSQL driver's text means, in words a user acts on (the driver's own text is never shown).
_REASONS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Connection refused", re.I), "connection refused: is the server running on that host and port?"),
    (
        re.compile(r'database "([^"]+)" does not exist'),
        "the database {0} does not exist: create it (CREATE DATABASE {0}) or fix the URL",
    ),
    (re.compile(r'role "([^"]+)" does not exist'), "the server has no user {0}: fix the URL's user"),
    (re.compile(r'password authentication failed for user "([^"]+)"'), "the server refused the password of user {0}"),
    (re.compile(r"no password supplied|fe_sendauth"), "the server asks for a password: put it in the URL or ~/.pgpass"),
    (
        re.compile(r"failed to resolve host '([^']+)'|could not translate host name \"([^\"]+)\""),
        "the host name {0} does not resolve",
    ),
    (
        re.compile(r'invalid (?:URI query parameter|connection option):? "([^"]+)"'),
        "the URL's option {0} is not one PostgreSQL takes (only ?schema= and libpq's options)",
    ),
    (re.compile(r"timeout expired", re.I), "the server did not answer within the connect timeout"),
    (
        re.compile(r"the database system is (?:starting up|shutting down|in recovery mode)"),
        "the server is starting up, shutting down or recovering: retry once it is up",
    ),
    (
        re.compile(r"permission denied for (?:schema|database) (\S+)"),
        "the URL's user may not use {0}: grant it or use another user",
    ),
)


def driver_reason(text: str) -> str | None:
    """A database driver's message as a reason in the store's words, or None when it is not one we know."""
    for pattern, words in _REASONS:
        found = pattern.search(text)
        if found is not None:
            return words.format(*[group for group in found.groups() if group is not None])
    return None

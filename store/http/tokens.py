"""What a bearer token must be, checked where it is configured rather than on the first request.

An HTTP header carries ASCII only: a token with any other character can never be sent by a
client (httpx refuses to encode it, a UTF-8 client sends bytes that never match), so it is
refused at start-up.  A server also refuses a short token: one that can be guessed is no
better than none.
"""

from __future__ import annotations

from store.errors import ConfigurationError

MIN_TOKEN_CHARS = 16  # ~96 bits from secrets.token_urlsafe; a short word is guessable
_MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def header_token(token: object) -> str:
    """A token a client can send: a non-empty string of visible ASCII (``!``..``~``), no spaces."""
    if not isinstance(token, str) or not token.strip():
        raise ConfigurationError("token must be a non-empty string")
    bad = sorted({ch for ch in token if not "!" <= ch <= "~"})
    if bad:
        shown = ", ".join(repr(ch) for ch in bad[:5])
        raise ConfigurationError(
            f"the token must be visible ASCII characters only (an HTTP header cannot carry {shown})"
        )
    return token


def server_token(token: object) -> str:
    """A token a server accepts: ``header_token`` and at least ``MIN_TOKEN_CHARS`` characters."""
    checked = header_token(token)
    if len(checked) < MIN_TOKEN_CHARS:
        raise ConfigurationError(
            f"the token is {len(checked)} characters; a server needs at least {MIN_TOKEN_CHARS} "
            f"(make one with {_MAKE_ONE})"
        )
    return checked

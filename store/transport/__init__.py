"""The complete-record transport: NeMo Gym's ``TokenSink``, ``TokenSource`` and
``LineageResolver`` on the store's event log (``TokenTransport``)."""

from store.transport.entries import token_digest
from store.transport.gym import TokenSnapshot
from store.transport.transport import TokenTransport, open_token_transport

__all__ = ["TokenSnapshot", "TokenTransport", "open_token_transport", "token_digest"]

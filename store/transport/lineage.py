"""Which committed entry a request continues, from the lineage fields the projection keeps.

The decision follows Gym's ``LineageResolver`` contract: candidates are the entries stamped with
the request's assistant fingerprint (by Gym's current fingerprint version, or unversioned), each
kept only when the request's leading items are exactly the context it was produced from (its
recorded length and conversation digest; an entry without a context digest never matches).
Candidates whose cumulative tokens are the same (digest and length) are one parent (the smallest
call id); anything but exactly one is unresolved, never a guess.  The hashing is Gym's own
(``store.transport.gym``).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Candidate(NamedTuple):
    """A ``token_entries`` row whose continuation fingerprint is the request's."""

    model_call_id: str
    event_seq: int
    token_digest: str | None
    cum_len: int | None
    parent_call_id: str | None
    prompt_is_delta: int
    fingerprint_version: int | None
    context_len: int
    context_digest: str


def pick_parent(candidates: list[Candidate], items: list[Any], lineage: Any) -> tuple[Candidate | None, str]:
    """The one entry the request continues, or None and why (``no_match``, ``ambiguous``)."""
    version = lineage.fingerprint_version
    kept = [
        candidate
        for candidate in candidates
        if candidate.fingerprint_version in (None, version) and _continues(candidate, items, lineage)
    ]
    if len(kept) > 1 and kept[0].token_digest and len({(c.token_digest, c.cum_len) for c in kept}) == 1:
        kept = [min(kept, key=lambda candidate: candidate.model_call_id)]  # identical tokens: interchangeable
    if len(kept) != 1:
        return None, "ambiguous" if kept else "no_match"
    return kept[0], ""


def _continues(candidate: Candidate, items: list[Any], lineage: Any) -> bool:
    if not candidate.context_digest or len(items) < candidate.context_len:
        return False
    return bool(lineage.conversation_digest(items[: candidate.context_len]) == candidate.context_digest)

"""NeMo Gym's objects, imported on first use only: the store never needs Gym to import.

With ``nemo_gym`` installed, a snapshot is Gym's ``TokenCaptureSnapshot`` holding Gym's
``TokenEntry`` objects, and the resolver answers Gym's ``LineageResolution`` computed with Gym's
own fingerprint functions (the protocol asks implementations to use Gym's hashing, not a copy).
Without it, a snapshot is the store's ``TokenSnapshot`` of plain JSON mappings, and ``resolve``
raises ``ConfigurationError``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import msgspec

from store.errors import ConfigurationError


@dataclass(frozen=True)
class TokenSnapshot:
    """A frozen rollout without Gym installed: the fields of Gym's ``TokenCaptureSnapshot``,
    each entry the JSON mapping it was put as."""

    rollout_id: str
    entries: tuple[Any, ...]
    incomplete: bool
    snapshot_id: str
    version: int


@dataclass(frozen=True)
class GymLineage:
    """What the resolver needs of Gym: its fingerprints and its resolution types."""

    assistant_fingerprint: Any
    conversation_digest: Any
    fingerprint_version: int
    resolution: Any  # LineageResolution
    match: Any  # LineageMatch
    status: Any  # ParentResolutionStatus


@functools.cache
def gym_records() -> tuple[Any, Any] | None:
    """(``TokenEntry``, ``TokenCaptureSnapshot``), or None when Gym is not installed."""
    try:
        from nemo_gym.token_id_capture.protocols import TokenCaptureSnapshot
        from nemo_gym.token_id_capture.records import TokenEntry
    except ImportError:
        return None
    return TokenEntry, TokenCaptureSnapshot


@functools.cache
def gym_lineage() -> GymLineage:
    """Gym's lineage functions and types; ``ConfigurationError`` when Gym is not installed."""
    try:
        from nemo_gym.token_id_capture import fingerprint
        from nemo_gym.token_id_capture.protocols import LineageMatch, LineageResolution
        from nemo_gym.token_id_capture.records import ParentResolutionStatus
    except ImportError as exc:
        raise ConfigurationError(
            f"resolve() matches entries by NeMo Gym's own fingerprints: install nemo-gym ({exc})"
        ) from None
    return GymLineage(
        assistant_fingerprint=fingerprint.assistant_fingerprint,
        conversation_digest=fingerprint.conversation_digest,
        fingerprint_version=int(fingerprint.FINGERPRINT_VERSION),
        resolution=LineageResolution,
        match=LineageMatch,
        status=ParentResolutionStatus,
    )


def entries(payloads: list[bytes]) -> tuple[Any, ...]:
    """The payloads as Gym's ``TokenEntry`` objects when Gym is installed, else JSON mappings."""
    records = gym_records()
    if records is None:
        return tuple(msgspec.json.decode(payload) for payload in payloads)
    return tuple(records[0].model_validate_json(payload) for payload in payloads)


def snapshot(rollout_id: str, payloads: list[bytes], incomplete: bool, snapshot_id: str, version: int) -> Any:
    """A snapshot of the payloads: Gym's objects when Gym is installed, else ``TokenSnapshot``."""
    records = gym_records()
    if records is None:
        return TokenSnapshot(rollout_id, entries(payloads), incomplete, snapshot_id, version)
    return records[1](
        rollout_id=rollout_id,
        entries=entries(payloads),
        incomplete=incomplete,
        snapshot_id=snapshot_id,
        version=version,
    )

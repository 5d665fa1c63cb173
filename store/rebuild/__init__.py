"""Rebuild, Gym-compatible (wire-contract 6.1-6.5): pure functions over a receipt and snapshots.

Verify and linearize (6.1, 6.2), terminal selection and witness attribution (6.3, 6.4), and the
routed-experts envelope (6.5).  ``store.rebuild`` hands on the public names of its modules.
"""

from store.rebuild.routed_rows import with_routed_experts
from store.rebuild.routes import (
    MISSING_ROUTE_SENTINEL,
    ROUTED_EXPERTS_ENVELOPE_VERSION,
    RoutedExperts,
    decode_routed_experts,
    encode_routed_experts,
)
from store.rebuild.terminal import (
    ASSISTANT_FINGERPRINT_VERSION,
    TerminalAttribution,
    TerminalSelection,
    assistant_fingerprint,
    resolve_terminal,
    select_terminal_call,
)
from store.rebuild.verify import (
    ExtrasCommitment,
    LinearizedRollout,
    LinearizedRow,
    SkippedChain,
    WeightVersionSpan,
    linearize,
    verify_and_linearize,
    verify_and_linearize_all,
)

__all__ = [
    "ASSISTANT_FINGERPRINT_VERSION",
    "MISSING_ROUTE_SENTINEL",
    "ROUTED_EXPERTS_ENVELOPE_VERSION",
    "ExtrasCommitment",
    "LinearizedRollout",
    "LinearizedRow",
    "RoutedExperts",
    "SkippedChain",
    "TerminalAttribution",
    "TerminalSelection",
    "WeightVersionSpan",
    "assistant_fingerprint",
    "decode_routed_experts",
    "encode_routed_experts",
    "linearize",
    "resolve_terminal",
    "select_terminal_call",
    "verify_and_linearize",
    "verify_and_linearize_all",
    "with_routed_experts",
]

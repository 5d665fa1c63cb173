"""``versions``: generated tokens by policy version, and the calls holding stale tokens."""

from __future__ import annotations

from typing import Any

import click

from store.cli import exits, output
from store.cli.browse import known_rollout
from store.cli.opening import STORE_HELP, read_only, store_argument


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store versions demo-store/demo.db\n\n"
    "  staging-store versions demo-store/demo.db --stale 3 --max-lag 1 --json",
)
@store_argument
@click.option("--rollout", "rollout_id", metavar="ROLLOUT", help="Only this rollout (every attempt).")
@click.option(
    "--stale",
    "current",
    type=click.IntRange(min=0),
    metavar="CURRENT",
    help="Also list calls holding tokens more than --max-lag versions behind policy version CURRENT.",
)
@click.option(
    "--max-lag",
    type=click.IntRange(min=0),
    metavar="N",
    help="With --stale (only): how many versions behind CURRENT is still fresh.  [default: 0]",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def versions(store: str | None, rollout_id: str | None, current: int | None, max_lag: int | None, as_json: bool) -> int:
    """Show generated tokens per policy version, store-wide and per rollout (every attempt counted once).

    Exit 1 when --rollout names a rollout the store does not hold.
    """
    if current is not None and rollout_id is not None:
        raise click.UsageError("--stale covers the whole store; drop --rollout")
    if max_lag is not None and current is None:
        raise click.UsageError("--max-lag only applies with --stale CURRENT")
    max_lag = max_lag or 0
    with read_only(store) as opened:
        totals = opened.version_tokens(rollout_id)
        per_rollout = opened.rollout_versions(rollout_id)
        if rollout_id is not None and not per_rollout:
            known_rollout(opened, rollout_id)
        stale = None if current is None else opened.stale(current, max_lag)
    shaped: dict[str, Any] = {
        "tokens_by_version": {str(version): count for version, count in sorted(totals.items())},
        "rollouts": [
            {
                "rollout_id": entry.rollout_id,
                "tokens_by_version": {str(v): n for v, n in sorted(entry.tokens_by_version.items())},
                "oldest_version": entry.oldest_version,
                "newest_version": entry.newest_version,
                "generated_tokens": entry.generated_tokens,
            }
            for entry in per_rollout
        ],
        "stale": None
        if stale is None
        else {
            "current_version": stale.current_version,
            "max_lag": stale.max_lag,
            "stale_tokens": stale.stale_tokens,
            "calls": [
                {
                    "rollout_id": call.rollout_id,
                    "capture_key": call.capture_key,
                    "model_call_id": call.model_call_id,
                    "state": call.state,
                    "oldest_version": call.oldest_version,
                    "stale_tokens": call.stale_tokens,
                    "generated_tokens": call.generated_tokens,
                }
                for call in stale.calls
            ],
        },
    }
    if as_json:
        output.emit_json(shaped)
        return exits.OK
    output.listing("generated tokens by policy version", ["version", "tokens"], [list(item) for item in totals.items()])
    output.listing(
        "\nper rollout",
        ["rollout", "oldest", "newest", "generated tokens"],
        [
            [entry["rollout_id"], entry["oldest_version"], entry["newest_version"], entry["generated_tokens"]]
            for entry in shaped["rollouts"]
        ],
    )
    if stale is not None:
        output.listing(
            f"\n{len(stale.calls)} call(s) with tokens more than {max_lag} version(s) behind {current}: "
            f"{stale.stale_tokens} stale tokens",
            ["call", "state", "oldest", "stale tokens", "generated tokens"],
            [
                [f"{c.capture_key}/{c.model_call_id}", c.state, c.oldest_version, c.stale_tokens, c.generated_tokens]
                for c in stale.calls
            ],
        )
    return exits.OK

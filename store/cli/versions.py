"""``versions``: generated tokens by policy version, and the calls holding stale tokens."""

from __future__ import annotations

from typing import Any

import click

from store.cli import exits, output
from store.cli.browse import known_rollout
from store.cli.opening import STORE_HELP, checked_names, read_only, store_argument


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store versions demo-store/demo.db\n\n"
    "  staging-store versions demo-store/demo.db --stale 3 --max-lag 1 --json",
)
@store_argument
@click.option(
    "--rollout",
    "rollout_ids",
    multiple=True,
    callback=checked_names,
    metavar="ROLLOUT",
    help="Only this rollout (every attempt; repeatable).",
)
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
@output.listing_options
def versions(
    store: str | None,
    rollout_ids: tuple[str, ...],
    current: int | None,
    max_lag: int | None,
    fmt: str,
    limit: int | None,
) -> int:
    """Show generated tokens per policy version, store-wide and per rollout, sorted by rollout id
    (every attempt counted once).

    --jsonl, --csv and --tsv print one line per rollout (with --stale: per stale call); --limit
    keeps the first N of those.  Exit 1 when a --rollout names a rollout the store does not hold.
    """
    from collections import Counter

    if current is not None and rollout_ids:
        raise click.UsageError("--stale covers the whole store; drop --rollout")
    if max_lag is not None and current is None:
        raise click.UsageError("--max-lag only applies with --stale CURRENT")
    max_lag = max_lag or 0
    with read_only(store) as opened:
        if not rollout_ids:
            totals = opened.version_tokens()
            per_rollout = opened.rollout_versions()
        else:
            per_rollout, counted = [], Counter[int]()
            for rollout_id in dict.fromkeys(rollout_ids):
                part = opened.rollout_versions(rollout_id)
                if not part:
                    known_rollout(opened, rollout_id)
                per_rollout += [entry for entry in part if entry not in per_rollout]
            for entry in per_rollout:
                counted.update(entry.tokens_by_version)
            totals = {version: counted[version] for version in sorted(counted)}
        per_rollout = output.limited(sorted(per_rollout, key=lambda entry: entry.rollout_id), limit)
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
    if stale is not None and limit is not None:
        shaped["stale"]["calls"] = shaped["stale"]["calls"][:limit]
    if fmt != "table":
        rows = shaped["rollouts"] if shaped["stale"] is None else shaped["stale"]["calls"]
        fields = list(rows[0]) if rows else (_STALE_FIELDS if stale is not None else _ROLLOUT_FIELDS)
        output.emit_listing(fmt, document=shaped, rows=rows, fields=fields, title=None, columns=[], table_rows=[])
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
                for c in stale.calls[: len(shaped["stale"]["calls"])]
            ],
        )
    return exits.OK


_ROLLOUT_FIELDS = ["rollout_id", "tokens_by_version", "oldest_version", "newest_version", "generated_tokens"]
_STALE_FIELDS = [
    "rollout_id", "capture_key", "model_call_id", "state", "oldest_version", "stale_tokens", "generated_tokens",
]  # fmt: skip

"""``receipts``: the generation-cut receipts kept in the log, by checkpoint or by rollout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from store.cli import exits, output
from store.cli.browse import known_rollout
from store.cli.opening import STORE_HELP, checked_names, read_only, shown, store_argument

if TYPE_CHECKING:
    from store.wire.cut_records import GenerationCutPrefixAck


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store receipts demo-store/demo.db --rollout run1-r0\n\n"
    "  staging-store receipts demo-store/demo.db --checkpoint checkpoint-1 --json",
)
@store_argument
@click.option("--checkpoint", "checkpoint_id", callback=checked_names, help="Only this checkpoint's receipts.")
@click.option(
    "--rollout",
    "rollout_id",
    callback=checked_names,
    help="Only acknowledgements of this rollout (bare id or capture key).",
)
@output.listing_options
def receipts(store: str | None, checkpoint_id: str | None, rollout_id: str | None, fmt: str, limit: int | None) -> int:
    """List the cut receipts workers returned, oldest first, one row per acknowledged call.

    What an orchestrator that lost its process needs to continue a cut call: the staging keys,
    generated-token count, digest and output limit of each durable prefix (a worker continues
    one with RolloutTokenCapture.continue_latest_cut), and where it is durable: "local" (in the
    store that served the cut) or "replicated" (in that store's replica before it was
    acknowledged: a host loss keeps it).  The store is opened read-only.  --json prints the
    receipts as the workers returned them and the domain of each; --jsonl one receipt per line,
    {"receipt", "domain"}; --csv and --tsv the table's rows.  --limit N keeps the first N receipts.
    Exit 1 when --rollout names a rollout the store does not hold, or --checkpoint a checkpoint
    it kept no receipt of.
    """
    from store.wire.codec import to_json

    with read_only(store) as opened:
        # The domain is kept with each receipt's event (not in the receipt's wire bytes, which are Gym's).
        kept = opened.kept_receipts(checkpoint_id=checkpoint_id, rollout_id=rollout_id)
        found = [receipt for receipt, _ in kept]
        domains = [domain for _, domain in kept]
        where = shown(opened)
        if rollout_id is not None and not found:
            # As given: ``lineage`` resolves an attempt's capture key to its rollout itself, and
            # leaves a rollout id that merely ends like one ("job-a7", no "job") as it is.
            known_rollout(opened, rollout_id)
    if checkpoint_id is not None and not found and rollout_id is None:
        raise exits.CommandError(f"no receipt of checkpoint {checkpoint_id!r} in the store", exits.PROBLEMS)
    found, domains = output.limited(found, limit), output.limited(domains, limit)
    if fmt in ("json", "jsonl"):
        import json

        shown_receipts = [json.loads(to_json(receipt)) for receipt in found]
        output.emit_listing(
            fmt,
            document={"store": where, "receipts": shown_receipts, "domains": domains},
            rows=[{"receipt": r, "domain": d} for r, d in zip(shown_receipts, domains, strict=True)],
            fields=[],
            title=None,
            columns=[],
            table_rows=[],
        )
        return exits.OK
    rows = [
        _row(receipt.checkpoint_id, domain, ack)
        for receipt, domain in zip(found, domains, strict=True)
        for ack in receipt.prefixes
        if rollout_id is None or rollout_id in (ack.rollout_id, _capture_key(ack))
    ]
    columns = ["checkpoint", "capture key", "call", "disposition", "domain", "kind", "tokens", "limit", "finish"]
    columns.append("keys")
    if fmt in ("csv", "tsv"):
        fields = [column.replace(" ", "_") for column in columns]
        table = [dict(zip(fields, row, strict=True)) for row in rows]
        output.emit_delimited(fields, table, "," if fmt == "csv" else "\t")
        return exits.OK
    output.listing(f"{len(found)} receipt(s), {len(rows)} acknowledgement(s)", columns, rows)
    output.show(f"store: {where}")
    return exits.OK


def _capture_key(ack: GenerationCutPrefixAck) -> str:
    from store.wire.cut_records import capture_key

    return capture_key(ack.rollout_id, ack.attempt_index)


def _row(checkpoint_id: str, domain: str | None, ack: GenerationCutPrefixAck) -> list[Any]:
    return [
        checkpoint_id,
        _capture_key(ack),
        ack.model_call_id,
        ack.disposition,
        # Only a durable_prefix acknowledgement is durable somewhere: a durable_failure names none.
        domain if ack.disposition == "durable_prefix" else None,
        ack.cut_kind,
        ack.prefix_token_count,
        ack.effective_output_limit,
        ack.terminal_finish_reason,
        len(ack.staging_keys),
    ]

"""Read views: ``rollouts``, ``lineage`` (a rollout's call tree), ``keys`` and ``show`` (one key or call)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from store.cli import exits, output
from store.cli.opening import STORE_HELP, checked_names, read_only, store_and, store_argument

if TYPE_CHECKING:
    from store.lineage import LineageCall, RolloutLineage
    from store.queries.reads import CallInfo, StoredChunk
    from store.store import Store


MATCH_HELP = "Only rollouts whose id matches this shell pattern (run1-*).  [default: every rollout]"


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store rollouts demo-store/demo.db\n\n"
    "  staging-store rollouts demo-store/demo.db --fenced --capture-keys | "
    "staging-store delete demo-store/demo.db --from-file - --dry-run",
)
@store_argument
@click.option("--fenced", is_flag=True, help="Only rollouts with a retired (fenced) attempt.  [default: every rollout]")
@click.option("--match", "pattern", metavar="GLOB", help=MATCH_HELP)
@click.option(
    "--capture-keys",
    "capture_keys",
    is_flag=True,
    help="Print only capture keys, one per line (with --fenced: the fenced attempts), for "
    "`delete --from-file -`.  [default: a table]",
)
@output.listing_options
def rollouts(
    store: str | None, fenced: bool, pattern: str | None, capture_keys: bool, fmt: str, limit: int | None
) -> int:
    """List every rollout, sorted by id, with its attempts, its calls by state (newest attempt of
    each call) and its fenced attempts (retired: late writes refused)."""
    import fnmatch

    if capture_keys and fmt != "table":
        raise click.UsageError(f"--capture-keys prints plain lines; it takes no --{fmt}")
    with read_only(store) as opened:
        found = opened.rollouts()
    shaped: list[dict[str, Any]] = [
        {
            "rollout_id": summary.rollout_id,
            "attempts": list(summary.attempts),
            "calls": summary.calls,
            "completed": summary.completed,
            "failed": summary.failed,
            "fenced": list(summary.fenced),
        }
        for summary in found
        if (not fenced or summary.fenced) and (pattern is None or fnmatch.fnmatchcase(summary.rollout_id, pattern))
    ]
    shaped = output.limited(shaped, limit)
    if capture_keys:
        keys = [key for row in shaped for key in (row["fenced"] if fenced else row["attempts"])]
        output.emit_lines(keys)
        return exits.OK
    output.emit_listing(
        fmt,
        document={"rollouts": shaped},
        rows=shaped,
        fields=["rollout_id", "attempts", "calls", "completed", "failed", "fenced"],
        title=f"{len(shaped)} rollout(s)",
        columns=["rollout", "attempts", "calls", "completed", "failed", "fenced"],
        table_rows=[
            [
                r["rollout_id"],
                ", ".join(r["attempts"]),
                r["calls"],
                r["completed"],
                r["failed"],
                ", ".join(r["fenced"]) or None,
            ]
            for r in shaped
        ],
    )
    return exits.OK


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store lineage demo-store/demo.db run1-r0\n\n"
    "  STAGING_STORE=demo-store/demo.db staging-store lineage run1-r0 --json",
)
@click.argument("arguments", nargs=-1, metavar="[STORE] ROLLOUT")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a tree.")
def lineage(arguments: tuple[str, ...], as_json: bool) -> int:
    """Show a rollout's call tree over every attempt: parents, continuations, states, versions, worker pids.

    ROLLOUT is the bare rollout id (an attempt's capture key names its rollout too).
    Exit 1 when the store has no such rollout.
    """
    store, rollout_id = store_and(arguments, "ROLLOUT")
    with read_only(store) as opened:
        found = opened.lineage(rollout_id)
    if found is None:
        raise exits.CommandError(no_rollout(rollout_id), exits.PROBLEMS)
    if as_json:
        output.emit_json(lineage_json(found))
    else:
        output.show(_tree(found))
    return exits.OK


def no_rollout(rollout_id: str) -> str:
    return f"no rollout {rollout_id!r} in the store"


def known_rollout(opened: Store, rollout_id: str) -> None:
    """A --rollout the store does not hold is a problem found (exit 1), as for ``lineage``;
    a rollout whose keys were all deleted is not known any more either."""
    if opened.lineage(rollout_id) is None:
        raise exits.CommandError(no_rollout(rollout_id), exits.PROBLEMS)


def lineage_json(found: RolloutLineage) -> dict[str, Any]:
    return {
        "rollout_id": found.rollout_id,
        "attempts": list(found.attempts),
        "calls": [_call_json(call) for call in found.calls],
    }


def _call_json(call: LineageCall) -> dict[str, Any]:
    resumes = call.resumes
    return {
        "capture_key": call.capture_key,
        "attempt": call.attempt,
        "model_call_id": call.model_call_id,
        "parent_call_id": call.parent_call_id,
        "state": call.state,
        "mode": call.mode,
        "prev_len": call.prev_len,
        "cum_len": call.cum_len,
        "generated_tokens": call.generated_tokens,
        "admitted_version": call.admitted_version,
        "oldest_version": call.oldest_version,
        "newest_version": call.newest_version,
        "version_spans": [[span.start, span.end, span.weight_version] for span in call.version_spans],
        "admitted_at": call.admitted_at,
        "worker_pid": call.worker_pid,
        "resumes": None
        if resumes is None
        else {
            "capture_key": resumes.capture_key,
            "attempt": resumes.attempt,
            "model_call_id": resumes.model_call_id,
            "checkpoint_id": resumes.checkpoint_id,
            "staging_keys": list(resumes.staging_keys),
            "generation_token_count": resumes.generation_token_count,
        },
        "resumed_by": call.resumed_by,
        "retired": call.retired,
    }


def _versions(call: LineageCall) -> str:
    if call.oldest_version is None:
        return "no tokens"
    if call.oldest_version == call.newest_version:
        return f"v{call.oldest_version}"
    return f"v{call.oldest_version}..v{call.newest_version}"


def _label(call: LineageCall) -> str:
    colour = {"completed": "green", "failed": "red", "retired": "dim"}.get(call.state, "yellow")
    parts = [
        f"[bold]{call.model_call_id}[/bold]",
        f"[{colour}]{call.state}[/{colour}]",
        f"{call.generated_tokens} generated of {call.cum_len if call.cum_len is not None else '?'} tokens",
        _versions(call),
    ]
    if call.worker_pid is not None:
        parts.append(f"pid {call.worker_pid}")
    if call.resumes is not None:
        cut = call.resumes
        parts.append(
            f"continues {cut.capture_key}/{cut.model_call_id} ({cut.generation_token_count} tokens reused"
            + (f", {cut.checkpoint_id})" if cut.checkpoint_id else ")")
        )
    if call.resumed_by is not None:
        parts.append(f"continued by {call.resumed_by}")
    return "  ".join(parts)


def _tree(found: RolloutLineage) -> Any:
    from rich.markup import escape
    from rich.tree import Tree

    root = Tree(f"rollout [bold]{escape(found.rollout_id)}[/bold]")
    for attempt_key in found.attempts:
        calls = [call for call in found.calls if call.capture_key == attempt_key]
        fence = "  [dim](retired: late writes refused)[/dim]" if calls and calls[0].retired else ""
        branch = root.add(f"attempt {calls[0].attempt if calls else '?'}: {escape(attempt_key)}{fence}")
        nodes: dict[str, Any] = {}
        for call in calls:  # parents commit before their children
            parent = nodes.get(call.parent_call_id or "", branch)
            nodes[call.model_call_id] = parent.add(_label(call))
    return root


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store keys demo-store/demo.db\n\n"
    "  staging-store keys demo-store/demo.db --rollout run1-r0 --json",
)
@store_argument
@click.option(
    "--rollout",
    "rollout_ids",
    multiple=True,
    callback=checked_names,
    metavar="ROLLOUT",
    help="Only this rollout's keys (every attempt; repeatable).",
)
@output.listing_options
def keys(store: str | None, rollout_ids: tuple[str, ...], fmt: str, limit: int | None) -> int:
    """List the live staging keys, in key order: the call each holds, its event and kind, its digest.

    Exit 1 when a --rollout names a rollout the store does not hold.
    """
    with read_only(store) as opened:
        if not rollout_ids:
            found = opened.staged_keys()
        else:
            found = []
            for rollout_id in dict.fromkeys(rollout_ids):
                part = opened.staged_keys(rollout_id)
                if not part:
                    known_rollout(opened, rollout_id)
                found += part
            found.sort(key=lambda key: key.staging_key)
    found = output.limited(found, limit)
    shaped: list[dict[str, Any]] = [
        {
            "staging_key": key.staging_key,
            "rollout_id": key.rollout_id,
            "model_call_id": key.model_call_id,
            "event_seq": key.event_seq,
            "kind": key.kind,
            "digest": key.digest,
        }
        for key in found
    ]
    output.emit_listing(
        fmt,
        document={"keys": shaped},
        rows=shaped,
        fields=["staging_key", "rollout_id", "model_call_id", "event_seq", "kind", "digest"],
        title=f"{len(shaped)} key(s)",
        columns=["key", "call", "kind", "event", "digest"],
        table_rows=[
            [
                key["staging_key"],
                f"{key['rollout_id']}/{key['model_call_id']}",
                key["kind"],
                key["event_seq"],
                key["digest"][:16] if key["digest"] else None,
            ]
            for key in shaped
        ],
    )
    return exits.OK


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store show demo-store/demo.db run1-r0/c0\n\n"
    "  staging-store show demo-store/demo.db run1-r0-a1/c2 --tokens --json",
)
@click.argument("arguments", nargs=-1, metavar="[STORE] KEY")
@click.option("--tokens", is_flag=True, help="Include the record's token ids, mask and log-probs.  [default: off]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def show(arguments: tuple[str, ...], tokens: bool, as_json: bool) -> int:
    """Show one staging key's record (verified) or one call (ROLLOUT/CALL) with its lineage fields.

    KEY is a staging key (a call's key is ROLLOUT/CALL; cut keys start with
    __generation_cut__/).  Exit 1 when it names neither a key nor a call.
    """
    from store.errors import UnknownKeyError

    store, key = store_and(arguments, "KEY")
    with read_only(store) as opened:
        chunk: StoredChunk | None
        try:
            (chunk,) = opened.fetch_chunks([key])
            opened.fetch([key])  # verifies the digest too
        except UnknownKeyError:
            chunk = None
        call = None
        if chunk is not None:
            call = opened.call(chunk.snapshot.rollout_id, chunk.snapshot.model_call_id)
        elif "/" in key:
            rollout_id, _, model_call_id = key.rpartition("/")
            call = opened.call(rollout_id, model_call_id) if rollout_id and model_call_id else None
    if chunk is None and call is None:
        raise exits.CommandError(f"no staging key or call {key!r} in the store", exits.PROBLEMS)
    shaped: dict[str, Any] = {
        "key": key,
        "record": None if chunk is None else _record_json(chunk, tokens),
        "call": None if call is None else call_json(call),
    }
    if as_json:
        output.emit_json(shaped)
    else:
        rows: list[list[Any]] = []
        for section in ("record", "call"):
            for name, value in (shaped[section] or {}).items():
                rows.append([section, name, value if not isinstance(value, list) else _short(value)])
        output.show(output.table(key, ["part", "field", "value"], rows))
    return exits.OK


def _short(values: list[Any]) -> str:
    return str(values) if len(values) <= 12 else f"{values[:12]} ... ({len(values)} items)"


def _record_json(chunk: StoredChunk, tokens: bool) -> dict[str, Any]:
    snapshot = chunk.snapshot
    shaped: dict[str, Any] = {
        "kind": chunk.kind.value,
        "schema_version": snapshot.schema_version,
        "rollout_id": snapshot.rollout_id,
        "model_call_id": snapshot.model_call_id,
        "parent_call_id": snapshot.parent_call_id,
        "mode": snapshot.mode,
        "prev_len": snapshot.prev_len,
        "delta_len": snapshot.delta_len,
        "cum_len": snapshot.cum_len,
        "weight_version": snapshot.weight_version,
        "generated_tokens": snapshot.generated_token_count,
        "digest": snapshot.digest,
        "extras_digest": snapshot.extras_digest,
        "chain_hash": snapshot.chain_hash,
        "cumulative_hash": snapshot.cumulative_hash,
        "version_spans": [[start, end, version] for start, end, version in chunk.spans],
    }
    if tokens:
        columns = snapshot.columns
        shaped["token_ids"] = [int(v) for v in columns.token_ids]
        shaped["token_mask"] = [float(v) for v in columns.token_mask]
        shaped["generation_log_probs"] = [float(v) for v in columns.log_probs]
    return shaped


def call_json(call: CallInfo) -> dict[str, Any]:
    return {
        "rollout_id": call.rollout_id,
        "model_call_id": call.model_call_id,
        "state": call.state,
        "parent_call_id": call.parent_call_id,
        "mode": call.mode,
        "prev_len": call.prev_len,
        "cum_len": call.cum_len,
        "generated_tokens": call.generated_tokens,
        "continues": None if call.continues is None else list(call.continues),
        "admitted_version": call.admitted_version,
        "oldest_version": call.oldest_version,
        "newest_version": call.newest_version,
        "version_spans": [[span.start, span.end, span.weight_version] for span in call.version_spans],
    }

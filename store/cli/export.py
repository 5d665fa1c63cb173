"""``export``: every rollout's verified, linearized rows as JSON Lines."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import click

from store.cli import exits, output
from store.cli.opening import STORE_HELP, checked_names, read_only, shown, store_argument


@click.command(
    epilog=f"{STORE_HELP}\n\nExamples:\n\n  staging-store export demo-store/demo.db -o rollouts.jsonl\n\n"
    "  staging-store export demo-store/demo.db --rollout run1-r0 | head -c 300",
)
@store_argument
@click.option(
    "-o",
    "--output",
    "target",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write the lines to FILE (a temporary file beside it, renamed to FILE once complete: an "
    "interrupted export leaves FILE as it was).  [default: stdout]",
)
@click.option(
    "--rollout",
    "rollout_ids",
    multiple=True,
    callback=checked_names,
    metavar="ROLLOUT",
    help="Only this rollout (repeatable).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the export report as JSON (on stderr when the lines go to stdout).",
)
def export(store: str | None, target: Path | None, rollout_ids: tuple[str, ...], as_json: bool) -> int:
    """Write one JSON object per linearized row of every rollout (verified as written).

    Each line holds token_ids, token_mask, logprobs, model_call_ids, prompt_len,
    weight_versions, token_policy_versions, ...; a rollout that fails to verify writes
    nothing and is reported.  Exit 0 when every rollout was exported, 1 otherwise (also
    for a --rollout the store does not hold).
    """
    if target is not None and target == Path():  # -o '' (a Path of it is the current folder)
        raise click.BadParameter("it is empty; name the file to write", param_hint="'-o' / '--output'")
    if target is not None and not target.parent.is_dir():
        raise click.BadParameter(f"the folder {target.parent} does not exist", param_hint="'-o' / '--output'")
    from store.errors import InvalidRecordError

    with read_only(store) as opened, output.progress_bar("exporting") as progress:
        try:
            report = opened.export_jsonl(
                target if target is not None else sys.stdout.buffer,
                rollout_ids=list(rollout_ids) or None,
                progress=progress,
            )
        except InvalidRecordError as exc:  # the library names its function; the user named -o
            if target is None:
                raise
            reason = str(exc).partition(f"{target}: ")[2] or exits.one_line(exc)
            reason = reason[:1].lower() + reason[1:]
            raise exits.CommandError(f"cannot write the export to {target} (-o): {reason}", exits.USAGE) from exc
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise
            raise exits.CommandError(
                f"cannot write the export to {target if target is not None else 'stdout'}: {exits.os_reason(exc)}"
            ) from exc
        where = shown(opened)
    shaped = {
        "store": where,
        "output": str(target) if target is not None else "-",
        "ok": report.ok,
        "rollouts": report.rollouts,
        "rows": report.rows,
        "failures": [{"rollout_id": f.rollout_id, "code": f.code, "detail": f.detail} for f in report.failures],
    }
    to_stderr = target is None
    if as_json:
        import json

        text = json.dumps(shaped, indent=2) + "\n"
        (sys.stderr if to_stderr else sys.stdout).write(text)
    elif not (to_stderr and output.QUIET[0]):  # -q: no report on stderr beside the lines
        summary = f"exported {report.rows} row(s) of {report.rollouts} rollout(s) to {shaped['output']}"
        lines = [summary] + [f"  not exported: {f.rollout_id}: {f.code}: {f.detail}" for f in report.failures]
        (sys.stderr if to_stderr else sys.stdout).write("\n".join(lines) + "\n")
    return exits.OK if report.ok else exits.PROBLEMS

"""``demo``: the main job, end to end (see ``store.demo``)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from store.cli import exits, invocation, output

DEFAULT_PATH = "demo-store/demo.db"


@click.command(
    epilog="Example: staging-store demo --rollouts 8 --workers 4 --tokens 256 --seed 7\n\n"
    "Exit 0 when everything verified, 1 when anything did not (the summary says what).",
)
@click.option(
    "--path",
    default=DEFAULT_PATH,
    show_default=True,
    help="SQLite store file to create or add a run to; its folder is created if the folder above it exists.",
)
@click.option("--rollouts", type=click.IntRange(1, 64), default=8, show_default=True, help="Rollouts to serve.")
@click.option("--workers", type=click.IntRange(1, 8), default=3, show_default=True, help="Worker processes.")
@click.option(
    "--tokens", type=click.IntRange(8, 4096), default=96, show_default=True, help="Tokens each call generates."
)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True, help="Engine seed.")
@click.option(
    "--engine",
    "engine_kind",
    type=click.Choice(["toy", "transformers"]),
    default="toy",
    show_default=True,
    help="toy: seeded token ids, nothing to install; transformers: a tiny random-weight Llama "
    "decoding with a KV cache (needs torch and the [transformers] extra; nothing is downloaded).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def demo(path: str, rollouts: int, workers: int, tokens: int, seed: int, engine_kind: str, as_json: bool) -> int:
    """Cut, crash, restore, continue, audit: the whole story on a SQLite file, in seconds.

    Worker processes serve 3-turn rollouts from a deterministic toy engine (seeded token ids
    and log-probs, no model download), staging through RolloutTokenCapture.  Mid-decoding a
    checkpoint cuts the in-flight calls; every worker is killed with SIGKILL; fresh workers
    restore as the next attempt and continue each cut call from its validated prefix; the
    dead attempt is retired (a late write from it is tried and must be refused); then
    the store is audited and exported, and every exported rollout is checked token for token
    against the same rollout decoded without a crash.
    """
    from store.cli.opening import remember
    from store.demo.run import run_demo

    if not path.strip():
        raise click.BadParameter("it is empty; name the store file to create or add a run to", param_hint="'--path'")
    remember(path)  # errors name the path as given, not resolved
    folder = Path(path).expanduser().absolute().parent
    if not folder.is_dir() and not folder.parent.is_dir():
        raise click.BadParameter(
            f"the folder {folder.parent} does not exist (the demo creates only the store's own folder)",
            param_hint="'--path'",
        )
    with _steps() as step:
        summary = run_demo(
            path, rollouts=rollouts, workers=workers, tokens=tokens, seed=seed, step=step, engine_kind=engine_kind
        )
    shaped = {
        "ok": summary.ok,
        "run": summary.run,
        "store": summary.store,
        "export": summary.export,
        "rollouts": summary.rollouts,
        "calls": summary.calls,
        "records": summary.records,
        "tokens_staged": summary.tokens_staged,
        "tokens_reused": summary.tokens_reused,
        "tokens_regenerated": summary.tokens_regenerated,
        "tokens_after_restore": summary.tokens_after_restore,
        "continuations_validated": summary.continuations_validated,
        "workers_lost": summary.workers_lost,
        "workers_rejoined": summary.workers_rejoined,
        "coordinator_log": summary.coordinator_log,
        "attempts_retired": summary.attempts_retired,
        "late_writes_refused": summary.late_writes_refused,
        "audit_ok": summary.audit_ok,
        "audit_problems": summary.audit_problems,
        "exported_rows": summary.exported_rows,
        "exported_rollouts": summary.exported_rollouts,
        "rollouts_identical": summary.rollouts_identical,
        "seconds": summary.seconds,
        "failures": summary.failures,
    }
    if as_json:
        output.emit_json(shaped)
    else:
        _show(shaped)
    return exits.OK if summary.ok else exits.PROBLEMS


class _steps:
    """Phase lines on stderr when it is a terminal (a spinner), silent when piped."""

    def __enter__(self) -> Any:

        if not output.chatty():
            return None
        from rich.console import Console

        self._console = Console(stderr=True)
        self._status = self._console.status("starting")
        self._status.start()

        def step(label: str) -> None:
            self._console.log(label)
            self._status.update(label)

        return step

    def __exit__(self, *exc: object) -> None:
        if hasattr(self, "_status"):
            self._status.stop()


def _show(s: dict[str, Any]) -> None:
    from rich.markup import escape

    rows = [
        ["rollouts (3 turns each)", s["rollouts"]],
        ["calls completed", s["calls"]],
        ["records staged", s["records"]],
        ["tokens staged", s["tokens_staged"]],
        ["tokens reused from cuts", s["tokens_reused"]],
        ["tokens regenerated (decoded after the cut, lost)", s["tokens_regenerated"]],
        ["tokens decoded in cut calls after the restore", s["tokens_after_restore"]],
        ["continuations validated", s["continuations_validated"]],
        [
            "workers lost (SIGKILL) / rejoined, as the coordinator logged them",
            f"{s['workers_lost']} / {s['workers_rejoined']}",
        ],
        ["dead attempts retired (Store.retire)", s["attempts_retired"]],
        ["late writes from a dead attempt refused", s["late_writes_refused"]],
        ["audit", "ok" if s["audit_ok"] else f"FAILED ({s['audit_problems']} problems)"],
        ["rows exported (every rollout of the store)", s["exported_rows"]],
        ["rollouts identical to an uninterrupted run", f"{s['rollouts_identical']} / {s['rollouts']}"],
        ["seconds", s["seconds"]],
    ]
    verdict = "[green]everything verified[/green]" if s["ok"] else "[red]verification FAILED[/red]"
    run, hint = invocation.command(), invocation.activation_hint()
    store = shlex.quote(invocation.shown_path(s["store"]))
    output.show(
        output.table("staging-store demo", ["", "value"], rows),
        *[f"  coordinator: {line}" for line in s["coordinator_log"]],
        verdict,
        *[f"  [red]-[/red] {failure}" for failure in s["failures"]],
        escape(f"store: {invocation.shown_path(s['store'])}"),  # as the user would type it here
        escape(f"export: {invocation.shown_path(s['export'])} (all {s['exported_rollouts']} rollouts of the store)"),
        f"next ({escape(hint)}):" if hint else "next:",
        *[
            escape(f"  {run} {line}")
            for line in (
                f"audit {store}",
                f"rollouts {store}",
                f"lineage {store} {s['run']}-r0",
                f"workers {store}",
                f"export {store} | head -c 400",
            )
        ],
    )
